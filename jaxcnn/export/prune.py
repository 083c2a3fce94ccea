"""Fine-tuning a pruned run through the trainer; the pruning itself lives in
:mod:`jaxcnn.train.prune` (training owns pruning and masks) and is re-exported here.
"""
from __future__ import annotations

import os

from jaxcnn.errors import ExportError
from jaxcnn.export._args import on_command_line
from jaxcnn.train.prune import (PRUNABLE, PruneMask, apply_masks, keep_tree,  # noqa: F401  (re-exported)
                                magnitude_prune, mask_updates, prunable_layers, sparsity_report,
                                with_keep)


def fine_tune(run_dir, workdir, *, sparsity: float, steps: int, scope: str = "global",
              structure: str = "unstructured", lr: float | None = None, stream=None) -> dict:
    """Prune a trained run and fine-tune it with the trainer.

    The run's resolved config is reused with ``model.init_from`` set to the
    run, ``prune.{amount,scope,structure}`` to the arguments, ``train.steps``
    to ``steps`` (the learning-rate schedule spans the fine-tune) and
    ``optim.lr`` to ``lr``; :func:`jaxcnn.train.run.train` then prunes the
    run's parameters exactly as :func:`magnitude_prune` does and trains with
    pruned weights held at zero, with the trainer's data pipeline, logging,
    evaluation, checkpoints and parallel plan.

    Arguments:
        run_dir: a finished ``jaxcnn-train`` run directory.
        workdir: the fine-tune's run directory: new or empty, or holding the
            same fine-tune (which then resumes, or only re-evaluates when finished).
        sparsity, scope, structure: as :func:`magnitude_prune`.
        steps: optimiser steps (>= 1).
        lr: peak learning rate; default: the run's ``optim.lr`` / 10.
        stream: where the trainer prints (default ``sys.stdout``).

    Returns:
        The trainer's final metrics (``loss``, ``top1``, ``top5``, ``count``,
        ``step``; none of the first four for per-step synthetic data); the
        fine-tuned parameters are in ``workdir``.
    """
    from jaxcnn.train.config import config_from_dict, load_config, to_dict
    from jaxcnn.train.run import train
    from jaxcnn.train.rundir import RunDir

    if not isinstance(steps, int) or steps < 1:
        raise ExportError(f"fine-tune steps must be an int >= 1, got {steps!r}")
    cfg_path = RunDir(run_dir).config
    if not os.path.isfile(cfg_path):
        raise ExportError(f"{cfg_path} does not exist: fine-tuning needs a jaxcnn run directory")
    workdir = os.fspath(workdir)
    raw = to_dict(load_config(cfg_path))
    raw["model"]["init_from"] = os.path.abspath(run_dir)
    raw["prune"] = {"amount": sparsity, "scope": scope, "structure": structure}
    raw["train"].update(steps=steps, epochs=None)
    raw["optim"]["lr"] = lr if lr is not None else raw["optim"]["lr"] / 10
    raw["checkpoint"]["resume"] = "auto"
    raw["logging"]["workdir"] = os.path.abspath(workdir)
    cfg = config_from_dict(raw, source=f"fine-tune of {run_dir}")
    if os.path.isdir(workdir) and os.listdir(workdir):
        previous = RunDir(workdir).config
        if not os.path.isfile(previous) or load_config(previous) != cfg:
            other_dir = ("--fine-tune-dir DIR" if on_command_line()
                         else "export's fine_tune_dir, fine_tune's workdir")
            raise ExportError(f"{workdir} is not empty and does not hold this fine-tune; remove it "
                              f"or give another directory ({other_dir})")
    return train(cfg, workdir, stream=stream)
