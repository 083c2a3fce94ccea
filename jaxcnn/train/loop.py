"""The training loop: one run, start to finish, as named steps.

:func:`train` reads top to bottom as what a run does:

1. :func:`start` joins the other processes, checks that resuming would not change how the
   run trains, builds and checks everything (:func:`jaxcnn.train.setup.prepare`: data, model,
   mesh, compiled steps, memory) and writes the run directory's records;
2. :meth:`Training.restore_or_init` resumes from the newest good checkpoint, or creates the
   first state (``model.init_from``, pruning);
3. :meth:`Training.run_steps` calls the pure ``train_step(state, batch)`` once per step, and
   at its cadence logs, evaluates and checkpoints (:meth:`Training.after_step`);
4. :meth:`Training.finish` evaluates, checkpoints and writes the final parameters.

The run directory's files are named in :class:`jaxcnn.train.rundir.RunDir`.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxcnn import interop, parallel
from jaxcnn.data import Prefetcher, eval_batches, preprocessing
from jaxcnn.errors import ConfigError, DataError, DataWorkerDied, TrainingStopped, WorkdirError
from jaxcnn.train import prune
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.resume import (check_fresh_start, check_resume_config, check_resume_data, record_run_config,
                                 restore_for_resume)
from jaxcnn.train.config import (Config, config_from_dict, load_config, resolve_duration, set_but_unused,
                                 to_dict, with_overrides)
from jaxcnn.train.ema import eval_params
from jaxcnn.train.image_input import TrainInput, eval_image_batches
from jaxcnn.train.metrics import (MetricsWriter, Progress, describe_devices, describe_precision,
                                  eval_line, per_class as per_class_report, read_metrics)
from jaxcnn.train.rundir import RunDir, check_workdir, default_workdir
from jaxcnn.train.setup import (Prepared, Run, batch_fn, eval_batch_size, init_state, initial_params,
                                eval_set_size, matmul_precision, parallel_config_errors, prepare,
                                process_share)

__all__ = ["train", "evaluate", "start", "Training", "TrainingStopped"]


def _eval_inputs(run: Run, bad: list, share=None):
    """The test set's batches, each example once (this process's rows of each: ``share``, see
    :func:`jaxcnn.train.setup.process_share`); an image source's bad images (skipped, their
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


def class_names(run: Run) -> list[str]:
    """A name per model output: the data's (an image folder's class folders, MNIST's digits,
    CIFAR-10's words), else the output's index."""
    names = preprocessing.from_run(run).class_names or ()
    return [str(names[i]) if i < len(names) else str(i) for i in range(run.num_classes)]


def evaluate(run: Run, eval_step, params, model_state, *, share=None, per_class=False) -> dict:
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


class _StopSignal:
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


def _summarise(history: list[dict]) -> dict:
    """Mean loss/top-1 over the interval; last value of the rest."""
    out = {k: float(np.mean([h[k] for h in history])) for k in ("loss", "top1", "grad_norm")}
    last = history[-1]
    out.update(lr=float(last["lr"]), loss_scale=float(last["loss_scale"]),
               skipped=int(last["skipped"]))
    return out


# run_steps' answer when early stopping ended the run: it then finishes as at the end
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


# The run directories this process trains in, each with its lock file held open (see RunDir.lock).
_LOCKS: dict = {}


