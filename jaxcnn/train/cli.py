"""Command lines: ``jaxcnn-train`` and ``jaxcnn-eval``.

Bad input (config, data files, checkpoints) ends the program with exit code 2
and one line on stderr naming the bad thing; no traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

# Exit codes: 0 success, 1 training stopped (non-finite loss, a lost peer process, a data worker
# process that died), 2 bad input,
# 128 + signal number when SIGTERM/SIGINT stopped the run after a checkpoint.
from jaxcnn._cli import EXIT_BAD_INPUT, OneLineParser, name_list, path_arg, use_compilation_cache


def _bad_input_errors():
    from jaxcnn.data import DataError
    from jaxcnn.train.checkpoint import CheckpointError
    from jaxcnn.train.config import ConfigError
    from jaxcnn.errors import WorkdirError
    return (ConfigError, DataError, CheckpointError, WorkdirError)


def _distributed_error():
    from jaxcnn.parallel.distributed import DistributedError
    return DistributedError


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _exit_now(code: int, line: str) -> None:
    """Writes ``line`` and ends the process at once, skipping exit hooks: after a peer process is
    lost (or never joined), JAX's exit hook would wait for it at a shutdown barrier, or for JAX's
    own connection attempt, and XLA would then abort with a C++ stack trace after our line. The
    distributed module's watch threads end the process the same way; only one line is written.
    (Also after Ctrl-C: see `interrupted`.)"""
    from jaxcnn.parallel.distributed import exit_now
    exit_now(line, code)


def interrupted(prog: str, own_process: bool) -> int:
    """Ctrl-C outside the training loop (which saves a checkpoint and stops on its own): one line,
    exit code 130. A command that owns its process (called with no ``argv``, as its console
    script does) ends it at once: an XLA compilation that Ctrl-C interrupts goes on on XLA's
    threads, and the interpreter's exit under it crashed (SIGSEGV after the line, exit 139)."""
    line = f"{prog}: interrupted"
    if own_process:
        _exit_now(130, line)
    print(line, file=sys.stderr)
    return 130


def _quiet_resource_tracker() -> None:
    """For ``multiprocessing``'s resource tracker, started later by the data loader: no warning
    about the semaphores it cleans up. A process that ends itself at once after its error line
    (a data worker that died, `_exit_now`) leaves grain's queues to the tracker, which unlinks
    them and used to add 3 lines of "leaked semaphore objects" after the line. The tracker
    takes its warning options from ``sys.warnoptions`` when it starts; this process's own
    warning filters are left as they are."""
    sys.warnoptions.append("ignore:resource_tracker:UserWarning")


def _configure_cpu() -> None:
    """``jaxcnn.cpu.configure()``: jaxcnn's XLA:CPU flag and glibc malloc policy for this
    process (each only where it helps; see ``jaxcnn.cpu``). It must run before JAX creates
    its backend; the entry points call it first. run_meta.json's ``host_malloc`` records
    the outcome."""
    from jaxcnn import cpu
    cpu.configure()


def _run_directory_as_config(path: str) -> str | None:
    """The error for a run directory given where a config file goes, or None."""
    from jaxcnn.train.rundir import RunDir
    if not os.path.isdir(path) or RunDir(path).problem() is not None:
        return None
    return (f"{path} is a run directory, not a config file: to resume it, jaxcnn-train "
            f"{RunDir(path).config} (its run directory is then the default --workdir); to evaluate "
            f"it, jaxcnn-eval {path}")


