"""The newer zoo models by name through the command lines: ``jaxcnn-export --model``
reads a parameter file of each family and writes it back unchanged, and
``jaxcnn-train model.name=...`` dry-runs one (traced, lowered, compiled train step;
``-m slow``)."""
import os

import jax
import numpy as np
import pytest
from export_cases import random_init

from jaxcnn import interop, models
from jaxcnn.export.cli import main
from jaxcnn.train.cli import train_main


@pytest.mark.parametrize("name, options", [
    ("resnext50_32x4d", {}), ("vgg13_bn", {"classifier_width": 16})])
def test_export_cli_takes_the_model_by_name(name, options, tmp_path, capsys):
    params, state = random_init(models.get(name, num_classes=10, **options), (32, 32, 3))
    path = str(tmp_path / "w.npz")
    interop.save_npz(path, params, state)
    out = str(tmp_path / "exported")
    argv = [path, "--model", name, "--format", "npz", "--out", out]
    for key, value in options.items():
        argv += ["--model-option", f"{key}={value}"]
    assert main(argv) == 0, capsys.readouterr().err     # num_classes read off the file
    got_params, got_state = interop.load_npz(out + ".npz")
    for want, got in ((params, got_params), (state, got_state)):
        assert jax.tree_util.tree_structure(want) == jax.tree_util.tree_structure(got)
        for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.slow     # compiles VGG-11-BN's train and eval steps: 8 s of CPU
def test_train_cli_dry_runs_a_new_model(tmp_path, capsys):
    tiny = ["data.source=synthetic", "data.image_size=[32,32,3]", "data.num_train=8",
            "data.num_eval=4", "data.batch_size=4", "data.num_classes=10", "model.name=vgg11_bn",
            "model.options={classifier_width: 16}", "train.steps=1", "logging.progress=none",
            "checkpoint.enabled=false", "optim.schedule.warmup=0", "mesh.data=1"]
    code = train_main([os.path.join("configs", "vgg11_cifar10.yaml"), *tiny,
                       "--workdir", str(tmp_path / "run"), "--dry-run"])
    assert code == 0, capsys.readouterr().err
