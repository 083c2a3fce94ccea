"""``jaxcnn-plot RUN_DIR``: a PNG of a run's loss and accuracy curves."""
from __future__ import annotations

import argparse
import os
import sys

from jaxcnn.train.metrics import read_metrics


def plot_run(run_dir: str, out: str | None = None) -> str:
    """Write ``RUN_DIR/curves.png`` (or ``out``) from ``metrics.jsonl``; return its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
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
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jaxcnn-plot", description=__doc__)
    parser.add_argument("run_dir")
    parser.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    from jaxcnn.train.rundir import RunDir
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
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
