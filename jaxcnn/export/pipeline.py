"""From a run directory or a parameter file to an exported model.

:func:`load_source` turns ``RUN_DIR`` (written by ``jaxcnn-train``: its
``config.resolved.yaml`` names the model, its ``params.npz`` or
``params.safetensors`` holds the trained parameters) or a bare parameter
file plus a model name into a model, its parameters and its input shape.
:func:`export` is what ``jaxcnn-export`` runs: optional pruning (and
fine-tuning through the trainer), BatchNorm folding and int8 quantisation, then
one output format.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, NamedTuple

import jax

from jaxcnn import interop, models
from jaxcnn.data.files import write_bytes_whole
from jaxcnn.data.preprocessing import PREPROCESSING_FILE, run_preprocessing
from jaxcnn.errors import ExportError
from jaxcnn.export._args import arg
from jaxcnn.export.fold import fold_batch_norm
from jaxcnn.export.onnx_export import RAW_IMAGE_OPSET, export_onnx
from jaxcnn.export.prune import fine_tune, magnitude_prune, sparsity_report
from jaxcnn.export.quantize import quantize_int8
from jaxcnn.export.stablehlo import export_stablehlo
from jaxcnn.layers.base import record_layers

FORMATS = ("stablehlo", "onnx", "npz", "safetensors")
_DATASET_SHAPES = {"mnist": (28, 28, 1), "cifar10": (32, 32, 3)}


class Source(NamedTuple):
    """A model with its parameters, ready to export.

    Arguments:
        name: zoo model name.
        model: the Layer tree.
        params, state: NumPy trees.
        image_shape: ``(H, W, C)`` of one input image.
        cfg: the run's config when loaded from a run directory, else None.
        preprocessing: the run's :class:`jaxcnn.data.preprocessing.Preprocessing`
            (its ``preprocessing.json``, or reconstructed for an older run directory);
            None for a bare parameter file.
    """

    name: str
    model: Any
    params: dict
    state: dict
    image_shape: tuple
    cfg: Any
    preprocessing: Any = None


def _load_params(path, like):
    if path.endswith(".npz"):
        return interop.load_npz(path, like=like)
    if path.endswith(".safetensors"):
        return interop.load_safetensors(path, like=like)
    from jaxcnn.interop.arrays import unknown_file_type
    raise ExportError(f"{path}: {unknown_file_type(path, or_run_dir=True)}")


def _last_weight_path(model, image_shape):
    """Dotted path of the last layer with a weight ``w`` (the classifier)."""
    with record_layers() as records:
        jax.eval_shape(lambda k: model.init(k, (1,) + tuple(image_shape))[:2],
                       jax.random.PRNGKey(0))
    paths = [r.path for r in records if "w" in r.params]
    return paths[-1] if paths else None


def _infer_num_classes(name, options, params_path, image_shape):
    """The classifier's width, read from the parameter file's last weight."""
    path = _last_weight_path(models.get(name, **options), image_shape)
    params, _ = _load_params(params_path, None)
    node = params
    for part in (path or "").split("."):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    if not isinstance(node, dict) or not hasattr(node.get("w"), "shape"):
        raise ExportError(f"{params_path}: no weight 'params/{path}.w' for model {name!r}'s "
                          f"classifier; is {arg('model')} right?")
    return int(node["w"].shape[-1])


def _image_shape_from_config(cfg):
    if cfg.data.image_size:
        return tuple(int(d) for d in cfg.data.image_size)
    if cfg.data.source in _DATASET_SHAPES:
        return _DATASET_SHAPES[cfg.data.source]
    if cfg.data.source == "synthetic":
        return models.default_input_shape(cfg.model.name)[1:]
    if cfg.data.source in ("folder", "records"):  # decoded to RGB at the model's size
        return tuple(models.default_input_shape(cfg.model.name)[1:3]) + (3,)
    from jaxcnn.data import load_dataset
    if cfg.data.path is not None and not os.path.exists(cfg.data.path):  # named by its key, as in training
        raise ExportError(f"data.path: {cfg.data.path!r} does not exist")
    return tuple(load_dataset(cfg.data.source, cfg.data.path).image_shape)


def load_source(source, *, model: str | None = None, num_classes: int | None = None,
                model_options: dict | None = None, image_shape=None,
                preprocessing: bool = True) -> Source:
    """Load a run directory or a parameter file.

    Arguments:
        source: a run directory (``config.resolved.yaml`` + ``params.npz`` or
            ``params.safetensors``) or a ``.npz``/``.safetensors`` parameter file.
        model: zoo model name; required for a parameter file, must match the
            run's for a run directory.
        num_classes: classifier width; default: the run's config, else read from
            the parameter file.
        model_options: extra model options (e.g. ``{"cifar_stem": True}``),
            added to the run's.
        image_shape: ``(H, W, C)``; default: the run's data, else the model's
            usual input.
        preprocessing: read the run's preprocessing (``preprocessing.json``, or
            reconstructed from its config and data for an older run directory);
            False: only a recorded ``preprocessing.json``.

    Returns:
        A :class:`Source`. Raises :class:`ExportError` (or ``ValueError`` from
        the file readers) naming the file or key at fault.
    """
    source = os.fspath(source)
    options = dict(model_options or {})
    cfg, prep = None, None
    given_shape = tuple(image_shape) if image_shape is not None else None
    if os.path.isdir(source):
        from jaxcnn.train.rundir import RunDir
        cfg_path = RunDir(source).config
        if not os.path.isfile(cfg_path):
            raise ExportError(f"{cfg_path} does not exist: not a jaxcnn run directory")
        from jaxcnn.train.config import load_config
        cfg = load_config(cfg_path, ["model.extra_outputs=true"])  # the head the run trained
        params_path = _run_params(source)
        if model is not None and model != cfg.model.name:
            raise ExportError(f"{arg('model', repr(model))} does not match the run's model "
                              f"{cfg.model.name!r}")
        model = cfg.model.name
        options = {**dict(cfg.model.options), **options}
        num_classes = num_classes or cfg.model.num_classes or cfg.data.num_classes
        recorded = os.path.join(source, PREPROCESSING_FILE)
        if preprocessing or os.path.isfile(recorded):
            prep = run_preprocessing(source, make_run=lambda: _build_run(cfg))
            image_shape = image_shape or tuple(prep.image_shape)
        image_shape = image_shape or _image_shape_from_config(cfg)
    elif os.path.isfile(source):
        params_path = source
        if not source.endswith((".npz", ".safetensors")):  # before asking for --model
            _load_params(source, None)
        if model is None:
            raise ExportError(f"{source}: a parameter file needs {arg('model', 'NAME')} "
                              f"(one of {models.names()})")
    else:
        raise ExportError(f"{source}: no such run directory or parameter file")
    if model not in models.names():
        raise ExportError(f"unknown model {model!r}; known models: {models.names()}")
    image_shape = tuple(int(d) for d in (image_shape or models.default_input_shape(model)[1:]))
    if len(image_shape) != 3:
        raise ExportError(f"image shape must be (H, W, C), got {image_shape}")
    if cfg is None and params_path.endswith(".safetensors") and interop.is_torch_safetensors(params_path):
        return _torch_source(params_path, model, num_classes, options, image_shape)
    if num_classes is None:
        num_classes = _infer_num_classes(model, options, params_path, image_shape)
    net = models.get(model, num_classes=num_classes, **options)
    like = jax.eval_shape(lambda k: net.init(k, (1,) + image_shape)[:2], jax.random.PRNGKey(0))
    try:
        params, state = _load_params(params_path, like)
    except ValueError as e:
        if given_shape is None or "shape" not in str(e):
            raise
        # The flattened classifier's width follows the image size: name the option that set it.
        shape = arg("image_shape", repr(given_shape), cli_value=",".join(map(str, given_shape)))
        raise ExportError(f"{shape}: the parameters do not fit the "
                          f"model at that input ({' '.join(str(e).split())})") from None
    return Source(model, net, params, state, image_shape, cfg, prep)


def _torch_source(path: str, model: str, num_classes, options: dict, image_shape: tuple) -> Source:
    """A PyTorch ``state_dict`` saved as safetensors (torchvision's or timm's names, as
    ``model.init_from`` takes it): converted to ``model``'s parameters, the classifier's width
    read from the file unless ``num_classes`` is given. (It was "unexpected key 'bn1.bias'; keys
    must start with 'params/' or 'state/'".)"""
    if num_classes is not None:
        options = dict(options, num_classes=num_classes)
    params, state = interop.load_torch_safetensors(path, model, input_shape=(1,) + image_shape, **options)
    if num_classes is None:
        head = _last_weight_path(models.get(model, **options), image_shape)
        node = params
        for part in (head or "").split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        num_classes = int(node["w"].shape[-1]) if isinstance(node, dict) and "w" in node else None
    net = models.get(model, **({} if num_classes is None else {"num_classes": num_classes}), **options)
    return Source(model, net, params, state, image_shape, None, None)


def _build_run(cfg):
    from jaxcnn.train._build import build_run
    return build_run(cfg)


# The extensions that name one export format: an --out ending in another format's is refused
# (--format stablehlo --out m.onnx wrote a StableHLO module that jaxcnn-predict and onnxruntime
# then read as a broken ONNX file; --format onnx --out m.npz, a "parameter file").
_EXTENSIONS = {".onnx": "onnx", ".npz": "npz", ".safetensors": "safetensors"}


def _check_out_extension(out: str, format: str) -> None:
    ext = os.path.splitext(out)[1].lower()
    named = _EXTENSIONS.get(ext)
    if named is not None and named != format:
        mine = next((e for e, f in _EXTENSIONS.items() if f == format), "")
        better = repr(os.path.splitext(out)[0] + mine) + ("" if mine else " (any name but those extensions)")
        raise ExportError(f"{arg('out', repr(out))} has the {ext} extension of the {named} format, but "
                          f"{arg('format')} is {format}; give {arg('out', better)}, or "
                          f"{arg('format', repr(named), cli_value=named)}")


def _check_out_spares_source(source, out: str) -> None:
    """An `ExportError` when writing ``out`` would overwrite the source: the parameter file
    itself, or a file the trainer keeps in the source run directory (``--out runs/x/params.npz``
    replaced the trained parameters with the pruned ones; a StableHLO file went over
    ``config.resolved.yaml``)."""
    from jaxcnn.train.rundir import RunDir
    source = os.fspath(source)
    real_out, real_source = os.path.realpath(out), os.path.realpath(source)
    if real_out == real_source:
        raise ExportError(f"{arg('out', repr(out))} is the source file {source}: it would be overwritten; "
                          "give another name")
    if os.path.isdir(real_source):
        for name in RunDir.ENTRIES:
            owned = os.path.join(real_source, name)
            if real_out == owned or real_out.startswith(owned + os.sep):
                raise ExportError(f"{arg('out', repr(out))} is the run's own {name} in {source}: it would be "
                                  "overwritten; "
                                  "give another name")


def _dataset(cfg):
    run = _build_run(cfg)
    if run.dataset is None and run.images is None:
        raise ExportError("the run's data is synthetic, generated per step; calibration and accuracy "
                          "need a dataset")
    return run


def calibration_batches(cfg, count: int, batch_size: int | None = None):
    """The first ``count`` batches of the run's training images, normalised as in
    training but not augmented: ``[(N, H, W, C) float32]``. For an image folder (or its
    records): ``count * batch_size`` training images spread evenly over the split (it is
    ordered by class), each resized and centre-cropped as in evaluation."""
    from jaxcnn.data import eval_batches
    run = _dataset(cfg)
    bs = batch_size or cfg.data.batch_size
    if run.images is not None:
        return _image_calibration_batches(run, cfg, count, bs)
    ds = run.dataset
    mean, std = (ds.mean, ds.std) if cfg.data.normalize else (None, None)
    n = min(len(ds.x_train), count * bs)
    return [b["image"] for b in eval_batches(ds.x_train[:n], ds.y_train[:n], bs, mean=mean, std=std)]


def _image_calibration_batches(run, cfg, count: int, batch_size: int):
    import numpy as np

    from jaxcnn.data.dataset import normalize
    from jaxcnn.data.loader import load_rgb
    from jaxcnn.data.transforms import eval_transform
    from jaxcnn.errors import BadImageError
    from jaxcnn.train._data import image_norm
    images, (mean, std) = run.images, image_norm(cfg)
    total = len(images.train)
    picks = np.unique(np.linspace(0, total - 1, min(total, count * batch_size)).astype(np.int64))
    decoded = []
    for index in picks:
        try:
            decoded.append(eval_transform(load_rgb(images.train, int(index))[0], images.image_size,
                                          images.eval_resize, images.augment.interpolation))
        except BadImageError:
            continue  # as data.on_bad_image: skip would; none at all is an error below
    if not decoded:
        raise ExportError(f"{images.path}: none of the {len(picks)} training images picked for calibration decodes")
    pixels = np.stack(decoded)
    return [normalize(pixels[i:i + batch_size], mean, std) for i in range(0, len(pixels), batch_size)]


def evaluate_model(cfg, model, params, state) -> dict:
    """Loss, top-1 and top-5 of ``model`` on the run's test set (eval mode)."""
    from jaxcnn.train._loop import evaluate
    from jaxcnn.train._build import matmul_precision
    from jaxcnn.train._data import train_image_norm
    from jaxcnn.train.step import make_eval_step
    run = _dataset(cfg)
    with matmul_precision(cfg):
        return evaluate(run, jax.jit(make_eval_step(model, image_norm=train_image_norm(run)).step), params, state)


def _run_params(source: str) -> str:
    """The final parameter file of a run directory; an ExportError saying why there is none."""
    from jaxcnn.train.rundir import RunDir
    params_path = RunDir(source).find_params()
    if params_path is None:
        ckpt = RunDir(source).checkpoints
        steps = sorted(int(n) for n in os.listdir(ckpt) if n.isdigit()) if os.path.isdir(ckpt) else []
        why = (f"it stopped at a checkpoint (step {steps[-1]}): run its jaxcnn-train command again to "
               f"finish it (jaxcnn-eval evaluates the checkpoint as it is)" if steps else
               "has training finished?")
        raise ExportError(f"{source}: run directory has no parameters "
                          f"({' or '.join(RunDir.PARAM_FILES)}); {why}")
    return params_path


def export(source, out, *, format: str, model: str | None = None, num_classes=None,
           model_options=None, image_shape=None, batch="dynamic", layout: str = "nhwc",
           fold_bn: bool = False, quantize: str | None = None, calibration_count: int = 4,
           prune: float | None = None, prune_scope: str = "global",
           prune_structure: str = "unstructured", fine_tune_steps: int = 0,
           fine_tune_lr: float | None = None, fine_tune_dir=None, opset: int | None = None,
           preprocessing: bool = True, raw_image: bool = False,
           log: Callable[[str], None] | None = None, train_stream=None) -> dict:
    """Load, optionally prune / fold / quantise, and write one export format.

    Arguments:
        source, model, num_classes, model_options, image_shape: as :func:`load_source`.
        out: output file; not an existing directory. ``npz`` output gets the ``.npz``
            extension NumPy adds when it is missing (the report names the real path).
        format: ``"stablehlo"``, ``"onnx"``, ``"npz"`` or ``"safetensors"``
            (the last two write ``(params, state)`` of the transformed model).
        batch: int or ``"dynamic"``; layout: ``"nhwc"`` or ``"nchw"``
            (StableHLO and ONNX).
        fold_bn: fold BatchNorm into the preceding convolution.
        quantize: None or ``"int8"`` (folds BatchNorm; needs a run directory
            for ``calibration_count`` batches of training images).
        prune: sparsity in ``[0, 1)`` or None; prune_scope, prune_structure: see
            :func:`jaxcnn.export.prune.magnitude_prune`.
        fine_tune_steps: steps of fine-tuning after pruning, through the trainer
            (:func:`jaxcnn.export.prune.fine_tune`; run directory only);
            fine_tune_lr: its peak learning rate (default: the run's / 10);
            fine_tune_dir: its run directory (default: ``out`` without its
            extension, plus ``_finetune``); what is exported is its result.
        opset: ONNX opset (None: 17, or 18 with ``raw_image``).
        preprocessing: build the run's input preprocessing (``preprocessing.json``:
            per-channel normalisation of raw pixels) into a StableHLO or ONNX export,
            so that it takes raw pixels as the data loaders give them (``uint8`` in
            ``[0, 255]``; float32 on the unit scale for float datasets). False: the
            export takes already normalised float32 inputs (the network's own).
            Either way the preprocessing is recorded: ONNX ``metadata_props``
            ``jaxcnn.preprocessing``, a StableHLO file's sidecar
            ``<out>.preprocessing.json``, and the report's ``preprocessing``.
        raw_image: an ONNX export of a run on an image folder or records takes one raw
            ``uint8`` image ``(H, W, 3)`` of any size and resizes, centre-crops and
            normalises it inside as the run's evaluation does (``export_onnx``'s
            ``raw_image``); its record says ``"raw_image": true, "input_layout": "HWC"``.
        log: called with progress lines (None: silent).
        train_stream: where the fine-tune's trainer prints (default ``sys.stdout``).

    Returns:
        A report: ``{"out", "format", "model", "preprocessing", ...}`` with ``sparsity`` and
        ``accuracy`` entries (before/after, when a run directory gives test data).

    Raises:
        ExportError: (or ``ValueError`` from the file readers) naming the argument at fault as
            this function's (``model='x'``, ``image_shape=...``); ``jaxcnn-export`` names its flags
            (``--model 'x'``) instead.
    """
    say = log or (lambda _: None)
    out = _checked_out(source, out, format, quantize, calibration_count)
    if raw_image:
        _check_raw_image_args(format, preprocessing, layout, batch, opset)
    src = load_source(source, model=model, num_classes=num_classes, model_options=model_options,
                      image_shape=image_shape,
                      preprocessing=preprocessing and format in ("onnx", "stablehlo"))
    net, params, state, cfg = src.model, src.params, src.state, src.cfg
    _check_run_needs(cfg, quantize=quantize, fine_tune_steps=fine_tune_steps, prune=prune,
                     model_options=model_options, num_classes=num_classes, image_shape=image_shape)
    report = {"out": out, "format": format, "model": src.name,
              "image_shape": list(src.image_shape), "accuracy": {}}
    prep, in_graph, report["preprocessing"] = _preprocessing_meta(src, preprocessing, format, layout,
                                                                  raw_image)
    fine = dict(steps=fine_tune_steps, lr=fine_tune_lr, workdir=fine_tune_dir, stream=train_stream)
    net, params, state = _transformed(source, src, out, report, say, prune=prune, prune_scope=prune_scope,
                                      prune_structure=prune_structure, fine_tune=fine, fold_bn=fold_bn,
                                      quantize=quantize, calibration_count=calibration_count)
    _write(format, out, net, params, state, src, report, batch=batch, layout=layout, opset=opset,
           built_in=prep if in_graph else None, raw_image=raw_image)
    say(f"wrote {format} to {out}")
    say(_raw_image_line(prep) if raw_image else
        _input_line(format, layout, src.image_shape, prep, in_graph, report, cfg is not None, batch))
    return report


def _transformed(source, src, out, report, say, *, prune, prune_scope, prune_structure, fine_tune: dict,
                 fold_bn, quantize, calibration_count):
    """``src``'s ``(model, params, state)`` pruned (and fine-tuned from ``source``, a run
    directory), folded or quantised as asked, each stage's top-1 accuracy recorded in ``report`` where the run has test data."""
    net, params, state, cfg = src.model, src.params, src.state, src.cfg
    has_data = cfg is not None and cfg.data.source != "synthetic"

    def accuracy(label, m, p, s):
        if has_data:
            report["accuracy"][label] = evaluate_model(cfg, m, p, s)["top1"]
            say(f"top-1 {label}: {report['accuracy'][label]:.4f}")

    if prune or quantize or fold_bn:
        accuracy("original", net, params, state)
    if prune:
        params, _ = magnitude_prune(net, params, prune, scope=prune_scope, structure=prune_structure)
        accuracy("pruned", net, params, state)
        if fine_tune["steps"]:
            net, params, state = _fine_tuned(source, out, report, say, has_data, sparsity=prune,
                                             scope=prune_scope, structure=prune_structure, **fine_tune)
        report["sparsity"] = sparsity_report(net, params)
        say(f"sparsity: {report['sparsity']['prunable_sparsity']:.4f} of conv/linear weights, "
            f"{report['sparsity']['total_sparsity']:.4f} of all parameters")
    if fold_bn and not quantize:
        net, params, state = fold_batch_norm(net, params, state)
        accuracy("folded", net, params, state)
    if quantize:
        net, params, state = quantize_int8(net, params, state, calibration_batches(cfg, calibration_count))
        accuracy("int8", net, params, state)
    return net, params, state


def _checked_out(source, out, format, quantize, calibration_count) -> str:
    """``out`` as the file that will be written (``.npz`` added where NumPy adds it), after
    checking the arguments that need no model: the format, the quantisation, and that the
    output's directory exists, is writable and the output would not replace the source."""
    if format not in FORMATS:
        raise ExportError(f"format must be one of {FORMATS}, got {format!r}")
    if quantize not in (None, "int8"):
        raise ExportError(f"quantize must be 'int8', got {quantize!r}")
    if calibration_count < 1:
        raise ExportError(f"calibration_count must be a positive count of batches, got {calibration_count}")
    out = os.fspath(out)
    if os.path.isdir(out):
        raise ExportError(f"{arg('out', repr(out))} is a directory; give the output file's name")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):  # before any work: it ended on "[Errno 2] No such file or directory"
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ExportError(f"{arg('out', repr(out))}: its directory {os.path.dirname(out) or '.'} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ExportError(f"{arg('out', repr(out))}: its directory {os.path.dirname(out) or '.'} is not "
                          "writable")
    _check_out_extension(out, format)
    if format == "npz" and not out.endswith(".npz"):
        out += ".npz"  # what np.savez writes
    _check_out_spares_source(source, out)
    return out


