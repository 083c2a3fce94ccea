"""Datasets from .npz files: accepted layouts and every refusal."""
import io
import zipfile

import numpy as np
import pytest

from jaxcnn.data import DataError, load_npz


def _arrays(rng, n=6, m=4, shape=(5, 5, 3), dtype=np.uint8):
    return {
        "x_train": rng.integers(0, 256, (n,) + shape).astype(dtype),
        "y_train": rng.integers(0, 4, n),
        "x_test": rng.integers(0, 256, (m,) + shape).astype(dtype),
        "y_test": rng.integers(0, 4, m),
    }


def _save(tmp_path, arrays, name="set.npz", compressed=False):
    path = tmp_path / name
    (np.savez_compressed if compressed else np.savez)(path, **arrays)
    return path


@pytest.mark.parametrize("compressed", [False, True])
def test_nhwc_uint8(tmp_path, rng, compressed):
    arrays = _arrays(rng)
    arrays["y_train"][0] = 6  # largest label sets the inferred class count
    dataset = load_npz(_save(tmp_path, arrays, compressed=compressed))
    assert dataset.name == "set" and dataset.num_classes == 7
    np.testing.assert_array_equal(dataset.x_train, arrays["x_train"])
    assert dataset.y_train.dtype == np.int32 and dataset.x_train.dtype == np.uint8
    np.testing.assert_allclose(dataset.mean, (arrays["x_train"] / 255).mean(axis=(0, 1, 2)), rtol=1e-6)


def test_nhw_gets_a_channel_and_float_becomes_float32(tmp_path, rng):
    arrays = _arrays(rng, shape=(5, 4), dtype=np.float64)
    arrays = {k: (v / 255 if k.startswith("x") else v) for k, v in arrays.items()}
    dataset = load_npz(_save(tmp_path, arrays), num_classes=4, name="mine")
    assert dataset.x_train.shape == (6, 5, 4, 1) and dataset.x_train.dtype == np.float32
    assert dataset.name == "mine" and dataset.num_classes == 4
    np.testing.assert_allclose(dataset.x_test[..., 0], arrays["x_test"], rtol=1e-7)


def test_missing_array(tmp_path, rng):
    arrays = _arrays(rng)
    del arrays["y_test"]
    with pytest.raises(DataError, match=r"set.npz: missing array 'y_test'"):
        load_npz(_save(tmp_path, arrays))


@pytest.mark.parametrize("key, value, message", [
    ("x_train", np.zeros((6, 25), np.uint8), r"x_train must be \(N, H, W, C\) or \(N, H, W\), got shape \(6, 25\)"),
    ("x_test", np.zeros((4, 5, 5, 3), np.int64), "x_test must be uint8 or floating point, got int64"),
    ("y_train", np.zeros(6, np.float32), "y_train must be a 1-D integer array, got float32"),
    ("y_test", np.zeros((4, 1), np.int64), r"y_test must be a 1-D integer array, got int64 with shape \(4, 1\)"),
    ("y_train", np.full(6, -1), r"y_train has labels in \[-1, -1\]"),
    ("y_test", np.zeros(3, np.int64), "x_test has 4 images but y_test has 3 labels"),
    ("x_test", np.zeros((4, 5, 6, 3), np.uint8), r"x_train uint8\(5, 5, 3\) and x_test uint8\(5, 6, 3\) differ"),
    ("x_train", np.full((6, 5, 5, 3), np.nan, np.float32), "x_train holds NaN or infinite values"),
    # PyTorch habits: channels first (read as 3-pixel rows of 5 channels), one-hot labels.
    ("x_train", np.zeros((6, 3, 5, 5), np.uint8), r"x_train has shape \(6, 3, 5, 5\), channels first "
                                                  r"\(N, C, H, W, PyTorch's layout\); jaxcnn takes channels "
                                                  r"last \(N, H, W, C\): save np.transpose\(x_train, \(0, 2, 3, 1\)\)"),
    ("y_train", np.eye(4)[[0, 1, 2, 3, 0, 1]], r"y_train must be a 1-D integer array, got float64 with shape "
                                               r"\(6, 4\); one-hot rows: save the class indices, "
                                               r"y_train.argmax\(axis=1\)$"),
])
def test_refusals(tmp_path, rng, key, value, message):
    arrays = _arrays(rng)
    arrays[key] = value
    if key == "x_train" and value.dtype == np.float32:
        arrays["x_test"] = arrays["x_test"].astype(np.float32)
    with pytest.raises(DataError, match="set.npz: .*" + message):
        load_npz(_save(tmp_path, arrays))


def test_labels_beyond_given_num_classes(tmp_path, rng):
    arrays = _arrays(rng)
    arrays["y_test"][1] = 4
    with pytest.raises(DataError, match=r"y_test has labels in \[\d, 4\], expected \[0, 3\]"):
        load_npz(_save(tmp_path, arrays), num_classes=4)


def test_object_arrays_are_refused_without_unpickling(tmp_path, rng):
    arrays = _arrays(rng)
    arrays["y_train"] = np.array([1, "a", None, 2, 3, 4], dtype=object)
    with pytest.raises(DataError, match="'y_train' has dtype object, which needs pickle; refused"):
        load_npz(_save(tmp_path, arrays))


def _npy_member(header_shape, data):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buffer, {"descr": "|u1", "fortran_order": False, "shape": header_shape})
    return buffer.getvalue() + data


def test_header_declaring_more_than_the_member_holds(tmp_path, rng):
    path = tmp_path / "liar.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for key, value in _arrays(rng).items():
            if key == "x_train":
                archive.writestr(key + ".npy", _npy_member((10**6, 10**6, 1, 1), b"\0" * 100))
            else:
                buffer = io.BytesIO()
                np.save(buffer, value)
                archive.writestr(key + ".npy", buffer.getvalue())
    with pytest.raises(DataError, match=r"liar.npz: array 'x_train' declares shape \(1000000, 1000000, 1, 1\)"):
        load_npz(path)


def test_total_size_limit(tmp_path, rng):
    with pytest.raises(DataError, match="more than the 100-byte limit"):
        load_npz(_save(tmp_path, _arrays(rng)), max_bytes=100)


def test_not_a_zip(tmp_path):
    path = tmp_path / "plain.npz"
    with open(path, "wb") as f:
        np.save(f, np.zeros(3))  # a bare .npy under an .npz name
    with pytest.raises(DataError, match="plain.npz: not a readable .npz file .*not a zip file"):
        load_npz(path)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="absent.npz: file not found"):
        load_npz(tmp_path / "absent.npz")
