"""What a trained model expects of its input: a run's ``preprocessing.json``.

The trainer normalises every image to ``(x / 255 - mean) / std`` (``uint8`` data) or
``(x - mean) / std`` (float data already on the unit scale), with the per-channel ``mean``
and ``std`` of the training set (:func:`jaxcnn.data.normalize`; with
``data.normalize: false`` only the unit scale: mean 0, std 1). A network trained that way
gives wrong answers on anything else, so ``jaxcnn-train`` records the preprocessing in the
run directory when training starts, ``jaxcnn-eval`` evaluates with it and
``jaxcnn-export`` builds it into the exported model (and its metadata).
:func:`run_preprocessing` is the one place they read it from; for a run directory written
before the file existed it reconstructs it from the run's config and data, as the trainer
computes it.

The file holds one JSON object::

    {"format": 1, "layout": "NHWC", "image_shape": [28, 28, 1], "pixel_dtype": "uint8",
     "pixel_range": [0, 255], "normalize": true, "mean": [0.1325...], "std": [0.3104...],
     "formula": "(x / 255 - mean) / std", "class_names": ["0", ..., "9"], "dataset": "mnist"}

``pixel_dtype``/``pixel_range`` say what raw input is: what the data loaders hand the
trainer (``uint8`` in ``[0, 255]`` for MNIST, CIFAR-10, synthetic data and ``uint8`` npz
files; ``float32`` on the unit scale for float npz files).
"""
from __future__ import annotations

import json
import math
import os
from typing import NamedTuple, Optional

import numpy as np

from jaxcnn.data.dataset import DataError, normalize
from jaxcnn.data.files import write_bytes_whole

PREPROCESSING_FILE = "preprocessing.json"
FORMAT_VERSION = 1
PIXEL_DTYPES = ("uint8", "float32")
CLASS_NAMES = {
    "mnist": tuple(str(d) for d in range(10)),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                "ship", "truck"),
}


class Preprocessing(NamedTuple):
    """How raw images become the network's input.

    Fields:
        image_shape: ``(H, W, C)`` of one image (NHWC layout).
        pixel_dtype: ``"uint8"`` (raw input in ``[0, 255]``) or ``"float32"`` (unit scale).
        mean, std: ``(C,)`` tuples of floats on the unit scale (float32 values).
        normalize: False when the run had ``data.normalize: false`` (mean 0, std 1).
        class_names: the label names, or None when the data does not name them.
        dataset: the data source's name, or None.
        resize_shorter_side: images of any size are resized so that their shorter side is this,
            then the centre ``H x W`` is cropped (the evaluation transform of an image folder,
            ``data.eval_resize``); None when the run's images all come at ``H x W``. Written as
            ``"resize": {"shorter_side": S}``, which ``jaxcnn-predict`` applies.
        resize_interpolation: that resize's filter (``data.augment.interpolation``), written
            into ``"resize"`` as ``"interpolation"`` unless it is ``"bilinear"``.
    """

    image_shape: tuple
    pixel_dtype: str
    mean: tuple
    std: tuple
    normalize: bool = True
    class_names: Optional[tuple] = None
    dataset: Optional[str] = None
    resize_shorter_side: Optional[int] = None
    resize_interpolation: str = "bilinear"

    @property
    def pixel_range(self) -> tuple:
        return (0, 255) if self.pixel_dtype == "uint8" else (0.0, 1.0)

    @property
    def formula(self) -> str:
        return "(x / 255 - mean) / std" if self.pixel_dtype == "uint8" else "(x - mean) / std"

    def scale_offset(self):
        """``(scale, offset)``, float32 ``(C,)``: ``x * scale - offset`` in float32 is exactly
        what :func:`jaxcnn.data.normalize` computes for raw pixels ``x``."""
        mean, std = np.asarray(self.mean, np.float64), np.asarray(self.std, np.float64)
        unit = 1.0 / 255.0 if self.pixel_dtype == "uint8" else 1.0
        return (unit / std).astype(np.float32), (mean / std).astype(np.float32)

    def apply(self, images) -> np.ndarray:
        """Raw images ``(..., C)`` of ``pixel_dtype`` -> the network's float32 input."""
        return normalize(np.asarray(images), self.mean, self.std)

    def to_dict(self) -> dict:
        return {"format": FORMAT_VERSION, "layout": "NHWC", "image_shape": list(self.image_shape),
                "pixel_dtype": self.pixel_dtype, "pixel_range": list(self.pixel_range),
                "normalize": bool(self.normalize), "mean": [float(v) for v in self.mean],
                "std": [float(v) for v in self.std], "formula": self.formula,
                "class_names": None if self.class_names is None else list(self.class_names),
                "dataset": self.dataset,
                **({} if self.resize_shorter_side is None else {"resize": self._resize_dict()})}

    def _resize_dict(self) -> dict:
        interpolation = self.resize_interpolation
        return {"shorter_side": int(self.resize_shorter_side),
                **({} if interpolation == "bilinear" else {"interpolation": interpolation})}

    def describe(self) -> str:
        """One line for people: what raw input is and how it is normalised."""
        def nums(values):
            return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"
        lo, hi = self.pixel_range
        return (f"{self.pixel_dtype} pixels in [{lo}, {hi}], NHWC {tuple(self.image_shape)}, "
                f"normalised {self.formula} with mean {nums(self.mean)} std {nums(self.std)}")