def _check_run_needs(cfg, *, quantize, fine_tune_steps, prune, model_options, num_classes, image_shape):
    """Quantisation and fine-tuning need a run directory (its data); fine-tuning needs pruning
    and the run's own model."""
    needs_run = [arg(name) for name, on in (("quantize", quantize), ("fine_tune_steps",
                                                                     fine_tune_steps)) if on]
    if needs_run and cfg is None:
        raise ExportError(f"{' and '.join(needs_run)} {'need' if len(needs_run) > 1 else 'needs'} "
                          f"training data: pass a run directory, "
                          "not a parameter file")
    if fine_tune_steps and not prune:
        raise ExportError(f"{arg('fine_tune_steps')} fine-tunes a pruned model: add "
                          f"{arg('prune', 'SPARSITY')}")
    if fine_tune_steps and (model_options or num_classes or image_shape):
        raise ExportError(f"{arg('fine_tune_steps')} trains the run's own model on its own data; leave "
                          f"out {arg('model_options')}, {arg('num_classes')} and {arg('image_shape')}")


def _check_raw_image_args(format: str, preprocessing: bool, layout: str, batch, opset) -> None:
    """The arguments a raw-image export refuses, before any work: it is ONNX only, builds the
    whole preprocessing in, and takes one ``(H, W, 3)`` image."""
    raw = arg("raw_image=True")
    if format != "onnx":
        raise ExportError(f"{raw} is for {arg('format', repr('onnx'), cli_value='onnx')} (the "
                          f"{format} export takes images at the model's size)")
    if not preprocessing:
        raise ExportError(f"{raw} builds the resize, crop and normalisation into the graph; "
                          f"leave out {arg('preprocessing=False')}")
    if layout != "nhwc":
        raise ExportError(f"{raw} takes one image (H, W, 3) as decoded; leave out "
                          f"{arg('layout', repr(layout), cli_value=layout)}")
    if batch not in ("dynamic", 1):
        raise ExportError(f"{raw} takes one image; leave out {arg('batch', repr(batch), cli_value=str(batch))}")
    if opset is not None and opset < RAW_IMAGE_OPSET:
        raise ExportError(f"{raw} needs {arg('opset', str(RAW_IMAGE_OPSET), cli_value=str(RAW_IMAGE_OPSET))} "
                          f"or later (Resize with antialias), got {opset}")


