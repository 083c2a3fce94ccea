"""What the user sees: metrics.jsonl, TensorBoard events and progress output."""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Mapping

import jax
import numpy as np

from jaxcnn.data.files import write_bytes_whole
from jaxcnn.errors import WorkdirError
from jaxcnn.train.rundir import RunDir


def _plain(value):
    """A JSON-friendly Python scalar from a numpy/jax scalar."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/Inf; keep them readable
    return value


class MetricsWriter:
    """Appends one JSON object per record to ``metrics.jsonl`` (and TensorBoard
    events when ``tensorboardX`` is installed and asked for).

    Only the process that should write (process 0) creates one with
    ``enabled=True``; the others get a writer that does nothing.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = False, enabled: bool = True,
                 resumed_at: int | None = None):
        """
        Arguments:
            workdir: the run directory.
            tensorboard: also write TensorBoard events.
            enabled: False on the processes that do not write.
            resumed_at: the step a run restarts from (0 for a fresh start over the file of a
                run killed before its first checkpoint): records of later steps (written by
                the run that was killed before its next checkpoint, and about to be written
                again) and a torn last line are dropped first.
        """
        self.enabled = enabled
        self._tb = None
        self._file = None
        self._at_resume: set[tuple[int, str]] = set()  # (step, kind) already recorded at resumed_at
        if not enabled:
            return
        path = self._path = RunDir(workdir).metrics
        if resumed_at is not None and os.path.exists(path):
            self._at_resume = _truncate_after(path, resumed_at)
        self._file = open(path, "a", encoding="utf-8")
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                print("[jaxcnn] logging.tensorboard is on but tensorboardX is not installed; "
                      "writing metrics.jsonl only", file=sys.stderr)
            else:
                self._tb = SummaryWriter(RunDir(workdir).tensorboard)

    def recorded(self, step: int, kind: str) -> bool:
        """Whether the file already holds a `kind` record of `step`, the step a resumed run
        restarts from (e.g. the final evaluation of a finished run that is run again)."""
        return (int(step), kind) in self._at_resume

    def write(self, step: int, kind: str, values: Mapping):
        if not self.enabled:
            return
        record = {"step": int(step), "kind": kind, "time": round(time.time(), 3)}
        record.update({k: _plain(v) for k, v in values.items()})
        self._append(json.dumps(record) + "\n", step)
        if self._tb is not None:
            for k, v in values.items():
                v = _plain(v)
                if isinstance(v, (int, float)):
                    self._tb.add_scalar(f"{kind}/{k}", v, int(step))

    def _append(self, line: str, step: int) -> None:
        """Writes one whole line or none: a failed write (a full disk) is cut off where the
        file ended, and the run stops with one :class:`WorkdirError` line."""
        end = os.fstat(self._file.fileno()).st_size  # every write is flushed: the file's end
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as e:
            file, self._file = self._file, None
            try:
                file.close()  # flushes what it still holds, or fails to again
            except OSError:
                pass
            try:
                os.truncate(self._path, end)
            except OSError:
                pass  # a resumed run drops a torn last line
            raise WorkdirError(f"cannot write {self._path} ({e.strerror or e}) at step {step}; its "
                               f"earlier records and the checkpoints are kept") from None

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _truncate_after(path: str, step: int) -> set[tuple[int, str]]:
    """Rewrites ``path`` (whole or not at all: `write_bytes_whole`) keeping the records of steps up to ``step``; returns the
    ``(step, kind)`` of the records kept at ``step`` itself."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    kept, at_step = [], set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line torn by a kill
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
            if int(record.get("step", 0)) == step:
                at_step.add((step, str(record.get("kind"))))
    if len(kept) == len(lines):
        return at_step
    write_bytes_whole(path, "".join(kept).encode())
    return at_step


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (or of a run directory).

    A last line without its newline that does not parse is left out: a run killed while
    writing it, or one still running (a resumed run drops it from the file too). Any other line
    that is not a JSON object is a ``ValueError`` naming the file and the line.
    """
    if os.path.isdir(path):
        path = RunDir(path).metrics
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines) and not line.endswith("\n"):
                break  # torn by a kill, or being written
            record = None
        if not isinstance(record, dict):
            raise ValueError(f"{path}: line {number} is not a JSON record")
        records.append(record)
    return records