def from_dataset(dataset, *, normalize: bool = True, source: str | None = None) -> Preprocessing:
    """The preprocessing the trainer applies to ``dataset`` (a :class:`jaxcnn.data.Dataset`
    with ``mean``/``std``); ``normalize=False``: the unit scale only."""
    channels = dataset.image_shape[-1]
    if normalize:
        if dataset.mean is None or dataset.std is None:
            raise DataError(f"{dataset.name}: dataset has no mean/std for normalisation")
        mean, std = np.asarray(dataset.mean, np.float32), np.asarray(dataset.std, np.float32)
    else:
        mean, std = np.zeros(channels, np.float32), np.ones(channels, np.float32)
    mean, std = (np.broadcast_to(v, (channels,)) for v in (mean, std))
    source = source or dataset.name
    return Preprocessing(tuple(int(d) for d in dataset.image_shape), str(dataset.x_train.dtype),
                         tuple(float(v) for v in mean), tuple(float(v) for v in std),
                         bool(normalize), CLASS_NAMES.get(source), source)


def from_run(run) -> Preprocessing:
    """The preprocessing of a :class:`jaxcnn.train._build.Run`, as its trainer applies it:
    the dataset's statistics (per ``data.normalize``), or for synthetic batches made per
    step the uniform-noise statistics the train step normalises ``uint8`` bytes with."""
    cfg = run.cfg
    if run.dataset is not None:
        return from_dataset(run.dataset, normalize=cfg.data.normalize, source=cfg.data.source)
    images = getattr(run, "images", None)
    if images is not None:  # an image folder or records: uint8 crops, ImageNet statistics
        from jaxcnn.data.transforms import IMAGENET_MEAN, IMAGENET_STD
        norm = bool(cfg.data.normalize)
        mean = IMAGENET_MEAN if norm else (0.0, 0.0, 0.0)
        std = IMAGENET_STD if norm else (1.0, 1.0, 1.0)
        return Preprocessing(tuple(int(d) for d in images.image_shape), "uint8",
                             tuple(float(np.float32(v)) for v in mean), tuple(float(np.float32(v)) for v in std),
                             norm, tuple(images.class_names), cfg.data.source, int(images.eval_resize),
                             images.augment.interpolation)
    from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD
    shape = tuple(int(d) for d in run.input_shape[1:])
    c = shape[-1]
    return Preprocessing(shape, "uint8", (float(np.float32(NOISE_MEAN)),) * c,
                         (float(np.float32(NOISE_STD)),) * c, True, None, cfg.data.source)


def _fail(path, message):
    raise DataError(f"{path}: {message}")


def read_resize(value, path):
    """``(shorter side, interpolation)`` of a record's ``"resize": {"shorter_side": S}`` (with an
    optional ``"interpolation"``, default bilinear; absent or null: ``(None, "bilinear")``)."""
    from jaxcnn.data.transforms import INTERPOLATIONS

    if value is None:
        return None, "bilinear"
    side = value.get("shorter_side") if isinstance(value, dict) else None
    interpolation = value.get("interpolation", "bilinear") if isinstance(value, dict) else None
    if (not (isinstance(side, int) and not isinstance(side, bool) and side > 0)
            or interpolation not in INTERPOLATIONS or not set(value) <= {"shorter_side", "interpolation"}):
        _fail(path, f"key 'resize' must be {{\"shorter_side\": positive int, \"interpolation\": one of "
                    f"{list(INTERPOLATIONS)} (optional)}} or null, got {str(value)[:80]}")
    return side, interpolation


