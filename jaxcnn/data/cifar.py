"""CIFAR-10 in its binary format (never the pickled Python version).

Each ``.bin`` file is a run of 3073-byte records: one label byte, then 3072 pixel bytes of a
32x32 image stored channel-major (1024 red, 1024 green, 1024 blue, each row-major).
"""
import os

import numpy as np

from jaxcnn.data.dataset import DataError, Dataset, channel_mean_std, check_dataset
from jaxcnn.data.files import check_regular_file

TRAIN_FILES = tuple(f"data_batch_{i}.bin" for i in range(1, 6))
TEST_FILES = ("test_batch.bin",)
RECORD_BYTES = 1 + 3 * 32 * 32
# The official archive extracts to this folder; `load_cifar10` accepts its parent too.
ARCHIVE_DIR = "cifar-10-batches-bin"
# A real batch file is 30,730,000 bytes; refuse anything far bigger before reading it.
MAX_FILE_BYTES = 64 * RECORD_BYTES * 10000


def read_cifar_bin(path, *, num_classes=10):
    """Reads one CIFAR-10 binary batch file.

    Arguments:
        path: a ``.bin`` file of 3073-byte records.
        num_classes: labels must be smaller than this.

    Returns:
        ``(images, labels)``: ``(N, 32, 32, 3)`` uint8 NHWC images and ``(N,)`` int32 labels.

    Raises:
        DataError: naming the file: missing, empty, size not a whole number of records,
            too large, label out of range.
    """
    path = check_regular_file(path)  # a FIFO or device has no size to check: refused
    try:
        size = os.path.getsize(path)
    except OSError as err:
        raise DataError(f"{path}: cannot read ({err})") from err
    if size == 0 or size % RECORD_BYTES:
        raise DataError(f"{path}: size {size} bytes is not a positive multiple of the "
                        f"{RECORD_BYTES}-byte CIFAR-10 record")
    if size > MAX_FILE_BYTES:
        raise DataError(f"{path}: size {size} bytes is over the {MAX_FILE_BYTES}-byte limit")
    records = np.fromfile(path, dtype=np.uint8)
    if records.size != size:
        raise DataError(f"{path}: read {records.size} bytes, expected {size}")
    records = records.reshape(-1, RECORD_BYTES)
    labels = records[:, 0]
    if labels.max() >= num_classes:
        bad = int(np.argmax(labels >= num_classes))
        raise DataError(f"{path}: label {int(labels[bad])} in record {bad} is out of range 0..{num_classes - 1}")
    images = records[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), labels.astype(np.int32)


def _read_split(directory, names):
    parts = []
    for name in names:
        path = os.path.join(directory, name)
        if not os.path.lexists(path):
            raise DataError(f"{directory}: missing CIFAR-10 file {name}")
        parts.append(read_cifar_bin(path))
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def load_cifar10(path) -> Dataset:
    """Loads CIFAR-10 from the binary distribution.

    Arguments:
        path: a directory holding ``data_batch_1.bin`` .. ``data_batch_5.bin`` and
            ``test_batch.bin``, or the directory the archive was extracted into (holding
            ``cifar-10-batches-bin/``).

    Returns:
        A `Dataset` named ``"cifar10"``: ``(N, 32, 32, 3)`` uint8 NHWC images, int32 labels,
        10 classes, mean/std measured on the training images.

    Raises:
        DataError: naming the file and what is wrong with it.
    """
    directory = os.fspath(path)
    if os.path.isdir(os.path.join(directory, ARCHIVE_DIR)):
        directory = os.path.join(directory, ARCHIVE_DIR)
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory holding the CIFAR-10 .bin files")
    x_train, y_train = _read_split(directory, TRAIN_FILES)
    x_test, y_test = _read_split(directory, TEST_FILES)
    mean, std = channel_mean_std(x_train)
    return check_dataset(Dataset(x_train, y_train, x_test, y_test, 10, "cifar10", mean, std))
