"""Resuming a run: which checkpoint to continue from, and whether the run directory's config
and data allow it.

:func:`restore_for_resume` follows ``checkpoint.resume`` (auto, must, never) over a
:class:`~jaxcnn.train.checkpoint.CheckpointManager`; the ``check_*`` functions compare what the
run directory recorded (``config.resolved.yaml``, ``run_meta.json``) with the run about to
start, before any compute, and :func:`record_run_config` keeps every config a run was continued
under (``config_history/``). Which keys count as a change is the config schema's
(:func:`jaxcnn.train.config.config_changes`).
"""
from __future__ import annotations

import os
import shutil
from typing import Mapping

import yaml

from jaxcnn.data.files import write_bytes_whole, write_whole
from jaxcnn.errors import CheckpointError, ConfigChangedError
from jaxcnn.train.checkpoint import CONFIG_WAYS_ON, CheckpointManager
from jaxcnn.train.config import change_summary, config_changes, other_model
from jaxcnn.train.rundir import RunDir


def restore_for_resume(manager: CheckpointManager, target, resume: str = "auto", *,
                       config: Mapping | None = None):
    """Restores the state to resume training from, following the `resume` policy.

    Arguments:
        manager: the run's `CheckpointManager`.
        target: pytree giving structure, shapes, dtypes and shardings (see `restore`).
        resume: "auto" resumes from the newest good checkpoint, or returns None when the
            directory has none; "must" is "auto" but raises when there is none; "never"
            returns None without looking.
        config: the run's resolved config: a checkpoint saved under one that trains
            differently raises `ConfigChangedError` (see `CheckpointManager.restore`);
            None accepts any.

    Returns:
        (step, state) or None. Newer checkpoints passed over because they do not match
        `target` are renamed to `<step>.mismatch` (damaged ones to `<step>.corrupt`, see
        `CheckpointManager.restore`), so that the resumed run can save those steps again.

    Raises:
        CheckpointError: resume="must" and no checkpoint, or checkpoints exist but none
            is usable (damaged, or not matching `target`): starting afresh over them is
            not a decision to take silently.
    """
    if resume not in ("auto", "must", "never"):
        raise ValueError(f"resume must be 'auto', 'must' or 'never', got {resume!r}")
    if resume == "never":
        return None
    if not manager.listed_steps():
        if resume == "must":
            raise CheckpointError(f"resume='must' but there is no checkpoint in {manager.directory}")
        return None
    step, state = manager.restore(target=target, config=config)
    # Newer checkpoints that do not match this run (another model's) would make orbax refuse every
    # save of this run up to their step: move them aside as well.
    manager.set_aside_newer(step)
    return step, state


# -- the run directory's config and its history ---------------------------------------------------


def _has_checkpoints(directory) -> bool:
    return os.path.isdir(directory) and any(n.isdigit() for n in os.listdir(directory))


