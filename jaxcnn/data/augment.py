"""Augmentation settings, one vocabulary for every source (timm's names), and their array form.

`Augment` names the steps (a random-resized crop, flips, a zero-padded random crop) and
`resolve_augment` turns the config's keys into one, unset keys taking the source's own recipe:
image files (``data.source: folder|records``, `jaxcnn.data.transforms.train_transform`) the
ImageNet one, in-memory arrays (MNIST, CIFAR-10, npz, synthetic) none.

On arrays the padded crop and the horizontal flip are drawn for the whole global batch from
``(seed, step)`` and applied with one vectorised gather (`augment_draws`, `crop_and_flip`), the
vertical flips drawn after them from the same stream; a random-resized crop (`resized_crops`)
draws from a stream of each example's own, ``(seed, step, position in the global batch)``. So a
process's share of the batch is augmented exactly as in a single-process run, and resuming at
any step reproduces the same images.
"""
import math
from typing import NamedTuple

import numpy as np

from jaxcnn.data.transforms import (INTERPOLATIONS, RATIO, SCALE, example_rng, pil_filter,
                                    random_resized_crop_box)

# Mixed into the seed so augmentation draws never share a stream with the epoch permutation.
_AUGMENT_STREAM = 0xA06
# The per-example stream of the random-resized crops of arrays.
_ARRAY_CROP_STREAM = 0xA07


class Augment(NamedTuple):
    """Augmentation steps, applied in this order.

    Fields:
        scale, ratio: the random-resized crop (torchvision ``RandomResizedCrop``): area fraction
            and aspect-ratio ranges, both or neither. None: no random crop (image files then
            get evaluation's resize and centre crop; arrays are left at their size).
        interpolation: the crop's resize filter (and image files' evaluation resize), one of
            ``bilinear``, ``bicubic``, ``nearest``.
        hflip, vflip: probabilities of mirroring the width and the height axis.
        crop_padding: pad each side by this many zero pixels, then crop back to ``H x W`` at a
            uniformly random offset (torchvision ``RandomCrop(size, padding=p)``); 0 disables.
        color_jitter, auto_augment: image files only, after the flips: timm's RandAugment /
            TrivialAugment / AugMix string (`jaxcnn.data.photometric.parse_auto_augment`), then
            torchvision ``ColorJitter`` factors ``(brightness, contrast, saturation, hue)`` (given
            as timm's number or list, `jaxcnn.data.photometric.parse_color_jitter`); None disables.
        reprob, remode: image files only, last: timm's random erasing with this probability
            and fill (`jaxcnn.data.photometric.random_erase`); 0 disables.
    """

    scale: tuple | None = None
    ratio: tuple | None = None
    interpolation: str = "bilinear"
    hflip: float = 0.0
    vflip: float = 0.0
    crop_padding: int = 0
    color_jitter: tuple | None = None
    auto_augment: str | None = None
    reprob: float = 0.0
    remode: str = "pixel"

    @property
    def photometric(self) -> bool:
        """Whether a photometric step (image files only) is on."""
        return self.color_jitter is not None or self.auto_augment is not None or self.reprob > 0

    @property
    def active(self) -> bool:
        """Whether this changes any array image (image files are resized whatever it says)."""
        return self.scale is not None or self.hflip > 0 or self.vflip > 0 or self.crop_padding > 0


# The ImageNet recipe image files get by default: RandomResizedCrop and RandomHorizontalFlip().
FILE_RECIPE = Augment(scale=SCALE, ratio=RATIO, hflip=0.5)


def resolve_augment(*, files: bool, no_aug: bool = False, scale=None, ratio=None, hflip=None, vflip=0.0,
                    interpolation="bilinear", crop_padding=0, color_jitter=None, auto_augment=None,
                    reprob=0.0, remode="pixel") -> Augment:
    """The `Augment` of a source from the config's ``data.augment`` keys (None: the source's own).

    Arguments:
        files: image files (`FILE_RECIPE` by default) rather than arrays (nothing by default).
        no_aug: no augmentation at all (``data.augment: none``); the other keys must be unset.
        scale, ratio: the random-resized crop; for arrays one given alone takes torchvision's
            default for the other.
        hflip, vflip, interpolation, crop_padding, color_jitter, auto_augment, reprob, remode:
            as `Augment`'s fields (the photometric ones for image files only).
    """
    if no_aug:
        return as_augment(Augment(interpolation=interpolation))
    if files or scale is not None or ratio is not None:
        scale = SCALE if scale is None else tuple(scale)
        ratio = RATIO if ratio is None else tuple(ratio)
    if hflip is None:
        hflip = FILE_RECIPE.hflip if files else 0.0
    augment = as_augment(Augment(scale, ratio, interpolation, float(hflip), float(vflip), int(crop_padding),
                                 color_jitter, auto_augment, float(reprob), remode))
    if not files:
        check_for_arrays(augment)
    return augment


def check_for_arrays(augment: Augment) -> None:
    """A ValueError for the steps in-memory arrays do not take (the photometric ones run on
    decoded image files)."""
    if augment.photometric:
        raise ValueError("augment: color_jitter, auto_augment and reprob work on decoded image files, "
                         "not on in-memory arrays")