def _train_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="jaxcnn-train",
        description="Train a jaxcnn model from a YAML config, e.g. "
                    "`jaxcnn-train configs/mnist_cnn.yaml train.epochs=2 optim.lr=3e-4`.",
        epilog="Config keys: `jaxcnn-train CONFIG --print-config` prints every key of a config with "
               "its value; docs/reference/config.md lists each key's type, default and choices.")
    p.add_argument("config", type=path_arg, help="YAML run config (may name a `base:` config)")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="dotted overrides applied after the file, e.g. data.batch_size=64")
    p.add_argument("--workdir", type=path_arg, default=None,
                   help="run directory (default: logging.workdir, else runs/<config name>)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="build and check what the run would (data, model, mesh, the train and eval "
                        "steps compiled from abstract inputs, their memory), print the summary, "
                        "and exit without allocating parameters or batches")
    return p


def dry_run(cfg, stream=None) -> None:
    """Build and check everything a real run does before its first step (the run function
    itself, :func:`jaxcnn.train.run.train` with ``dry_run=True``, which stops after its steps
    section: data, model, ``model.init_from``, the mesh and parallel plan, the wrapped train and
    eval steps compiled from abstract inputs, the memory they need), print the model summary
    and exit: no parameter or batch is allocated and no step runs."""
    from jaxcnn import summary
    from jaxcnn.train._loop import unused_settings_lines
    from jaxcnn.train._memory import fmt_bytes
    from jaxcnn.train.run import train

    stream = stream or sys.stdout
    # Single process: the distributed section is not joined (its peers are not dry-running).
    prepared = train(cfg, dry_run=True)
    run, plan, memory = prepared.run, prepared.plan, prepared.memory
    print(summary(run.model, (1,) + tuple(run.input_shape[1:])), file=stream)
    for line in unused_settings_lines(cfg):
        print(line, file=stream)
    metrics = prepared.train_out[1]
    start = f", parameters from {cfg.model.init_from}" if cfg.model.init_from else ""
    clipped = (f" (data.eval_batch_size {cfg.data.eval_batch_size} clipped to the test set)"
               if cfg.data.eval_batch_size and prepared.eval_batch_size < cfg.data.eval_batch_size else "")
    need = [f"{name.replace('_', ' ')} {fmt_bytes(memory[name])}"
            for name in ("state", "train_step", "eval_step") if memory.get(name) is not None]
    of = f" of {fmt_bytes(memory['available'])} available" if memory.get("available") else ""
    pipe = f" x pipe {plan.pipeline.stages}" if plan.pipeline else ""
    spatial = (f" x spatial {plan.spatial.shards} (images split along height through "
               f"{plan.spatial.gather_after}"
               f"{', explicit halos' if plan.spatial_halo == 'explicit' else ''})" if plan.spatial else "")
    print(f"dry run ok: model {cfg.model.name}{start}, input {run.input_shape}, "
          f"{run.total_steps} steps ({run.steps_per_epoch}/epoch), policy {run.policy.to_string()}, "
          f"mesh data {plan.mesh.shape['data']}{pipe} x model {plan.mesh.shape['model']}{spatial} ({plan.strategy}), "
          f"eval batch {prepared.eval_batch_size}{clipped}, memory {', '.join(need) or 'unknown'}{of}, "
          f"step metrics {sorted(metrics)}", file=stream)


def train_main(argv=None) -> int:
    """Entry point of ``jaxcnn-train``."""
    _configure_cpu()
    args = _train_parser().parse_intermixed_args(argv)
    cfg = run_dir = None
    if (problem := _run_directory_as_config(args.config)) is not None:
        return _fail("jaxcnn-train", problem)
    try:
        from jaxcnn.train.config import dump_config, load_config
        cfg = load_config(args.config, args.overrides)
        if args.print_config:  # valid YAML: keys unused by this config's choices get a comment
            sys.stdout.write(dump_config(cfg))
            return 0
        use_compilation_cache(cfg.train.compilation_cache)
        if args.dry_run:
            dry_run(cfg)
            return 0
        from jaxcnn.parallel.distributed import report_errors_as
        from jaxcnn.train._orbax_noise import quiet_abandoned_orbax_coroutines
        from jaxcnn.errors import DataWorkerDied, TrainingStopped
        from jaxcnn.train.run import train
        from jaxcnn.train.rundir import RunDir, check_workdir, default_workdir
        report_errors_as("jaxcnn-train")  # a lost peer ends the process with our line, on any thread
        if argv is None:
            _quiet_resource_tracker()
        workdir = args.workdir or cfg.logging.workdir or default_workdir(args.config, args.overrides)
        run_dir = RunDir(workdir)
        quiet_abandoned_orbax_coroutines(run_dir.checkpoints_log)
        check_workdir(  # before any compute: a file, read-only, full
            workdir, "--workdir" if args.workdir else
                      "logging.workdir" if cfg.logging.workdir else "workdir")
        try:
            result = train(cfg, workdir, argv=[sys.argv[0]] + list(argv if argv is not None else sys.argv[1:]),
                           config_path=os.path.abspath(args.config))
        except TrainingStopped as e:
            print(f"jaxcnn-train: stopped: {e}", file=sys.stderr)
            return 1
        except DataWorkerDied as e:  # a machine's fault, not bad input: one line, exit 1
            if argv is None:  # grain's exit-time clean-up could wait on the worker's half-sent batch
                _exit_now(1, f"jaxcnn-train: error: {e}")
            print(f"jaxcnn-train: error: {e}", file=sys.stderr)
            return 1
        except (RuntimeError, ValueError) as e:  # JaxRuntimeError, or ValueError from a fetch
            from jaxcnn.parallel.distributed import lost_peer
            lost = lost_peer(e, cfg.distributed.timeout_s)
            if lost is None:
                raise
            raise lost from None
    except _bad_input_errors() as e:
        message = str(e)
        if run_dir is not None:  # resuming a run started elsewhere: say where
            message = run_dir.explain_missing_path(message, cfg, moved_only=True)
        return _fail("jaxcnn-train", message)
    except _distributed_error() as e:  # a peer process is missing or lost: one line, exit 1
        if e.must_exit:
            _exit_now(1, f"jaxcnn-train: error: {e}")
        print(f"jaxcnn-train: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("jaxcnn-train", argv is None)
    if "stopped_by" in result:
        import signal
        return 128 + int(getattr(signal, result["stopped_by"]))
    return 0


def _eval_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="jaxcnn-eval",
        description="Evaluate a finished or running training run on its test set.")
    p.add_argument("run_dir", type=path_arg, help="a run directory written by jaxcnn-train")
    p.add_argument("overrides", nargs="*", default=[], metavar="key=value",
                   help="dotted overrides of the run's config (e.g. data.path=...)")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step to evaluate (default: the latest good one)")
    p.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    p.add_argument("--per-class", action="store_true",
                   help="also each class's images, recall (its accuracy) and precision, and the "
                        "confusion matrix (printed up to 20 classes; always in --json)")
    p.add_argument("--other-classes", action="store_true",
                   help="evaluate on image data that name other classes than the run was "
                        "trained on (refused by default: the labels would not be the model's)")
    return p


def _holds_checkpoints(directory) -> bool:
    return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))