def start(cfg, run_dir: RunDir, *, argv=None, config_path=None) -> tuple[Prepared, list[str], float]:
    """Everything before the first state exists.

    Joins the other processes (``distributed``), refuses to resume under settings that train
    differently (unless ``checkpoint.on_config_change`` is "continue"), builds and checks the
    run (:func:`prepare`: the same mesh, plan, steps and size checks as ``--dry-run``; the steps
    are compiled here). ``run_meta.json`` and ``preprocessing.json`` are written by
    :func:`record_start` once the state is restored or created: a refused resume changes neither.

    Returns:
        ``(prepared, config_changes, seconds prepare took)``.
    """
    with parallel_config_errors():
        d = cfg.distributed  # before anything touches a device
        parallel.initialize(d.mode, coordinator_address=d.coordinator_address, num_processes=d.num_processes,
                            process_id=d.process_id, timeout_s=d.timeout_s)
    if not cfg.checkpoint.enabled or cfg.checkpoint.resume == "never":  # a new run: it must replace nothing
        check_fresh_start(run_dir.path, to_dict(cfg), why="checkpoint.enabled=false" if not cfg.checkpoint.enabled
                          else "checkpoint.resume=never")
    changes = check_resume_config(
        run_dir.path, to_dict(cfg), resume=cfg.checkpoint.resume if cfg.checkpoint.enabled else "never",
        on_change=cfg.checkpoint.on_config_change)
    t0 = time.perf_counter()
    prepared = prepare(cfg, check_run=lambda run: changes.extend(_data_changes(cfg, run_dir, run)))
    prepare_s = time.perf_counter() - t0
    os.makedirs(run_dir.path, exist_ok=True)
    key = os.path.realpath(run_dir.path)
    if jax.process_index() == 0 and key not in _LOCKS:  # one trainer per run directory
        _LOCKS[key] = run_dir.lock()
    return prepared, changes, prepare_s


def _unlock(run_dir: RunDir) -> None:
    lock = _LOCKS.pop(os.path.realpath(run_dir.path), None)
    if lock is not None:
        lock.close()


def _data_changes(cfg, run_dir: RunDir, run) -> list[str]:
    """``"data: ..."`` for each way a resumed run's image data changed (`check_resume_data`)."""
    if run.images is None:
        return []
    changes = check_resume_data(run_dir.path, run.images.fingerprint(),
                                resume=cfg.checkpoint.resume if cfg.checkpoint.enabled else "never",
                                on_change=cfg.checkpoint.on_config_change)
    return [f"data: {c}" for c in changes]


def record_start(cfg, run_dir: RunDir, prepared: Prepared, first: int, changes, *, argv, config_path) -> None:
    """After the resume decision (a refused resume leaves the run directory as it was): the
    config (``config.resolved.yaml``, earlier ones kept in ``config_history/``),
    ``run_meta.json`` and ``preprocessing.json`` (what the model expects: ``jaxcnn-eval``,
    ``-export`` and ``-predict`` read it)."""
    if jax.process_index() != 0:
        return
    record_run_config(run_dir.path, to_dict(cfg), first, changes)
    run = prepared.run
    run_dir.write_meta(argv, config_path, data=None if run.images is None else run.images.fingerprint())
    preprocessing.write_preprocessing(run_dir.preprocessing, preprocessing.from_run(prepared.run))


def startup_lines(cfg, prepared: Prepared, workdir: str, prepare_s: float) -> list[str]:
    """What ``jaxcnn-train`` prints before its first step."""
    run = prepared.run
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
             describe_devices(prepared.plan),
             f"model, data and compiled steps ready in {prepare_s:.1f} s"]
    if cfg.data.eval_batch_size and prepared.eval_batch_size < cfg.data.eval_batch_size:
        lines.append(f"data.eval_batch_size {cfg.data.eval_batch_size} clipped to the "
                     f"{eval_set_size(run)} test images: eval batch {prepared.eval_batch_size}")
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