def _preprocessing_meta(src, preprocessing: bool, format: str, layout: str, raw_image: bool = False):
    """``(prep, in_graph, meta)``: the run's preprocessing at the export's image shape, whether
    it is built into the exported graph, and the record of it the export carries (a
    raw-image export's refused, in one line, for a run whose evaluation resizes nothing)."""
    prep = src.preprocessing
    if raw_image and (prep is None or prep.resize_shorter_side is None):
        raise ExportError(f"{arg('raw_image=True')} builds the run's evaluation resize "
                          "into the graph, but " + (
                              "a bare parameter file records no preprocessing; export the run directory"
                              if prep is None else
                              f"this run's {prep.dataset or 'data'} images come at the model's size "
                              f"{tuple(prep.image_shape)} and its evaluation resizes none"))
    if raw_image and prep.resize_interpolation != "bilinear":
        raise ExportError(f"{arg('raw_image=True')} resizes as Pillow's bilinear filter does; this run "
                          f"resizes with {prep.resize_interpolation!r} (data.augment.interpolation), which "
                          "the graph does not reproduce")
    if prep is not None and tuple(prep.image_shape) != tuple(src.image_shape):
        if prep.image_shape[-1] != src.image_shape[-1] and preprocessing:
            raise ExportError(f"{arg('image_shape', repr(tuple(src.image_shape)), cli_value=str(tuple(src.image_shape)))}"
                              f" has {src.image_shape[-1]} channels but the run's preprocessing "
                              f"normalises {prep.image_shape[-1]}; add {arg('preprocessing=False')}")
        prep = prep._replace(image_shape=tuple(src.image_shape))
    in_graph = bool(preprocessing and prep is not None and format in ("onnx", "stablehlo"))
    meta = None
    if prep is not None:
        meta = {**prep.to_dict(), "in_graph": in_graph}
        if format in ("onnx", "stablehlo"):
            meta.update(input_layout="HWC" if raw_image else layout.upper(),
                        input_dtype=prep.pixel_dtype if in_graph else "float32")
        if raw_image:
            meta["raw_image"] = True
    return prep, in_graph, meta


