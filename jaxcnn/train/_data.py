"""The run's data, as the run function's data section opens them (pure helpers).

`build_data` loads (or describes, for per-step synthetic batches) the data ``cfg.data`` names;
`batch_fn` makes a training step's batch from them; `eval_batch_size`/`eval_set_size` size the
evaluation. An image folder or record files (``data.source: folder|records``): `open_images`
opens the data a config names (`jaxcnn.data.ImageData`), with config errors naming the key;
`augment_spec` is the augmentation ``data.augment`` asks of any source. `TrainInput` is the
stream of training batches from a step on: grain `jaxcnn.data.Loader` workers
(``data.workers``) make this process's share of each global batch (`jaxcnn.data.TrainBatches`:
the batch for step ``s`` depends only on the data seed and ``s``, so a resumed run starts the
stream at its step), each batch with the messages of the bad images skipped in it
(``data.on_bad_image: skip``), which the loop counts into ``metrics.jsonl``.
`eval_image_batches` gives the validation split once, as ``uint8`` images the eval step
normalises on the device (`image_norm`), as the train step does.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxcnn import models
from jaxcnn._cli import name_list
from jaxcnn.data import SyntheticSpec, load_dataset, steps_per_epoch, synthetic_batch, synthetic_dataset, train_batch
from jaxcnn.data.augment import Augment, resolve_augment
from jaxcnn.data.files import check_regular_file
from jaxcnn.data.images import SOURCES, ImageData, missing_packages
from jaxcnn.data.loader import Loader, check_open_files, split_info
from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD
from jaxcnn.data.transforms import IMAGENET_MEAN, IMAGENET_STD, default_eval_resize
from jaxcnn.errors import ConfigError, DataError

# data.workers is bounded by this many per core (and at least MAX_WORKERS_FLOOR in all).
WORKERS_PER_CORE = 4
MAX_WORKERS_FLOOR = 16
# The evaluation resize is at most this many times the crop (each image is resized to it first).
MAX_RESIZE_FACTOR = 8

# Synthetic training sets up to this many bytes (uint8 pixels) are generated once and
# held in memory; larger ones (ImageNet-shaped throughput runs) are made per step.
_SYNTHETIC_IN_MEMORY_BYTES = 256 * 2**20


def data_seed(cfg) -> int:
    """The seed of the data's order, augmentation and split: ``data.seed``, else ``train.seed``."""
    return cfg.train.seed if cfg.data.seed is None else cfg.data.seed


def _model_defaults(name: str):
    try:
        return models.default_input_shape(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"model.name: {e}", path="model.name") from None


class DataSetup(NamedTuple):
    """The training data a config asks for (:func:`build_data`): the run function's local
    ``data``, which `jaxcnn.train._build.build_run` takes."""

    dataset: Any            # a jaxcnn.data.Dataset, or None for on-the-fly synthetic batches
    synthetic: Any          # SyntheticSpec when batches are generated per step, else None
    image_shape: tuple      # (H, W, C)
    num_classes: int        # what the model predicts: model.num_classes, else the data's
    steps_per_epoch: int
    images: Any = None      # a jaxcnn.data.ImageData (folder/records): batches made by grain workers


