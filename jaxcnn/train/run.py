"""The life of a training run, top to bottom: :func:`train`, and :func:`run`, its entry from Python.

:func:`train` is one function in banner-marked sections, read in order, as big_vision's
``train.py`` is: config (the processes joined, the resume decision); data; model, optimiser and
policy; parallel plan; steps (compiled from abstract inputs and checked against memory:
``--dry-run`` stops here); restore or init; the loop (log, evaluate, checkpoint); finish. What
the sections build are its local variables. The pure pieces it calls live in
:mod:`~jaxcnn.train._data` (the data), :mod:`~jaxcnn.train._build` (model, optimiser, first
state), :mod:`~jaxcnn.train._plan` (mesh, plan, compiled steps), :mod:`~jaxcnn.train._memory`
(will it fit) and :mod:`~jaxcnn.train._loop` (evaluation, batches, logging, saves); the run
directory's files are named in :class:`jaxcnn.train.rundir.RunDir`. It is the one function of
the library over 80 lines (``tests/test_layering.py`` names it).

``jaxcnn.train.run`` is the function :func:`run` (the package imports it), not this module: the
module is ``sys.modules["jaxcnn.train.run"]``.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, NamedTuple

import jax

from jaxcnn import interop, parallel
from jaxcnn.data import preprocessing
from jaxcnn.errors import ConfigError, TrainingStopped, WorkdirError  # noqa: F401  (re-exported)
from jaxcnn.layers import Choices
from jaxcnn.train import _build, _data, _loop, _memory, _plan, prune
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.config import Config, config_from_dict, load_config, to_dict, with_overrides
from jaxcnn.train.ema import eval_params
from jaxcnn.train.metrics import MetricsWriter, Progress, eval_line
from jaxcnn.train.resume import check_fresh_start, check_resume_config, record_run_config, restore_for_resume
from jaxcnn.train.rundir import RunDir, check_workdir, default_workdir
from jaxcnn.train.step import make_eval_step, make_train_step

__all__ = ["run", "train", "Prepared", "TrainingStopped", "WorkdirError"]


class Prepared(NamedTuple):
    """What :func:`train` has built when its steps section ends, as ``train(cfg,
    dry_run=True)`` returns it: ``jaxcnn-train --dry-run`` prints its summary from it (the same
    mesh, plan, steps and checks as the run's)."""

    run: Any               # the Run (jaxcnn.train._build.build_run)
    plan: Any
    loaded: Any            # model.init_from's (params, model_state), or None
    train_step: Any        # the wrapped train step the loop calls: (state, placed batch)
    eval_step: Any         # the wrapped eval step: (params, model_state, placed eval batch)
    eval_batch_size: int
    memory: dict           # bytes: "state", "train_step", "eval_step" (None: not known), "available"
    train_out: Any         # the train step's output shapes (state, metrics)


# The run directories this process trains in, each with its lock file held open (see RunDir.lock).
_LOCKS: dict = {}


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
        ConfigError: naming the key (a mapping with neither ``workdir`` nor
            ``logging.workdir`` names ``logging.workdir``); and what :func:`train` raises.

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


def train(cfg, workdir=None, *, argv=None, config_path=None, stream=None, dry_run=False):
    """Run training as ``cfg`` says, writing everything under ``workdir``.

    Arguments:
        cfg: a loaded :class:`~jaxcnn.train.config.Config`.
        workdir: the run directory (resumed from its checkpoints); required unless ``dry_run``.
        argv, config_path: the command line and config file recorded in the run's metadata.
        stream: where progress is printed (default ``sys.stdout``).
        dry_run: stop after the steps section (below).

    Returns the final evaluation metrics and ``step`` (and ``stopped_by`` when a signal
    ended the run early). Raises ``ConfigError``/``DataError``/``CheckpointError`` for bad
    input, before any compute where possible; ``TrainingStopped`` at a non-finite loss under
    ``nan_policy: stop``; ``WorkdirError`` when the final parameters cannot be written;
    ``ValueError`` without a ``workdir`` (and not ``dry_run``).

    With ``dry_run`` (``jaxcnn-train --dry-run``) it stops when its steps section ends and
    returns what it built (:class:`Prepared`): data, model, ``model.init_from``, the mesh and
    plan, the wrapped steps compiled from abstract inputs, their memory checked. No parameter
    or batch is allocated, no step runs, and it stays in this process (the ``distributed``
    section is not joined: its peers are not dry-running) without a run directory
    (``workdir`` is not used).
    """
    # ---- config: join the other processes; refuse to resume under settings that train differently
    stream = stream or sys.stdout
    changes = []  # what changed since the run's checkpoints (checkpoint.on_config_change=continue)
    if not dry_run:
        if workdir is None:
            raise ValueError("train: workdir is needed (a run directory) unless dry_run=True")
        run_dir = RunDir(workdir)
        with _plan.parallel_config_errors():
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

    # ---- data ----
    _build.check_names(cfg)  # model.name, precision.policy: one line each, before any file is read
    data = _data.build_data(cfg, _data.data_seed(cfg))

    # ---- model, optimiser and policy ----
    run = _build.build_run(cfg, data)
    if not dry_run:  # a resumed run's image data must be the ones it trained on
        changes.extend(_loop.data_changes(cfg, run_dir, run))
    loaded = _build.load_init_from(run) if cfg.model.init_from else None

    # ---- parallel plan ----
    with _plan.parallel_config_errors():
        plan = _plan.make_plan(cfg, run.model, run.input_shape, _build.abstract_state(run))
    _plan.check_accumulate(cfg, plan)

    # ---- steps: wrapped by the plan, compiled from abstract inputs, their memory checked ----
    image_norm = _data.train_image_norm(run)
    train_step = plan.wrap_step(make_train_step(
        plan.step_model, run.tx, policy=run.policy, label_smoothing=cfg.optim.label_smoothing,
        schedule=run.schedule, skip_nonfinite=cfg.train.nan_policy == "skip",
        axis_name=plan.step_axis_name, sync_batch_norm=plan.sync_batch_norm, image_norm=image_norm,
        choices=Choices(impl=cfg.model.impl, batch_norm_grad=cfg.model.batch_norm_grad, conv_bn=cfg.model.conv_bn),
        mix=_build.mix_spec(cfg), accumulate=_build.micro_batches(cfg), pipeline=plan.pipeline,
        # mpmd: each stage's tx sees its own gradients, so the step clips by the whole model's
        # norm first (tx's own clip_by_global_norm then finds every stage within it)
        clip_norm=cfg.optim.grad_clip_norm if plan.mpmd is not None else None))
    eval_step = plan.wrap_eval(make_eval_step(plan.step_model, policy=run.policy,
                                              choices=Choices(impl=cfg.model.impl), image_norm=image_norm))
    eval_size = _data.eval_batch_size(run)
    available = _memory.available_memory(_memory.local_devices(plan))
    memory = {"available": available[0] if available else None}
    memory["state"] = _memory.check_state_memory(
        plan, available, lambda shape: _plan.size_keys(run, shape) or [f"model.name={cfg.model.name}"])
    step_memory, train_out = _plan.measure_steps(cfg, run, plan, train_step, eval_step, eval_size, available)
    memory.update(step_memory)
    if dry_run:
        return Prepared(run, plan, loaded, train_step, eval_step, eval_size, memory, train_out)
    prepare_s = time.perf_counter() - t0
    os.makedirs(run_dir.path, exist_ok=True)
    lock_key = os.path.realpath(run_dir.path)
    if jax.process_index() == 0 and lock_key not in _LOCKS:  # one trainer per run directory
        _LOCKS[lock_key] = run_dir.lock()

    is_main = jax.process_index() == 0
    manager = metrics = None
    error = None  # why the parameter file could not be written
    try:  # a refused resume closes the checkpoint manager too: its orbax thread outlived the process
        if cfg.checkpoint.enabled:
            manager = CheckpointManager(
                run_dir.checkpoints, keep=cfg.checkpoint.keep, keep_best=cfg.checkpoint.keep_best,
                best_metric="eval/top1", on_error=cfg.checkpoint.on_error, step_leaf="step",
                log_path=run_dir.checkpoints_log)
        for line in _loop.startup_lines(cfg, run, plan, eval_size, run_dir.path, prepare_s):
            _loop.say(stream, line)
        if changes:  # checkpoint.on_config_change=continue
            _loop.say(stream, f"continuing under changes (checkpoint.on_config_change=continue): "
                              f"{'; '.join(changes)}")

        # ---- restore or init: the newest good checkpoint, else a new state made in place, sharded
        state = None
        if manager is not None:
            restored = restore_for_resume(
                manager, plan.abstract_state, cfg.checkpoint.resume,
                config=None if cfg.checkpoint.on_config_change == "continue" else to_dict(cfg))
            if restored is not None:
                step, state = restored
                _loop.say(stream, f"resumed from step {step}: {manager.directory}/{step}")
        if state is None:  # from model.init_from or the seed, pruned as the prune section says
            trees, keep = _build.initial_params(run, loaded)
            state = plan.create_state(lambda t, k: _build.init_state(run, t, k), trees, keep)
            if cfg.model.init_from:
                _loop.say(stream, f"parameters from {cfg.model.init_from}")
            if keep is not None:
                _loop.say(stream, f"prune {cfg.prune.amount:g} ({cfg.prune.scope}, {cfg.prune.structure}): "
                                  f"{prune.describe_keep(keep)}")
        first = int(state.step)
        if is_main:  # after the resume decision: a refused resume leaves the run directory as it was
            record_run_config(run_dir.path, to_dict(cfg), first, changes)  # config.resolved.yaml, config_history/
            run_dir.write_meta(argv, config_path, data=None if run.images is None else run.images.fingerprint())
            # what the model expects: jaxcnn-eval, -export and -predict read it
            preprocessing.write_preprocessing(run_dir.preprocessing, preprocessing.from_run(run))

        # ---- the loop: a step, then the logging, evaluation and checkpoint due after it ----
        last = run.total_steps
        log_every, eval_every, ckpt_every = (_loop.every(cfg, key, run.steps_per_epoch) for key in (
            "logging.log_every", "train.eval_every", "checkpoint.every"))
        # metrics.jsonl is truncated after `first`: a resumed run, or a fresh one over a run
        # killed before its first checkpoint
        metrics = MetricsWriter(run_dir.path, tensorboard=cfg.logging.tensorboard, enabled=is_main,
                                resumed_at=first)
        progress = Progress(last, first, mode=cfg.logging.progress, enabled=is_main, stream=stream)
        stopper = _loop.early_stopping(cfg, run_dir.metrics, first)
        history = []  # the step metrics since the last log line (device arrays)
        timer = None  # [interval start, steps timed in it]; None until the first step is done
        first_step_s = 0.0  # the first step's time (its executable already compiled)
        last_eval = (None, {})  # (step, metrics) of the latest evaluation
        # Images skipped so far (data.on_bad_image: skip), counted as their batches are consumed.
        bad_images = 0 if run.images is None else run.images.skipped_at_open
        stopped_by = None  # a signal's name, or EARLY_STOP

        def save(state, step, eval_metrics=None):
            _loop.save(cfg, manager, progress, history, state, step, eval_metrics)

        def stop_for_signal(state, done, signum):  # saves the state after step `done`, says so
            save(state, done)
            progress.message(f"[jaxcnn] {signal.Signals(signum).name} received: checkpoint saved at step "
                             f"{done}, stopping")
            return signal.Signals(signum).name

        if stopper is not None and stopper.stopped:  # a resumed run that had stopped early
            stopped_by = _loop.EARLY_STOP
            progress.close()
        else:
            batches, close_batches = _loop.train_batches(cfg, run, plan, first)
            try:
                with _loop.StopSignal() as stop, _build.matmul_precision(cfg):
                    for step in range(first, last):
                        try:
                            batch, bad = next(batches)
                        except RuntimeError as err:  # a data worker died: of our stop signal, or not
                            if stop.signum is None:
                                _loop.stop_for_dead_worker(err, step, manager, lambda: save(state, step))
                                raise
                            stopped_by = stop_for_signal(state, step, stop.signum)
                            break
                        for message in bad[:max(0, _loop.NAMED_BAD_IMAGES - bad_images)]:
                            progress.message(f"[jaxcnn] skipped a bad image: {message}")
                        bad_images += len(bad)
                        if timer is None:  # the first step: its time (the executable is already compiled)
                            t1 = time.perf_counter()
                            state, step_metrics = train_step(state, batch)
                            jax.block_until_ready(step_metrics)
                            first_step_s = time.perf_counter() - t1
                            progress.message(f"[jaxcnn] first step took {first_step_s:.1f} s")
                            timer = [time.perf_counter(), 0]
                        else:
                            state, step_metrics = train_step(state, batch)
                            timer[1] += 1
                        history.append(step_metrics)
                        done, signum = step + 1, stop.signum
                        if done % log_every == 0 or done == last:
                            history = _loop.check_finite(cfg, history, done, manager)
                            _loop.log(cfg, run, metrics, progress, history, timer, first_step_s, bad_images, done)
                            history, timer = [], [time.perf_counter(), 0]
                        evaluated, eval_metrics = False, None
                        if eval_every and done % eval_every == 0 and done != last:
                            try:  # early stopping may end the run here: finish then records its per_class
                                eval_metrics = _loop.evaluate_state(run, eval_step, plan, state,
                                                                    per_class=stopper is not None)
                                evaluated = True
                            except RuntimeError as err:
                                # A terminal's Ctrl-C (a scheduler's SIGTERM) also reaches the data loader's
                                # worker processes. They hold both back while starting
                                # (jaxcnn.data.workers.held_signals); one that dies of another stop signal
                                # anyway is reported by grain as a RuntimeError. With the signal received,
                                # that is the stop it asked for.
                                if stop.signum is None:
                                    _loop.stop_for_dead_worker(err, done, manager, lambda: save(state, done))
                                    raise
                                stopped_by = stop_for_signal(state, done, stop.signum)
                                break
                            last_eval = (done, eval_metrics)
                            if eval_metrics:
                                metrics.write(done, "eval", {k: v for k, v in eval_metrics.items() if k != "per_class"})
                                progress.message(f"[jaxcnn] eval at step {done}: "
                                                 f"{eval_line(eval_metrics, run.num_classes)}")
                            if stopper is not None and eval_metrics and stopper.update(eval_metrics):
                                save(state, done, eval_metrics)
                                es = cfg.train.early_stopping
                                progress.message(f"[jaxcnn] early stopping at step {done}: eval {es.metric} has not "
                                                 f"improved on {stopper.best:.4f} for {es.patience} evaluations")
                                stopped_by = _loop.EARLY_STOP
                                break
                        saving = ckpt_every and done % ckpt_every == 0
                        if saving and done != last:
                            save(state, done, eval_metrics)
                        if signum is not None and done != last:
                            stopped_by = stop_for_signal(state, done, signum)
                            break
                        if evaluated or saving:  # eval/save time is not step time: the interval restarts
                            timer = [time.perf_counter(), 0]
            finally:
                close_batches()
                progress.close()

        # ---- finish: the final evaluation, the last checkpoint, params.<checkpoint.format> ----
        result = {"step": int(state.step)}
        if stopped_by not in (None, _loop.EARLY_STOP):  # a signal: saved, the same command resumes
            result["stopped_by"] = stopped_by
        else:
            step = int(state.step)
            recorded = last_eval[0] == step  # early stopping has just evaluated and recorded this state
            if recorded:
                final = dict(last_eval[1])
            else:
                with _build.matmul_precision(cfg):
                    final = _loop.evaluate_state(run, eval_step, plan, state, per_class=True)
            report = final.pop("per_class", None)
            # recorded once, not again for a re-run of a finished run
            if final and not recorded and not metrics.recorded(step, "eval"):
                metrics.write(step, "eval", final)
            if report is not None and not metrics.recorded(step, "per_class"):
                metrics.write(step, "per_class", report)
            save(state, step, final or None)
            trees = parallel.to_host((eval_params(state, run.policy), state.state))  # all processes
            if is_main:
                fmt = cfg.checkpoint.format
                error = run_dir.save_params(fmt, trees, interop.save_npz if fmt == "npz" else interop.save_safetensors)
                if error is not None and manager is not None:
                    error += f"; checkpoints in {manager.directory} are kept"
            if final:
                _loop.say(stream, f"final eval at step {step}: {eval_line(final, run.num_classes)}")
            result.update(final)
            if stopped_by == _loop.EARLY_STOP:
                result["early_stopped"] = True
    finally:
        if manager is not None:
            manager.wait()
            manager.close()
        if metrics is not None:
            metrics.close()
        lock = _LOCKS.pop(lock_key, None)
        if lock is not None:
            lock.close()
    if error is not None:  # after the checkpoints are written out
        raise WorkdirError(error)
    return result
