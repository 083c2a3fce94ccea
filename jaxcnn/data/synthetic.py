"""Random images and labels from a seed, for throughput benchmarks and smoke tests.

A batch is a pure function of ``(seed, step)`` and is generated on the fly: nothing the size
of a dataset is ever held. Example ``i`` of a global batch owns a fixed stretch of one PCG64
stream, so a process jumps straight to its share (``PCG64.advance``) and the global batch is
the same whatever the number of processes.
"""
from typing import NamedTuple

import numpy as np

from jaxcnn.data.dataset import Dataset, normalize
from jaxcnn.data.pipeline import process_share

# Uniform uint8 noise has mean 127.5/255 and standard deviation sqrt((256**2 - 1) / 12) / 255.
NOISE_MEAN = 0.5
NOISE_STD = float(np.sqrt((256.0**2 - 1.0) / 12.0) / 255.0)
# Streams of one seed: training batches, and the train/test splits of `synthetic_dataset`.
_BATCH_STREAM, _TRAIN_STREAM, _TEST_STREAM = 0, 1, 2


class SyntheticSpec(NamedTuple):
    """Shape of a synthetic dataset.

    Fields:
        image_shape: ``(H, W, C)`` of one image; ImageNet-shaped by default.
        num_classes: labels are uniform in ``[0, num_classes)``.
        name: dataset name.
    """

    image_shape: tuple = (224, 224, 3)
    num_classes: int = 1000
    name: str = "synthetic"


def _examples(seed, stream, index, start, count, spec):
    """Images ``start .. start + count`` of the group ``(seed, stream, index)``, and their labels."""
    pixels = int(np.prod(spec.image_shape))
    words = -(-pixels // 8)  # 64-bit draws per image
    bits = np.random.PCG64(np.random.SeedSequence([seed, stream, index]))
    bits.advance(start * words)
    images = bits.random_raw(count * words).view(np.uint8).reshape(count, words * 8)[:, :pixels]
    labels = np.random.default_rng([seed, stream, index, 1]).integers(
        0, spec.num_classes, size=start + count, dtype=np.int32)[start:]
    return images.reshape((count,) + tuple(spec.image_shape)), labels


def synthetic_batch(spec: SyntheticSpec, step: int, *, seed: int, batch_size: int,
                    process_index: int = 0, process_count: int = 1, image_dtype="float32") -> dict:
    """This process's share of the synthetic global batch for ``step``.

    Arguments:
        spec: image shape and number of classes.
        step: training step (non-negative).
        seed: data seed.
        batch_size: global batch size, divisible by ``process_count``.
        process_index: this process, in ``[0, process_count)``.
        process_count: number of processes sharing the global batch.
        image_dtype: ``"float32"`` for images normalised like real data (``(x/255 - 0.5) / std``
            of uniform noise) or ``"uint8"`` for raw bytes, which are 4x cheaper to make and move
            when the normalisation is done on the device.

    Returns:
        ``{"image": (B, H, W, C), "label": (B,) int32}`` with ``B = batch_size // process_count``.
    """
    start, local = process_share(batch_size, process_index, process_count)
    if step < 0:
        raise ValueError(f"synthetic_batch: step must be non-negative, got {step}")
    images, labels = _examples(seed, _BATCH_STREAM, step, start, local, spec)
    if image_dtype == "float32":
        images = normalize(images, (NOISE_MEAN,), (NOISE_STD,))
    elif image_dtype != "uint8":
        raise ValueError(f"synthetic_batch: image_dtype must be 'float32' or 'uint8', got {image_dtype!r}")
    return {"image": images, "label": labels}


def synthetic_dataset(spec: SyntheticSpec, *, num_train: int, num_test: int, seed: int) -> Dataset:
    """A small synthetic `Dataset` held in memory, for tests and smoke runs of the real-data path.

    Arguments:
        spec: image shape and number of classes.
        num_train: number of training images (at least 1).
        num_test: number of test images.
        seed: data seed.

    Returns:
        A `Dataset` of uint8 noise images with int32 labels; mean/std are the noise statistics.
    """
    if num_train < 1 or num_test < 0:
        raise ValueError(f"synthetic_dataset: need num_train >= 1 and num_test >= 0, got {num_train}, {num_test}")
    x_train, y_train = _examples(seed, _TRAIN_STREAM, 0, 0, num_train, spec)
    x_test, y_test = _examples(seed, _TEST_STREAM, 0, 0, num_test, spec)
    channels = spec.image_shape[-1]
    return Dataset(x_train, y_train, x_test, y_test, spec.num_classes, spec.name,
                   np.full(channels, NOISE_MEAN, np.float32), np.full(channels, NOISE_STD, np.float32))