def format_eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h:d}:{m:02d}:{s:02d}" if h else f"{m:d}:{s:02d}"


def _scale_note(values: Mapping) -> str:
    """`` scale S skipped N`` under loss scaling (scale != 1 or skipped steps), else ``""``."""
    scale, skipped = values.get("loss_scale", 1.0), values.get("skipped", 0)
    if scale == 1.0 and not skipped:
        return ""
    return f"  scale {scale:g}  skipped {skipped}"


class Progress:
    """A progress bar on a terminal (tqdm), one line per log interval otherwise.

    Arguments:
        total_steps: the run's last step.
        start_step: the step training starts (or resumes) from.
        mode: ``"auto"`` (bar on a TTY with tqdm installed, else lines),
            ``"bar"``, ``"lines"`` or ``"none"``.
        enabled: False on processes other than 0.
    """

    def __init__(self, total_steps: int, start_step: int = 0, *, mode: str = "auto",
                 enabled: bool = True, stream=None):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.mode = mode if enabled else "none"
        self._bar = None
        if self.mode in ("auto", "bar"):
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            tty = hasattr(self.stream, "isatty") and self.stream.isatty()
            if tqdm is not None and (self.mode == "bar" or tty):
                self._bar = tqdm(total=total_steps, initial=start_step, file=self.stream,
                                 unit="step", dynamic_ncols=True)
            self.mode = "bar" if self._bar is not None else "lines"

    def update(self, step: int, epoch: float, values: Mapping, *, img_per_s: float,
               step_time: float, eta_s: float):
        if self.mode == "bar":
            self._bar.n = step
            extra = {"scale": f"{values['loss_scale']:g}", "skipped": values["skipped"]} \
                if _scale_note(values) else {}
            self._bar.set_postfix(loss=f"{values['loss']:.4f}", train_acc=f"{values['top1']:.3f}",
                                  img_s=f"{img_per_s:,.0f}", refresh=False, **extra)
            self._bar.refresh()
        elif self.mode == "lines":
            print(f"step {step}/{self.total}  epoch {epoch:.2f}  loss {values['loss']:.4f}  "
                  f"train_acc {values['top1']:.4f}  lr {values['lr']:.3g}  img/s {img_per_s:,.0f}  "
                  f"step {step_time * 1000:.1f} ms  eta {format_eta(eta_s)}{_scale_note(values)}",
                  file=self.stream, flush=True)

    def message(self, text: str):
        if self.mode == "none":
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self):
        if self._bar is not None:
            self._bar.close()
            self._bar = None


# -- the start-up lines ----------------------------------------------------------------------------

_DTYPE_ROLES = {"p": "params", "c": "compute", "o": "output", "m": "master copy"}


def describe_precision(cfg, run) -> str:
    """``precision ...  loss scaling ...`` of the start-up output, in the config's words:
    ``precision fp32``, ``precision bf16 (params f32, compute bf16)``, ``loss scaling off``,
    ``loss scaling dynamic (from 32768)``."""
    dtypes = dict(part.split("=") for part in run.policy.to_string().split(","))
    text = f"precision {cfg.precision.policy}"
    if set(dtypes.values()) != {"f32"}:
        shown = {k: v for k, v in dtypes.items() if k in ("p", "c") or v != dtypes["p"]}
        text += " (" + ", ".join(f"{_DTYPE_ROLES[k]} {v}" for k, v in shown.items()) + ")"
    if cfg.precision.overrides:
        text += " with " + ", ".join(f"{kind} {spec}" for kind, spec in cfg.precision.overrides.items())
    kind = cfg.precision.loss_scale
    if kind == "auto":
        kind = run.policy.default_loss_scale
    scale = f"{cfg.precision.loss_scale_init:g}"
    text += {"none": "  loss scaling off", "static": f"  loss scaling static ({scale})",
             "dynamic": f"  loss scaling dynamic (from {scale})"}[kind]
    return text