class Training:
    """One run in progress: what its steps share (the run, its plan and steps, its checkpoint
    manager, metrics and progress output), and the named steps of :func:`train`."""

    def __init__(self, cfg, prepared: Prepared, run_dir: RunDir, stream):
        self.cfg, self.prepared, self.run_dir, self.stream = cfg, prepared, run_dir, stream
        self.run: Run = prepared.run
        self.plan = prepared.plan
        self.is_main = jax.process_index() == 0
        self.manager = None
        if cfg.checkpoint.enabled:
            self.manager = CheckpointManager(
                run_dir.checkpoints, keep=cfg.checkpoint.keep, keep_best=cfg.checkpoint.keep_best,
                best_metric="eval/top1", on_error=cfg.checkpoint.on_error, step_leaf="step",
                log_path=run_dir.checkpoints_log)
        self.history: list = []   # the step metrics since the last log line (device arrays)
        self.metrics = self.progress = self.stopper = None
        self.last_eval = (None, {})  # (step, metrics) of the latest evaluation
        self._stop = None  # run_steps' _StopSignal while it runs
        self._first_step_s = 0.0  # the first step's time (its executable already compiled)
        # Images skipped so far (data.on_bad_image: skip), counted as their batches are consumed.
        self.bad_images = 0 if self.run.images is None else self.run.images.skipped_at_open

    def say(self, text: str) -> None:
        if self.is_main:
            print(f"[jaxcnn] {text}", file=self.stream, flush=True)

    def every(self, key: str):
        """A cadence key (``train.eval_every`` ...) in steps, or None when unset."""
        section, name = key.split(".")
        value = self.cfg[section][name]
        return resolve_duration(value, self.run.steps_per_epoch, key=key) if value is not None else None

    # -- 2. restore or initialise ------------------------------------------------------------

    def restore_or_init(self):
        """The state the run continues from: the newest good checkpoint (``checkpoint.resume``),
        or a new one created in place, already sharded (no full copy on one device), from
        ``model.init_from`` or the seed, pruned as the ``prune`` section says."""
        cfg = self.cfg
        if self.manager is not None:
            restored = restore_for_resume(
                self.manager, self.plan.abstract_state, cfg.checkpoint.resume,
                config=None if cfg.checkpoint.on_config_change == "continue" else to_dict(cfg))
            if restored is not None:
                step, state = restored
                self.say(f"resumed from step {step}: {self.manager.directory}/{step}")
                return state
        trees, keep = initial_params(self.run, self.prepared.loaded)
        state = self.plan.create_state(lambda t, k: init_state(self.run, t, k), trees, keep)
        if cfg.model.init_from:
            self.say(f"parameters from {cfg.model.init_from}")
        if keep is not None:
            self.say(f"prune {cfg.prune.amount:g} ({cfg.prune.scope}, {cfg.prune.structure}): "
                     f"{prune.describe_keep(keep)}")
        return state

    # -- 3. the steps and their cadence ------------------------------------------------------

    def _batches(self, start: int):
        """Placed batches for steps ``start ...``: prefetched on a thread, or made in turn."""
        if self.run.images is not None:
            return self._image_batches(start)
        make_batch, put = batch_fn(self.run, self.plan.batch_share), self.plan.put_batch
        if self.cfg.data.prefetch:
            prefetch = Prefetcher(make_batch, size=max(1, self.cfg.data.prefetch), start=start,
                                  stop=self.run.total_steps, device_put=put)
            return iter(prefetch), prefetch.close
        return (put(make_batch(s)) for s in range(start, self.run.total_steps)), lambda: None

    def _image_batches(self, start: int):
        """An image source's batches, made by ``data.workers`` grain processes and prefetched on a
        thread; each bad image skipped is counted when its batch is consumed (and the first are
        named)."""
        cfg, put = self.cfg, self.plan.put_batch
        source = TrainInput(self.run.images, seed=self.run.data_seed, batch_size=cfg.data.batch_size,
                            start=start, stop=self.run.total_steps, workers=cfg.data.workers,
                            **process_share(self.plan.batch_share))
        if cfg.data.prefetch:
            prefetch = Prefetcher(source, size=max(1, cfg.data.prefetch),
                                  device_put=lambda item: (put(item[0]), item[1]))
            items, closers = iter(prefetch), (prefetch.close, source.close)
        else:
            items, closers = ((put(arrays), bad) for arrays, bad in source), (source.close,)

        def counted():
            for batch, bad in items:
                for message in bad[:max(0, 20 - self.bad_images)]:
                    self.progress.message(f"[jaxcnn] skipped a bad image: {message}")
                self.bad_images += len(bad)
                yield batch

        return counted(), lambda: [close() for close in closers]

    def run_steps(self, state, start: int):
        """Steps ``start`` to the end (or to a SIGTERM/SIGINT, which saves and stops).

        Returns:
            ``(state, stopped_by)``: the signal's name, or None when every step ran.
        """
        batches, close = self._batches(start)
        self._timer = None  # (interval start, steps timed in it); None until the first step is done
        try:
            with _StopSignal() as stop, matmul_precision(self.cfg):
                self._stop = stop
                for step in range(start, self.run.total_steps):
                    try:
                        batch = next(batches)
                    except RuntimeError as err:
                        if stop.signum is None:
                            self.stop_for_dead_worker(err, state, step)
                            raise
                        return state, self.stop_for_signal(state, step, stop.signum)  # see after_step
                    state = self._one_step(state, batch)
                    stopped_by = self.after_step(state, step + 1, stop.signum)
                    if stopped_by is not None:
                        return state, stopped_by
        finally:
            self._stop = None
            close()
            self.progress.close()
        return state, None

    def _one_step(self, state, batch):
        if self._timer is None:  # the first step: its time (the executable is already compiled)
            t0 = time.perf_counter()
            state, m = self.prepared.train_step(state, batch)
            jax.block_until_ready(m)
            self._first_step_s = time.perf_counter() - t0
            self.progress.message(f"[jaxcnn] first step took {self._first_step_s:.1f} s")
            self._timer = [time.perf_counter(), 0]
        else:
            state, m = self.prepared.train_step(state, batch)
            self._timer[1] += 1
        self.history.append(m)
        return state

    def after_step(self, state, done: int, signum) -> str | None:
        """Logging, evaluation and checkpointing due after step ``done``; a received signal
        saves and stops (returns its name)."""
        last = self.run.total_steps
        if done % self.log_every == 0 or done == last:
            self.log(done)
        evaluated, eval_metrics = False, None
        if self.eval_every and done % self.eval_every == 0 and done != last:
            try:
                eval_metrics, evaluated = self.evaluate_and_record(state, done), True
            except RuntimeError as err:
                # A terminal's Ctrl-C (a scheduler's SIGTERM) also reaches the data loader's worker
                # processes. They hold both back while starting (jaxcnn.data.workers.held_signals);
                # one that dies of another stop signal anyway is reported by grain as a
                # RuntimeError. With the signal received, that is the stop it asked for.
                received = self._stop.signum if self._stop is not None else None
                if received is None:
                    self.stop_for_dead_worker(err, state, done)
                    raise
                return self.stop_for_signal(state, done, received)
            if self.stopper is not None and eval_metrics and self.stopper.update(eval_metrics):
                self.save(state, done, eval_metrics)
                self.say_early_stop(done)
                return EARLY_STOP
        saving = self.ckpt_every and done % self.ckpt_every == 0
        if saving and done != last:
            self.save(state, done, eval_metrics)
        if signum is not None and done != last:
            return self.stop_for_signal(state, done, signum)
        if evaluated or saving:  # eval/save time is not step time: the interval restarts after it
            self._timer = [time.perf_counter(), 0]
        return None

    def stop_for_dead_worker(self, err: RuntimeError, state, done: int) -> None:
        """For a data worker that died (`DataWorkerDied`): saves the state after step ``done``
        and raises the error again, saying so and at which step; any other error is left as is.
        In a multi-process run nothing is saved: the save waits for every process at a barrier,
        and the others wait in the next step's collective (they see this process lost)."""
        if not isinstance(err, DataWorkerDied):
            return
        if jax.process_count() > 1:
            saved = (f"stopped after step {done} in process {jax.process_index()} of "
                     f"{jax.process_count()}, no checkpoint (the other processes cannot join its save)")
        elif self.manager is None:
            saved = f"stopped after step {done}, no checkpoint (checkpoint.enabled: false)"
        else:
            self.save(state, done)
            saved = f"checkpoint saved at step {done}"
        raise DataWorkerDied(f"{err}; {saved}") from None

    def stop_for_signal(self, state, done: int, signum: int) -> str:
        """Saves the state after step ``done`` and says so; returns the signal's name."""
        stopped_by = signal.Signals(signum).name
        self.save(state, done)
        self.progress.message(f"[jaxcnn] {stopped_by} received: checkpoint saved at step {done}, stopping")
        return stopped_by

    def log(self, done: int) -> None:
        """One ``train`` record (metrics.jsonl, TensorBoard, progress) for the steps since the last."""
        self.check_finite(done)
        run = self.run
        start, steps = self._timer
        # A log right after the first step (logging.log_every: 1, a 1-step run) has no step
        # timed after it: that step's own time (it printed NaN, written as "nan" strings).
        step_time = (time.perf_counter() - start) / steps if steps else self._first_step_s
        img_s = self.cfg.data.batch_size / max(step_time, 1e-9)
        values = _summarise(self.history)
        values.update(epoch=done / run.steps_per_epoch, img_per_s=img_s, step_time_ms=step_time * 1000)
        if run.images is not None:  # running total of the images skipped (data.on_bad_image: skip)
            values["bad_images"] = self.bad_images
        eta = (run.total_steps - done) * step_time
        self.metrics.write(done, "train", values)
        self.progress.update(done, done / run.steps_per_epoch, values, img_per_s=img_s,
                             step_time=step_time, eta_s=eta)
        self.history = []
        self._timer = [time.perf_counter(), 0]

    def evaluate_and_record(self, state, done: int) -> dict:
        # Early stopping may end the run here, and finish() then records this evaluation's
        # per-class report; otherwise the host need not build it.
        result = self.evaluate(state, per_class=self.stopper is not None)
        self.last_eval = (done, result)
        if result:
            self.metrics.write(done, "eval", {k: v for k, v in result.items() if k != "per_class"})
            self.progress.message(f"[jaxcnn] eval at step {done}: "
                                  f"{eval_line(result, self.run.num_classes)}")
        return result

    def evaluate(self, state, per_class: bool = False) -> dict:
        """The eval metrics of the parameters the run exports (their moving average with
        ``train.ema_decay``), with ``per_class`` also the per-class report. Data changed under the run (records converted again, images of
        a folder's ``val`` split added, removed or renamed: `ImageData.changes_since_opened`)
        stop it first, naming the change, rather than changing its validation data silently."""
        images = self.run.images
        if images is not None and (changes := changes_on_any_process(images.changes_since_opened())):
            raise DataError(f"{images.path}: the data changed while the run trained ({'; '.join(changes)}); "
                            f"stopped before evaluating on them; the checkpoints are kept")
        step, plan = self.prepared.eval_step, self.plan
        return evaluate(self.run, lambda p, s, batch: step(p, s, plan.put_eval_batch(batch)),
                        eval_params(state, self.run.policy), state.state, share=plan.batch_share,
                        per_class=per_class)

    def check_finite(self, done: int) -> None:
        """Stops (``nan_policy: stop``) at the first non-finite loss among the steps since the
        last check."""
        self.history = jax.device_get(self.history)
        bad = [i for i, h in enumerate(self.history) if not math.isfinite(float(h["loss"]))]
        if bad and self.cfg.train.nan_policy == "stop":
            first = done - len(self.history) + bad[0] + 1
            manager = self.manager
            last_ckpt = manager.latest_step() if manager is not None else None
            where = "none" if last_ckpt is None else os.path.join(manager.directory, str(last_ckpt))
            raise TrainingStopped(f"non-finite loss at step {first}; train.nan_policy is 'stop'; "
                                  f"last good checkpoint: {where}")

    def save(self, state, step: int, eval_metrics=None) -> None:
        if self.manager is None:
            return
        self.check_finite(step)
        if self.manager.latest_step() == step:  # a finished run resumed: this state is that checkpoint
            return
        ok = self.manager.save(step, state, config_dict=to_dict(self.cfg),
                               metrics={"eval/top1": eval_metrics["top1"]} if eval_metrics else None)
        if not ok:
            self.progress.message(f"[jaxcnn] warning: checkpoint at step {step} was not saved")

    def say_early_stop(self, done: int) -> None:
        es = self.cfg.train.early_stopping
        self.progress.message(f"[jaxcnn] early stopping at step {done}: eval {es.metric} has not improved "
                              f"on {self.stopper.best:.4f} for {es.patience} evaluations")

    def open_outputs(self, start: int) -> None:
        """metrics.jsonl (truncated after ``start``: a resumed run, or a fresh one over a run
        killed before its first checkpoint), progress output and the cadences."""
        cfg = self.cfg
        self.log_every = self.every("logging.log_every")
        self.eval_every = self.every("train.eval_every")
        self.ckpt_every = self.every("checkpoint.every")
        self.metrics = MetricsWriter(self.run_dir.path, tensorboard=cfg.logging.tensorboard,
                                     enabled=self.is_main, resumed_at=start)
        self.progress = Progress(self.run.total_steps, start, mode=cfg.logging.progress,
                                 enabled=self.is_main, stream=self.stream)
        es = cfg.train.early_stopping
        self.stopper = None
        if es.patience is not None:
            self.stopper = EarlyStopping(es.metric, es.patience, es.min_delta)
            if start > 0 and os.path.isfile(self.run_dir.metrics):
                self.stopper.replay(read_metrics(self.run_dir.metrics), start)

    # -- 4. finish ---------------------------------------------------------------------------

    def finish(self, state) -> tuple[dict, str | None]:
        """The final evaluation (recorded once, not again for a re-run of a finished run), the
        last checkpoint and ``params.<checkpoint.format>``.

        Returns:
            ``(final metrics, None or the reason the parameter file could not be written)``.
        """
        step = int(state.step)
        recorded = self.last_eval[0] == step  # early stopping has just evaluated and recorded this state
        if recorded:
            final = dict(self.last_eval[1])
        else:
            with matmul_precision(self.cfg):
                final = self.evaluate(state, per_class=True)
        report = final.pop("per_class", None)
        if final and not recorded and not self.metrics.recorded(step, "eval"):
            self.metrics.write(step, "eval", final)
        if report is not None and not self.metrics.recorded(step, "per_class"):
            self.metrics.write(step, "per_class", report)
        self.save(state, step, final or None)
        trees = parallel.to_host((eval_params(state, self.run.policy), state.state))  # all processes
        error = None
        if self.is_main:
            fmt = self.cfg.checkpoint.format
            error = self.run_dir.save_params(
                fmt, trees, interop.save_npz if fmt == "npz" else interop.save_safetensors)
            if error is not None and self.manager is not None:
                error += f"; checkpoints in {self.manager.directory} are kept"
        if final:
            self.say(f"final eval at step {step}: {eval_line(final, self.run.num_classes)}")
        return final, error

    def close(self) -> None:
        if self.manager is not None:
            self.manager.wait()
            self.manager.close()
        if self.metrics is not None:
            self.metrics.close()


