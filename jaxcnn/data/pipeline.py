"""Stateless batching: the batch for step ``s`` is a pure function of ``(seed, s)``.

Epoch ``e = s // steps_per_epoch`` visits the training set in the order of a permutation
seeded by ``(seed, e)``, so resuming from a checkpoint at any step needs no iterator state.
In a multi-process run each process takes a contiguous share of every global batch.
"""
import functools

import numpy as np

from jaxcnn.data.augment import as_augment, augment_draws, check_for_arrays, crop_and_flip, resized_crops
from jaxcnn.data.dataset import DataError, Dataset, normalize, to_unit_scale


def process_share(batch_size: int, process_index: int, process_count: int):
    """Where this process's share of a global batch starts, and its size.

    Arguments:
        batch_size: global batch size, divisible by ``process_count``.
        process_index: in ``[0, process_count)``.
        process_count: number of processes.

    Returns:
        ``(start, local_batch_size)``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} is not in [0, process_count={process_count})")
    if batch_size % process_count:
        raise ValueError(f"global batch size {batch_size} is not divisible by process_count {process_count}")
    local = batch_size // process_count
    return process_index * local, local


def steps_per_epoch(num_examples: int, batch_size: int, *, drop_last: bool = True) -> int:
    """Number of batches in one pass over ``num_examples`` (the short last batch counts unless ``drop_last``)."""
    steps = num_examples // batch_size if drop_last else -(-num_examples // batch_size)
    if steps < 1:
        raise ValueError(f"{num_examples} examples make no full batch of {batch_size}")
    return steps


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    # Cached because every step of an epoch needs it, and an ImageNet-sized permutation is slow.
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    order.flags.writeable = False
    return order


def batch_indices(num_examples: int, batch_size: int, seed: int, step: int, *, drop_last: bool = True) -> np.ndarray:
    """Indices of the training examples in the global batch for ``step``.

    Arguments:
        num_examples: training set size.
        batch_size: global batch size.
        seed: data seed (non-negative int).
        step: training step (non-negative int).
        drop_last: drop the short last batch of each epoch, so that every batch is full.

    Returns:
        ``(batch_size,)`` int64 indices (shorter for the last batch of an epoch when
        ``drop_last=False``); across one epoch each example appears at most once, and exactly
        once when ``drop_last=False``.
    """
    if step < 0 or seed < 0:
        raise ValueError(f"batch_indices: seed and step must be non-negative, got seed={seed}, step={step}")
    per_epoch = steps_per_epoch(num_examples, batch_size, drop_last=drop_last)
    epoch, position = divmod(int(step), per_epoch)
    order = _epoch_permutation(int(num_examples), int(seed), epoch)
    return order[position * batch_size:(position + 1) * batch_size].copy()


def train_batch(dataset: Dataset, step: int, *, seed: int, batch_size: int, augment,
                process_index: int = 0, process_count: int = 1) -> dict:
    """This process's share of the training batch for ``step``, augmented and normalised.

    Arguments:
        dataset: a `Dataset` with ``mean``/``std`` set (the loaders set them).
        step: training step.
        seed: data seed; shuffling and augmentation are pure functions of ``(seed, step)``.
        batch_size: global batch size, divisible by ``process_count``.
        augment: None/False, an `Augment`, or a mapping of its fields: its random-resized crop
            (each image resized back to its own size), then its padded crop and flips.
        process_index: this process, in ``[0, process_count)``.
        process_count: number of processes sharing the global batch.

    Returns:
        ``{"image": (B, H, W, C) float32, "label": (B,) int32}``, ``B = batch_size // process_count``;
        images are ``(x/255 - mean) / std`` (``(x - mean) / std`` for float datasets).
    """
    augment = as_augment(augment)
    check_for_arrays(augment)
    if dataset.mean is None or dataset.std is None:
        raise DataError(f"{dataset.name}: dataset has no mean/std for normalisation; use dataset.with_stats()")
    start, local = process_share(batch_size, process_index, process_count)
    indices = batch_indices(len(dataset.x_train), batch_size, seed, step)[start:start + local]
    images = dataset.x_train[indices]
    if augment.active:
        if augment.scale is not None:
            images = resized_crops(images, seed, step, start, augment)
        offsets, hflips, vflips = augment_draws(seed, step, batch_size, augment)
        share = slice(start, start + local)
        images = crop_and_flip(images, offsets[share], hflips[share], augment.crop_padding)
        images[vflips[share]] = images[vflips[share], ::-1]
    labels = dataset.y_train[indices].astype(np.int32, copy=False)
    return {"image": normalize(images, dataset.mean, dataset.std), "label": labels}


def eval_batches(images: np.ndarray, labels: np.ndarray, batch_size: int, *, mean=None, std=None,
                 process_index: int = 0, process_count: int = 1):
    """Yields every example exactly once, in order, in batches padded to ``batch_size``.

    Arguments:
        images: ``(N, H, W, C)`` uint8 or float images.
        labels: ``(N,)`` int labels.
        batch_size: global batch size, divisible by ``process_count``.
        mean: ``(C,)`` normalisation mean (use the training set's, ``dataset.mean``); None with
            ``std`` None only converts to the unit scale.
        std: ``(C,)`` normalisation standard deviation.
        process_index: this process, in ``[0, process_count)``.
        process_count: number of processes sharing each global batch.

    Yields:
        ``ceil(N / batch_size)`` dicts ``{"image": (B, H, W, C) float32, "label": (B,) int32,
        "mask": (B,) bool}`` with ``B = batch_size // process_count``; padding rows are zero
        images with label 0 and ``mask`` False, and only the last global batch has them.
    """
    if len(images) != len(labels):
        raise ValueError(f"eval_batches: {len(images)} images but {len(labels)} labels")
    if (mean is None) != (std is None):
        raise ValueError("eval_batches: give both mean and std, or neither")
    start, local = process_share(batch_size, process_index, process_count)
    total = len(images)
    for batch_start in range(0, total, batch_size):
        lo = min(batch_start + start, total)
        hi = min(batch_start + start + local, total)
        chunk = images[lo:hi]
        chunk = to_unit_scale(chunk) if mean is None else normalize(chunk, mean, std)
        image = np.zeros((local,) + images.shape[1:], np.float32)
        label = np.zeros(local, np.int32)
        mask = np.zeros(local, bool)
        image[:hi - lo] = chunk
        label[:hi - lo] = labels[lo:hi]
        mask[:hi - lo] = True
        yield {"image": image, "label": label, "mask": mask}