def _final_params(run, run_dir, path):
    """``(step, params, model_state)`` of a run's final parameter file (what it evaluated and
    exported at its end: the moving average if it kept one), checked against the model; the
    step is the last one ``metrics.jsonl`` records (None without one)."""
    from jaxcnn import interop
    from jaxcnn.train.metrics import read_metrics
    from jaxcnn.train._build import abstract_state
    like = abstract_state(run)
    load = interop.load_npz if path.endswith(".npz") else interop.load_safetensors
    params, model_state = load(path, like=(like.params, like.state))
    records = read_metrics(run_dir.path) if os.path.isfile(run_dir.metrics) else []
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return (max(steps) if steps else None), params, model_state


def _trained_image_classes(run_dir):
    """The class names an image-folder or record run was trained on (its
    ``preprocessing.json``), else None: its model has one output per class, whatever the
    data evaluated on hold."""
    from jaxcnn.data.preprocessing import read_preprocessing
    if not os.path.exists(run_dir.preprocessing):
        return None
    prep = read_preprocessing(run_dir.preprocessing)
    return prep.class_names if prep.dataset in ("folder", "records") else None


def _check_same_classes(run_dir, run, trained_on) -> None:
    """A ``DataError`` when the image data name other classes than the run was trained on
    (``preprocessing.json``): label ``i`` would be another class than the model's output
    ``i``, and the accuracy a comparison of unrelated labels. ``--other-classes`` skips it."""
    from jaxcnn.errors import DataError
    if run.images is None or trained_on is None:
        return
    now = list(run.images.class_names)
    if now != list(trained_on):
        raise DataError(f"data.path: {run.images.path} names the classes {name_list(now)}, but "
                        f"{run_dir.path} was trained on {name_list(trained_on)}; --other-classes "
                        "evaluates anyway")


def _warn_of_other_data(run_dir, run) -> None:
    """One line on stderr when the image data evaluated on are not those the run recorded
    (``run_meta.json``): the folder changed since training, or it is another folder
    (``data.path=...``), which is fine to evaluate on, so it goes on.  The comparison is the
    one that stops a resume (`check_resume_data`)."""
    if run.images is None:
        return
    from jaxcnn.train.resume import recorded_data_changes
    fingerprint = run.images.fingerprint()
    changes = recorded_data_changes(run_dir.path, fingerprint)
    if changes:
        print(f"jaxcnn-eval: warning: {fingerprint['path']} does not hold the data {run_dir.path} was "
              f"trained on ({'; '.join(changes)}); evaluating on them as they are now", file=sys.stderr)


