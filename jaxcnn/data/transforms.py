"""The standard ImageNet transforms, on the host with Pillow and NumPy, ``uint8`` out.

Training (timm's ``transforms_imagenet_train`` order, torchvision's definitions): a random-resized
crop (``RandomResizedCrop(size, scale, ratio)``: a crop of a random area fraction and aspect
ratio, ten tries, then torchvision's centre-crop fallback) resized with Pillow's filter
(``bilinear`` by default, antialiased) to ``(H, W)``; a horizontal and a vertical flip, each
with its probability; then torchvision's ``RandomCrop(size, padding=p)`` (zero padding). The
ImageNet recipe is ``scale=(0.08, 1)``, ``ratio=(3/4, 4/3)``, horizontal flip 1/2. Without a
random crop (``scale`` None: no augmentation) training takes evaluation's transform.
Evaluation (``Resize(resize)`` then ``CenterCrop((H, W))``): resize the shorter side to
``resize`` and cut out the centre.

Every random draw for an example comes from a generator seeded by ``(seed, step, position)``,
where ``position`` is the example's place in the global batch: a batch is a pure function of
the seed and the step, whichever process or worker makes it. The draws come in the order of the
steps (crop, horizontal flip, vertical flip, padded crop), a step with nothing to do drawing
nothing. Normalisation is left to the device, as the trainer does for ``uint8`` data.
"""
from __future__ import annotations

import functools
import math

import numpy as np

# ImageNet's channel statistics on the unit scale: the device normalises image files with them
# (torchvision's and timm's ImageNet convention), and the photometric steps fill with them.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
CROP_TRIES = 10
# Mixed into each example's seed so these draws share no stream with the epoch permutation.
_TRANSFORM_STREAM = 0x1A6E


# Pillow's filter for each ``interpolation`` (torchvision's PIL path uses the same ones).
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


def example_rng(seed: int, step: int, position: int, stream: int = _TRANSFORM_STREAM) -> np.random.Generator:
    """The generator for the example at ``position`` of the global batch for ``step`` (``stream``
    tells apart the uses that must not share draws)."""
    return np.random.default_rng([int(seed), int(step), int(position), int(stream)])


def random_resized_crop_box(rng: np.random.Generator, height: int, width: int, scale=SCALE, ratio=RATIO):
    """torchvision's ``RandomResizedCrop.get_params``: ``(top, left, crop_h, crop_w)``.

    Up to ten times: draw a target area ``U(scale) * H * W`` and a log-uniform aspect ratio
    in ``ratio``, round the side lengths, and take the crop if it fits, at a uniformly random
    position. Otherwise the centre crop of the whole image clamped to ``ratio``.
    """
    area = height * width
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(CROP_TRIES):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    # torchvision can round a side of a 1-pixel-thin image to 0 (ratio (2, 3): round(1 / 2) = 0);
    # an empty crop cannot be resized, so it is one pixel.
    h, w = max(1, h), max(1, w)
    return (height - h) // 2, (width - w) // 2, h, w


def _pil():
    global _PIL_IMAGE
    if _PIL_IMAGE is None:  # imported on first use: the loaders' hot loop calls this per image
        from PIL import Image

        _PIL_IMAGE = Image
    return _PIL_IMAGE


_PIL_IMAGE = None


