"""Classify image files with a trained run or an exported model: ``jaxcnn-predict``.

    jaxcnn-predict runs/mnist_cnn digit.png [more.png ... | a folder of images] [--top-k 5] [--json]
    jaxcnn-predict mnist.onnx digit.png

In Python, ``jaxcnn.predict(source, images, top_k=5)`` returns one :class:`Prediction` per
image (``load_predictor(source)`` keeps the model for many calls).

``source`` is a run directory (its ``config.resolved.yaml`` and ``params.npz`` or
``params.safetensors``; run with JAX), an ``.onnx`` export (run with onnxruntime) or a
StableHLO export with its ``.preprocessing.json`` sidecar (run with ``jax.export``). Every
image gets the run's own preprocessing, read from the run's ``preprocessing.json`` or the
export's record of it, so nobody has to know the training mean and std:

1. decode as training decodes (:func:`jaxcnn.data.folder.decode_image`: Pillow, EXIF
   orientation applied, 16/32-bit grey scaled to 8 bits, alpha dropped), then convert to the
   model's channels (``L`` for one channel, ``RGB`` for three);
2. if the preprocessing record holds ``"resize": {"shorter_side": S}`` (with its
   ``"interpolation"`` when not bilinear), evaluation's own transform
   (:func:`jaxcnn.data.transforms.eval_transform`): the shorter side goes to ``S``
   (aspect ratio kept, torchvision's rounding) and the centre ``H x W`` is cropped, as
   torchvision's ``Resize(S)`` + ``CenterCrop``, for every image. Runs on an image folder or
   record files record their evaluation transform so (``data.eval_resize``). Other runs'
   data come at the model's size, so their records leave ``resize`` out, and an image of
   another size is resized to ``H x W`` (bilinear, antialiased when shrinking). An ONNX export
   made with ``--raw-image`` (its record says ``"raw_image": true``) does this step itself: each
   decoded image is fed at its own size, one per run;
3. ``uint8`` pixels, normalised as the trainer did (``(x / 255 - mean) / std``; float
   datasets: ``x / 255`` first, as on their unit scale). Exports that build the
   normalisation in take the raw pixels, as the exporter recorded.

The softmax of the logits gives the probabilities (float64, summing to 1); class names come
from the record's ``class_names``, else the class index. A missing, unreadable or corrupt
image, or a source that is none of the three, is a :class:`PredictError` naming the file:
one line and exit code 2 from the command.
"""
from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence

import numpy as np

from jaxcnn import _host_memory
from jaxcnn.data.files import file_kind
from jaxcnn.data.preprocessing import Preprocessing, from_dict
from jaxcnn.errors import PredictError

from jaxcnn._cli import EXIT_BAD_INPUT, path_arg
_CHUNK = 32                      # images per forward pass (the last one padded)
_MAX_RECORD_BYTES = 1 << 20      # a preprocessing record larger than this is not one


class ClassScore(NamedTuple):
    """One of an image's top classes."""

    index: int
    name: str
    probability: float


class Prediction(NamedTuple):
    """What the model says about one image.

    Fields:
        image: the file name (``"<image 0>"`` ... for in-memory images).
        top_k: the ``k`` most probable classes, most probable first.
        probabilities: ``(num_classes,)`` float64, summing to 1.
    """

    image: str
    top_k: tuple
    probabilities: np.ndarray

    def to_dict(self) -> dict:
        return {"image": self.image, "top_k": [s._asdict() for s in self.top_k]}


class Resize(NamedTuple):
    """How an image of any size becomes ``H x W`` (see the module's docstring); ``in_model``:
    the model does it itself (an ONNX export with ``--raw-image``), so each image is fed
    decoded, at its own size, one per run."""

    shorter_side: Optional[int] = None   # None: resize to H x W directly
    interpolation: str = "bilinear"      # the shorter-side resize's filter
    in_model: bool = False