def eval_main(argv=None) -> int:
    """Entry point of ``jaxcnn-eval``."""
    _configure_cpu()
    args = _eval_parser().parse_intermixed_args(argv)
    cfg = None
    try:
        import jax

        from jaxcnn.train._orbax_noise import quiet_abandoned_orbax_coroutines
        from jaxcnn.train.checkpoint import CheckpointError, CheckpointManager
        quiet_abandoned_orbax_coroutines()  # read-only: the one line per checkpoint is the report
        from jaxcnn.train.config import ConfigError
        from jaxcnn.train.ema import eval_params
        from jaxcnn.train._loop import evaluate
        from jaxcnn.train.rundir import RunDir
        from jaxcnn.train._build import abstract_state, matmul_precision
        from jaxcnn.train._data import train_image_norm
        from jaxcnn.layers import Choices
        from jaxcnn.train.step import make_eval_step

        run_dir = RunDir(args.run_dir)
        if (problem := run_dir.problem()) is not None:
            return _fail("jaxcnn-eval", problem)
        if args.per_class and args.other_classes:
            raise ConfigError("--per-class with --other-classes: the confusion matrix's rows would be "
                              "the data's classes and its columns the run's")
        cfg, trained = _eval_config(run_dir, args.overrides)
        run = _eval_run(run_dir, cfg, trained, check_classes=not args.other_classes)
        ckpt_dir = run_dir.checkpoints
        final = run_dir.find_params()
        if args.step is None and final is not None and not _holds_checkpoints(ckpt_dir):
            # A run with checkpoint.enabled=false (or its checkpoints removed): its final
            # parameters, as jaxcnn-export and -predict use them ("checkpoints does not exist").
            step, params, model_state = _final_params(run, run_dir, final)
        else:
            # Read-only: evaluation reports a damaged checkpoint and passes over it; only training
            # moves one aside.
            manager = CheckpointManager(ckpt_dir, read_only=True, step_leaf="step")
            if manager.latest_step() is None:
                raise CheckpointError(f"{ckpt_dir}: no complete checkpoint to evaluate")
            if args.step is not None and args.step < 0:  # said "checkpoints/-1 does not exist"
                saved = ", ".join(map(str, manager.all_steps()))
                raise CheckpointError(f"--step {args.step} is not a valid step (steps count from 0); "
                                      f"steps saved in {ckpt_dir}: {saved}")
            step, state = manager.restore(args.step, target=abstract_state(run))
            manager.close()
            params, model_state = eval_params(state, run.policy), state.state  # the EMA if the run kept one
        with matmul_precision(cfg):
            eval_step = make_eval_step(run.model, policy=run.policy, choices=Choices(impl=cfg.model.impl),
                                       image_norm=train_image_norm(run))
            result = evaluate(run, jax.jit(eval_step.step), params, model_state,
                              per_class=args.per_class)
        result["step"] = step
    except _bad_input_errors() as e:
        message = str(e)
        if cfg is not None:
            message = run_dir.explain_missing_path(message, cfg)
        return _fail("jaxcnn-eval", message)
    except KeyboardInterrupt:
        return interrupted("jaxcnn-eval", argv is None)
    if args.json:
        print(json.dumps(result))
    else:
        _print_eval(result, run.num_classes, args.per_class)
    return 0


def _eval_config(run_dir, overrides):
    """``(config, trained class names or None)`` of the run directory for ``jaxcnn-eval``:
    the head is the one the run trained (its recorded config counts as
    ``model.extra_outputs=true``; a null ``model.num_classes`` is the trained class count),
    whatever classes the data evaluated on hold."""
    from jaxcnn.train.config import load_config
    trained = _trained_image_classes(run_dir)
    head = ["model.extra_outputs=true"]
    cfg = load_config(run_dir.config, head + list(overrides))
    use_compilation_cache(cfg.train.compilation_cache)
    if trained is not None and cfg.model.num_classes is None:
        cfg = load_config(run_dir.config, head + [f"model.num_classes={len(trained)}", *overrides])
    return cfg, trained


def _eval_run(run_dir, cfg, trained, *, check_classes: bool):
    """The ``Run`` that ``jaxcnn-eval`` evaluates: normalised as in training (the run's
    ``preprocessing.json``, as ``jaxcnn-export`` does), its image data's classes checked
    against the trained ones (``check_classes``) and compared with what the run recorded."""
    from jaxcnn.data.preprocessing import run_preprocessing, with_preprocessing
    from jaxcnn.errors import ConfigError, DataError
    from jaxcnn.train._build import build_run
    try:
        run = build_run(cfg)
    except ConfigError as e:
        if trained is None or e.path != "model.num_classes":
            raise
        raise DataError(f"data.path: {cfg.data.path} holds more classes than the {len(trained)} "
                        f"{run_dir.path} was trained on ({name_list(trained)}): the labels past "
                        "them have no output to score") from None
    prep = run_preprocessing(run_dir.path, run=run)
    if check_classes:
        _check_same_classes(run_dir, run, prep.class_names)
    run = with_preprocessing(run, prep)
    _warn_of_other_data(run_dir, run)
    return run


def _print_eval(result: dict, num_classes: int, per_class: bool) -> None:
    from jaxcnn.train.metrics import eval_line, per_class_lines
    from jaxcnn.train.step import MAX_CONFUSION_CLASSES
    print(f"step {result['step']}: {eval_line(result, num_classes)}")
    if "per_class" in result:
        print("\n".join(per_class_lines(result["per_class"])))
    elif per_class:
        print(f"(no per-class results: they are counted up to {MAX_CONFUSION_CLASSES:,} classes, "
              f"and the model has {num_classes:,})")


if __name__ == "__main__":
    sys.exit(train_main())
