"""The pieces the run function's loop calls (:func:`jaxcnn.train.run.train`): evaluation
(`evaluate`, `evaluate_state`), the training batches (`train_batches`), a log record (`log`),
a checkpoint save (`save`) and the checks around them (`check_finite`, `stop_for_dead_worker`,
`EarlyStopping`, `StopSignal`), and the lines a run prints before its first step
(`startup_lines`). Each takes what it reads as arguments; the run's state stays the run
function's.
"""
from __future__ import annotations

import math
import os
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcnn.data import Prefetcher, eval_batches, preprocessing
from jaxcnn.errors import DataError, DataWorkerDied, TrainingStopped
from jaxcnn.train._data import (TrainInput, batch_fn, eval_batch_size, eval_image_batches, eval_set_size,
                                process_share)
from jaxcnn.train.config import resolve_duration, set_but_unused, to_dict
from jaxcnn.train.ema import eval_params
from jaxcnn.train.metrics import (describe_devices, describe_precision, per_class as per_class_report,
                                  read_metrics)
from jaxcnn.train.resume import check_resume_data

# How many skipped bad images a run names in its output (it counts them all).
NAMED_BAD_IMAGES = 20


def _eval_inputs(run, bad: list, share=None):
    """The test set's batches, each example once (this process's rows of each: ``share``, see
    `jaxcnn.train._data.process_share`); an image source's bad images (skipped, their
    rows masked out) are appended to ``bad``."""
    cfg, share = run.cfg, process_share(share)
    if run.images is not None:
        for batch, files in eval_image_batches(run.images, eval_batch_size(run), workers=cfg.data.workers,
                                               **share):
            bad.extend(files)
            yield batch
        return
    mean, std = (run.dataset.mean, run.dataset.std) if cfg.data.normalize else (None, None)
    yield from eval_batches(run.dataset.x_test, run.dataset.y_test, eval_batch_size(run), mean=mean, std=std,
                            **share)


def class_names(run) -> list[str]:
    """A name per model output: the data's (an image folder's class folders, MNIST's digits,
    CIFAR-10's words), else the output's index."""
    names = preprocessing.from_run(run).class_names or ()
    return [str(names[i]) if i < len(names) else str(i) for i in range(run.num_classes)]


def evaluate(run, eval_step, params, model_state, *, share=None, per_class=False) -> dict:
    """Loss, top-1 and top-5 over the whole test set (nothing dropped; for an image source,
    ``bad_images`` counts the validation images skipped). ``eval_step`` gets this process's rows
    of each batch: ``share`` (``plan.batch_share``), by default this process's of all. With
    ``per_class`` (and a step that counts the confusion matrix) also ``per_class``:
    :func:`jaxcnn.train.metrics.per_class` with the run's class names."""
    if eval_set_size(run) is None:
        return {}
    totals, bad = None, []
    for batch in _eval_inputs(run, bad, share):
        sums = eval_step(params, model_state, batch)
        totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    if totals is None:
        return {}
    totals = jax.device_get(totals)
    count = max(float(totals["count"]), 1.0)
    result = {"loss": float(totals["loss_sum"]) / count, "top1": float(totals["top1_sum"]) / count,
              "top5": float(totals["top5_sum"]) / count, "count": int(totals["count"])}
    if run.images is not None:
        result["bad_images"] = len(bad)
    if per_class and "confusion" in totals:
        result["per_class"] = per_class_report(totals["confusion"], class_names(run))
    return result


def changes_on_any_process(changes: list[str]) -> list[str]:
    """``changes`` (this process's view of its data, `ImageData.changes_since_opened`), or when
    only another process of a multi-process run saw a change, a phrase naming it: every
    process stops before the evaluation's collectives, where one alone would leave the others
    waiting until they took it for a lost peer. A collective: every process calls it."""
    if jax.process_count() == 1:
        return changes
    from jax.experimental import multihost_utils
    seen = np.asarray(multihost_utils.process_allgather(np.int32(bool(changes)))).reshape(-1)
    if changes or not seen.any():
        return changes
    return [f"process {int(np.argmax(seen))} of {seen.size} saw them change"]