def resize_rule(record: dict, where: str) -> Resize:
    """The ``"resize"`` entry of a preprocessing record (absent: resize to ``H x W``)."""
    from jaxcnn.data.preprocessing import read_resize
    from jaxcnn.errors import DataError

    try:
        side, interpolation = read_resize(record.get("resize"), where)
    except DataError as err:
        raise PredictError(str(err)) from None
    return Resize() if side is None else Resize(side, interpolation=interpolation)


class Predictor(NamedTuple):
    """A loaded model: ``logits(images)`` maps preprocessed ``(N, H, W, C)`` images to
    ``(N, num_classes)`` float32 logits (with ``resize.in_model``: a list of ``N`` decoded
    images of their own sizes)."""

    source: str
    kind: str                    # "run", "onnx" or "stablehlo"
    preprocessing: Preprocessing
    resize: Resize
    logits: Callable[[np.ndarray], np.ndarray]

    @property
    def image_shape(self) -> tuple:
        return tuple(self.preprocessing.image_shape)

    def predict(self, images: Sequence[Any], top_k: int = 5) -> list[Prediction]:
        """:func:`predict` with this model."""
        return list(self.predictions(images, top_k))

    def predictions(self, images: Sequence[Any], top_k: int = 5) -> Iterator[Prediction]:
        """One :class:`Prediction` per image, in order, as they are made: ``_CHUNK`` images are
        decoded, preprocessed and run at a time, and each decoded image is dropped once it is
        pixels, so memory stays bounded for any number of images (all were decoded first:
        2.0 GB for 200 photos). Under :func:`jaxcnn.cpu.configure`'s malloc policy the heap's
        free pages are given back after each chunk (`jaxcnn._host_memory.give_back_free_memory`)."""
        _check_top_k(top_k)  # now, not at the first image
        return self._stream(_as_list(images), top_k)

    def _stream(self, images: list, top_k: int) -> Iterator[Prediction]:
        for start in range(0, len(images), _CHUNK):
            chunk = images[start:start + _CHUNK]
            names = [_name(im, start + i) for i, im in enumerate(chunk)]
            pixels = [to_pixels(decode_image(im, name), self.image_shape, self.resize)
                      for im, name in zip(chunk, names)]
            if not self.resize.in_model:
                pixels = np.stack(pixels)
            scores = self._scores(pixels, names, top_k)
            # Under jaxcnn.cpu.configure's malloc policy (a kept heap) decoded photos fragment it
            # between forward passes; a no-op otherwise.
            _host_memory.give_back_free_memory()
            yield from scores

    def _scores(self, pixels, names, top_k) -> list[Prediction]:
        if self.preprocessing.pixel_dtype == "float32":  # float datasets: the unit scale
            pixels = pixels.astype(np.float32) / np.float32(255)
        logits = self.logits(pixels)
        class_names = self.preprocessing.class_names or ()
        out = []
        for name, row in zip(names, logits):
            probs = softmax(row)
            order = np.argsort(-probs, kind="stable")[:top_k]
            top = tuple(ClassScore(int(i), class_names[i] if i < len(class_names) else str(int(i)),
                                   float(probs[i])) for i in order)
            out.append(Prediction(name, top, probs))
        return out


def _as_list(images) -> list:
    """``images`` as a list; one path (``str``/``PathLike``) or Pillow image is a list of one (a
    path was iterated character by character: "d: no such image file")."""
    if isinstance(images, (str, bytes, os.PathLike)) or type(images).__module__.startswith("PIL."):
        return [images]
    return list(images)


def _name(image, i: int) -> str:
    return os.fspath(image) if isinstance(image, (str, os.PathLike)) else f"<image {i}>"


def _check_top_k(top_k) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise PredictError(f"top_k must be a positive int, got {top_k!r}")


def softmax(logits) -> np.ndarray:
    """float64 softmax of one row of logits."""
    z = np.asarray(logits, np.float64)
    z = np.exp(z - z.max())
    return z / z.sum()


