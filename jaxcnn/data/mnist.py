"""MNIST from the four standard IDX files; by default the 10,000-digit sample shipped in the package."""
import importlib.resources
import os

from jaxcnn.data.dataset import DataError, Dataset, channel_mean_std, check_dataset
from jaxcnn.data.idx import DEFAULT_MAX_BYTES, read_idx_images, read_idx_labels

# Standard base names; a directory may hold each one raw or with ``.gz`` appended.
TRAIN_IMAGES = "train-images-idx3-ubyte"
TRAIN_LABELS = "train-labels-idx1-ubyte"
TEST_IMAGES = "t10k-images-idx3-ubyte"
TEST_LABELS = "t10k-labels-idx1-ubyte"
MNIST_FILES = tuple(name + ".gz" for name in (TRAIN_IMAGES, TRAIN_LABELS, TEST_IMAGES, TEST_LABELS))


def _find(directory, base):
    # Prefer the raw file when both exist: it is the faster one to read.
    for candidate in (base, base + ".gz"):
        path = os.path.join(directory, candidate)
        if os.path.lexists(path):  # read_idx refuses it unless a regular file
            return path
    raise DataError(f"{directory}: missing MNIST file {base} (or {base}.gz)")


def _load_pair(images_path, labels_path, max_bytes):
    images = read_idx_images(images_path, max_bytes=max_bytes)
    labels = read_idx_labels(labels_path, num_classes=10, max_bytes=max_bytes)
    if len(images) != len(labels):
        raise DataError(f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels")
    return images, labels


def _load_directory(directory, max_bytes):
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory holding the MNIST IDX files")
    x_train, y_train = _load_pair(_find(directory, TRAIN_IMAGES), _find(directory, TRAIN_LABELS), max_bytes)
    x_test, y_test = _load_pair(_find(directory, TEST_IMAGES), _find(directory, TEST_LABELS), max_bytes)
    mean, std = channel_mean_std(x_train)
    return check_dataset(Dataset(x_train, y_train, x_test, y_test, 10, "mnist", mean, std))


def load_mnist(path=None, *, max_bytes=DEFAULT_MAX_BYTES) -> Dataset:
    """Loads MNIST.

    Arguments:
        path: a directory holding ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
            ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``, each raw or gzipped
            (``.gz`` appended). None loads the packaged 10,000-digit sample (8,000 train,
            2,000 test; see ``jaxcnn/data/mnist10k/README.md``).
        max_bytes: per-file payload cap, see `jaxcnn.data.idx.read_idx`.

    Returns:
        A `Dataset` named ``"mnist"``: ``(N, 28, 28, 1)`` uint8 images, int32 labels,
        10 classes, mean/std measured on the training images.

    Raises:
        DataError: naming the file and what is wrong with it.
    """
    if path is not None:
        return _load_directory(os.fspath(path), max_bytes)
    with packaged_mnist_dir() as directory:
        return _load_directory(os.fspath(directory), max_bytes)


def packaged_mnist_dir():
    """The packaged sample directory, as a context manager yielding a filesystem path.

    It is `importlib.resources.as_file`, so it also works when the package is zipped.
    """
    return importlib.resources.as_file(importlib.resources.files("jaxcnn.data") / "mnist10k")
