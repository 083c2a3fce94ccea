"""The trainer's input from an image folder or record files (``data.source: folder|records``).

`open_images` opens the data a config names (`jaxcnn.data.ImageData`), with config errors
naming the key; `augment_spec` is the augmentation ``data.augment`` asks of any source.
`TrainInput` is the stream of training batches from a step on: grain `jaxcnn.data.Loader`
workers (``data.workers``) make this process's share of each global batch
(`jaxcnn.data.TrainBatches`: the batch for step ``s`` depends only on the data seed and ``s``,
so a resumed run starts the stream at its step), each batch with the messages of the bad images
skipped in it (``data.on_bad_image: skip``), which the loop counts into ``metrics.jsonl``.
`eval_image_batches` gives the validation split once, as ``uint8`` images the eval step
normalises on the device (`image_norm`), as the train step does.
"""
from __future__ import annotations

import os

import numpy as np

from jaxcnn.data.augment import Augment, resolve_augment
from jaxcnn.data.images import SOURCES, ImageData, missing_packages
from jaxcnn.data.transforms import IMAGENET_MEAN, IMAGENET_STD
from jaxcnn.data.loader import Loader, check_open_files, split_info
from jaxcnn.data.transforms import default_eval_resize
from jaxcnn.errors import ConfigError, DataError

# data.workers is bounded by this many per core (and at least MAX_WORKERS_FLOOR in all).
WORKERS_PER_CORE = 4
MAX_WORKERS_FLOOR = 16
# The evaluation resize is at most this many times the crop (each image is resized to it first).
MAX_RESIZE_FACTOR = 8


def open_images(cfg, default_hw, data_seed: int) -> ImageData:
    """The `ImageData` of ``cfg.data`` (``source`` folder or records); ``default_hw`` is the
    model's ``(H, W)`` used when ``data.image_size`` is null; ``data_seed`` chooses the images
    ``data.val_split`` holds out."""
    data = cfg.data
    if missing := missing_packages(data.source):
        raise ConfigError(f"data.source: {data.source!r} needs {', '.join(missing)}, which "
                          f"{'is' if len(missing) == 1 else 'are'} not installed: pip install -e \".[data]\" "
                          "(or pip install 'jaxcnn[data]')", path="data.source")
    if data.path is None or not os.path.exists(data.path):
        make = ("an image folder (PATH/train/<class>/<image>, PATH/val/<class>/<image>; or "
                "PATH/<class>/<image> with data.val_split); "
                f"jaxcnn-data shapes {data.path or 'PATH'} writes an example one"
                if data.source == "folder" else
                f"a record directory; jaxcnn-data convert IMAGE_FOLDER {data.path or 'PATH'} writes one")
        raise ConfigError(f"data.path: {data.path!r} does not exist; it should be {make}",
                          path="data.path")
    most = max(MAX_WORKERS_FLOOR, WORKERS_PER_CORE * (os.cpu_count() or 1))
    if data.workers > most:  # each is a process: 2**31-1 of them would never start
        raise ConfigError(f"data.workers: {data.workers} worker processes is more than {most} "
                          f"({WORKERS_PER_CORE} per core of this machine's {os.cpu_count()})", path="data.workers")
    if data.workers:
        try:  # before training: the evaluation loader's workers would start after it
            check_open_files(data.workers, loaders=2)
        except DataError as err:
            raise ConfigError(f"data.workers: {err}", path="data.workers") from None
    size = tuple(data.image_size[:2]) if data.image_size else tuple(default_hw)
    if data.eval_resize is not None and not max(size) <= data.eval_resize <= MAX_RESIZE_FACTOR * max(size):
        raise ConfigError(f"data.eval_resize: {data.eval_resize} must be from the crop's longer side "
                          f"{max(size)} (data.image_size={list(size)}) to {MAX_RESIZE_FACTOR} times it",
                          path="data.eval_resize")
    resize = data.eval_resize
    if resize is None and data.augment.crop_pct is not None:
        resize = default_eval_resize(size, data.augment.crop_pct)
    return ImageData(data.source, data.path, image_size=size, on_bad_image=data.on_bad_image,
                     eval_resize=resize, outside_links=data.outside_links,
                     val_split=data.val_split, seed=data_seed, augment=augment_spec(cfg))


def augment_spec(cfg) -> Augment:
    """The `jaxcnn.data.Augment` of ``cfg.data.augment`` for ``cfg.data.source``: the keys left
    null take the source's recipe (`jaxcnn.data.resolve_augment`; the schema has checked them)."""
    augment = cfg.data.augment
    return resolve_augment(files=cfg.data.source in SOURCES, no_aug=augment.no_aug, scale=augment.scale,
                           ratio=augment.ratio, hflip=augment.hflip, vflip=augment.vflip,
                           interpolation=augment.interpolation, crop_padding=augment.crop_padding,
                           color_jitter=augment.color_jitter, auto_augment=augment.auto_augment,
                           reprob=augment.reprob, remode=augment.remode)


def image_norm(cfg):
    """``(mean, std)`` the train step normalises ``uint8`` images with on the device:
    ImageNet's channel statistics, or the unit scale only with ``data.normalize: false``."""
    if cfg.data.normalize:
        return np.asarray(IMAGENET_MEAN, np.float32), np.asarray(IMAGENET_STD, np.float32)
    return np.zeros(3, np.float32), np.ones(3, np.float32)


class TrainInput:
    """Training batches ``start, start + 1, ...`` of an image source, made by ``workers`` grain
    processes: iterating gives ``(arrays, bad)``, ``arrays = {"image": uint8, "label": int32}``
    (this process's share) and ``bad`` the messages of the images skipped in that batch (the
    loop counts them as it consumes the batch, so a prefetched batch is not counted early).
    """

    def __init__(self, images: ImageData, *, seed: int, batch_size: int, start: int, stop: int, workers: int,
                 process_index: int = 0, process_count: int = 1):
        maker = images.train_batches(seed=seed, batch_size=batch_size, process_index=process_index,
                                     process_count=process_count)
        self._loader = Loader(maker, start, stop, workers=workers)

    def __iter__(self):
        return self

    def __next__(self):
        arrays, _, files = split_info(next(self._loader))
        return arrays, files

    def close(self):
        self._loader.close()


def eval_image_batches(images: ImageData, batch_size: int, *, workers: int, process_index: int = 0,
                       process_count: int = 1):
    """Yields ``(arrays, bad)`` for the validation split: ``arrays = {"image": uint8 (normalised
    on the device by an eval step given `image_norm`), "label", "mask"}`` (a skipped image's row
    is masked out) and ``bad`` the messages of the images skipped in the batch."""
    maker = images.eval_batches(batch_size=batch_size, process_index=process_index, process_count=process_count)
    with Loader(maker, 0, len(maker), workers=workers) as loader:
        for batch in loader:
            arrays, _, files = split_info(batch)
            yield arrays, files