def decode_image(image, name: str = "image"):
    """An upright 8-bit RGB Pillow image, fully decoded, from a file path, a Pillow image or a
    ``(H, W)`` / ``(H, W, C)`` ``uint8`` array; a missing, unreadable or corrupt file is a
    :class:`PredictError` naming it.

    A file is read and decoded as training reads its images
    (:func:`jaxcnn.data.folder.decode_image`: EXIF orientation, 16/32-bit grey scaled to 8 bits,
    palette, alpha and CMYK alike); a Pillow image or an array gets the same orientation and
    conversion."""
    from PIL import Image

    from jaxcnn.data import folder
    from jaxcnn.errors import BadImageError
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim not in (2, 3) or (
                image.ndim == 3 and image.shape[-1] not in (1, 3, 4)):
            raise PredictError(f"{name}: an image array must be uint8 (H, W) or (H, W, C) with "
                               f"C in 1, 3, 4, got {image.dtype} {image.shape}")
        image = Image.fromarray(image[..., 0] if image.ndim == 3 and image.shape[-1] == 1 else image)
    if isinstance(image, Image.Image):
        if 0 in image.size:
            raise PredictError(f"{name}: an empty ({image.width}x{image.height}) image")
        return folder.as_upright_rgb(image)
    path = check_image_file(image)
    try:
        return folder.decode_image(folder.read_file(path), path)
    except BadImageError as e:
        raise PredictError(str(e)) from None


def check_image_file(image) -> str:
    """The path ``image`` names, checked to be a regular file without opening it: a directory,
    a missing file, a FIFO or a device is a :class:`PredictError` naming it."""
    path = os.fspath(image)
    if os.path.isdir(path):
        raise PredictError(f"{path}: is a directory, not an image")
    if not os.path.exists(path):
        raise PredictError(f"{path}: no such image file")
    mode = os.stat(path).st_mode
    if not stat.S_ISREG(mode):  # before opening: a FIFO blocked Pillow's open for good
        raise PredictError(f"{path}: is {file_kind(mode)}, not an image file")
    return path


def to_pixels(img, image_shape: tuple, resize: Resize = Resize()) -> np.ndarray:
    """``(H, W, C)`` ``uint8`` pixels of a Pillow image: channels converted, then resized as
    :class:`Resize` says. With a shorter side it is evaluation's own transform
    (:func:`jaxcnn.data.transforms.eval_transform`: torchvision's ``Resize(S)`` +
    ``CenterCrop``), for every image, one already ``H x W`` included; with ``in_model``, the
    image's own pixels at its own size (the model resizes them)."""
    from PIL import Image

    from jaxcnn.data.transforms import eval_transform
    h, w, c = (int(d) for d in image_shape)
    if c not in (1, 3):
        raise PredictError(f"the model takes {c}-channel images; image files give 1 (L) or 3 (RGB)")
    img = img.convert("L" if c == 1 else "RGB")
    if resize.in_model:
        return np.asarray(img, np.uint8).reshape(img.height, img.width, c)
    side = resize.shorter_side
    if side is not None:
        if side < max(h, w):
            raise PredictError(f"resize.shorter_side {side} is smaller than the model's {w}x{h} "
                               "images: the centre crop would not fit")
        pixels = eval_transform(img, (h, w), side, resize.interpolation)
    else:
        pixels = np.asarray(img if img.size == (w, h) else img.resize((w, h), Image.BILINEAR),
                            np.uint8)
    return pixels.reshape(h, w, c)


# ------------------------------------------------------------------ sources