def _saved_run_config(path: str):
    """The config a run directory records (normalised through the schema when it validates, so
    that a file from an older jaxcnn compares by value), or a string saying why it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            saved = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"{path} cannot be read ({type(e).__name__})"
    if not isinstance(saved, Mapping):
        return f"{path} is not a mapping"
    from jaxcnn.train.config import ConfigError, config_from_dict, to_dict
    try:
        return to_dict(config_from_dict(saved, source=path))
    except ConfigError:
        return saved  # compared as written


def check_fresh_start(workdir: str, config_dict: Mapping | None = None, *,
                      why: str = "checkpoint.resume=never") -> None:
    """Before any compute, for a run that starts afresh whatever `workdir` holds
    (``checkpoint.resume: never``, or ``checkpoint.enabled: false``, given as `why`): a
    `CheckpointError` when `workdir` holds an earlier run's checkpoints, a `ConfigChangedError`
    when it holds the final parameters of a run under another training config (`config_dict`).
    A new run there could not save a checkpoint until it passed their newest step (orbax refuses
    older steps), its metrics went after theirs in ``metrics.jsonl``, and its config and
    ``params.npz`` replaced theirs beside them (with checkpoints off, silently)."""
    run_dir = RunDir(workdir)
    directory = run_dir.checkpoints
    if _has_checkpoints(directory):
        steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
        shown = ", ".join(map(str, steps[-5:]))
        raise CheckpointError(f"{why}, but {directory} holds the checkpoints of an earlier run "
                              f"(steps {'..., ' if len(steps) > 5 else ''}{shown}): a new run would mix with them; "
                              f"give it a new --workdir, or remove {directory} to start over")
    params = run_dir.find_params()
    if config_dict is None or params is None or not os.path.isfile(run_dir.config):
        return
    saved = _saved_run_config(run_dir.config)
    changes = [saved] if isinstance(saved, str) else config_changes(saved, config_dict)
    if changes:
        raise ConfigChangedError(f"{workdir} holds the final parameters ({params}) of a run under another config "
                                 f"({change_summary(changes)}); with {why} this run starts afresh and would replace "
                                 "them: give it a new --workdir DIR")


def check_resume_config(workdir: str, config_dict: Mapping, *, resume: str = "auto",
                        on_change: str = "stop") -> list[str]:
    """Before any compute: does resuming the run in `workdir` change how it trains?

    When `workdir/checkpoints` holds checkpoints that `resume` would continue from, compares
    the keys of `config_dict` that change the training math (`training_config`) with those of
    `workdir/config.resolved.yaml`.

    Returns:
        The changes, ``"key: old -> new"`` (empty: identical, or nothing to resume).

    Raises:
        ConfigChangedError: there are changes and `on_change` is "stop"; the message names the
            keys and the two ways on.
    """
    run_dir = RunDir(workdir)
    if resume == "never" or not _has_checkpoints(run_dir.checkpoints):
        return []
    path = run_dir.config
    if not os.path.isfile(path):
        return []  # the checkpoints' own config digests decide (restore_for_resume)
    saved = _saved_run_config(path)
    changes = [saved] if isinstance(saved, str) else config_changes(saved, config_dict)
    if changes and on_change == "stop":
        other = None if isinstance(saved, str) else other_model(saved, config_dict)
        if other is not None:  # continuing under another model cannot restore its checkpoints
            raise ConfigChangedError(f"{workdir} holds the checkpoints of {other} as configured "
                                     f"({change_summary(changes, 3)}); start a new run with --workdir DIR")
        raise ConfigChangedError(f"{workdir} was trained under another config ({change_summary(changes)}); "
                                 f"{CONFIG_WAYS_ON}")
    return changes


def recorded_data_changes(workdir: str, fingerprint) -> list[str]:
    """How the data `fingerprint` describes (`jaxcnn.data.ImageData.fingerprint`; None: a
    source that holds no such record) differ from those the run in `workdir` recorded in
    ``run_meta.json``, one phrase per change (`jaxcnn.data.images.data_changes`); empty when
    the same or nothing was recorded.  `check_resume_data` stops a resume on them;
    ``jaxcnn-eval`` warns."""
    if fingerprint is None:
        return []
    from jaxcnn.data.images import data_changes
    return data_changes(RunDir(workdir).read_meta().get("data"), fingerprint)


def check_resume_data(workdir: str, fingerprint, *, resume: str = "auto", on_change: str = "stop") -> list[str]:
    """Before any compute: did the data of the run in `workdir` change since it last ran?

    An image folder (or record directory) with images added, removed or renamed, or another
    set of classes, gives batches other than those the checkpoints were trained on, under the
    same config. `fingerprint` is the data's now (`jaxcnn.data.ImageData.fingerprint`; None for
    the sources that hold no such record), compared with the one ``run_meta.json`` recorded.

    Returns:
        The changes (empty: the same, nothing to resume, or nothing recorded).

    Raises:
        ConfigChangedError: there are changes and `on_change` is "stop"; the message names
            them and the two ways on.
    """
    run_dir = RunDir(workdir)
    if fingerprint is None or resume == "never" or not _has_checkpoints(run_dir.checkpoints):
        return []
    changes = recorded_data_changes(workdir, fingerprint)
    if changes and on_change == "stop":
        raise ConfigChangedError(
            f"{workdir} was trained on other data than {fingerprint['path']} holds now ({'; '.join(changes)}); "
            f"start a new run with --workdir DIR, or continue this one on the data as they are now "
            f"with checkpoint.on_config_change=continue")
    return changes


def record_run_config(workdir: str, config_dict: Mapping, step: int, changes: list[str]) -> None:
    """Writes `workdir/config.resolved.yaml`; when a run continues at `step` under a changed
    config, first keeps every config it ran under in `config_history/from_step_<N>.yaml`
    (N: the step from which that config applies; the run's first config is from_step_0)."""
    run_dir = RunDir(workdir)
    path = run_dir.config
    if changes and os.path.isfile(path):
        history = run_dir.config_history
        os.makedirs(history, exist_ok=True)
        if not any(n.startswith("from_step_") for n in os.listdir(history)):
            write_whole(os.path.join(history, "from_step_0.yaml"), lambda partial: shutil.copyfile(path, partial))
        _write_yaml(os.path.join(history, f"from_step_{int(step)}.yaml"), config_dict)
    _write_yaml(path, config_dict)


def _write_yaml(path: str, data: Mapping) -> None:
    write_bytes_whole(path, yaml.safe_dump(dict(data), sort_keys=False).encode())
