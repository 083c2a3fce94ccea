"""Colour jitter, auto-augmentation and random erasing on the host, in timm's vocabulary
(``color_jitter``, ``auto_augment``, ``reprob``): the photometric steps of the training pipeline.

`color_jitter` is torchvision's ``ColorJitter`` on a ``PIL.Image`` (its PIL path: Pillow's
``ImageEnhance`` for brightness, contrast and saturation, a shift of the HSV hue channel for
hue), the four adjustments in a random order. `parse_auto_augment` reads timm's RandAugment,
TrivialAugment and AugMix strings (`rand_augment`, `augmix`) and `auto_augment` applies them.
`random_erase` is timm's ``RandomErasing`` geometry on the ``uint8`` image before the device
normalises it, so its fills are stated in pixel values: timm's zero of the normalised image is
the dataset mean.

timm's order (``transforms_factory.create_transform``): crop and flips; then `auto_augment`, or
`color_jitter` when there is no ``auto_augment`` (timm turns colour jitter off under it unless
the string contains ``3a``); `random_erase` last.

Every draw comes from the ``np.random.Generator`` passed in (`transforms.example_rng`'s), never
from Python's ``random`` or torch's generator.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from PIL import Image, ImageEnhance

from jaxcnn.data.augmix import AugMix, augmix, parse_augmix
from jaxcnn.data.rand_augment import DEFAULT_FILL, auto_augment_error, parse_rand_augment, rand_augment

COLOR_JITTER_EXAMPLE = "0.4 or [0.4, 0.4, 0.4, 0.1]"
ERASE_MODES = ("const", "rand", "pixel")
ERASE_ATTEMPTS = 10


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def parse_color_jitter(value, key: str = "color_jitter"):
    """timm's ``color_jitter`` value as ``(brightness, contrast, saturation, hue)``.

    A number ``v`` is ``(v, v, v, 0)``; a list of 3 or 4 numbers gives the factors (hue 0 when
    absent). Brightness, contrast and saturation must be at least 0, hue in ``[0, 0.5]``.

    Raises:
        ValueError: one line naming ``key`` and the value.
    """
    if _is_number(value):
        factors = (float(value),) * 3 + (0.0,)
    elif isinstance(value, (list, tuple)) and len(value) in (3, 4) and all(map(_is_number, value)):
        factors = tuple(float(v) for v in value) + (0.0,) * (4 - len(value))
    else:
        raise ValueError(f"{key}: expected a number or a list of 3 or 4 numbers "
                         f"(brightness, contrast, saturation[, hue]), e.g. {COLOR_JITTER_EXAMPLE}; got {value!r}")
    if min(factors[:3]) < 0 or not 0.0 <= factors[3] <= 0.5 or not all(map(math.isfinite, factors)):
        raise ValueError(f"{key}: brightness, contrast and saturation must be >= 0 and hue in [0, 0.5]; "
                         f"got {value!r}")
    return factors


def color_jitter_draws(rng: np.random.Generator, brightness, contrast, saturation, hue=0.0):
    """torchvision ``ColorJitter.get_params``: ``(order, factors)``.

    ``order`` is a random permutation of ``0..3`` (brightness, contrast, saturation, hue);
    ``factors[i]`` is drawn uniformly from ``[max(0, 1 - v), 1 + v]`` for the first three and
    ``[-v, v]`` for hue, or is None (the adjustment is skipped, nothing drawn) when ``v`` is 0.
    """
    order = rng.permutation(4)
    factors = []
    for i, v in enumerate((brightness, contrast, saturation, hue)):
        if v == 0:
            factors.append(None)
        elif i < 3:
            factors.append(float(rng.uniform(max(0.0, 1.0 - v), 1.0 + v)))
        else:
            factors.append(float(rng.uniform(-v, v)))
    return order, factors


def adjust_hue(image, factor: float):
    """torchvision's PIL ``adjust_hue``: shift the HSV hue channel by ``int(factor * 255)``
    (modulo 256), ``factor`` in ``[-0.5, 0.5]``; RGB ``PIL.Image`` in and out."""
    shift = int(factor * 255)
    h, s, v = image.convert("HSV").split()
    h = h.point([(i + shift) % 256 for i in range(256)])
    return Image.merge("HSV", (h, s, v)).convert(image.mode)


# torchvision's PIL adjust_brightness, adjust_contrast, adjust_saturation, adjust_hue, by index.
ADJUSTMENTS = (
    lambda image, f: ImageEnhance.Brightness(image).enhance(f),
    lambda image, f: ImageEnhance.Contrast(image).enhance(f),
    lambda image, f: ImageEnhance.Color(image).enhance(f),
    adjust_hue,
)


def color_jitter(image, rng: np.random.Generator, brightness, contrast, saturation, hue=0.0):
    """torchvision ``ColorJitter(brightness, contrast, saturation, hue)`` on an RGB ``PIL.Image``.

    Draws `color_jitter_draws` from ``rng`` and applies the adjustments that are on in the
    drawn order (the factors as `parse_color_jitter` returns them). Returns a ``PIL.Image``.
    """
    order, factors = color_jitter_draws(rng, brightness, contrast, saturation, hue)
    for i in order:
        if factors[i] is not None:
            image = ADJUSTMENTS[i](image, factors[i])
    return image


def parse_auto_augment(value: str, *, fill=DEFAULT_FILL, interpolation: str = "random"):
    """timm's ``auto_augment`` string as a policy for `auto_augment`.

    ``rand-...`` and ``trivialaugment``: `rand_augment.parse_rand_augment`; ``augmix-...``:
    `augmix.parse_augmix`. timm's AutoAugment policies (``original``, ``v0``, ...) are not
    supported.

    Arguments:
        fill: RGB ``uint8`` fill of geometric ops: `mean_fill` of the dataset mean, as timm's.
        interpolation: ``'random'`` (bilinear or bicubic per op, as timm) or one of them, or
            ``'nearest'``.

    Raises:
        ValueError: one line naming the string and showing a valid one.
    """
    if not isinstance(value, str):
        raise auto_augment_error(value, "not a string")
    name = value.split("-")[0]
    if name == "augmix":
        return parse_augmix(value, fill=fill, interpolation=interpolation)
    if name == "rand" or value == "trivialaugment":
        return parse_rand_augment(value, fill=fill, interpolation=interpolation)
    raise auto_augment_error(value, "unknown policy (RandAugment 'rand-...', 'trivialaugment' and AugMix "
                                    "'augmix-...' are supported, not AutoAugment's 'original', 'v0', ...)")


def auto_augment(image, policy, rng: np.random.Generator):
    """Applies a `parse_auto_augment` policy to an RGB ``PIL.Image``; returns a ``PIL.Image``."""
    if isinstance(policy, AugMix):
        return augmix(image, policy, rng)
    return rand_augment(image, policy, rng)


def mean_fill(mean) -> tuple:
    """The ``uint8`` colour of a dataset mean given in ``[0, 1]`` (timm's ``img_mean``:
    ``min(255, round(255 * m))`` per channel), e.g. ImageNet's ``(124, 116, 104)``."""
    return tuple(min(255, int(round(255 * float(m)))) for m in mean)