class StopSignal:
    """Turns SIGTERM/SIGINT into a flag read at the next step boundary."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def summarise(history: list[dict]) -> dict:
    """Mean loss/top-1 over the interval; last value of the rest."""
    out = {k: float(np.mean([h[k] for h in history])) for k in ("loss", "top1", "grad_norm")}
    last = history[-1]
    out.update(lr=float(last["lr"]), loss_scale=float(last["loss_scale"]),
               skipped=int(last["skipped"]))
    return out


# The run's stopped_by when early stopping ended it: it then finishes as at the end
EARLY_STOP = "early_stopping"


class EarlyStopping:
    """``train.early_stopping``: stop after ``patience`` evaluations in a row without the
    metric improving on the best so far by more than ``min_delta``."""

    def __init__(self, metric: str, patience: int, min_delta: float):
        self.metric, self.patience, self.min_delta = metric, patience, min_delta
        self.best, self.bad = None, 0

    def update(self, result: dict) -> bool:
        """Record one evaluation; True when the run should stop."""
        value = float(result[self.metric])
        lower = self.metric == "loss"
        if self.best is None or (value < self.best - self.min_delta if lower
                                 else value > self.best + self.min_delta):
            self.best, self.bad = value, 0
        else:
            self.bad += 1
        return self.bad >= self.patience

    @property
    def stopped(self) -> bool:
        return self.bad >= self.patience

    def replay(self, records: list[dict], upto: int) -> None:
        """The evaluations a resumed run already made (metrics.jsonl, steps <= ``upto``), so a
        resume stops where the uninterrupted run would."""
        for record in records:
            if record.get("kind") == "eval" and record["step"] <= upto and self.metric in record:
                self.update(record)


def data_changes(cfg, run_dir, run) -> list[str]:
    """``"data: ..."`` for each way a resumed run's image data changed (`check_resume_data`)."""
    if run.images is None:
        return []
    changes = check_resume_data(run_dir.path, run.images.fingerprint(),
                                resume=cfg.checkpoint.resume if cfg.checkpoint.enabled else "never",
                                on_change=cfg.checkpoint.on_config_change)
    return [f"data: {c}" for c in changes]


def startup_lines(cfg, run, plan, eval_size: int, workdir: str, prepare_s: float) -> list[str]:
    """What ``jaxcnn-train`` prints before its first step."""
    if run.images is not None:
        data = (f"{len(run.images.train)} train / {len(run.images.val)} val images, {run.images.num_classes} "
                f"classes, {cfg.data.workers} workers")
    else:
        data = ("synthetic" if run.dataset is None
                else f"{len(run.dataset.x_train)} train / {len(run.dataset.x_test)} test")
    lines = [f"model {cfg.model.name}  data {cfg.data.source} ({data})  batch {cfg.data.batch_size}  "
             f"steps {run.total_steps} ({run.steps_per_epoch}/epoch)",
             f"{describe_precision(cfg, run)}  optimiser {cfg.optim.name} lr {cfg.optim.lr:g} "
             f"({cfg.optim.schedule.name})  workdir {workdir}",
             describe_devices(plan),
             f"model, data and compiled steps ready in {prepare_s:.1f} s"]
    if cfg.data.eval_batch_size and eval_size < cfg.data.eval_batch_size:
        lines.append(f"data.eval_batch_size {cfg.data.eval_batch_size} clipped to the "
                     f"{eval_set_size(run)} test images: eval batch {eval_size}")
    if run.images is not None and run.images.split_note() is not None:
        lines.append(run.images.split_note())
    if run.images is not None and run.images.skipped_note() is not None:
        lines.append(run.images.skipped_note())
    lines.extend(unused_settings_lines(cfg))
    return lines


def unused_settings_lines(cfg) -> list[str]:
    """One line naming the settings this config's choices leave unused (it dropped them without
    a word: ``data.image_size`` set for ``npz`` data trained at the stored size)."""
    unused = set_but_unused(cfg)
    return [f"not applied: {'; '.join(unused)}"] if unused else []


def say(stream, text: str) -> None:
    """``[jaxcnn] text`` on ``stream``, from the main process only."""
    if jax.process_index() == 0:
        print(f"[jaxcnn] {text}", file=stream, flush=True)


def every(cfg, key: str, steps_per_epoch: int):
    """A cadence key (``train.eval_every`` ...) in steps, or None when unset."""
    section, name = key.split(".")
    value = cfg[section][name]
    return resolve_duration(value, steps_per_epoch, key=key) if value is not None else None


def early_stopping(cfg, metrics_path: str, start: int):
    """``train.early_stopping``'s `EarlyStopping`, or None when it is off; a resumed run
    (``start > 0``) first replays the evaluations ``metrics_path`` recorded up to ``start``."""
    es = cfg.train.early_stopping
    if es.patience is None:
        return None
    stopper = EarlyStopping(es.metric, es.patience, es.min_delta)
    if start > 0 and os.path.isfile(metrics_path):
        stopper.replay(read_metrics(metrics_path), start)
    return stopper


def train_batches(cfg, run, plan, start: int):
    """Placed batches for steps ``start ...``, prefetched on a thread (``data.prefetch``) or made
    in turn, each with the messages of the bad images skipped in it (an image source's; none
    for the others), for the loop to count as it consumes the batch.

    Returns:
        ``(iterator of (batch, bad), close)``.
    """
    put = plan.put_batch
    if run.images is None:
        make_batch = batch_fn(run, plan.batch_share)
        if cfg.data.prefetch:
            prefetch = Prefetcher(make_batch, size=max(1, cfg.data.prefetch), start=start,
                                  stop=run.total_steps, device_put=put)
            return ((batch, ()) for batch in prefetch), prefetch.close
        return ((put(make_batch(s)), ()) for s in range(start, run.total_steps)), lambda: None
    # made by data.workers grain processes
    source = TrainInput(run.images, seed=run.data_seed, batch_size=cfg.data.batch_size, start=start,
                        stop=run.total_steps, workers=cfg.data.workers, **process_share(plan.batch_share))
    if cfg.data.prefetch:
        prefetch = Prefetcher(source, size=max(1, cfg.data.prefetch),
                              device_put=lambda item: (put(item[0]), item[1]))
        return iter(prefetch), lambda: [close() for close in (prefetch.close, source.close)]
    return ((put(arrays), bad) for arrays, bad in source), source.close


