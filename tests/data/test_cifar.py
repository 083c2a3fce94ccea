"""CIFAR-10 binary format, on files written here record by record."""
import numpy as np
import pytest

from jaxcnn.data import DataError, load_cifar10, read_cifar_bin

TRAIN = [f"data_batch_{i}.bin" for i in range(1, 6)]


def _write_split(directory, rng, fmt, counts=(3, 2, 1, 2, 4), test_count=3):
    records = {}
    for name, count in zip(TRAIN + ["test_batch.bin"], list(counts) + [test_count]):
        records[name] = fmt.cifar_records(rng, count)
        (directory / name).write_bytes(records[name].tobytes())
    return records


def _reference_image(record):
    # Straight from the format description: channel-major planes, each row-major.
    image = np.zeros((32, 32, 3), np.uint8)
    for c in range(3):
        for h in range(32):
            for w in range(32):
                image[h, w, c] = record[1 + c * 1024 + h * 32 + w]
    return image


def test_records_become_nhwc_images(tmp_path, rng, fmt):
    records = fmt.cifar_records(rng, 3)
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(records.tobytes())
    images, labels = read_cifar_bin(path)
    assert images.shape == (3, 32, 32, 3) and images.dtype == np.uint8 and images.flags.c_contiguous
    assert labels.dtype == np.int32
    np.testing.assert_array_equal(labels, records[:, 0])
    for i in range(3):
        np.testing.assert_array_equal(images[i], _reference_image(records[i]))


@pytest.mark.parametrize("nested", [False, True])
def test_load_concatenates_batches_in_order(tmp_path, rng, fmt, nested):
    directory = tmp_path / "cifar-10-batches-bin" if nested else tmp_path
    directory.mkdir(exist_ok=True)
    records = _write_split(directory, rng, fmt)
    dataset = load_cifar10(tmp_path)
    assert dataset.name == "cifar10" and dataset.num_classes == 10
    train = np.concatenate([records[name] for name in TRAIN])
    assert dataset.x_train.shape == (12, 32, 32, 3) and dataset.x_test.shape == (3, 32, 32, 3)
    np.testing.assert_array_equal(dataset.y_train, train[:, 0])
    np.testing.assert_array_equal(dataset.x_train[7], _reference_image(train[7]))
    np.testing.assert_array_equal(dataset.y_test, records["test_batch.bin"][:, 0])
    unit = dataset.x_train.astype(np.float64) / 255
    np.testing.assert_allclose(dataset.mean, unit.mean(axis=(0, 1, 2)), rtol=1e-6)
    np.testing.assert_allclose(dataset.std, unit.std(axis=(0, 1, 2)), rtol=1e-5)


def test_partial_record(tmp_path, rng, fmt):
    path = tmp_path / "data_batch_1.bin"
    path.write_bytes(fmt.cifar_records(rng, 2).tobytes()[:-5])
    with pytest.raises(DataError, match="data_batch_1.bin: size 6141 bytes is not a positive multiple of the 3073"):
        read_cifar_bin(path)


def test_empty_file(tmp_path):
    path = tmp_path / "test_batch.bin"
    path.write_bytes(b"")
    with pytest.raises(DataError, match="test_batch.bin: size 0 bytes"):
        read_cifar_bin(path)


def test_label_out_of_range(tmp_path, rng, fmt):
    records = fmt.cifar_records(rng, 4)
    records[2, 0] = 10
    path = tmp_path / "data_batch_3.bin"
    path.write_bytes(records.tobytes())
    with pytest.raises(DataError, match=r"data_batch_3.bin: label 10 in record 2 is out of range 0\.\.9"):
        read_cifar_bin(path)


def test_missing_batch_file(tmp_path, rng, fmt):
    _write_split(tmp_path, rng, fmt)
    (tmp_path / "data_batch_4.bin").unlink()
    with pytest.raises(DataError, match="missing CIFAR-10 file data_batch_4.bin"):
        load_cifar10(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(DataError, match="not a directory"):
        load_cifar10(tmp_path / "nope")