def _fine_tuned(source, out, report, say, has_data, *, sparsity, steps, scope, structure, lr,
                workdir, stream):
    """The pruned run fine-tuned through the trainer, in ``workdir`` (default: next to
    ``out``): its ``(model, params, state)``, recorded in ``report``."""
    workdir = os.fspath(workdir or os.path.splitext(os.fspath(out))[0] + "_finetune")
    say(f"fine-tuning for {steps} steps in {workdir}")
    result = fine_tune(source, workdir, sparsity=sparsity, steps=steps, scope=scope,
                       structure=structure, lr=lr, stream=stream)
    if "stopped_by" in result:  # Ctrl-C or SIGTERM: the trainer saved a checkpoint
        from jaxcnn.errors import TrainingStopped
        raise TrainingStopped(f"fine-tuning in {workdir} stopped by {result['stopped_by']} at step "
                              f"{result['step']} (checkpoint saved); the same command resumes it")
    tuned = load_source(workdir)
    report["fine_tune"] = {"workdir": workdir, "steps": steps}
    if has_data and "top1" in result:
        report["accuracy"]["fine_tuned"] = result["top1"]
        say(f"top-1 fine_tuned: {result['top1']:.4f}")
    return tuned.model, tuned.params, tuned.state


def _write(format, out, net, params, state, src, report, *, batch, layout, opset, built_in,
           raw_image=False):
    """The model in ``format`` to ``out`` (StableHLO's preprocessing record beside it)."""
    meta = report["preprocessing"]
    if format == "stablehlo":
        export_stablehlo(net, params, state, src.image_shape, batch=batch, layout=layout, path=out,
                         preprocessing=built_in)
        if meta is not None:
            report["preprocessing_file"] = out + ".preprocessing.json"
            write_bytes_whole(report["preprocessing_file"], json.dumps(meta, indent=2).encode())
    elif format == "onnx":
        export_onnx(net, params, state, src.image_shape, path=out, batch=batch, layout=layout,
                    opset=opset, model_name=src.name, preprocessing=built_in, raw_image=raw_image,
                    metadata=None if meta is None else {"jaxcnn.preprocessing": json.dumps(meta)})
    else:
        host = jax.device_get((params, state))
        (interop.save_npz if format == "npz" else interop.save_safetensors)(out, *host)