def evaluate_state(run, eval_step, plan, state, per_class: bool = False) -> dict:
    """The eval metrics of the parameters the run exports (their moving average with
    ``train.ema_decay``), with ``per_class`` also the per-class report (`evaluate`; ``eval_step``
    the plan's wrapped one). Data changed under the run (records converted again, images of a
    folder's ``val`` split added, removed or renamed: `ImageData.changes_since_opened`) stop it
    first, naming the change, rather than changing its validation data silently."""
    images = run.images
    if images is not None and (changes := changes_on_any_process(images.changes_since_opened())):
        raise DataError(f"{images.path}: the data changed while the run trained ({'; '.join(changes)}); "
                        f"stopped before evaluating on them; the checkpoints are kept")
    return evaluate(run, lambda p, s, batch: eval_step(p, s, plan.put_eval_batch(batch)),
                    eval_params(state, run.policy), state.state, share=plan.batch_share, per_class=per_class)


def check_finite(cfg, history: list, done: int, manager) -> list:
    """``history`` (the step metrics since the last log, ending at step ``done``) on the host.
    Raises ``TrainingStopped`` (``nan_policy: stop``) at the first non-finite loss among them,
    naming the last good checkpoint of ``manager`` (None: checkpoints off)."""
    history = jax.device_get(history)
    bad = [i for i, h in enumerate(history) if not math.isfinite(float(h["loss"]))]
    if bad and cfg.train.nan_policy == "stop":
        first = done - len(history) + bad[0] + 1
        last_ckpt = manager.latest_step() if manager is not None else None
        where = "none" if last_ckpt is None else os.path.join(manager.directory, str(last_ckpt))
        raise TrainingStopped(f"non-finite loss at step {first}; train.nan_policy is 'stop'; "
                              f"last good checkpoint: {where}")
    return history


def log(cfg, run, metrics, progress, history: list, timer, first_step_s: float, bad_images: int,
        done: int) -> None:
    """One ``train`` record (metrics.jsonl, TensorBoard, progress) for the steps since the last:
    ``history`` their metrics on the host (`check_finite`), ``timer`` ``[interval start, steps
    timed in it]``, ``bad_images`` the images skipped so far (an image source's)."""
    start, steps = timer
    # A log right after the first step (logging.log_every: 1, a 1-step run) has no step
    # timed after it: that step's own time (it printed NaN, written as "nan" strings).
    step_time = (time.perf_counter() - start) / steps if steps else first_step_s
    img_s = cfg.data.batch_size / max(step_time, 1e-9)
    values = summarise(history)
    values.update(epoch=done / run.steps_per_epoch, img_per_s=img_s, step_time_ms=step_time * 1000)
    if run.images is not None:  # running total of the images skipped (data.on_bad_image: skip)
        values["bad_images"] = bad_images
    eta = (run.total_steps - done) * step_time
    metrics.write(done, "train", values)
    progress.update(done, done / run.steps_per_epoch, values, img_per_s=img_s, step_time=step_time, eta_s=eta)


def save(cfg, manager, progress, history: list, state, step: int, eval_metrics=None) -> None:
    """Checkpoint ``state`` at ``step`` (nothing without a ``manager``: checkpoints off), once
    its unlogged ``history`` is checked finite (`check_finite`); a finished run resumed saves
    nothing (this state is its checkpoint). A save that failed under ``checkpoint.on_error:
    warn`` is one warning line."""
    if manager is None:
        return
    check_finite(cfg, history, step, manager)
    if manager.latest_step() == step:
        return
    ok = manager.save(step, state, config_dict=to_dict(cfg),
                      metrics={"eval/top1": eval_metrics["top1"]} if eval_metrics else None)
    if not ok:
        progress.message(f"[jaxcnn] warning: checkpoint at step {step} was not saved")


def stop_for_dead_worker(err: RuntimeError, done: int, manager, save_now) -> None:
    """For a data worker that died (`DataWorkerDied`): saves the state after step ``done``
    (``save_now()``) and raises the error again, saying so and at which step; any other error
    is left as is. In a multi-process run nothing is saved: the save waits for every process at
    a barrier, and the others wait in the next step's collective (they see this process lost)."""
    if not isinstance(err, DataWorkerDied):
        return
    if jax.process_count() > 1:
        saved = (f"stopped after step {done} in process {jax.process_index()} of "
                 f"{jax.process_count()}, no checkpoint (the other processes cannot join its save)")
    elif manager is None:
        saved = f"stopped after step {done}, no checkpoint (checkpoint.enabled: false)"
    else:
        save_now()
        saved = f"checkpoint saved at step {done}"
    raise DataWorkerDied(f"{err}; {saved}") from None
