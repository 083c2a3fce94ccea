"""Pruning through the trainer: ``mask_updates`` keeps pruned weights at exactly
zero under momentum and weight decay; ``model.init_from`` + ``prune:`` in a
config prune the starting parameters, hold the masks through a checkpoint
resume (they live in the train state) and under a master-copy policy; bad
``init_from`` files stop ``jaxcnn-train`` before any compute with exit code 2
and one line.  The MNIST fine-tune of a trained run is in test_export_mnist.py."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from export_cases import random_init

from jaxcnn import interop
from jaxcnn import layers as L
from jaxcnn import models
from jaxcnn.export import magnitude_prune
from jaxcnn.export.prune import keep_tree, mask_updates, with_keep
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import load_config
from jaxcnn.train._build import build_run, initial_params


_MODEL = L.serial(("c", L.Conv2D(4, 3)), L.Flatten(), ("fc", L.Linear(3)))


def _train(tx, opt_state, params, steps=5):
    """``steps`` optimiser steps on a random least-squares loss; returns the params."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 6, 6, 2)), jnp.float32)

    def loss(p):
        return jnp.sum(_MODEL.apply(p, {}, x)[0] ** 2)

    @jax.jit                 # one compilation per optimiser instead of every op eagerly
    def step(params, opt_state):
        updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return jax.device_get(params)


def test_mask_updates_hold_pruned_weights_at_zero():
    params, _ = random_init(_MODEL, (6, 6, 2))
    pruned, masks = magnitude_prune(_MODEL, params, 0.6)
    adamw = optax.adamw(0.05, weight_decay=0.5)
    # Without the mask, momentum brings the pruned weights back (the test can fail) ...
    free = _train(adamw, adamw.init(pruned), pruned)
    assert np.all(free["c"]["w"] != 0)
    # ... with it they stay at exactly zero while the kept ones train.
    tx = optax.chain(adamw, mask_updates())
    held = _train(tx, with_keep(tx.init(pruned), keep_tree(pruned, masks)), pruned)
    for key in ("c", "fc"):
        keep = masks[f"{key}.w"]
        np.testing.assert_array_equal(held[key]["w"][~keep], 0)
        assert np.all(held[key]["w"][keep] != pruned[key]["w"][keep])
    assert np.all(held["c"]["b"] != pruned["c"]["b"])          # biases train


# lenet5 on a small synthetic set with an fp32 master copy of bf16 parameters: the masks
# must hold in the master copy.  One device keeps it short; bf16_params over the 8 emulated
# CPU devices is covered in tests/parallel/test_parallel_data.py, and the MNIST fine-tune in
# test_export_mnist.py runs on all 8.
TINY = ["mesh.data=1", "data.source=synthetic", "data.image_size=[28,28,1]", "data.num_train=64",
        "data.num_eval=16", "data.batch_size=16", "model.name=lenet5", "train.eval_every=null",
        "logging.progress=none", "precision.policy=bf16_params", "optim.name=sgd",
        "optim.lr=0.05", "optim.weight_decay=0.01", "checkpoint.every=2"]


def test_trainer_prunes_and_resumes_with_its_masks(tmp_path, capsys):
    config = os.path.join("configs", "lenet5_mnist.yaml")
    # A constant learning rate: the cosine schedule would bake train.steps into the programs, and
    # the 2-step run, the 4-step resume and the masks drawn below compile the same ones (the
    # persistent XLA cache serves them) instead of each their own.
    prune = ["prune.amount=0.5", "prune.scope=layer", "prune.structure=channel",
             "optim.schedule.name=constant"]
    work = str(tmp_path / "run")
    assert train_main([config, *TINY, *prune, "train.steps=2", "--workdir", work]) == 0
    assert "prune 0.5 (layer, channel)" in capsys.readouterr().out
    # A longer run is another config: continuing it under that one is asked for explicitly.
    assert train_main([config, *TINY, *prune, "train.steps=4", "checkpoint.on_config_change=continue",
                       "--workdir", work]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    # The masks the trainer drew: channels of the seed's random init.
    run = build_run(load_config(config, [*TINY, *prune, "train.steps=4"]))
    (start, _), keep = initial_params(run)
    final, _ = interop.load_npz(os.path.join(work, "params.npz"))
    for path in ("conv1", "conv2", "fc1", "fc2"):
        dead = keep[path]["w"].reshape(-1, keep[path]["w"].shape[-1]).min(0) == 0
        assert dead.sum() == round(0.5 * dead.size), path
        w = final[path]["w"].reshape(-1, dead.size)
        np.testing.assert_array_equal(w[:, dead], 0)
        np.testing.assert_array_equal(final[path]["b"][dead], 0)
        assert np.all(np.any(w[:, ~dead] != start[path]["w"].reshape(w.shape)[:, ~dead], axis=0))
    np.testing.assert_array_equal(keep["fc3"]["w"], 1)          # the logits layer is kept whole


def _fails(argv, capsys, *needles):
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxcnn-train: error: model.init_from"), err
    for needle in needles:
        assert needle in err, err


def test_bad_init_from_exits_2_with_one_line(tmp_path, capsys):
    base = ["configs/lenet5_mnist.yaml", *TINY, "train.steps=1", "--workdir",
            str(tmp_path / "w")]
    _fails(base + [f"model.init_from={tmp_path}/missing.npz"], capsys, "missing.npz",
           "does not exist")
    _fails(base + [f"model.init_from={tmp_path}"], capsys, "params.npz", "directory")
    (tmp_path / "weights.pt").write_bytes(b"\x80\x02 not for us")
    _fails(base + [f"model.init_from={tmp_path}/weights.pt"], capsys, "a PyTorch .pt file is a pickle",
           "safetensors")
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    _fails(base + [f"model.init_from={corrupt}"], capsys, "corrupt.safetensors")
    # Another model's parameters: the message names the key and both shapes.
    # (The files only need the right names, shapes and dtypes: random_init draws them with NumPy
    # from jax.eval_shape instead of running lenet5's initialisers op by op, 8 s each.)
    other = models.get("lenet5", num_classes=4)
    params, state = random_init(other, (28, 28, 1))
    interop.save_npz(tmp_path / "four.npz", params, state)
    _fails(base + [f"model.init_from={tmp_path}/four.npz"], capsys, "four.npz",
           "'params/fc3.w' has shape (84, 4), expected (84, 10)")
    # Integer weights of the right shapes.
    params, state = random_init(models.get("lenet5"), (28, 28, 1))
    params["conv1"]["w"] = np.zeros(params["conv1"]["w"].shape, np.int32)
    interop.save_npz(tmp_path / "ints.npz", params, state)
    _fails(base + [f"model.init_from={tmp_path}/ints.npz"], capsys,
           "'params/conv1.w' has dtype int32, expected float32")
    assert not os.path.exists(tmp_path / "w"), "nothing written before the checks"
    # --dry-run checks model.init_from too, and accepts a matching file.
    _fails(base + [f"model.init_from={tmp_path}/four.npz", "--dry-run"], capsys, "four.npz",
           "'params/fc3.w' has shape (84, 4), expected (84, 10)")
    params, state = random_init(models.get("lenet5"), (28, 28, 1))
    interop.save_npz(tmp_path / "good.npz", params, state)
    assert train_main(base + [f"model.init_from={tmp_path}/good.npz", "--dry-run"]) == 0
    assert f"parameters from {tmp_path}/good.npz" in capsys.readouterr().out