def run(config, *, overrides=(), workdir=None, stream=None) -> dict:
    """Train as ``config`` says, from Python: what ``jaxcnn-train`` runs.

    Arguments:
        config: a YAML file's path, a mapping of the config's sections (``{"model": {"name":
            "lenet5"}, "train": {"steps": 100}}``, validated as a file is), or a loaded
            :class:`~jaxcnn.train.config.Config`.
        overrides: dotted ``key=value`` strings over it, as on the command line.
        workdir: the run directory; default ``logging.workdir``, else for a file
            ``runs/<its name>`` (``runs/<its name>-<data folder>`` with a ``data.path``
            override). A run resumes from the checkpoints it finds there.
        stream: where progress is printed (default ``sys.stdout``).

    Returns:
        As :func:`train`: the final evaluation metrics and ``step``.

    Raises:
        ConfigError naming the key (a mapping with neither ``workdir`` nor
        ``logging.workdir`` names ``logging.workdir``), and what :func:`train` raises.
        Unlike the command line, it sets nothing process-wide first (XLA flags, malloc:
        :func:`jaxcnn.cpu.configure` is the caller's to call).
    """
    path = os.fspath(config) if isinstance(config, (str, os.PathLike)) else None
    if path is not None:
        cfg = load_config(path, overrides)
    elif isinstance(config, Config):
        cfg = with_overrides(config, overrides)
    else:
        cfg = config_from_dict(config, overrides, source="run(config)")
    what = "workdir" if workdir is not None or cfg.logging.workdir is None else "logging.workdir"
    workdir = workdir or cfg.logging.workdir or (default_workdir(path, overrides) if path else None)
    if workdir is None:
        raise ConfigError("logging.workdir: a config given as a mapping needs a run directory: "
                          "set logging.workdir, or pass workdir=", path="logging.workdir")
    check_workdir(os.fspath(workdir), what)
    return train(cfg, os.fspath(workdir), config_path=path, stream=stream)