def _run_predictor(path: str) -> Predictor:
    """A run directory, run with JAX in eval mode under the run's precision policy."""
    import jax
    import jax.numpy as jnp

    from jaxcnn import precision as P
    from jaxcnn.export.pipeline import load_source
    from jaxcnn.layers import Choices
    from jaxcnn.train.rundir import RunDir
    from jaxcnn.train._build import matmul_precision

    src = load_source(path)
    prep = src.preprocessing
    cfg = src.cfg
    try:
        policy = P.get_policy(cfg.precision.policy, dict(cfg.precision.overrides))
    except ValueError as e:
        raise PredictError(f"{path}: precision.policy: {e}") from None
    choices = Choices(impl=cfg.model.impl)
    scale, offset = (jnp.asarray(v) for v in prep.scale_offset())

    @jax.jit
    def forward(params, state, x):  # the normalisation as jaxcnn.data.normalize computes it
        x = x.astype(jnp.float32) * scale - offset
        logits, _ = src.model.apply(params, state, x, train=False, policy=policy, choices=choices)
        return logits.astype(jnp.float32)

    params, state = jax.device_put((src.params, src.state))

    def logits(pixels):
        n = len(pixels)
        padded = np.concatenate([pixels, np.zeros((_CHUNK - n,) + pixels.shape[1:], pixels.dtype)]) \
            if n < _CHUNK else pixels
        with matmul_precision(cfg):
            return np.asarray(forward(params, state, padded))[:n]

    record = _read_record(RunDir(path).preprocessing) if os.path.isfile(
        RunDir(path).preprocessing) else {}
    return Predictor(path, "run", prep, resize_rule(record, RunDir(path).preprocessing), logits)