def pil_filter(interpolation: str):
    """Pillow's resampling filter for ``interpolation`` (one of `INTERPOLATIONS`)."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"interpolation must be one of {list(INTERPOLATIONS)}, got {interpolation!r}")
    return getattr(_pil(), interpolation.upper())


def train_transform(image, size, rng: np.random.Generator, augment, *, resize: int | None = None, out=None):
    """One training example from an RGB ``PIL.Image``: the steps of `augment` in timm's order.

    Arguments:
        image: the decoded image.
        size: ``(H, W)`` of the output.
        rng: the example's generator (`example_rng`).
        augment: a `jaxcnn.data.Augment`: ``scale``/``ratio`` of the random-resized crop (None:
            evaluation's `eval_transform` to ``resize``), ``interpolation``, ``hflip``/``vflip``
            probabilities, ``auto_augment`` and ``color_jitter``, ``crop_padding``, ``reprob``.
        resize: the evaluation resize, used when ``augment.scale`` is None.
        out: an ``(H, W, 3)`` ``uint8`` array to write into (a batch row), or None.

    Returns:
        ``(H, W, 3)`` ``uint8`` array (``out`` when given). The steps draw from ``rng`` in
        timm's order: crop, flips, auto augmentation, colour jitter, padded crop, random erasing
        (`jaxcnn.data.photometric`; its fills are the ImageNet mean and std the device
        normalises with).
    """
    if augment.scale is None:
        array = eval_transform(image, size, resize, augment.interpolation)
    else:
        out_h, out_w = size
        top, left, h, w = random_resized_crop_box(rng, image.height, image.width, augment.scale, augment.ratio)
        crop = image.crop((left, top, left + w, top + h)).resize((out_w, out_h), pil_filter(augment.interpolation))
        array = np.asarray(crop, np.uint8)
    array = random_flips(array, rng, augment.hflip, augment.vflip)
    if augment.auto_augment is not None or augment.color_jitter is not None:
        array = _colour_steps(array, rng, augment)
    if augment.crop_padding:
        array = random_padded_crop(array, rng, augment.crop_padding)
    if out is None:
        out = np.array(array, np.uint8)
    else:
        np.copyto(out, array)
    if augment.reprob:
        from jaxcnn.data.photometric import random_erase
        mean, std = _IMAGENET_PIXELS
        random_erase(out, rng, augment.reprob, mean=mean, std=std, mode=augment.remode)
    return out


def _colour_steps(array: np.ndarray, rng: np.random.Generator, augment) -> np.ndarray:
    """``augment.auto_augment`` then ``augment.color_jitter`` of an ``(H, W, 3)`` ``uint8`` array."""
    from jaxcnn.data import photometric

    image = _pil().fromarray(np.ascontiguousarray(array))
    if augment.auto_augment is not None:
        image = photometric.auto_augment(image, _policy(augment.auto_augment, augment.interpolation), rng)
    if augment.color_jitter is not None:
        image = photometric.color_jitter(image, rng, *augment.color_jitter)
    return np.asarray(image, np.uint8)


@functools.lru_cache(maxsize=16)
def _policy(auto_augment: str, interpolation: str):
    """The parsed ``auto_augment`` policy (parsed once per process), its geometric ops filling
    with the ImageNet mean and resampling with the crop's filter, as timm's do."""
    from jaxcnn.data.photometric import mean_fill, parse_auto_augment

    return parse_auto_augment(auto_augment, fill=mean_fill(IMAGENET_MEAN), interpolation=interpolation)


# The ImageNet channel mean and std in pixel units (random erasing's fills), computed once.
_IMAGENET_PIXELS = (255.0 * np.asarray(IMAGENET_MEAN), 255.0 * np.asarray(IMAGENET_STD))


def random_flips(array: np.ndarray, rng: np.random.Generator, hflip: float, vflip: float) -> np.ndarray:
    """torchvision's ``RandomHorizontalFlip(hflip)`` then ``RandomVerticalFlip(vflip)`` of an
    ``(H, W, ...)`` array: each mirrors when a uniform draw is below its probability; a
    probability of 0 draws nothing (timm leaves that transform out)."""
    if hflip > 0 and rng.random() < hflip:
        array = array[:, ::-1]
    if vflip > 0 and rng.random() < vflip:
        array = array[::-1]
    return array


def random_padded_crop(array: np.ndarray, rng: np.random.Generator, padding: int) -> np.ndarray:
    """torchvision's ``RandomCrop((H, W), padding=padding)`` of an ``(H, W, C)`` array: zero-pad
    each side by ``padding``, then cut ``H x W`` at a row and then a column offset drawn
    uniformly from ``[0, 2 * padding]``."""
    h, w = array.shape[:2]
    top, left = (int(v) for v in rng.integers(0, 2 * padding + 1, size=2))
    padded = np.pad(array, ((padding, padding), (padding, padding)) + ((0, 0),) * (array.ndim - 2))
    return padded[top:top + h, left:left + w]


def resized_shape(height: int, width: int, resize: int):
    """torchvision ``Resize(int)``: the shorter side becomes ``resize``, the longer keeps the ratio
    (truncated, as torchvision does). Returns ``(new_h, new_w)``."""
    if width <= height:
        return int(resize * height / width), resize
    return resize, int(resize * width / height)


def center_crop_box(height: int, width: int, size):
    """torchvision ``CenterCrop``'s ``(top, left)`` for a crop of ``size = (H, W)`` that fits."""
    out_h, out_w = size
    return int(round((height - out_h) / 2.0)), int(round((width - out_w) / 2.0))


def eval_transform(image, size, resize: int, interpolation: str = "bilinear"):
    """Resize the shorter side of an RGB ``PIL.Image`` to ``resize``, then centre-crop ``size = (H, W)``.

    ``resize`` must be at least ``max(H, W)`` so that the crop fits; ``interpolation`` is one of
    `INTERPOLATIONS` (torchvision's ``Resize(resize, interpolation)`` on a PIL image).

    Returns:
        ``(H, W, 3)`` ``uint8`` array.
    """
    out_h, out_w = size
    if resize < max(out_h, out_w):
        raise ValueError(f"eval resize {resize} is smaller than the crop {tuple(size)}")
    new_h, new_w = resized_shape(image.height, image.width, resize)
    if (new_h, new_w) != (image.height, image.width):
        image = image.resize((new_w, new_h), pil_filter(interpolation))
    top, left = center_crop_box(new_h, new_w, size)
    return np.ascontiguousarray(np.asarray(image, np.uint8)[top:top + out_h, left:left + out_w])


def default_eval_resize(size, crop_pct: float | None = None) -> int:
    """The evaluation resize for a crop of ``size = (H, W)``: with ``crop_pct``, timm's
    ``floor(max(H, W) / crop_pct)``; None: ``max(H, W) / 0.875`` rounded (224 -> 256)."""
    if crop_pct is not None:
        return int(math.floor(max(size) / crop_pct))
    return int(math.floor(max(size) / 0.875 + 0.5))