def _check_range(name, pair, low_open_zero, high):
    if (not isinstance(pair, tuple) or len(pair) != 2 or not all(isinstance(v, (int, float)) for v in pair)
            or not all(math.isfinite(v) for v in pair) or not 0 < pair[0] <= pair[1] or pair[1] > high):
        raise ValueError(f"augment: {name} must be [lo, hi] with 0 < lo <= hi{low_open_zero}, got {pair!r}")


def as_augment(value) -> Augment:
    """Checks and normalises an augmentation setting.

    Arguments:
        value: None or False (no augmentation), an `Augment`, or a mapping of its fields.

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
    if (augment.scale is None) != (augment.ratio is None):
        raise ValueError(f"augment: give scale and ratio together, got scale={augment.scale!r}, "
                         f"ratio={augment.ratio!r}")
    if augment.scale is not None:
        augment = augment._replace(scale=tuple(augment.scale), ratio=tuple(augment.ratio))
        _check_range("scale", augment.scale, " <= 1", 1.0)
        _check_range("ratio", augment.ratio, "", math.inf)
    if augment.interpolation not in INTERPOLATIONS:
        raise ValueError(f"augment: interpolation must be one of {list(INTERPOLATIONS)}, "
                         f"got {augment.interpolation!r}")
    for name in ("hflip", "vflip"):
        p = getattr(augment, name)
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float)) or not 0 <= p <= 1:
            raise ValueError(f"augment: {name} must be a probability in [0, 1], got {p!r}")
    if not isinstance(augment.crop_padding, (int, np.integer)) or augment.crop_padding < 0:
        raise ValueError(f"augment: crop_padding must be a non-negative int, got {augment.crop_padding!r}")
    return _checked_photometric(augment) if augment.photometric else augment


def _checked_photometric(augment: Augment) -> Augment:
    """``augment`` with its photometric fields checked (`jaxcnn.data.photometric`'s parsers)."""
    from jaxcnn.data import photometric

    if augment.color_jitter is not None:
        augment = augment._replace(color_jitter=photometric.parse_color_jitter(
            augment.color_jitter, "augment: color_jitter"))
    if augment.auto_augment is not None:
        photometric.parse_auto_augment(augment.auto_augment)
    if isinstance(augment.reprob, bool) or not isinstance(augment.reprob, (int, float)) or not 0 <= augment.reprob <= 1:
        raise ValueError(f"augment: reprob must be a probability in [0, 1], got {augment.reprob!r}")
    if augment.remode not in photometric.ERASE_MODES:
        raise ValueError(f"augment: remode must be one of {list(photometric.ERASE_MODES)}, got {augment.remode!r}")
    return augment


def augment_draws(seed: int, step: int, batch_size: int, augment: Augment):
    """Random crop offsets and flip decisions for every example of a global batch.

    Arguments:
        seed: data seed.
        step: training step.
        batch_size: global batch size.
        augment: the settings.

    Returns:
        ``(offsets, hflips, vflips)``: ``(batch_size, 2)`` int offsets (row, column) into the
        padded image, each in ``[0, 2 * crop_padding]``, and two ``(batch_size,)`` bool arrays
        (a uniform draw below ``hflip``, resp. ``vflip``; the vertical ones are drawn only
        when ``vflip > 0``).
    """
    rng = np.random.default_rng([seed, step, _AUGMENT_STREAM])
    offsets = rng.integers(0, 2 * augment.crop_padding + 1, size=(batch_size, 2))
    hflips = rng.random(batch_size) < augment.hflip
    vflips = rng.random(batch_size) < augment.vflip if augment.vflip > 0 else np.zeros(batch_size, bool)
    return offsets, hflips, vflips


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


def resized_crop(image: np.ndarray, box, interpolation: str) -> np.ndarray:
    """The ``(top, left, h, w)`` crop of an ``(H, W, C)`` image resized back to ``H x W``
    with Pillow's filter, each channel on its own (``uint8`` as 8-bit images, anything else
    as 32-bit float ones, cast back to the image's dtype)."""
    from PIL import Image

    top, left, h, w = box
    height, width, channels = image.shape
    bands = []
    for c in range(channels):
        band = image[top:top + h, left:left + w, c]
        band = np.ascontiguousarray(band if image.dtype == np.uint8 else band.astype(np.float32))
        bands.append(np.asarray(Image.fromarray(band).resize((width, height), pil_filter(interpolation))))
    return np.stack(bands, axis=-1).astype(image.dtype, copy=False)


def resized_crops(images: np.ndarray, seed: int, step: int, start: int, augment: Augment) -> np.ndarray:
    """Each image's random-resized crop (``augment.scale``/``ratio``), resized back to its size:
    ``images`` are the global batch's rows from ``start`` on, example ``k`` drawing its box
    from ``(seed, step, start + k)``'s own stream."""
    out = np.empty_like(images)
    height, width = images.shape[1:3]
    for k, image in enumerate(images):
        rng = example_rng(seed, step, start + k, _ARRAY_CROP_STREAM)
        box = random_resized_crop_box(rng, height, width, augment.scale, augment.ratio)
        out[k] = resized_crop(image, box, augment.interpolation)
    return out