def from_dict(d, path="preprocessing") -> Preprocessing:
    """Check and read a dict as :meth:`Preprocessing.to_dict` writes it; a bad entry is a
    :class:`DataError` naming ``path`` and the key."""
    if not isinstance(d, dict):
        _fail(path, f"expected a JSON object, got {type(d).__name__}")
    for key in ("image_shape", "pixel_dtype", "mean", "std"):
        if key not in d:
            _fail(path, f"missing key {key!r}")
    shape = d["image_shape"]
    if (not isinstance(shape, list) or len(shape) != 3
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        _fail(path, f"key 'image_shape' must be [H, W, C] (positive ints), got {shape!r}")
    if d["pixel_dtype"] not in PIXEL_DTYPES:
        _fail(path, f"key 'pixel_dtype' must be one of {list(PIXEL_DTYPES)}, got {d['pixel_dtype']!r}")
    stats = {}
    for key in ("mean", "std"):
        v = d[key]
        if (not isinstance(v, list) or len(v) != shape[2]
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool)
                           and math.isfinite(x) for x in v)):
            _fail(path, f"key {key!r} must be a list of {shape[2]} finite numbers (one per "
                        f"channel), got {str(v)[:80]}")
        stats[key] = tuple(float(np.float32(x)) for x in v)
    if not all(s > 0 for s in stats["std"]):
        _fail(path, f"key 'std' must be positive, got {list(stats['std'])}")
    names = d.get("class_names")
    if names is not None and (not isinstance(names, list)
                              or not all(isinstance(n, str) for n in names)):
        _fail(path, f"key 'class_names' must be a list of strings or null, got {str(names)[:80]}")
    normalize_ = d.get("normalize", True)
    if not isinstance(normalize_, bool):
        _fail(path, f"key 'normalize' must be true or false, got {normalize_!r}")
    dataset = d.get("dataset")
    return Preprocessing(tuple(shape), d["pixel_dtype"], stats["mean"], stats["std"], normalize_,
                         None if names is None else tuple(names),
                         dataset if isinstance(dataset, str) else None, *read_resize(d.get("resize"), path))


def read_preprocessing(path) -> Preprocessing:
    """Read a ``preprocessing.json``; a missing, unreadable or malformed file is a
    :class:`DataError` naming it."""
    path = os.fspath(path)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read ({e})") from None
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    return from_dict(d, path)


def write_preprocessing(path, prep: Preprocessing, **extra) -> None:
    """Write ``prep`` (plus ``extra`` entries) as JSON, whole or not at all (`write_bytes_whole`)."""
    write_bytes_whole(path, (json.dumps({**prep.to_dict(), **extra}, indent=2) + "\n").encode())


def run_preprocessing(run_dir, *, run=None, make_run=None) -> Preprocessing:
    """The preprocessing of a run directory: its ``preprocessing.json``, or for a run written
    before that file existed, reconstructed from the run's config and data as the trainer
    computes it (``run``, or ``make_run()``, e.g. ``lambda: build_run(cfg)``: data never
    imports the trainer). ``jaxcnn-eval`` and ``jaxcnn-export`` both read it here.

    When ``run`` is given, the recorded file is checked against its data: the same image
    shape and pixel dtype, or a :class:`DataError` naming the file.
    """
    path = os.path.join(os.fspath(run_dir), PREPROCESSING_FILE)
    if not os.path.exists(path):
        if run is None:
            run = make_run()
        return from_run(run)
    prep = read_preprocessing(path)
    if run is not None:
        now = from_run(run)
        if (tuple(prep.image_shape), prep.pixel_dtype) != (tuple(now.image_shape), now.pixel_dtype):
            _fail(path, f"records {prep.pixel_dtype} images of shape {tuple(prep.image_shape)} "
                        f"but the run's data now has {now.pixel_dtype} {tuple(now.image_shape)}")
    return prep


def with_preprocessing(run, prep: Preprocessing):
    """``run`` whose dataset normalises with ``prep``'s statistics (the ones it was trained
    with), not the ones measured on the data as it is now."""
    if run.dataset is None:
        return run
    dataset = run.dataset._replace(mean=np.asarray(prep.mean, np.float32),
                                   std=np.asarray(prep.std, np.float32))
    return run._replace(dataset=dataset)
