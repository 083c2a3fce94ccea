"""A generated image folder of coloured shapes, for examples, tests and benchmarks.

``write_shapes_folder(root)`` draws ``ROOT/{train,val}/<colour>/<n>.{jpg,png}``: each image a
disc, square or triangle of the class's colour on a dim noisy background, at a random size,
position and image size, saved in a rotation of file formats and Pillow modes (RGB JPEG,
RGBA PNG, palette PNG, CMYK JPEG, grey+alpha PNG), so a loader meets what real folders
hold. The class is the shape's colour: an easy task a small network learns in a few steps.
``jaxcnn-data shapes OUT`` writes one from the command line.
"""
from __future__ import annotations

import os

import numpy as np

COLOURS = {"blue": (40, 60, 230), "green": (40, 200, 60), "red": (230, 40, 40), "yellow": (230, 220, 40)}
_FORMATS = (("jpg", "RGB"), ("png", "RGBA"), ("png", "P"), ("jpg", "CMYK"), ("png", "RGB"), ("jpg", "RGB"))


def shape_image(rng: np.random.Generator, colour, height: int, width: int):
    """An RGB ``PIL.Image`` of ``height x width``: a random shape of ``colour`` on a noisy dark background."""
    from PIL import Image, ImageDraw

    background = rng.integers(0, 70, size=(height, width, 3), dtype=np.uint8)
    image = Image.fromarray(background, "RGB")
    draw = ImageDraw.Draw(image)
    side = int(rng.integers(max(4, min(height, width) // 2), min(height, width) + 1))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    box = (left, top, left + side - 1, top + side - 1)
    kind = int(rng.integers(3))
    if kind == 0:
        draw.ellipse(box, fill=tuple(colour))
    elif kind == 1:
        draw.rectangle(box, fill=tuple(colour))
    else:
        draw.polygon([(left, top + side - 1), (left + side - 1, top + side - 1), (left + side // 2, top)],
                     fill=tuple(colour))
    return image


def write_shapes_folder(root, *, per_class=(12, 4), classes=None, size_range=(16, 40), seed: int = 0,
                        jpeg_quality: int = 90) -> dict:
    """Writes an image folder of coloured shapes.

    Arguments:
        root: the folder to write (created); ``root/train`` and ``root/val`` must not hold files yet.
        per_class: images per class in ``(train, val)``.
        classes: colour names (keys of `COLOURS`); None: all of them.
        size_range: image heights and widths are drawn from ``[lo, hi]``.
        seed: the generator's seed.
        jpeg_quality: quality of the JPEG files.

    Returns:
        ``{split: [paths written]}``.
    """
    from PIL import Image

    classes = sorted(COLOURS) if classes is None else list(classes)
    rng = np.random.default_rng(seed)
    written = {}
    for split, count in zip(("train", "val"), per_class):
        written[split] = []
        for name in classes:
            folder = os.path.join(os.fspath(root), split, name)
            os.makedirs(folder, exist_ok=True)
            for n in range(count):
                h, w = (int(v) for v in rng.integers(size_range[0], size_range[1] + 1, size=2))
                image = shape_image(rng, COLOURS[name], h, w)
                ext, mode = _FORMATS[len(written[split]) % len(_FORMATS)]
                if mode == "P":
                    image = image.convert("P", palette=Image.ADAPTIVE, colors=64)
                elif mode != "RGB":
                    image = image.convert(mode)
                path = os.path.join(folder, f"{n:05d}.{ext}")
                image.save(path, **({"quality": jpeg_quality} if ext == "jpg" else {}))
                written[split].append(path)
    return written