def build_data(cfg, data_seed: int) -> DataSetup:
    """Load (or describe, for per-step synthetic batches) the data ``cfg.data`` names.

    Raises:
        ConfigError: a batch larger than the training set, a missing ``data.path``, a model
            with fewer classes than the data; DataError: a malformed data file.
    """
    batch_size = cfg.data.batch_size
    if cfg.data.source == "synthetic":
        return _synthetic_data(cfg, data_seed)
    if cfg.data.source in ("folder", "records"):
        return _image_data(cfg, data_seed)
    path = cfg.data.path
    if path is not None and not os.path.exists(path):
        where = ("; CIFAR-10's binary version (data_batch_1.bin ... test_batch.bin) is cifar-10-binary.tar.gz "
                 "from https://www.cs.toronto.edu/~kriz/cifar.html, extracted" if cfg.data.source == "cifar10" else "")
        raise ConfigError(f"data.path: {path!r} does not exist{where}", path="data.path")
    if cfg.data.source == "npz":  # a device or FIFO is never data: /dev/zero ran into the OOM killer
        check_regular_file(path, "data.path")
    dataset = load_dataset(cfg.data.source, path)
    num_classes = dataset.num_classes
    if cfg.model.num_classes is not None and cfg.model.num_classes < num_classes:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is smaller than the "
                          f"dataset's {num_classes} classes", path="model.num_classes")
    if len(dataset.x_train) < batch_size:
        raise ConfigError(f"data.batch_size: {batch_size} is larger than the training set "
                          f"({len(dataset.x_train)} images)", path="data.batch_size")
    return DataSetup(dataset, None, tuple(dataset.image_shape), cfg.model.num_classes or num_classes,
                     steps_per_epoch(len(dataset.x_train), batch_size))


def _image_data(cfg, data_seed: int) -> DataSetup:
    """An image folder or record directory, opened (file lists, record counts, class names,
    the ``data.val_split`` drawn from ``data_seed``), its images read by the loader's workers
    as batches need them."""
    images = open_images(cfg, _model_defaults(cfg.model.name)[1:3], data_seed)
    if cfg.model.num_classes is not None and cfg.model.num_classes < images.num_classes:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is smaller than the "
                          f"{images.num_classes} classes of {cfg.data.path}", path="model.num_classes")
    more = cfg.model.num_classes is not None and cfg.model.num_classes > images.num_classes
    if more and not cfg.model.extra_outputs:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is more than the {images.num_classes} "
                          f"classes of {cfg.data.path} ({name_list(images.class_names)}): outputs "
                          f"{images.num_classes}-{cfg.model.num_classes - 1} would be classes no image has, "
                          "which predictions could name; leave it null (the data's count), or set "
                          "model.extra_outputs=true if the larger head is on purpose", path="model.num_classes")
    if len(images.train) < cfg.data.batch_size:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is larger than the training set "
                          f"({len(images.train)} images)", path="data.batch_size")
    return DataSetup(None, None, images.image_shape, cfg.model.num_classes or images.num_classes,
                     steps_per_epoch(len(images.train), cfg.data.batch_size), images)


