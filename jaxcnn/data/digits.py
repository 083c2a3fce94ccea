"""A generated image folder of coloured handwritten digits, made from the packaged MNIST sample.

``write_digits_folder(root)`` writes ``ROOT/<digit>/<n>.{png,jpg}``: class folders only
(torchvision's ``ImageFolder`` layout, for a validation split made in code with
``data.val_split``). Each image is one of the packaged MNIST training digits, its ink and paper
in two random colours far apart, resized (bilinear) to a random square side, saved as PNG or
JPEG in turn: what a user's own folder of small scanned or photographed digits looks like, and
a task where mirroring or cropping to 8% of the image destroys the label (a flipped 2 is no
digit; an 8% crop of a 3 can be a 2). ``jaxcnn-data digits OUT`` writes one from the command
line.
"""
from __future__ import annotations

import os

import numpy as np

_FORMATS = ("png", "jpg")


def _colours(rng: np.random.Generator):
    """Ink and paper colours whose grey levels differ by at least 96 (the digit stays legible)."""
    while True:
        ink, paper = rng.integers(0, 256, size=(2, 3))
        if abs(float(ink.mean()) - float(paper.mean())) >= 96:
            return ink.astype(np.float32), paper.astype(np.float32)


def digit_image(rng: np.random.Generator, grey: np.ndarray, side: int):
    """An RGB ``PIL.Image`` of ``side x side``: the ``(28, 28)`` ``uint8`` MNIST digit ``grey``
    (ink 255) in random ink and paper colours, resized bilinearly."""
    from PIL import Image

    ink, paper = _colours(rng)
    alpha = grey.astype(np.float32)[..., None] / 255.0
    rgb = np.rint(alpha * ink + (1.0 - alpha) * paper).astype(np.uint8)
    return Image.fromarray(rgb, "RGB").resize((side, side), Image.BILINEAR)


def write_digits_folder(root, *, digits=(0, 1, 2, 3), per_class: int = 200, size_range=(20, 71),
                        seed: int = 0, jpeg_quality: int = 90) -> dict:
    """Writes an image folder of coloured digits, ``root/<digit>/<n>.{png,jpg}``.

    Arguments:
        root: the folder to write (created); its class folders must not hold files yet.
        digits: the classes, digits 0-9; each folder is named by its digit.
        per_class: images per class, the first MNIST training digits of that class in the
            packaged sample (at most its count: 690 to 902 per digit).
        size_range: each image's side is drawn from ``[lo, hi]``.
        seed: the generator's seed (colours, sizes).
        jpeg_quality: quality of the JPEG files.

    Returns:
        ``{digit name: [paths written]}``.

    Raises:
        ValueError: a digit outside 0-9 or repeated, or more images of a digit than the sample has.
    """
    from jaxcnn.data.mnist import load_mnist

    digits = [int(d) for d in digits]
    if not digits or len(set(digits)) != len(digits) or not all(0 <= d <= 9 for d in digits):
        raise ValueError(f"digits: expected distinct digits 0-9, got {digits}")
    mnist = load_mnist()
    rng = np.random.default_rng(seed)
    written = {}
    for digit in digits:
        (picks,) = np.nonzero(mnist.y_train == digit)
        if per_class > len(picks):
            raise ValueError(f"per_class: {per_class} is more than the {len(picks)} images of digit "
                             f"{digit} in the packaged MNIST sample")
        folder = os.path.join(os.fspath(root), str(digit))
        os.makedirs(folder, exist_ok=True)
        written[str(digit)] = []
        for n, index in enumerate(picks[:per_class]):
            side = int(rng.integers(size_range[0], size_range[1] + 1))
            image = digit_image(rng, mnist.x_train[index].reshape(28, 28), side)
            ext = _FORMATS[n % len(_FORMATS)]
            path = os.path.join(folder, f"{n:05d}.{ext}")
            image.save(path, **({"quality": jpeg_quality} if ext == "jpg" else {}))
            written[str(digit)].append(path)
    return written