def per_class(confusion, names) -> dict:
    """The per-class record of a confusion matrix (rows: true class, columns: top-1
    prediction): each class's ``images``, ``recall`` (its accuracy: the share of its images
    predicted as it) and ``precision`` (the share of the images predicted as it that are it;
    None where no image is), the ``classes`` (``names``) and the ``confusion`` counts."""
    counts = np.rint(np.asarray(confusion, np.float64)).astype(np.int64)
    images, predicted, correct = counts.sum(1), counts.sum(0), np.diag(counts)

    def share(num, den):
        return [None if d == 0 else float(n / d) for n, d in zip(num, den)]
    return {"classes": list(names), "images": images.tolist(), "recall": share(correct, images),
            "precision": share(correct, predicted), "confusion": counts.tolist()}


# Classes up to which the console prints the confusion matrix (the record holds it always).
PRINTED_CONFUSION = 20


def per_class_lines(report: dict) -> list[str]:
    """The console table of :func:`per_class`, and its confusion matrix for a few classes."""
    names = report["classes"]
    width = max(len("class"), *(len(n) for n in names))

    def f(v):
        return "     n/a" if v is None else f"{v:8.4f}"
    lines = [f"{'class':<{width}}  {'images':>7}  {'recall':>8}  {'precision':>9}"]
    lines += [f"{n:<{width}}  {i:>7,}  {f(r)}  {f(p):>9}" for n, i, r, p in
              zip(names, report["images"], report["recall"], report["precision"])]
    if len(names) <= PRINTED_CONFUSION:
        cell = max(5, *(len(f"{c:,}") for row in report["confusion"] for c in row))
        lines.append("confusion (rows: true class, columns: predicted, in the order above)")
        lines += [f"{n:<{width}}  " + " ".join(f"{c:>{cell},}" for c in row)
                  for n, row in zip(names, report["confusion"])]
    return lines


def eval_line(result: dict, num_classes: int) -> str:
    """An evaluation's console text: loss, top-1, top-5 where it says something (more than
    5 classes; with 5 or fewer it is always 1) and the image count."""
    text = f"loss {result['loss']:.4f}  top-1 {result['top1']:.4f}"
    if num_classes > 5:
        text += f"  top-5 {result['top5']:.4f}"
    return text + f"  ({result['count']} images)"


def describe_devices(plan) -> str:
    """The ``devices ...`` start-up line: data parallelism (or one device); the model axis, pipeline
    stages, the spatial split, fsdp and the process count only where used, and with several processes, when a data shard's devices span
    processes (``mesh.order: [pipe]``), how many and which share of every batch each loads."""
    n_data, n_model = plan.mesh.shape["data"], plan.mesh.shape["model"]
    text = f"devices {jax.device_count()} ({jax.default_backend()}): " + (
        "one device" if jax.device_count() == 1 else f"data parallel over {n_data} ({plan.strategy})")
    if n_model > 1:
        text += f", model parallel over {n_model}"
    pipe = getattr(plan, "pipeline", None)
    if pipe is not None:
        text += (f", pipeline over {pipe.stages} stages ({pipe.microbatches} micro-batches, bubble "
                 f"{pipe.bubble_fraction:.0%}; blocks per stage {pipe.split}; schedule {pipe.schedule}"
                 f"{'; one program per stage (mpmd)' if getattr(pipe, 'engine', 'spmd') == 'mpmd' else ''})")
    spatial = getattr(plan, "spatial", None)
    if spatial is not None:
        text += (f", images split along height over {spatial.shards} (through {spatial.gather_after}"
                 f"{', remat' if getattr(plan, 'spatial_remat', False) else ''}"
                 f"{', explicit halos' if getattr(plan, 'spatial_halo', None) == 'explicit' else ''})")
    if plan.fsdp:
        text += ", parameters and optimiser state sharded over the data axis (fsdp)"
    procs = jax.process_count()
    if procs > 1:
        text += f", {procs} processes"
        count = plan.batch_share[1]
        if count != procs:  # another axis spans processes: several load the same rows
            spans = max(len({d.process_index for d in shard.reshape(-1)}) for shard in plan.mesh.devices)
            loads = "the whole batch" if count == 1 else f"1/{count} of every batch"
            text += f" (a data shard's devices span {spans} processes; each process loads {loads})"
    return text