def erase_box(rng: np.random.Generator, height: int, width: int, count: int = 1, *, min_area=0.02,
              max_area=1 / 3, log_aspect=(math.log(0.3), math.log(1 / 0.3))):
    """timm ``RandomErasing``'s box for one of ``count`` boxes: ``(top, left, h, w)`` or None.

    Up to ten times: an area ``U(min_area, max_area) * H * W / count`` and a log-uniform aspect
    ``h / w``, sides rounded; the first box strictly smaller than the image on both sides is
    placed uniformly (top in ``[0, H - h]``, left in ``[0, W - w]``). None when all ten fail.
    """
    area = height * width
    for _ in range(ERASE_ATTEMPTS):
        target_area = rng.uniform(min_area, max_area) * area / count
        aspect = math.exp(rng.uniform(*log_aspect))
        h = int(round(math.sqrt(target_area * aspect)))
        w = int(round(math.sqrt(target_area / aspect)))
        if w < width and h < height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    return None


def _check_erase(array, prob, mode, mean, std, min_count, max_count):
    if not isinstance(array, np.ndarray) or array.dtype != np.uint8 or array.ndim != 3:
        raise ValueError(f"random_erase: expected a uint8 (H, W, C) array, got "
                         f"{getattr(array, 'dtype', type(array).__name__)} {getattr(array, 'shape', '')}")
    if not array.flags.writeable:
        raise ValueError("random_erase: the array is read-only (it erases in place): pass a writable copy")
    if mode not in ERASE_MODES:
        raise ValueError(f"random_erase: mode must be one of {ERASE_MODES}, got {mode!r}")
    if not 0.0 <= prob <= 1.0 or not 1 <= min_count <= max_count:
        raise ValueError(f"random_erase: need prob in [0, 1] and 1 <= min_count <= max_count, "
                         f"got prob={prob!r}, counts ({min_count}, {max_count})")
    if len(mean) != array.shape[2] or (mode != "const" and (std is None or len(std) != array.shape[2])):
        raise ValueError(f"random_erase: mean{'' if mode == 'const' else ' and std'} need one value per "
                         f"channel of the {array.shape} image, got mean={mean!r}, std={std!r}")


