"""Host-side augmentation: random crop with zero padding and random horizontal flip.

Both are drawn for the whole global batch from ``(seed, step)`` and applied with one
vectorised gather, so a process's share of the batch is augmented exactly as it would be in a
single-process run, and resuming at any step reproduces the same images.
"""
from typing import NamedTuple

import numpy as np

# Mixed into the seed so augmentation draws never share a stream with the epoch permutation.
_AUGMENT_STREAM = 0xA06


class Augment(NamedTuple):
    """Augmentation settings.

    Fields:
        crop_padding: pad each side by this many zero pixels, then crop back to ``H x W`` at a
            uniformly random offset (torchvision ``RandomCrop(size, padding=p)``); 0 disables.
        flip: mirror the width axis with probability 1/2 (``RandomHorizontalFlip``).
    """

    crop_padding: int = 0
    flip: bool = False

    @property
    def active(self) -> bool:
        """Whether this changes any image."""
        return self.crop_padding > 0 or self.flip


def as_augment(value) -> Augment:
    """Normalises an augmentation setting.

    Arguments:
        value: None or False (no augmentation), an `Augment`, or a mapping with the fields of
            `Augment` (as read from a config file).

    Returns:
        An `Augment`.
    """
    if value is None or value is False:
        return Augment()
    if isinstance(value, Augment):
        augment = value
    elif isinstance(value, dict):
        unknown = set(value) - set(Augment._fields)
        if unknown:
            raise ValueError(f"augment: unknown keys {sorted(unknown)}; expected {list(Augment._fields)}")
        augment = Augment(**value)
    else:
        raise ValueError(f"augment: expected None, False, Augment or a mapping, got {value!r}")
    if not isinstance(augment.crop_padding, (int, np.integer)) or augment.crop_padding < 0:
        raise ValueError(f"augment: crop_padding must be a non-negative int, got {augment.crop_padding!r}")
    if not isinstance(augment.flip, (bool, np.bool_)):
        raise ValueError(f"augment: flip must be a bool, got {augment.flip!r}")
    return augment


def augment_draws(seed: int, step: int, batch_size: int, augment: Augment):
    """Random crop offsets and flip decisions for every example of a global batch.

    Arguments:
        seed: data seed.
        step: training step.
        batch_size: global batch size.
        augment: the settings.

    Returns:
        ``(offsets, flips)``: ``(batch_size, 2)`` int offsets (row, column) into the padded
        image, each in ``[0, 2 * crop_padding]``, and ``(batch_size,)`` bool flips.
    """
    rng = np.random.default_rng([seed, step, _AUGMENT_STREAM])
    offsets = rng.integers(0, 2 * augment.crop_padding + 1, size=(batch_size, 2))
    flips = rng.random(batch_size) < 0.5
    if not augment.flip:
        flips[:] = False
    return offsets, flips


def crop_and_flip(images: np.ndarray, offsets: np.ndarray, flips: np.ndarray, padding: int) -> np.ndarray:
    """Crops each zero-padded image at its offset, then mirrors the flipped ones.

    Arguments:
        images: ``(B, H, W, C)`` images of any dtype.
        offsets: ``(B, 2)`` row/column offsets into the padded image, in ``[0, 2 * padding]``.
        flips: ``(B,)`` bool, mirror the width axis.
        padding: zero pixels added on each side before cropping.

    Returns:
        ``(B, H, W, C)`` images, same dtype: ``out[b, i, j] = x[b, i + oy - p, j' + ox - p]``
        with ``j' = W - 1 - j`` when flipped, and 0 where that falls outside the image.
    """
    n, h, w, _ = images.shape
    padded = np.pad(images, ((0, 0), (padding, padding), (padding, padding), (0, 0)))
    rows = offsets[:, 0, None] + np.arange(h)
    cols = np.where(flips[:, None], np.arange(w - 1, -1, -1), np.arange(w)) + offsets[:, 1, None]
    return padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
