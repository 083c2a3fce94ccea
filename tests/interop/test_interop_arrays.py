"""npz and safetensors files: exact round trips (bfloat16 and 0-d arrays
included), template checks, and clear errors on bad files."""
import zipfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxcnn import models
from jaxcnn.interop import load_npz, load_safetensors, save_npz, save_safetensors

FORMATS = [(save_npz, load_npz, "npz"), (save_safetensors, load_safetensors, "safetensors")]
IDS = ["npz", "safetensors"]


def _variables(seed=0):
    rng = np.random.default_rng(seed)
    params = {
        "conv1": {"w": rng.standard_normal((3, 3, 2, 4)).astype(np.float32),
                  "b": rng.standard_normal(4).astype(np.float32)},
        "layer1": {"0": {"conv1": {"w": jnp.asarray(rng.standard_normal((1, 1, 4, 4)),
                                                    jnp.bfloat16)}}},
        "half": rng.standard_normal((2, 5)).astype(np.float16),
        "f64": rng.standard_normal(3),
        "f8": rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
    }
    state = {"bn": {"mean": rng.standard_normal(4).astype(np.float32),
                    "var": rng.random(4).astype(np.float32),
                    "count": np.asarray(7, np.int32)}}
    return params, state


def _assert_same(a, b):
    fa, fb = (jax.tree_util.tree_flatten_with_path(t) for t in (a, b))
    assert fa[1] == fb[1]                                   # same structure
    for (path, x), (_, y) in zip(fa[0], fb[0]):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, path
        # Compare bits, so NaNs and -0.0 count too.
        assert x.tobytes() == y.tobytes(), path


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_round_trip_is_exact(tmp_path, save, load, ext):
    params, state = _variables()
    params["f64"][0] = np.nan
    path = tmp_path / f"vars.{ext}"
    save(path, params, state)
    got_params, got_state = load(path)
    _assert_same(got_params, params)
    _assert_same(got_state, state)
    assert got_state["bn"]["count"].shape == ()


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_a_full_disk_is_an_os_error_and_keeps_the_earlier_file(tmp_path, save, load, ext):
    """A real write error (the partial file is a link to /dev/full, whose every write is ENOSPC):
    an OSError, as every caller expects (safetensors' own file writer raised a SafetensorError,
    a traceback in jaxcnn-train and jaxcnn-export), the file saved before kept, no partial file."""
    import errno
    import os
    params, state = _variables()
    path = tmp_path / f"vars.{ext}"
    save(path, params, state)
    before = path.read_bytes()
    os.symlink("/dev/full", f"{path}.partial")
    with pytest.raises(OSError) as err:
        save(path, {"other": np.zeros(3, np.float32)}, state)
    assert err.value.errno == errno.ENOSPC
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_model_round_trip_checked_against_template(tmp_path, save, load, ext):
    model = models.get("resnet18", num_classes=10, cifar_stem=True)
    template = jax.eval_shape(lambda k: model.init(k, (1, 32, 32, 3))[:2], jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    params, state = jax.tree_util.tree_map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), template)
    path = tmp_path / f"resnet.{ext}"
    save(path, params, state)
    got = load(path, like=template)
    _assert_same(got, (params, state))


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_template_mismatch_names_the_keys(tmp_path, save, load, ext):
    params, state = _variables()
    path = tmp_path / f"vars.{ext}"
    save(path, params, state)
    like_params = dict(params, conv1={"w": params["conv1"]["w"][..., :3],    # wrong shape
                                      "b": params["conv1"]["b"]}, extra=np.zeros(2))
    del like_params["half"]
    with pytest.raises(ValueError) as info:
        load(path, like=(like_params, state))
    message = str(info.value)
    assert str(path) in message
    assert "missing key 'params/extra'" in message
    assert "unexpected key 'params/half'" in message
    assert "'params/conv1.w' has shape (3, 3, 2, 4), expected (3, 3, 2, 3)" in message


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_another_models_file_is_a_short_message(tmp_path, save, load, ext):
    """resnet18's parameters read against resnet34's template: three keys of each sort, then
    how many more (it listed every one of about 150 keys, one per line)."""
    from jaxcnn.models import get as get_model
    shape = (1, 32, 32, 3)
    small, big = (jax.eval_shape(lambda k, m=get_model(n, num_classes=10): m.init(k, shape)[:2],
                                 jax.random.PRNGKey(0)) for n in ("resnet18", "resnet34"))
    params, state = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), small)
    path = tmp_path / f"r18.{ext}"
    save(path, params, state)
    with pytest.raises(ValueError) as info:
        load(path, like=big)
    message = str(info.value)
    assert len(message) < 1500, len(message)
    assert str(path) in message and "missing key 'params/layer1.2." in message
    missing = len(_leaves(big[0])) - len(_leaves(small[0]))
    assert f"and {missing - 3} more missing params keys" in message


def _leaves(tree):
    return jax.tree_util.tree_leaves(tree)


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_corrupt_and_missing_files_name_the_path(tmp_path, save, load, ext):
    path = tmp_path / f"vars.{ext}"
    save(path, *_variables())
    data = path.read_bytes()
    truncated = tmp_path / f"truncated.{ext}"
    truncated.write_bytes(data[: len(data) // 2])
    garbage = tmp_path / f"garbage.{ext}"
    garbage.write_bytes(b"\x00not an array file at all" * 3)
    for bad in (truncated, garbage):
        with pytest.raises(ValueError, match=f"{bad}: not a readable .{ext} file"):
            load(bad)
    with pytest.raises(FileNotFoundError, match="missing.*no such file"):
        load(tmp_path / f"missing.{ext}")


def test_npz_never_unpickles(tmp_path):
    path = tmp_path / "pickled.npz"
    np.savez(path, **{"params/x": np.array([{"a": 1}], dtype=object)})
    with pytest.raises(ValueError, match=r"pickled.npz: array 'params/x' has dtype object, "
                                         r"which needs pickle; refused"):
        load_npz(path)


def test_npz_with_a_flipped_byte_is_rejected(tmp_path):
    path = tmp_path / "vars.npz"
    save_npz(path, *_variables())
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("params/conv1.w.npy")
    data[info.header_offset + 30 + len(info.filename) + 200] ^= 0xFF   # inside the array data
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"vars.npz: cannot read array 'params/conv1.w' .*CRC"):
        load_npz(path)


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_foreign_keys_are_rejected(tmp_path, save, load, ext):
    path = tmp_path / f"foreign.{ext}"
    if ext == "npz":
        np.savez(path, **{"conv1.weight": np.zeros(3, np.float32)})
    else:
        import safetensors.numpy
        safetensors.numpy.save_file({"conv1.weight": np.zeros(3, np.float32)}, str(path))
    with pytest.raises(ValueError, match="unexpected key 'conv1.weight'.*'params/' or 'state/'"):
        load(path)


@pytest.mark.parametrize("save, load, ext", FORMATS, ids=IDS)
def test_unstorable_trees_are_rejected(tmp_path, save, load, ext):
    path = tmp_path / f"bad.{ext}"
    with pytest.raises(ValueError, match="key 'a.b' under 'conv'"):
        save(path, {"conv": {"a.b": np.zeros(2)}})
    with pytest.raises(TypeError, match="leaf 'conv.w' is a list"):
        save(path, {"conv": {"w": [1.0, 2.0]}})
    with pytest.raises(TypeError, match="expected a nested dict"):
        save(path, [np.zeros(2)])
    assert not path.exists()
