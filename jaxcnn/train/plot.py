"""``jaxcnn-plot RUN_DIR``: a PNG of a run's loss and accuracy curves, and of its final
evaluation's confusion matrix where ``metrics.jsonl`` holds one."""
from __future__ import annotations

import os
import sys

from jaxcnn.train.metrics import read_metrics
from jaxcnn.train.rundir import RunDir


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write ``RUN_DIR/curves.png`` (or ``out``) from ``metrics.jsonl``; return its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train" and "loss" in r and "top1" in r]
    evals = [r for r in records if r.get("kind") == "eval" and "loss" in r and "top1" in r]
    if not train and not evals:
        raise ValueError(f"{RunDir(run_dir).metrics} holds no training or evaluation records yet "
                         "(the first comes at step logging.log_every)")
    per_class = [r for r in records if r.get("kind") == "per_class" and "confusion" in r]
    fig, axes = plt.subplots(1, 3 if per_class else 2, figsize=(16 if per_class else 11, 4))
    ax_loss, ax_acc = axes[:2]
    ax_loss.plot([r["step"] for r in train], [float(r["loss"]) for r in train], label="train")
    if evals:
        ax_loss.plot([r["step"] for r in evals], [float(r["loss"]) for r in evals], "o-", label="eval")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    ax_loss.legend()
    ax_acc.plot([r["step"] for r in train], [float(r["top1"]) for r in train], label="train top-1")
    if evals:
        ax_acc.plot([r["step"] for r in evals], [float(r["top1"]) for r in evals], "o-",
                    label="eval top-1")
    ax_acc.set(xlabel="step", ylabel="accuracy", title="accuracy")
    ax_acc.legend()
    if per_class:
        _confusion(axes[2], per_class[-1])
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# Classes up to which the confusion matrix's axes name each class.
NAMED_CLASSES = 30


def _confusion(ax, record: dict) -> None:
    """The confusion matrix of a ``per_class`` record, each row as shares of its class's images."""
    import numpy as np
    counts = np.asarray(record["confusion"], np.float64)
    shares = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    image = ax.imshow(shares, vmin=0, vmax=1, cmap="Blues")
    ax.figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    names = record["classes"]
    if len(names) <= NAMED_CLASSES:
        ax.set_xticks(range(len(names)), names, rotation=90)
        ax.set_yticks(range(len(names)), names)
    ax.set(xlabel="predicted", ylabel="true class", title=f"confusion at step {record['step']}")


def _check_out(out: str) -> None:
    """A ``ValueError`` naming ``--out`` when matplotlib cannot write it (before any plotting)."""
    from matplotlib.backend_bases import FigureCanvasBase
    kinds = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1].lstrip(".").lower()
    if ext not in kinds:
        what = f"unknown image type '.{ext}'" if ext else "no file extension"
        raise ValueError(f"--out {out!r}: {what}; use one of {', '.join('.' + k for k in sorted(kinds))}")
    parent = os.path.dirname(out) or "."
    if not os.path.isdir(parent):
        raise ValueError(f"--out {out!r}: directory {parent!r} does not exist")


def main(argv=None) -> int:
    from jaxcnn._cli import OneLineParser, path_arg
    parser = OneLineParser(prog="jaxcnn-plot",
                           description="Draw a run's training and evaluation loss and top-1 accuracy "
                                       "curves, and its final evaluation's confusion matrix, from its "
                                       "metrics.jsonl into a PNG (needs matplotlib).")
    parser.add_argument("run_dir", type=path_arg, help="a run directory written by jaxcnn-train (finished or running)")
    parser.add_argument("--out", type=path_arg, default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    path = RunDir(args.run_dir).metrics
    if not os.path.isfile(path):
        print(f"jaxcnn-plot: error: {path} does not exist", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("jaxcnn-plot: error: matplotlib is not installed (pip install 'jaxcnn[plot]')",
              file=sys.stderr)
        return 2
    try:
        if args.out is not None:
            _check_out(args.out)
        print(plot_run(args.run_dir, args.out))
    except (ValueError, OSError) as e:
        print(f"jaxcnn-plot: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