def _input_line(format, layout, image_shape, prep, in_graph, report, from_run, batch="dynamic") -> str:
    """What the exported model takes, for the command's output (``batch``: the export's)."""
    h, w, c = image_shape
    n = batch if isinstance(batch, int) else "N"  # --batch 4 exports a fixed batch of 4
    dims = f"({n}, {h}, {w}, {c})" if layout == "nhwc" else f"({n}, {c}, {h}, {w})"
    where = {"onnx": "its metadata_props 'jaxcnn.preprocessing'",
             "stablehlo": report.get("preprocessing_file")}.get(format)
    if prep is None and from_run:  # an older run directory, not reconstructed for this export
        return ("input: float32, normalised as the network was trained on (the run directory has "
                f"no preprocessing.json; an ONNX or StableHLO export without {arg('preprocessing=False')} "
                "reconstructs it and builds it in)")
    if prep is None:
        return ("input: float32, normalised as the network was trained on (a bare parameter file "
                "records no preprocessing; export the run directory to build it in)")
    if format not in ("onnx", "stablehlo"):
        return (f"the parameters expect inputs preprocessed as {prep.formula}, mean "
                f"{list(prep.mean)}, std {list(prep.std)} (the run's preprocessing.json)")
    lo, hi = prep.pixel_range
    if in_graph:
        return (f"input: raw {prep.pixel_dtype} pixels in [{lo}, {hi}], {layout.upper()} {dims}"
                f"{_resize_note(prep, h, w)}; the model normalises them ({prep.formula}, mean "
                f"{list(prep.mean)}, std {list(prep.std)}); recorded in {where}; "
                f"{arg('preprocessing=False')} leaves it out")
    return (f"input: float32 {layout.upper()} {dims}, already normalised: {prep.formula} of "
            f"{prep.pixel_dtype} pixels in [{lo}, {hi}]{_resize_note(prep, h, w)}, mean "
            f"{list(prep.mean)}, std {list(prep.std)} ({arg('preprocessing=False')}; recorded in {where})")


def _raw_image_line(prep) -> str:
    """What a raw-image ONNX export takes, for the command's output."""
    h, w, c = prep.image_shape
    return (f"input: raw uint8 image of any size (H, W, {c}): resized (shorter side "
            f"{prep.resize_shorter_side}, bilinear antialiased), centre-cropped to {h}x{w} and "
            f"normalised inside ({prep.formula}, mean {list(prep.mean)}, std {list(prep.std)}), as "
            "the run's evaluation does; output (1, classes); recorded in its metadata_props "
            "'jaxcnn.preprocessing'")


def _resize_note(prep, h: int, w: int) -> str:
    """How an image becomes the input's pixels, where the run's evaluation resized and cropped
    (an image folder or records): a model fed images resized straight to the crop sees other
    pixels than it was measured on."""
    if not prep.resize_shorter_side:
        return ""
    return (f", each image first resized ({prep.resize_interpolation}) so that its shorter side is "
            f"{prep.resize_shorter_side} px and centre-cropped to {h}x{w}, as evaluation does "
            "(jaxcnn-predict does it)")

