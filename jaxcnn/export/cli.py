"""``jaxcnn-export``: export a trained run or a parameter file.

    jaxcnn-export runs/mnist_cnn --format onnx --out mnist.onnx   # takes raw uint8 pixels
    jaxcnn-export runs/mnist_cnn --format stablehlo --quantize int8 --out mnist_int8.stablehlo
    jaxcnn-export weights.npz --model resnet18 --model-option cifar_stem=true \\
        --input-shape 32,32,3 --format onnx --fold-bn --layout nchw --out r18.onnx

    jaxcnn-export runs/mnist_cnn --format onnx --prune 0.5 --fine-tune-steps 100 \\
        --out mnist_sparse.onnx      # fine-tunes with jaxcnn-train's loop in mnist_sparse_finetune/

Exports of a run directory take raw pixels (``uint8`` 0-255 as the data loaders give
them, float32 0-1 for float datasets) and normalise them inside as the trainer did (the
run's ``preprocessing.json``); ``--no-preprocessing`` exports the bare network, which takes
normalised float32 input. The normalisation is recorded either way (ONNX metadata_props
``jaxcnn.preprocessing``; StableHLO: ``OUT.preprocessing.json``) and printed.
``--raw-image`` (ONNX, a run on an image folder or records): the model takes one raw
``uint8`` image ``(H, W, 3)`` of any size and resizes and centre-crops it inside too, as
the run's evaluation does.

Bad input (a run directory without parameters, a corrupt parameter file, a
layer ONNX export does not support) ends with exit code 2 and one line on
stderr; no traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import yaml

from jaxcnn._cli import EXIT_BAD_INPUT


def _batch(text: str):
    if text == "dynamic":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int or 'dynamic', got {text!r}")
    return value


def _shape(text: str):
    try:
        dims = tuple(int(d) for d in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) != 3 or min(dims) < 1:
        raise argparse.ArgumentTypeError(f"expected H,W,C (three positive ints), got {text!r}")
    return dims


def _option(text: str):
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or type(e).__name__
        raise argparse.ArgumentTypeError(
            f"option {key!r}: value {value!r} is not valid YAML ({problem})") from None


def _positive(text: str):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def _sparsity(text: str):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 <= value < 1.0:  # NaN too
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1), got {text!r}")
    return value


def _positive_float(text: str):
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0.0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def parser() -> argparse.ArgumentParser:
    """The ``jaxcnn-export`` argument parser."""
    from jaxcnn._cli import OneLineParser, path_arg
    p = OneLineParser(
        prog="jaxcnn-export",
        description="Export a jaxcnn run directory (or a .npz/.safetensors parameter file "
                    "with --model) to StableHLO, ONNX, npz or safetensors, optionally pruned, "
                    "BatchNorm-folded or int8-quantised.")
    p.add_argument("source", type=path_arg, metavar="RUN_DIR_OR_PARAMS",
                   help="a run directory written by jaxcnn-train, or a .npz/.safetensors parameter "
                        "file (then --model NAME)")
    p.add_argument("--format", required=True, choices=("stablehlo", "onnx", "npz", "safetensors"),
                   help="stablehlo (jax.export, parameters inside), onnx (onnxruntime), or the "
                        "parameters alone as npz or safetensors")
    p.add_argument("--out", type=path_arg, required=True,
                   help="output file (not a directory; npz output gets '.npz' appended "
                        "when missing)")
    p.add_argument("--model", default=None, help="zoo model name (required with a parameter file)")
    p.add_argument("--num-classes", type=_positive, default=None,
                   help="classifier width (default: the run's, else read from the parameters)")
    p.add_argument("--model-option", type=_option, action="append", default=[],
                   metavar="KEY=VALUE", help="model option, e.g. cifar_stem=true (repeatable)")
    p.add_argument("--input-shape", type=_shape, default=None, metavar="H,W,C",
                   help="image shape (default: the run's data, else the model's usual input)")
    p.add_argument("--batch", type=_batch, default="dynamic",
                   help="batch size N, or 'dynamic' (default) for a symbolic batch")
    p.add_argument("--layout", choices=("nhwc", "nchw"), default="nhwc",
                   help="input layout of the exported model (default nhwc)")
    p.add_argument("--fold-bn", action="store_true", help="fold BatchNorm into the conv before it")
    p.add_argument("--quantize", choices=("int8",), default=None,
                   help="post-training int8 quantisation (needs a run directory for calibration)")
    p.add_argument("--calibration-batches", type=_positive, default=4,
                   help="training batches used to calibrate activation ranges (default 4)")
    p.add_argument("--prune", type=_sparsity, default=None, metavar="SPARSITY",
                   help="magnitude-prune this fraction of the conv/linear weights")
    p.add_argument("--prune-scope", choices=("global", "layer"), default="global",
                   help="with --prune: the smallest weights of the whole model (global, default) "
                        "or the same fraction of each layer")
    p.add_argument("--prune-structure", choices=("unstructured", "channel"), default="unstructured",
                   help="with --prune: single weights (default) or whole output channels")
    p.add_argument("--fine-tune-steps", type=_positive, default=0,
                   help="after --prune, fine-tune this many steps with the trainer, pruned "
                        "weights held at zero (run directory only)")
    p.add_argument("--fine-tune-lr", type=_positive_float, default=None,
                   help="fine-tuning peak learning rate (default: the run's / 10)")
    p.add_argument("--fine-tune-dir", type=path_arg, default=None,
                   help="the fine-tune's run directory (default: OUT without its extension "
                        "+ '_finetune')")
    p.add_argument("--no-preprocessing", dest="preprocessing", action="store_false",
                   help="leave the run's input normalisation out of a StableHLO/ONNX export: "
                        "it then takes normalised float32 inputs instead of raw pixels (uint8 "
                        "0-255, or float 0-1 for float datasets); the normalisation is still "
                        "recorded in its metadata")
    p.add_argument("--raw-image", action="store_true",
                   help="ONNX of a run on an image folder or records: the model takes one raw uint8 "
                        "image (H, W, 3) of any size and resizes, centre-crops and normalises it "
                        "inside as the run's evaluation does (opset 18)")
    p.add_argument("--opset", type=int, default=None,
                   help="ONNX opset (>= 17; default 17, 18 with --raw-image)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    return p


def main(argv=None) -> int:
    """Entry point of ``jaxcnn-export``; returns the exit code."""
    from jaxcnn import cpu
    cpu.configure()  # before JAX starts: jaxcnn's XLA:CPU flag and malloc policy
    args = parser().parse_args(argv)
    from jaxcnn.export._args import command_line_flags
    from jaxcnn.export.pipeline import export
    from jaxcnn.train.checkpoint import CheckpointError
    from jaxcnn.errors import TrainingStopped
    log = None if args.json else print
    try:
        with command_line_flags():  # errors name --model, --out..., not the Python arguments
            report = export(
                args.source, args.out, format=args.format, model=args.model,
                num_classes=args.num_classes, model_options=dict(args.model_option),
                image_shape=args.input_shape, batch=args.batch, layout=args.layout,
                fold_bn=args.fold_bn, quantize=args.quantize,
                calibration_count=args.calibration_batches, prune=args.prune,
                prune_scope=args.prune_scope, prune_structure=args.prune_structure,
                fine_tune_steps=args.fine_tune_steps, fine_tune_lr=args.fine_tune_lr,
                fine_tune_dir=args.fine_tune_dir, opset=args.opset,
                preprocessing=args.preprocessing, raw_image=args.raw_image, log=log,
                train_stream=sys.stderr if args.json else sys.stdout)
    except (ValueError, OSError, CheckpointError) as e:  # ExportError, ConfigError, DataError, files
        message = " ".join(str(e).split())  # one line, even for multi-line messages
        if os.path.isdir(args.source):  # a run directory started elsewhere: say where
            from jaxcnn.train.rundir import RunDir
            message = RunDir(args.source).explain_missing_path(message)
        print(f"jaxcnn-export: error: {message}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except TrainingStopped as e:  # the fine-tune hit a non-finite loss
        print(f"jaxcnn-export: stopped: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        from jaxcnn.train.cli import interrupted
        return interrupted("jaxcnn-export", argv is None)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