def _read_record(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.loads(f.read(_MAX_RECORD_BYTES))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PredictError(f"{path}: cannot read the preprocessing record ({e})") from None


def _export_record(record, where: str):
    """``(Preprocessing, Resize, in_graph, layout)`` of an export's preprocessing record; a
    raw-image export (``"raw_image": true``, layout ``HWC``) resizes in the model."""
    if not isinstance(record, dict):
        raise PredictError(f"{where}: the preprocessing record is not a JSON object")
    prep = from_dict(record, where)
    layout = str(record.get("input_layout", "NHWC")).upper()
    raw = record.get("raw_image", False) is True
    if layout not in (("HWC",) if raw else ("NHWC", "NCHW")):
        raise PredictError(f"{where}: input_layout must be " + (
            "HWC with raw_image" if raw else "NHWC or NCHW") + f", got {layout!r}")
    resize = resize_rule(record, where)
    if raw and (resize.shorter_side is None or not record.get("in_graph", True)):
        raise PredictError(f"{where}: raw_image needs a 'resize' and in_graph: true")
    return prep, resize._replace(in_model=raw), bool(record.get("in_graph", True)), layout


def _feed(prep: Preprocessing, in_graph: bool, layout: str):
    """Raw pixels -> what the export takes: raw (normalised inside) or normalised float32."""
    def convert(pixels):
        x = pixels if in_graph else prep.apply(pixels)
        return np.transpose(x, (0, 3, 1, 2)) if layout == "NCHW" else x
    return convert


def _batched(feed, fixed: int | None, run):
    """``pixels -> float32 logits`` of an exported model: ``feed`` prepares its input, ``run``
    calls it; a model exported for a fixed batch gets batches of that size, the last one
    zero-padded (and its padding rows dropped)."""
    def logits(pixels):
        x = feed(pixels)
        step = fixed or len(x)
        rows = []
        for i in range(0, len(x), step):
            part = x[i:i + step]
            n = len(part)
            if fixed and n < fixed:
                part = np.concatenate([part, np.zeros((fixed - n,) + part.shape[1:], part.dtype)])
            rows.append(np.asarray(run(part), np.float32)[:n])
        return np.concatenate(rows)

    return logits


def _onnx_predictor(path: str) -> Predictor:
    try:
        import onnxruntime as ort
    except ImportError:
        raise PredictError(f"{path}: running an .onnx export needs onnxruntime "
                           "(pip install 'jaxcnn[export]')") from None
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's load errors share no base class
        detail = " ".join(str(e).split())[:200]
        raise PredictError(f"{path}: not a readable ONNX model ({type(e).__name__}: {detail})") from None
    meta = session.get_modelmeta().custom_metadata_map
    where = f"{path} (metadata 'jaxcnn.preprocessing')"
    if "jaxcnn.preprocessing" not in meta:
        raise PredictError(f"{path}: no 'jaxcnn.preprocessing' metadata; export a run directory "
                           "with jaxcnn-export to record its preprocessing")
    try:
        record = json.loads(meta["jaxcnn.preprocessing"])
    except json.JSONDecodeError as e:
        raise PredictError(f"{where}: not valid JSON ({e})") from None
    prep, resize, in_graph, layout = _export_record(record, where)
    inp = session.get_inputs()[0]
    if resize.in_model:  # one decoded image per run: (H, W, C) of its own size
        return Predictor(path, "onnx", prep, resize, lambda images: np.concatenate(
            [session.run(None, {inp.name: image})[0] for image in images]))
    feed = _feed(prep, in_graph, layout)
    fixed = inp.shape[0] if isinstance(inp.shape[0], int) else None

    return Predictor(path, "onnx", prep, resize, _batched(
        feed, fixed, lambda part: session.run(None, {inp.name: part})[0]))


def _stablehlo_predictor(path: str, sidecar: str) -> Predictor:
    from jaxcnn.export.stablehlo import load_stablehlo
    prep, resize, in_graph, layout = _export_record(_read_record(sidecar), sidecar)
    exported = load_stablehlo(path)
    feed = _feed(prep, in_graph, layout)
    batch = exported.in_avals[0].shape[0]
    fixed = batch if isinstance(batch, int) else None
    return Predictor(path, "stablehlo", prep, resize, _batched(feed, fixed, exported.call))


def load_predictor(source) -> Predictor:
    """Load a run directory, an ``.onnx`` export or a StableHLO export (with its
    ``.preprocessing.json``) for :meth:`Predictor.predict`.

    Raises:
        PredictError: (or another ``ValueError``: ``ExportError``, ``DataError``,
            ``ConfigError``) naming the file at fault.
    """
    path = os.fspath(source)
    if os.path.isdir(path):
        from jaxcnn.train.rundir import RunDir
        if not os.path.isfile(RunDir(path).config):
            raise PredictError(f"{path}: not a jaxcnn run directory (no {RunDir.CONFIG})")
        return _run_predictor(path)
    if not os.path.isfile(path):
        raise PredictError(f"{path}: no such run directory or exported model")
    if path.lower().endswith(".onnx"):
        return _onnx_predictor(path)
    if path.lower().endswith((".npz", ".safetensors")):
        from jaxcnn.train.rundir import RunDir
        parent = os.path.dirname(path) or "."
        way = (f"give its run directory, {parent}" if os.path.isfile(RunDir(parent).config) else
               "export it with jaxcnn-export PARAMS --model NAME --format onnx, or give its run directory")
        raise PredictError(f"{path}: a parameter file holds neither the preprocessing nor the class names; {way}")
    if path.endswith(".preprocessing.json"):
        raise PredictError(f"{path}: the preprocessing record of a StableHLO export; give the export, "
                           f"{path[:-len('.preprocessing.json')]}")
    sidecar = path + ".preprocessing.json"
    if os.path.isfile(sidecar):
        return _stablehlo_predictor(path, sidecar)
    raise PredictError(f"{path}: not a run directory, an .onnx export or a StableHLO export "
                       f"(which has its preprocessing in {os.path.basename(sidecar)})")


def predict(source, images: Sequence[Any], top_k: int = 5) -> list[Prediction]:
    """Classify images with a trained run or an exported model.

    Arguments:
        source: a run directory, an ``.onnx`` export, a StableHLO export (with its
            ``.preprocessing.json``), or a :class:`Predictor` from :func:`load_predictor`.
        images: image file paths (anything Pillow reads), Pillow images, or ``uint8``
            arrays ``(H, W)``/``(H, W, C)``; each is preprocessed as the module's docstring
            says. One path or Pillow image is a list of one.
        top_k: how many classes to report per image (at most the class count).

    Returns:
        One :class:`Prediction` per image, in order: ``top_k`` :class:`ClassScore`
        ``(index, name, probability)`` and all ``probabilities``. The images are decoded a
        chunk at a time (:meth:`Predictor.predictions`); every path is checked to be an image
        file before the model is loaded.

    Raises:
        PredictError: (a ``ValueError``) naming the bad image or source.
    """
    _check_top_k(top_k)
    images = _as_list(images)
    for image in images:
        if isinstance(image, (str, os.PathLike)):
            check_image_file(image)
    predictor = source if isinstance(source, Predictor) else load_predictor(source)
    return predictor.predict(images, top_k)


def format_predictions(predictions: Sequence[Prediction]) -> str:
    """The command's text output: per image its name, then one line per class."""
    lines = []
    for p in predictions:
        lines.append(p.image)
        width = max((len(s.name) for s in p.top_k), default=0)
        lines += [f"  {s.name:<{width}}  {s.probability:.4f}" for s in p.top_k]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    from jaxcnn._cli import OneLineParser
    p = OneLineParser(
        prog="jaxcnn-predict",
        description="Print the top classes of images, with their names and probabilities, "
                    "as a trained run (or its ONNX/StableHLO export) sees them after the run's "
                    "own preprocessing (resize, normalisation).")
    p.add_argument("source", type=path_arg, help="a run directory, an .onnx export, or a StableHLO export "
                                  "(with its .preprocessing.json beside it)")
    p.add_argument("images", type=path_arg, nargs="+", metavar="IMAGE",
                   help="image files (PNG, JPEG, ...), or directories: every image file under one")
    p.add_argument("--top-k", type=_positive_int, default=5, help="classes per image (default 5)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: {source, predictions: [{image, top_k: [{index, name, "
                        "probability}]}]}")
    return p


def image_files(paths: Sequence[str]) -> list[str]:
    """The command line's IMAGE arguments, a directory among them standing for every image file
    under it (by extension, sorted, sub-folders included, as an image folder's class folders;
    hidden files and OS litter such as ``Thumbs.db`` left out). A directory without one is a
    :class:`PredictError` naming it."""
    from jaxcnn.data.folder import IMAGE_EXTENSIONS, is_image_name, is_os_metadata
    out = []
    for path in paths:
        if not os.path.isdir(path):
            out.append(path)
            continue
        found = []
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if not is_os_metadata(d, folder=True))
            found.extend(os.path.join(dirpath, f) for f in filenames
                         if is_image_name(f) and not is_os_metadata(f, folder=False))
        if not found:
            raise PredictError(f"{path}: a directory with no image files ({', '.join(IMAGE_EXTENSIONS)})")
        out.extend(sorted(found))
    return out


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def main(argv=None) -> int:
    """Entry point of ``jaxcnn-predict``; returns the exit code."""
    from jaxcnn import cpu
    cpu.configure()  # before JAX starts, as the other commands
    args = parser().parse_args(argv)
    from jaxcnn.train.checkpoint import CheckpointError
    found = []
    try:
        files = image_files(args.images)
        for path in files:
            check_image_file(path)
        # streamed: each prediction is shown as it is made, in bounded memory for any number of images
        for prediction in load_predictor(args.source).predictions(files, top_k=args.top_k):
            if args.json:
                found.append(prediction.to_dict())
            else:
                print(format_predictions([prediction]), flush=True)
    except (ValueError, OSError, CheckpointError) as e:  # PredictError, ExportError, DataError...
        message = " ".join(str(e).split())
        if os.path.isdir(args.source):  # a run directory started elsewhere: say where
            from jaxcnn.train.rundir import RunDir
            message = RunDir(args.source).explain_missing_path(message)
        print(f"jaxcnn-predict: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        from jaxcnn.train.cli import interrupted
        return interrupted("jaxcnn-predict", argv is None)
    if args.json:
        print(json.dumps({"source": args.source, "predictions": found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
