"""The in-memory `Dataset` type, the `DataError` raised for bad data, and normalisation.

Images are NHWC numpy arrays, either ``uint8`` in ``[0, 255]`` or ``float32`` already on
the unit scale (typically ``[0, 1]``); labels are ``int32``. Normalisation is
``(x / 255 - mean) / std`` for ``uint8`` and ``(x - mean) / std`` for floats, with per-channel
``mean``/``std`` measured on the unit scale.
"""
from typing import NamedTuple, Optional

import numpy as np

from jaxcnn.errors import DataError  # noqa: F401  (re-exported: defined here before)

# Channel statistics are accumulated over chunks of about this many values, so that a
# wide copy of a large training set (50,000 CIFAR images: 1.2 GB as int64) is never made.
_STATS_CHUNK_VALUES = 1 << 22


class Dataset(NamedTuple):
    """Train and test splits held in memory.

    Fields:
        x_train: ``(N, H, W, C)`` images, ``uint8`` or ``float32``.
        y_train: ``(N,)`` ``int32`` labels in ``[0, num_classes)``.
        x_test: ``(M, H, W, C)`` images with the same ``H, W, C`` and dtype as ``x_train``.
        y_test: ``(M,)`` ``int32`` labels.
        num_classes: number of classes.
        name: a short name such as ``"mnist"``.
        mean: ``(C,)`` float32 per-channel mean of ``x_train`` on the unit scale, or None.
        std: ``(C,)`` float32 per-channel standard deviation, or None.

    The loaders fill ``mean``/``std``; a hand-built dataset gets them from `with_stats`.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    name: str
    mean: Optional[np.ndarray] = None
    std: Optional[np.ndarray] = None

    @property
    def image_shape(self):
        """``(H, W, C)`` of one image."""
        return tuple(self.x_train.shape[1:])

    def with_stats(self) -> "Dataset":
        """Returns a copy whose ``mean``/``std`` are measured on ``x_train`` (see `channel_mean_std`)."""
        mean, std = channel_mean_std(self.x_train)
        return self._replace(mean=mean, std=std)


def to_unit_scale(images: np.ndarray) -> np.ndarray:
    """Converts images to float32 on the unit scale.

    Arguments:
        images: any-shape ``uint8`` array (divided by 255) or float array (taken as is).

    Returns:
        A float32 array of the same shape.
    """
    if images.dtype == np.uint8:
        return images.astype(np.float32) * np.float32(1.0 / 255.0)
    return images.astype(np.float32, copy=False)


def channel_mean_std(images: np.ndarray):
    """Per-channel mean and (population) standard deviation of NHWC images on the unit scale.

    Arguments:
        images: ``(N, H, W, C)`` ``uint8`` or float array, ``N >= 1``.

    Returns:
        ``(mean, std)``, each a ``(C,)`` float32 array. A channel that is constant gets
        std 1 so that normalising never divides by zero.
    """
    if images.ndim != 4 or images.shape[0] == 0:
        raise DataError(f"channel_mean_std: expected non-empty (N, H, W, C) images, got shape {images.shape}")
    channels = images.shape[-1]
    per_image = images[0].size
    # uint8 sums are exact in int64; floats are summed in float64.
    wide_dtype = np.int64 if images.dtype == np.uint8 else np.float64
    total = np.zeros(channels, np.float64)
    total_sq = np.zeros(channels, np.float64)
    rows = max(1, _STATS_CHUNK_VALUES // per_image)
    for start in range(0, images.shape[0], rows):
        # Summing over the leading axis of (n, H*W*C) first adds whole contiguous rows, which
        # is many times faster in NumPy than reducing an (n*H*W, C) array over its long axis.
        block = images[start:start + rows].reshape(-1, per_image).astype(wide_dtype)
        total += block.sum(axis=0).reshape(-1, channels).sum(axis=0)
        total_sq += np.square(block).sum(axis=0).reshape(-1, channels).sum(axis=0)
    scale = 255.0 if images.dtype == np.uint8 else 1.0
    count = images.size // channels
    mean = total / count / scale
    std = np.sqrt(np.maximum(total_sq / count / scale**2 - np.square(mean), 0.0))
    std = np.where(std > 1e-8, std, 1.0)
    return mean.astype(np.float32), std.astype(np.float32)


def normalize(images: np.ndarray, mean, std) -> np.ndarray:
    """Normalises images to float32: ``(x / 255 - mean) / std`` for ``uint8``, ``(x - mean) / std`` for floats.

    Arguments:
        images: ``(..., C)`` ``uint8`` or float array.
        mean: ``(C,)`` per-channel mean on the unit scale.
        std: ``(C,)`` per-channel standard deviation on the unit scale.

    Returns:
        A new float32 array of the same shape.
    """
    mean = np.asarray(mean, np.float64)
    std = np.asarray(std, np.float64)
    unit = 1.0 / 255.0 if images.dtype == np.uint8 else 1.0
    # One multiply and one subtract into a preallocated float32 buffer: this is the
    # hot host-side cost of a batch, so the intermediate float copies are avoided.
    out = np.empty(images.shape, np.float32)
    np.multiply(images, (unit / std).astype(np.float32), out=out, casting="unsafe")
    np.subtract(out, (mean / std).astype(np.float32), out=out)
    return out


def check_dataset(dataset: Dataset) -> Dataset:
    """Checks shapes, dtypes and label ranges of a `Dataset`; returns it unchanged.

    Arguments:
        dataset: the dataset to check.

    Raises:
        DataError: naming the field and the problem.
    """
    name = dataset.name
    for split in ("train", "test"):
        x, y = getattr(dataset, f"x_{split}"), getattr(dataset, f"y_{split}")
        if not isinstance(x, np.ndarray) or x.ndim != 4:
            raise DataError(f"{name}: x_{split} must be an (N, H, W, C) numpy array, "
                            f"got {getattr(x, 'shape', type(x))}")
        if x.dtype != np.uint8 and x.dtype != np.float32:
            raise DataError(f"{name}: x_{split} must be uint8 or float32, got {x.dtype}")
        if not isinstance(y, np.ndarray) or y.ndim != 1 or y.dtype != np.int32:
            raise DataError(f"{name}: y_{split} must be a 1-D int32 numpy array, got "
                            f"{getattr(y, 'dtype', type(y))} {getattr(y, 'shape', '')}")
        if len(x) != len(y):
            raise DataError(f"{name}: x_{split} has {len(x)} images but y_{split} has {len(y)} labels")
        if len(y) and (y.min() < 0 or y.max() >= dataset.num_classes):
            raise DataError(f"{name}: y_{split} has labels in [{y.min()}, {y.max()}], "
                            f"expected [0, {dataset.num_classes - 1}]")
    if len(dataset.x_train) == 0:
        raise DataError(f"{name}: x_train is empty")
    if dataset.x_train.shape[1:] != dataset.x_test.shape[1:] or dataset.x_train.dtype != dataset.x_test.dtype:
        raise DataError(f"{name}: x_train {dataset.x_train.dtype}{dataset.x_train.shape[1:]} and x_test "
                        f"{dataset.x_test.dtype}{dataset.x_test.shape[1:]} differ in image shape or dtype")
    return dataset