def _synthetic_data(cfg, data_seed: int) -> DataSetup:
    """Synthetic data: a fixed in-memory set the model can fit (with a test split) when small,
    else fresh images every step, never materialised (throughput runs)."""
    image_shape = tuple(cfg.data.image_size or _model_defaults(cfg.model.name)[1:])
    num_classes = cfg.data.num_classes or cfg.model.num_classes or 10
    spec = SyntheticSpec(image_shape=image_shape, num_classes=num_classes)
    image_bytes = int(np.prod(image_shape))
    dataset, synthetic = None, None
    if cfg.data.num_train * image_bytes <= _SYNTHETIC_IN_MEMORY_BYTES:
        if (cfg.data.num_train + cfg.data.num_eval) * image_bytes > 2 * _SYNTHETIC_IN_MEMORY_BYTES:
            raise ConfigError(f"data.num_eval: {cfg.data.num_eval} synthetic test images of shape "
                              f"{image_shape} would take more than the "
                              f"{2 * _SYNTHETIC_IN_MEMORY_BYTES >> 20} MiB held in memory",
                              path="data.num_eval")
        dataset = synthetic_dataset(spec, num_train=cfg.data.num_train,
                                    num_test=cfg.data.num_eval, seed=data_seed)
    else:
        synthetic = spec
    if cfg.data.num_train < cfg.data.batch_size:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is larger than the training set "
                          f"(data.num_train={cfg.data.num_train})", path="data.batch_size")
    return DataSetup(dataset, synthetic, image_shape, num_classes,
                     max(1, cfg.data.num_train // cfg.data.batch_size))



def check_augment(cfg, data) -> None:
    """Augmentation the data cannot take: any on per-step synthetic noise, a crop padding as
    large as the image."""
    image_shape = data.image_shape
    if data.synthetic is not None and augment_spec(cfg).active:
        raise ConfigError(f"data.augment: synthetic images made per step (data.num_train={cfg.data.num_train} "
                          f"of shape {image_shape}, more than the {_SYNTHETIC_IN_MEMORY_BYTES >> 20} MiB held "
                          "in memory) are noise and never augmented; leave data.augment at its defaults",
                          path="data.augment")
    pad = cfg.data.augment.crop_padding
    if pad and pad >= min(image_shape[0], image_shape[1]):  # padded batches grew to terabytes
        raise ConfigError(f"data.augment.crop_padding: {pad} must be smaller than the image side "
                          f"({min(image_shape[0], image_shape[1])} for {tuple(image_shape)} images)",
                          path="data.augment.crop_padding")



def process_share(share=None) -> dict:
    """The input makers' ``process_index``/``process_count`` for the rows of every batch this
    process loads: ``share`` is ``(index, count)`` (``plan.batch_share``: the rows of the data
    shards this process's devices hold); None: ``(jax.process_index(), jax.process_count())``,
    which is the plan's share when each data shard's devices are in one process."""
    index, count = (jax.process_index(), jax.process_count()) if share is None else share
    return {"process_index": index, "process_count": count}


def batch_fn(run, share=None):
    """``step -> batch`` (host numpy arrays) for the run's training data: the rows ``share``
    (``plan.batch_share``; see :func:`process_share`) names. For an image source the
    loop runs these makers in grain workers (`TrainInput`); this
    one makes them in turn, without the bookkeeping keys."""
    cfg = run.cfg
    share = process_share(share)
    if run.images is not None:  # uint8: the train step normalises them on the device
        maker = run.images.train_batches(seed=run.data_seed, batch_size=cfg.data.batch_size, **share)
        return lambda step: split_info(maker(step))[0]
    if run.synthetic is not None:  # bytes: the train step normalises them on the device
        return lambda step: synthetic_batch(run.synthetic, step, seed=run.data_seed,
                                            batch_size=cfg.data.batch_size, image_dtype="uint8",
                                            **share)
    augment = augment_spec(cfg)
    dataset = run.dataset
    if not cfg.data.normalize:  # unit scale only, as in evaluate()
        channels = dataset.image_shape[-1]
        dataset = dataset._replace(mean=np.zeros(channels, np.float32), std=np.ones(channels, np.float32))
    return lambda step: train_batch(dataset, step, seed=run.data_seed,
                                    batch_size=cfg.data.batch_size, augment=augment, **share)



def eval_batch_size(run) -> int:
    """The evaluation batch: ``data.eval_batch_size`` (else ``data.batch_size``), clipped to the
    test set (rounded up to a multiple of the process count), as PyTorch's DataLoader gives a
    smaller batch: a larger one would only be padding (``data.eval_batch_size=1000000000``
    allocated 2.85 TiB of it)."""
    cfg = run.cfg
    size = cfg.data.eval_batch_size or cfg.data.batch_size
    count = eval_set_size(run)
    if count is not None and size > count:
        procs = jax.process_count()
        size = max(procs, -(-count // procs) * procs)
    return size


def eval_set_size(run):
    """The number of evaluation images (the test split, or an image source's ``val``), or None
    when there is none (synthetic batches made per step)."""
    if run.images is not None:
        return len(run.images.val)
    return None if run.dataset is None else len(run.dataset.x_test)


def train_image_norm(run):
    """``(mean, std)`` the train step normalises ``uint8`` batches with on the device, or None
    for sources whose batches arrive normalised."""
    if run.synthetic is not None:
        return NOISE_MEAN, NOISE_STD
    if run.images is not None:
        return image_norm(run.cfg)
    return None



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
