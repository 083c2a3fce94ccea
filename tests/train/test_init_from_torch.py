"""Fine-tuning from pretrained PyTorch weights by config: ``model.init_from`` naming a
torchvision-named state dict saved as safetensors, ``model.init_from_skip`` re-initialising
the classifier from the seed. The weights are a random 1000-class resnet18 written with
``to_torch_state_dict`` (no torch needed); the run is a 10-class one on tiny synthetic images
(the whole trainer's run: mnist_cnn's, from a 1000-class mnist_cnn file).
"""

import jax
import numpy as np
import pytest
import safetensors.numpy
import yaml

from jaxcnn import interop, models
from jaxcnn.train import _build
from jaxcnn.interop.arrays import tree_items
from jaxcnn.train.config import ConfigError, load_config

from train_cli import cli, one_line

# 16x16 RGB synthetic images: resnet18 takes them (down to 1x1 before its pooling) in seconds.
TINY = {"model": {"name": "resnet18", "num_classes": 10},
        "train": {"steps": 1, "eval_every": None, "seed": 3},
        "data": {"source": "synthetic", "image_size": [16, 16, 3], "num_train": 8, "num_eval": 4,
                 "num_classes": 10, "batch_size": 4, "prefetch": 0},
        "checkpoint": {"enabled": False},
        "logging": {"progress": "lines"}, "mesh": {"data": 1}}


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A 1000-class resnet18 state dict, torchvision names and layouts, without
    ``num_batches_tracked`` (as some published files are), saved as safetensors."""
    model = models.get("resnet18", num_classes=1000)
    template = jax.eval_shape(lambda k: model.init(k, (1, 16, 16, 3))[:2], jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    params, state = jax.tree_util.tree_map(
        lambda s: (rng.standard_normal(s.shape) * 0.1 + (1.0 if s.dtype.kind == "f" else 0)
                   ).astype(s.dtype), template)
    sd = {k: np.asarray(v) for k, v in to_torch(params, state).items()
          if not k.endswith("num_batches_tracked")}
    path = str(tmp_path_factory.mktemp("pretrained") / "resnet18.safetensors")
    safetensors.numpy.save_file(sd, path)
    return path, sd


def to_torch(params, state, num_classes=1000):
    return interop.to_torch_state_dict("resnet18", params, state, num_classes=num_classes,
                                       input_shape=(1, 16, 16, 3))


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)




def test_the_file_is_recognised_by_its_names(pretrained, tmp_path):
    path, _ = pretrained
    assert interop.is_torch_safetensors(path)
    ours = str(tmp_path / "ours.safetensors")
    interop.save_safetensors(ours, {"fc": {"w": np.zeros((2, 3), np.float32)}})
    assert not interop.is_torch_safetensors(ours)


def _loaded(path, tiny, skip):
    cfg = load_config(tiny, [f"model.init_from={path}", f"model.init_from_skip=[{skip}]"])
    run = _build.build_run(cfg)
    return run, _build.load_init_from(run)


def test_a_1000_class_file_starts_a_10_class_run_bit_for_bit(pretrained, tiny):
    """Every loaded layer of the initial state equals the file's value bit for bit (converted
    to our layout: a transpose, exact); fc is the seed's random initialisation, as in a run
    without init_from. (The other spellings of the skip load the same trees: the next test.)"""
    path, sd = pretrained
    run, loaded = _loaded(path, tiny, "fc")
    assert "fc" not in loaded[0]
    state = jax.jit(lambda t: _build.init_state(run, t))(_build.initial_params(run, loaded)[0])
    fresh = jax.jit(lambda: _build.init_state(run))()
    got = to_torch(*jax.device_get((state.params, state.state)), num_classes=10)
    # The head as the seed makes it, in the 10-class model; the rest as in the file.
    fc_fresh = to_torch(*jax.device_get((fresh.params, fresh.state)), num_classes=10)
    assert set(got) == set(sd) | {k for k in got if k.endswith("num_batches_tracked")}
    for k, v in got.items():
        v = np.asarray(v)
        if k.startswith("fc."):
            assert v.shape == (10, 512)[:v.ndim] and np.array_equal(v, np.asarray(fc_fresh[k])), k
        elif k.endswith("num_batches_tracked"):
            assert v == 0, k
        else:
            assert v.dtype == sd[k].dtype and np.array_equal(v, sd[k]), k
    assert not np.array_equal(np.asarray(state.params["layer1"]["0"]["conv1"]["w"]),
                              np.asarray(fresh.params["layer1"]["0"]["conv1"]["w"]))


@pytest.mark.parametrize("skip", ["fc.weight,fc.bias", "fc.w,fc.b"])
def test_the_skip_in_torchs_or_our_naming_loads_what_fc_does(pretrained, tiny, skip):
    """Skip entries in torch's or our naming alike: the loaded trees are those of
    ``init_from_skip=[fc]``, key for key and bit for bit, fc left out. What follows the load
    (initial_params filling the skipped layers from the seed, init_state) depends on the
    skip only through these trees, and is checked bit for bit for [fc] above: a jitted
    ResNet-18 initialisation per spelling (about 11 s each) checked the same path again."""
    path, _ = pretrained
    _, want = _loaded(path, tiny, "fc")
    _, loaded = _loaded(path, tiny, skip)
    assert "fc" not in loaded[0]
    for have, ref in zip(loaded, want):
        have, ref = dict(tree_items(have)), dict(tree_items(ref))
        assert have.keys() == ref.keys()
        for k in ref:
            assert have[k].dtype == ref[k].dtype and np.array_equal(have[k], ref[k]), k


# mnist_cnn on 12x12 digits: conv1, conv2, fc1 after a flatten (torch's CHW order), fc2.
SMALL = ["model.name=mnist_cnn", "data.image_size=[12,12,1]"]


@pytest.fixture(scope="module")
def pretrained_small(tmp_path_factory):
    """A 1000-class mnist_cnn state dict for 12x12 digits, torch's names and layouts, as
    safetensors: what the trainer run below starts from."""
    model = models.get("mnist_cnn", num_classes=1000)
    template = jax.eval_shape(lambda k: model.init(k, (1, 12, 12, 1))[:2], jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    params, state = jax.tree_util.tree_map(
        lambda s: (rng.standard_normal(s.shape) * 0.1).astype(s.dtype), template)
    sd = interop.to_torch_state_dict("mnist_cnn", params, state, num_classes=1000,
                                     input_shape=(1, 12, 12, 1))
    path = str(tmp_path_factory.mktemp("pretrained_small") / "mnist_cnn.safetensors")
    safetensors.numpy.save_file({k: np.asarray(v) for k, v in sd.items()}, path)
    return path


def test_the_fine_tune_trains(pretrained_small, tiny, tmp_path):
    """The whole trainer starts from a torch-named file, its head skipped, and takes its step.
    The run is mnist_cnn's: what the trainer does with the file (run.py's load_init_from,
    initial_params, init_state) is checked bit for bit on ResNet-18 (BatchNorm statistics, no
    num_batches_tracked, 1000 -> 10 classes) above; a ResNet-18 run compiled its step and
    initialisation here again (16 s of the file's 35)."""
    path = pretrained_small
    assert interop.is_torch_safetensors(path)
    code, out, err = cli([tiny, *SMALL, f"model.init_from={path}", "model.init_from_skip=[fc2]",
                          "--workdir", tmp_path / "run"])
    assert code == 0, err
    assert f"parameters from {path}" in out + err
    params, _ = interop.load_npz(tmp_path / "run" / "params.npz")
    assert params["fc2"]["w"].shape == (128, 10)


def test_a_shape_mismatch_without_skip_is_one_line_naming_key_and_shapes(pretrained, tiny):
    path, _ = pretrained
    line = one_line(*cli([tiny, f"model.init_from={path}", "--dry-run"])[::2])
    assert line.startswith(f"jaxcnn-train: error: model.init_from: {path}: resnet18: ")
    assert "key 'fc.weight' has shape (1000, 512), the model's is (10, 512)" in line
    assert "key 'fc.bias' has shape (1000,), the model's is (10,)" in line
    assert "model.init_from_skip" in line


def test_missing_unexpected_and_unknown_skip_are_named(pretrained, tiny, tmp_path):
    _, sd = pretrained
    broken = {k: v for k, v in sd.items() if k != "layer2.0.bn1.running_var"}
    broken["head.extra.weight"] = np.zeros((3, 4), np.float32)
    path = str(tmp_path / "broken.safetensors")
    safetensors.numpy.save_file(broken, path)
    line = one_line(*cli([tiny, f"model.init_from={path}", "model.init_from_skip=[fc]",
                          "--dry-run"])[::2])
    assert "missing key 'layer2.0.bn1.running_var' (the model's shape (128,))" in line
    assert "unexpected key 'head.extra.weight' (shape (3, 4))" in line
    line = one_line(*cli([tiny, f"model.init_from={path}", "model.init_from_skip=[fcc]",
                          "--dry-run"])[::2])
    assert line.startswith("jaxcnn-train: error: model.init_from_skip: ") and "'fcc'" in line
    with pytest.raises(ConfigError, match="model.init_from_skip: .*model.init_from is null"):
        load_config(tiny, ["model.init_from_skip=[fc]"])


def test_skip_in_a_jaxcnn_parameter_file(tiny, tmp_path):
    """The same option for jaxcnn's own files: a 4-class run's parameters start a 10-class run."""
    cfg4 = load_config(tiny, SMALL + ["model.num_classes=4", "data.num_classes=4"])
    run4 = _build.build_run(cfg4)
    p4 = jax.device_get(jax.jit(lambda: _build.init_state(run4))())
    path = str(tmp_path / "p4.npz")
    interop.save_npz(path, p4.params, p4.state)
    cfg = load_config(tiny, SMALL + [f"model.init_from={path}", "model.init_from_skip=[fc2]"])
    run = _build.build_run(cfg)
    start, _ = _build.initial_params(run, _build.load_init_from(run))
    for layer in ("conv1", "conv2", "fc1"):
        assert np.array_equal(start[0][layer]["w"], p4.params[layer]["w"]), layer
    fresh = jax.device_get(jax.jit(lambda: _build.init_state(run))())
    assert np.array_equal(start[0]["fc2"]["w"], fresh.params["fc2"]["w"])
    assert start[0]["fc2"]["w"].shape == (128, 10)
    with pytest.raises(ConfigError) as mismatch:
        _build.load_init_from(_build.build_run(load_config(tiny, SMALL + [f"model.init_from={path}"])))
    # One line, the problems apart (the trainer's one-line error ran them together).
    assert str(mismatch.value) == (
        f"model.init_from: {path}: does not match the expected parameters: key 'params/fc2.b' "
        "has shape (4,), expected (10,); key 'params/fc2.w' has shape (128, 4), expected "
        "(128, 10) (model.init_from_skip: [LAYER] re-initialises a layer instead of loading it)")
    with pytest.raises(ConfigError, match=r"model.init_from_skip: \['fc3'\] names no layer"):
        _build.load_init_from(_build.build_run(load_config(
            tiny, SMALL + [f"model.init_from={path}", "model.init_from_skip=[fc3]"])))


def test_a_pytorch_pickle_is_refused_with_the_conversion_to_run(tiny, tmp_path):
    """The downloaded ``.pth`` itself, as a new user tries first: it said only 'expected a .npz
    or .safetensors parameter file'; now also the one line that converts it (never unpickled)."""
    pth = tmp_path / "resnet18-f37072fd.pth"
    pth.write_bytes(b"\x80\x02}q\x00.")  # a pickle protocol 2 stream; never read
    line = one_line(*cli([tiny, f"model.init_from={pth}", "--dry-run"])[::2])
    assert line == (f"jaxcnn-train: error: model.init_from: '{pth}': a PyTorch .pth file is a pickle, which "
                    "jaxcnn never loads; convert it once where torch is installed: safetensors.torch.save_file("
                    f"torch.load('{pth}'), 'resnet18-f37072fd.safetensors')")
    png = tmp_path / "x.png"
    png.write_bytes(b"x")
    line = one_line(*cli([tiny, f"model.init_from={png}", "--dry-run"])[::2])
    assert line.endswith(f"'{png}': unknown parameter file type '.png'; expected a .npz or .safetensors "
                         "file or a run directory")