def _erase_pixels(rng, shape, mode, mean, std):
    """The ``uint8`` block for one box: the rounded mean (const), or a mean + std normal draw per
    channel (rand) or per pixel (pixel), rounded and clipped to ``[0, 255]``."""
    mean = np.asarray(mean, np.float64)
    if mode == "const":
        return np.clip(np.round(mean), 0, 255).astype(np.uint8)
    noise = rng.standard_normal(shape if mode == "pixel" else (shape[2],))
    return np.clip(np.round(mean + np.asarray(std, np.float64) * noise), 0, 255).astype(np.uint8)


def random_erase(array, rng: np.random.Generator, prob: float, *, mean, std=None, mode: str = "const",
                 min_area: float = 0.02, max_area: float = 1 / 3, min_aspect: float = 0.3,
                 max_aspect: float | None = None, min_count: int = 1, max_count: int | None = None):
    """timm ``RandomErasing(prob, mode=mode, max_count=max_count)`` on a ``uint8`` image, in place.

    With probability ``prob``: draw a count in ``[min_count, max_count]`` (``max_count`` defaults to
    ``min_count``), and for each, `erase_box` (area fraction in ``[min_area, max_area]`` shared by
    the count, aspect ``h / w`` log-uniform in ``[min_aspect, max_aspect or 1 / min_aspect]``)
    and fill the box. timm erases the normalised image, where 0 is the dataset mean and its
    noise is ``N(0, 1)``; here the image is still ``uint8``, so, with ``mean`` and ``std`` the
    dataset's per-channel mean and std in pixel units (``255 *`` the ``[0, 1]`` ones):

    - ``'const'``: the mean, rounded: timm's zeros exactly, up to that rounding;
    - ``'rand'``: one ``mean + std * N(0, 1)`` colour per box; ``'pixel'``: one per pixel and
      channel. Both are timm's normal noise mapped to pixel values, then rounded and clipped to
      ``[0, 255]``; timm's noise is neither (with ImageNet's mean and std, the pixel range ends
      1.8 to 2.6 sigma from the mean, so 3 to 4% of the noise values are clipped here).

    Arguments:
        array: ``(H, W, C)`` ``uint8``, writable; erased in place.
        rng: the example's generator; the draws are timm's, in its order: one uniform for
            ``prob``, the count (only when ``min_count < max_count``), then per box up to ten
            (area, aspect) pairs, the position, and the box's noise (``'rand'``, ``'pixel'``).

    Returns:
        ``array``.
    """
    max_count = min_count if max_count is None else max_count
    _check_erase(array, prob, mode, mean, std, min_count, max_count)
    if rng.random() >= prob:
        return array
    height, width = array.shape[:2]
    count = min_count if min_count == max_count else int(rng.integers(min_count, max_count + 1))
    log_aspect = (math.log(min_aspect), math.log(max_aspect or 1 / min_aspect))
    for _ in range(count):
        box = erase_box(rng, height, width, count, min_area=min_area, max_area=max_area, log_aspect=log_aspect)
        if box is not None:
            top, left, h, w = box
            array[top:top + h, left:left + w] = _erase_pixels(rng, (h, w, array.shape[2]), mode, mean, std)
    return array
