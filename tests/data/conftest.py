"""Helpers for the data tests: writers for the IDX and CIFAR-10 binary formats."""
import gzip
import types

import numpy as np
import pytest


def idx_bytes(array, *, magic=None, dims=None):
    """IDX encoding of a uint8 array; ``magic``/``dims`` override the header to forge bad files."""
    array = np.asarray(array, np.uint8)
    if magic is None:
        magic = 0x00000800 | array.ndim
    if dims is None:
        dims = array.shape
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in dims)
    return header + array.tobytes()


def write_idx(path, array=None, *, gz=False, raw=None, **header):
    """Writes an IDX file (or the given raw bytes), gzip-compressed when ``gz``."""
    data = raw if raw is not None else idx_bytes(array, **header)
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def write_mnist_dir(directory, x_train, y_train, x_test, y_test, *, gz=True):
    """Writes the four MNIST files; images are (N, H, W) uint8."""
    suffix = ".gz" if gz else ""
    write_idx(directory / f"train-images-idx3-ubyte{suffix}", x_train, gz=gz)
    write_idx(directory / f"train-labels-idx1-ubyte{suffix}", y_train, gz=gz)
    write_idx(directory / f"t10k-images-idx3-ubyte{suffix}", x_test, gz=gz)
    write_idx(directory / f"t10k-labels-idx1-ubyte{suffix}", y_test, gz=gz)
    return directory


def cifar_records(rng, count):
    """Random CIFAR-10 records: (count, 3073) uint8, label byte first."""
    records = rng.integers(0, 256, size=(count, 3073), dtype=np.uint8)
    records[:, 0] = rng.integers(0, 10, size=count)
    return records


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture(scope="session")
def fmt():
    """The file-format writers above, as a namespace (test modules cannot import conftest)."""
    return types.SimpleNamespace(idx_bytes=idx_bytes, write_idx=write_idx, write_mnist_dir=write_mnist_dir,
                                 cifar_records=cifar_records)
