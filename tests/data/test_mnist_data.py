"""MNIST loading: the packaged 10,000-digit sample against its README, and directories of IDX files."""
import gzip
import hashlib
import os
import re
import shutil

import numpy as np
import pytest

from jaxcnn.data import MNIST_FILES, DataError, load_mnist, packaged_mnist_dir


def _readme():
    with packaged_mnist_dir() as directory:
        with open(os.path.join(directory, "README.md")) as f:
            return f.read()


@pytest.fixture(scope="module")
def packaged():
    return load_mnist()


def test_packaged_files_match_readme_sha256():
    digests = dict(re.findall(r"\| (\S+\.gz) \| [^|]+ \| ([0-9a-f]{64}) \|", _readme()))
    assert sorted(digests) == sorted(MNIST_FILES)
    with packaged_mnist_dir() as directory:
        for name, expected in digests.items():
            with open(os.path.join(directory, name), "rb") as f:
                assert hashlib.sha256(f.read()).hexdigest() == expected, name


def test_packaged_sample_shapes_and_class_counts(packaged):
    assert packaged.name == "mnist" and packaged.num_classes == 10
    assert packaged.x_train.shape == (8000, 28, 28, 1) and packaged.x_test.shape == (2000, 28, 28, 1)
    assert packaged.x_train.dtype == np.uint8 and packaged.y_train.dtype == np.int32
    counts = re.search(r"Class counts: train \[([\d ]+)\], test \[([\d ]+)\]", _readme())
    train_counts, test_counts = ([int(v) for v in group.split()] for group in counts.groups())
    np.testing.assert_array_equal(np.bincount(packaged.y_train, minlength=10), train_counts)
    np.testing.assert_array_equal(np.bincount(packaged.y_test, minlength=10), test_counts)


def test_packaged_pixels_match_an_independent_decode(packaged):
    # Reference decode: skip the fixed 16-byte header of a 3-dim IDX file, nothing else.
    with packaged_mnist_dir() as directory:
        with gzip.open(os.path.join(directory, "t10k-images-idx3-ubyte.gz")) as f:
            raw = np.frombuffer(f.read()[16:], np.uint8).reshape(2000, 28, 28)
        with gzip.open(os.path.join(directory, "t10k-labels-idx1-ubyte.gz")) as f:
            labels = np.frombuffer(f.read()[8:], np.uint8)
    np.testing.assert_array_equal(packaged.x_test[..., 0], raw)
    np.testing.assert_array_equal(packaged.y_test, labels)
    assert 0 < packaged.x_train.mean() < 255  # real digits, not blank images


def test_mean_std_are_the_training_pixel_statistics(packaged):
    unit = packaged.x_train.astype(np.float64) / 255.0
    np.testing.assert_allclose(packaged.mean, [unit.mean()], rtol=1e-6)
    np.testing.assert_allclose(packaged.std, [unit.std()], rtol=1e-5)


def test_directory_of_raw_files_loads_the_same(tmp_path, packaged):
    with packaged_mnist_dir() as directory:
        for name in MNIST_FILES:
            with gzip.open(os.path.join(directory, name)) as src, open(tmp_path / name[:-3], "wb") as dst:
                shutil.copyfileobj(src, dst)
    loaded = load_mnist(tmp_path)
    for field in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(loaded, field), getattr(packaged, field))


def test_small_directory(tmp_path, rng, fmt):
    x = rng.integers(0, 256, (6, 5, 4), dtype=np.uint8)
    y = np.array([0, 1, 2, 9, 4, 5])
    fmt.write_mnist_dir(tmp_path, x, y, x[:2], y[:2], gz=False)
    dataset = load_mnist(str(tmp_path))
    assert dataset.x_train.shape == (6, 5, 4, 1) and dataset.x_test.shape == (2, 5, 4, 1)
    np.testing.assert_array_equal(dataset.y_train, y)


def test_count_mismatch_names_both_files(tmp_path, rng, fmt):
    x = rng.integers(0, 256, (6, 5, 5), dtype=np.uint8)
    fmt.write_mnist_dir(tmp_path, x, np.arange(5), x, np.arange(6))
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte.gz has 6 images but \S*train-labels-idx1-ubyte.gz "
                                        r"has 5 labels"):
        load_mnist(tmp_path)


def test_missing_file(tmp_path, rng, fmt):
    x = rng.integers(0, 256, (3, 5, 5), dtype=np.uint8)
    fmt.write_mnist_dir(tmp_path, x, np.arange(3), x, np.arange(3))
    os.remove(tmp_path / "t10k-labels-idx1-ubyte.gz")
    with pytest.raises(DataError, match="missing MNIST file t10k-labels-idx1-ubyte"):
        load_mnist(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        load_mnist(tmp_path / "absent")


def test_bad_label_in_test_split(tmp_path, rng, fmt):
    x = rng.integers(0, 256, (3, 5, 5), dtype=np.uint8)
    fmt.write_mnist_dir(tmp_path, x, np.arange(3), x, np.array([1, 2, 11]))
    with pytest.raises(DataError, match="t10k-labels-idx1-ubyte.gz: label 11 at index 2 is out of range"):
        load_mnist(tmp_path)
