"""The standard ImageNet transforms, on the host with Pillow and NumPy, ``uint8`` out.

Training (torchvision ``RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3))`` then
``RandomHorizontalFlip()``): pick a crop of a random area fraction and aspect ratio (ten
tries, then torchvision's centre-crop fallback), resize it bilinearly (Pillow's, with its
antialiasing) to ``(H, W)``, and mirror it with probability 1/2. Evaluation
(``Resize(resize)`` then ``CenterCrop((H, W))``): resize the shorter side to ``resize`` and
cut out the centre.

Every random draw for an example comes from a generator seeded by ``(seed, step, position)``,
where ``position`` is the example's place in the global batch: a batch is a pure function of
the seed and the step, whichever process or worker makes it. Normalisation is left to the
device, as the trainer does for ``uint8`` data.
"""
from __future__ import annotations

import math

import numpy as np

SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
CROP_TRIES = 10
# Mixed into each example's seed so these draws share no stream with the epoch permutation.
_TRANSFORM_STREAM = 0x1A6E


def example_rng(seed: int, step: int, position: int) -> np.random.Generator:
    """The generator for the example at ``position`` of the global batch for ``step``."""
    return np.random.default_rng([int(seed), int(step), int(position), _TRANSFORM_STREAM])


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


def train_transform(image, size, rng: np.random.Generator, *, scale=SCALE, ratio=RATIO, flip: bool = True,
                    out=None):
    """Random-resized crop to ``size = (H, W)`` and random horizontal flip of an RGB ``PIL.Image``.

    Arguments:
        out: an ``(H, W, 3)`` ``uint8`` array to write into (a batch row), or None.

    Returns:
        ``(H, W, 3)`` ``uint8`` array (``out`` when given).
    """
    out_h, out_w = size
    top, left, h, w = random_resized_crop_box(rng, image.height, image.width, scale, ratio)
    crop = image.crop((left, top, left + w, top + h)).resize((out_w, out_h), _pil().BILINEAR)
    array = np.asarray(crop, np.uint8)
    if flip and rng.random() < 0.5:
        array = array[:, ::-1]
    if out is None:
        return np.ascontiguousarray(array)
    np.copyto(out, array)
    return out


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


def eval_transform(image, size, resize: int):
    """Resize the shorter side of an RGB ``PIL.Image`` to ``resize``, then centre-crop ``size = (H, W)``.

    ``resize`` must be at least ``max(H, W)`` so that the crop fits.

    Returns:
        ``(H, W, 3)`` ``uint8`` array.
    """
    out_h, out_w = size
    if resize < max(out_h, out_w):
        raise ValueError(f"eval resize {resize} is smaller than the crop {tuple(size)}")
    new_h, new_w = resized_shape(image.height, image.width, resize)
    if (new_h, new_w) != (image.height, image.width):
        image = image.resize((new_w, new_h), _pil().BILINEAR)
    top, left = center_crop_box(new_h, new_w, size)
    return np.ascontiguousarray(np.asarray(image, np.uint8)[top:top + out_h, left:left + out_w])


def default_eval_resize(size) -> int:
    """The usual evaluation resize for a crop: ``max(H, W) / 0.875`` (224 -> 256)."""
    return int(math.floor(max(size) / 0.875 + 0.5))