def train(cfg, workdir: str, *, argv=None, config_path=None, stream=None) -> dict:
    """Run training as ``cfg`` says, writing everything under ``workdir``.

    Returns the final evaluation metrics and ``step`` (and ``stopped_by`` when a signal
    ended the run early). Raises ``ConfigError``/``DataError``/``CheckpointError`` for bad
    input, before any compute where possible; ``TrainingStopped`` at a non-finite loss under
    ``nan_policy: stop``; ``WorkdirError`` when the final parameters cannot be written.
    """
    run_dir = RunDir(workdir)
    prepared, changes, prepare_s = start(cfg, run_dir, argv=argv, config_path=config_path)
    try:
        return _train(cfg, run_dir, prepared, changes, prepare_s, argv=argv, config_path=config_path,
                      stream=stream)
    finally:
        _unlock(run_dir)


def _train(cfg, run_dir: RunDir, prepared, changes, prepare_s, *, argv, config_path, stream) -> dict:
    """`train` once the run directory is this process's."""
    workdir = run_dir.path
    training = Training(cfg, prepared, run_dir, stream or sys.stdout)
    for line in startup_lines(cfg, prepared, workdir, prepare_s):
        training.say(line)
    if changes:  # checkpoint.on_config_change=continue
        training.say(f"continuing under changes (checkpoint.on_config_change=continue): {'; '.join(changes)}")
    error = None
    try:  # a refused resume closes the checkpoint manager too: its orbax thread outlived the process
        state = training.restore_or_init()
        first = int(state.step)
        record_start(cfg, run_dir, prepared, first, changes, argv=argv, config_path=config_path)
        training.open_outputs(first)
        if training.stopper is not None and training.stopper.stopped:  # a resumed run that had stopped
            stopped_by = EARLY_STOP
            training.progress.close()
        else:
            state, stopped_by = training.run_steps(state, first)
        result = {"step": int(state.step)}
        if stopped_by in (None, EARLY_STOP):
            final, error = training.finish(state)
            result.update(final)
            if stopped_by == EARLY_STOP:
                result["early_stopped"] = True
        else:
            result["stopped_by"] = stopped_by
    finally:
        training.close()
    if error is not None:  # after the checkpoints are written out
        raise WorkdirError(error)
    return result
