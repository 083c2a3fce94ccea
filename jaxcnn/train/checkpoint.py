"""Train-state checkpoints: orbax-checkpoint underneath, an integrity manifest on top.

orbax does the writing: one directory per step, written under a temporary name
(`<step>.orbax-checkpoint-tmp`), given a `commit_success.txt` marker and then
renamed, so a checkpoint is visible only when complete; it also does async saves,
multi-host coordination, retention and restoring onto other shardings. What orbax
does not do is notice damaged bytes, so every checkpoint carries a JSON manifest
(path, shape, dtype and sha256 of each array, computed from the host copy at save
time) that is checked on every restore before the state is handed back.

Layout of one checkpoint::

    <directory>/<step>/commit_success.txt   orbax's commit marker
    <directory>/<step>/state/               the pytree (orbax StandardSave: OCDBT + zarr)
    <directory>/<step>/meta/metadata        JSON: format, step, arrays manifest, metrics, config,
                                            config_digest (of the keys that change the training math)
    <directory>/<step>/metrics/metrics      orbax's copy of the ranking metric (keep_best only)

No pickle anywhere: arrays are tensorstore files, everything else is JSON.

A checkpoint is damaged (skipped for the previous one) when any of these disagree: its
directory name, the step in its manifest and the `step` leaf of its state; its arrays and
their manifest. Each damaged checkpoint is reported in one line; the full error (tensorstore's
spec, orbax's background-thread tracebacks) goes to the manager's `log_path` when it has one.
"""
from __future__ import annotations

import errno
import json
import logging
import math
import os
import shutil
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as ocp_managers

from jaxcnn.errors import CheckpointCorruptError, CheckpointError, ConfigChangedError  # noqa: F401  (re-exported)
from jaxcnn.train import _checkpoint_files as files
from jaxcnn.train._orbax_noise import OrbaxNoise
from jaxcnn.train.config import change_summary, config_changes, config_digest

logger = logging.getLogger(__name__)

_STATE, _META = "state", "meta"
_FORMAT = 1
# orbax 0.12 writes this file into the step directory before the final rename
# (and uses it alone as the marker on filesystems without atomic rename), so a
# step directory without it was not produced by a completed save.
_COMMIT_MARKER = "commit_success.txt"
_TMP_MARK = ".orbax-checkpoint-tmp"
_QUARANTINE_SUFFIX = ".corrupt"
_MISMATCH_SUFFIX = ".mismatch"
_LINK_SUFFIX = ".symlink"
_RANK_KEY = "rank"
_ENTRY_KEYS = {"path", "shape", "dtype", "sha256"}


CONFIG_WAYS_ON = ("start a new run with --workdir DIR, or continue this one under the new config "
                   "with checkpoint.on_config_change=continue")


# -- one line per failure; the detail to a log file ----------------------------------------------

def _brief(exc: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of the innermost cause (tensorstore's own error, not orbax's wrapper
    with the whole TensorStore spec), at most `limit` characters."""
    seen, inner = set(), exc
    while True:
        nxt = inner.__cause__ or inner.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(inner))
        inner = nxt
    text = str(inner).strip().splitlines()
    text = text[0] if text else ""
    text = text.split(" See full TensorStore details")[0]
    if len(text) > limit:
        text = text[:limit] + "..."
    return f"{type(inner).__name__}: {text}"


# How often a read-only restore lists the checkpoints again when the ones it was reading were
# removed under it (a training run's retention, checkpoint.keep=1, while jaxcnn-eval reads).
_RELISTS = 5


class CheckpointManager:
    """Keeps the last `keep` train-state checkpoints in `directory` (plus the best one).

    Arguments:
        directory: folder holding one sub-folder per saved step; created if missing.
        keep: how many of the most recent checkpoints to keep (>= 1).
        keep_best: also keep the checkpoint with the best `best_metric`, however old.
        best_metric: key in the `metrics` passed to `save` that ranks checkpoints.
        best_mode: "max" or "min": whether a larger or smaller metric is better.
        on_error: what a failed save does: "stop" raises `CheckpointError`, "warn"
            logs a warning and returns False. Previous checkpoints stay intact either way.
        async_save: write in a background thread (`save` returns once the arrays are
            copied to host); errors then surface in the next `save` or in `wait`.
        read_only: never change the directory (for evaluation): nothing is created, removed
            or renamed; damaged checkpoints are reported and passed over, symbolic links
            are passed over, and saving is refused.
        log_path: file to which the full detail of each failed save or restore is appended
            (e.g. `<run dir>/checkpoints.log`); None: the detail goes to this module's logger at
            DEBUG level. The warning or error itself is always one line.
        step_leaf: path of the state's leaf that holds its step (e.g. "step" for a
            `TrainState`): a checkpoint whose leaf disagrees with its name is damaged.

    A state is any pytree (nested dicts, tuples, NamedTuples such as optax states)
    of jax/NumPy arrays; scalars are stored as 0-d NumPy arrays, typed PRNG keys
    are refused (store `jax.random.key_data(key)`). Arrays this process sees whole
    are copied to host once per save and written from that copy; `restore` places
    them back on the target's shardings.
    """

    def __init__(self, directory, *, keep: int = 3, keep_best: bool = False,
                 best_metric: str = "eval/top1", best_mode: str = "max",
                 on_error: str = "stop", async_save: bool = False, read_only: bool = False,
                 log_path=None, step_leaf: str | None = None):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {best_mode!r}")
        if on_error not in ("stop", "warn"):
            raise ValueError(f"on_error must be 'stop' or 'warn', got {on_error!r}")
        self.directory = Path(directory).absolute()
        self.keep, self.keep_best = keep, keep_best
        self.best_metric, self.best_mode, self.on_error = best_metric, best_mode, on_error
        self.read_only, self.step_leaf = read_only, step_leaf
        self.log_path = None if log_path is None else Path(log_path)
        self._warned: set[str] = set()
        if read_only:
            if not self.directory.is_dir():
                raise CheckpointError(f"{self.directory} does not exist: no checkpoints")
        else:
            self.directory.mkdir(parents=True, exist_ok=True)
            for tmp in sorted(self.directory.glob(f"*{_TMP_MARK}*")):
                logger.warning("ignoring half-written checkpoint %s (an interrupted save); removing it", tmp)
                if jax.process_index() == 0:  # now: orbax's own cleanup may still run when a save starts
                    shutil.rmtree(tmp, ignore_errors=True)
            self._set_aside_links()

        policies = [ocp_managers.LatestN(keep)]
        best_fn = None
        if keep_best:
            # orbax ranks ascending and keeps the last n; checkpoints saved without
            # the metric carry the worst possible value so they never rank as best.
            best_fn = lambda m: m[_RANK_KEY]  # noqa: E731
            policies.append(ocp_managers.BestN(get_metric_fn=best_fn, reverse=best_mode == "min", n=1,
                                               keep_checkpoints_without_metrics=False))
        with OrbaxNoise(self._detail):  # read-only: orbax warns that it is, twice
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=async_save, create=not read_only,
                cleanup_tmp_directories=not read_only, read_only=read_only,
                best_fn=best_fn, best_mode=best_mode,
                preservation_policy=ocp_managers.AnyPreservationPolicy(policies))
            self._mgr = ocp.CheckpointManager(self.directory, options=options, item_names=(_STATE, _META))

    def _set_aside_links(self):
        """Renames step entries that are symbolic links to `<step>.symlink`.

        Checkpoints are never written as links, and orbax would restore from a link's target and,
        at retention time, try to delete through it (failing the save that triggered the cleanup).
        Renaming moves the link only; whatever it points to is never read or deleted.
        """
        if jax.process_index() != 0:
            return
        for entry in sorted(self.directory.iterdir()):
            if entry.name.isdigit() and entry.is_symlink():
                aside = entry.with_name(entry.name + _LINK_SUFFIX)
                try:
                    entry.rename(aside)
                    logger.warning("checkpoint entry %s is a symbolic link (to %s), which is never written here; "
                                   "moved it to %s without touching its target", entry, os.readlink(aside), aside)
                except OSError as e:
                    logger.warning("could not move the symbolic link %s aside: %s", entry, e)

    # -- listing ---------------------------------------------------------------------------

    def _step_path(self, step: int) -> Path:
        return self.directory / str(step)

    def _warn_once(self, message: str):
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s", message)

    def all_steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending.

        A step directory without orbax's commit marker or without the manifest is a
        half-written save: it is left out with a warning naming its path. Checking the
        array bytes needs a full read and happens in `restore`.
        """
        steps = []
        for step in self.listed_steps():
            path = self._step_path(step)
            if not (path / _COMMIT_MARKER).is_file():
                self._warn_once(f"ignoring half-written checkpoint {path}: no {_COMMIT_MARKER}")
            elif not (path / _META).is_dir():
                self._warn_once(f"ignoring checkpoint {path}: its manifest ({_META}/) is missing")
            else:
                steps.append(step)
        return sorted(steps)

    def listed_steps(self) -> list[int]:
        """Every step directory orbax lists, damaged ones included, newest first (read-only: not
        symbolic links, which a writable manager moves aside)."""
        steps = sorted(self._mgr.all_steps(), reverse=True)
        if self.read_only:
            for step in [s for s in steps if self._step_path(s).is_symlink()]:
                self._warn_once(f"passing over checkpoint {self._step_path(step)}: a symbolic link")
                steps.remove(step)
        return steps

    def _detail(self, text: str):
        """Appends the full story of a failure to `log_path` (process 0), else logs it at DEBUG."""
        if self.log_path is None or self.read_only or jax.process_index() != 0:
            logger.debug("%s", text)
            return
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text.rstrip()}\n")
        except OSError:  # e.g. the full disk that made the save fail
            logger.debug("%s", text)

    def _where_detail(self) -> str:
        return "" if self.log_path is None or self.read_only else f" (details in {self.log_path})"

    def latest_step(self) -> int | None:
        """The newest committed step, or None when there is none."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def metadata(self, step: int) -> dict:
        """The JSON saved with `step`: {"format", "step", "arrays", "metrics", "config"}."""
        path = self._step_path(step)
        try:
            meta = self._mgr.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))[_META]
        except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing
            raise CheckpointCorruptError(
                f"manifest of checkpoint {path} is missing or unreadable ({_brief(e)})") from None
        arrays = meta.get("arrays") if isinstance(meta, dict) else None
        if (not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(arrays, list)
                or not all(isinstance(e, dict) and _ENTRY_KEYS <= e.keys() for e in arrays)):
            raise CheckpointCorruptError(f"manifest of checkpoint {path} is malformed (format {_FORMAT} expected)")
        return meta

    def best_step(self) -> int | None:
        """The step whose saved metrics have the best finite `best_metric` (latest on ties), or None."""
        best = None
        for step in self.all_steps():
            try:
                value = files.metric_value(self.metadata(step).get("metrics"), self.best_metric)
            except CheckpointError as e:
                self._warn_once(str(e))
                continue
            if value is None:
                continue
            if best is None or (value >= best[0] if self.best_mode == "max" else value <= best[0]):
                best = (value, step)
        return None if best is None else best[1]

    # -- saving ----------------------------------------------------------------------------

    def save(self, step: int, state, *, metrics: Mapping | None = None,
             config_dict: Mapping | None = None, force: bool = False) -> bool:
        """Saves `state` as checkpoint `step`; returns whether a checkpoint was written.

        Arguments:
            step: training step (>= 0). Without `force`, a step not newer than the latest
                saved one is skipped (returns False, with a warning).
            state: the pytree to store (see the class docstring).
            metrics: optional {name: number}, stored in the manifest; `best_metric` ranks
                checkpoints for `keep_best`.
            config_dict: optional JSON-serialisable resolved config, stored in the manifest.
            force: save even if `step` is not newer than the latest checkpoint (a step
                that already exists still raises `CheckpointError`).

        Returns False (on_error="warn") or raises `CheckpointError` (on_error="stop") when
        writing fails, e.g. with a full disk; the previous checkpoints are kept.
        """
        step = int(step)
        if self.read_only:
            raise CheckpointError(f"cannot save step {step}: {self.directory} was opened read-only")
        if not force and not self._mgr.should_save(step):
            logger.warning("not saving checkpoint for step %d in %s: latest saved step is %s",
                           step, self.directory, self._mgr.latest_step())
            return False
        leaves, treedef = files.named_leaves(state)
        names = [name for name, _ in leaves]
        leaves = list(zip(names, files.to_host([files.as_array(name, x) for name, x in leaves])))
        meta = {"format": _FORMAT, "step": step, "arrays": [files.describe(n, x) for n, x in leaves],
                "metrics": files.jsonable(metrics), "config": config_dict,
                "config_digest": None if config_dict is None else config_digest(config_dict)}
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"config_dict/metrics for step {step} are not JSON-serialisable: {e}") from None
        rank = None
        if self.keep_best:
            value = files.metric_value(metrics, self.best_metric)
            worst = -math.inf if self.best_mode == "max" else math.inf
            rank = {_RANK_KEY: worst if value is None else value}
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(treedef.unflatten([x for _, x in leaves])),
                                     _META: ocp.args.JsonSave(meta)})
        failure = None
        with OrbaxNoise(self._detail) as noise:
            try:
                return bool(self._mgr.save(step, args=args, metrics=rank, force=force))
            except ocp.checkpoint_manager.StepAlreadyExistsError:
                failure = f"checkpoint for step {step} already exists at {self._step_path(step)}"
            except Exception as e:  # noqa: BLE001 - the state was validated above: what fails here is the write
                noise.failed = True
                failure = self._save_failure(step, e)
        if failure.startswith("checkpoint for step"):
            raise CheckpointError(failure)
        return self._save_failed(failure)

    def _save_failure(self, step: int | None, exc: Exception) -> str:
        """The one-line message of a failed save (the full traceback goes to the detail log)."""
        self._detail("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
        if step is not None and jax.process_index() == 0:
            self._remove_partial(step)
        code = files.errno_of(exc)
        cause = _brief(exc)
        if code is not None:
            cause = f"{errno.errorcode.get(code, 'errno')} (errno {code}): {os.strerror(code)}; {cause}"
        what = "a background checkpoint save" if step is None else f"saving checkpoint step {step}"
        return f"{what} to {self.directory} failed: {cause}; previous checkpoints are kept{self._where_detail()}"

    def _save_failed(self, message: str) -> bool:
        # Raised without the orbax exception chained: it holds the abandoned coroutines, whose
        # reports would reach stderr whenever it is freed (see OrbaxNoise).
        if self.on_error == "stop":
            raise CheckpointError(message)
        logger.warning("%s", message)
        return False

    def _remove_partial(self, step: int):
        """Deletes the temporary directory of a failed save, which would otherwise sit on a full disk.

        tensorstore writes of the other arrays are still in flight when the error reaches
        us and may recreate files, so removal repeats until the directory stays gone.
        """
        quiet = 0
        for _ in range(100):
            leftovers = list(self.directory.glob(f"{step}{_TMP_MARK}*"))
            for tmp in leftovers:
                shutil.rmtree(tmp, ignore_errors=True)
            quiet = 0 if leftovers else quiet + 1
            if quiet == 3:
                return
            time.sleep(0.05)
        logger.warning("could not remove the partial checkpoint of step %d in %s; it is removed at the next start",
                       step, self.directory)

    def wait(self):
        """Blocks until a background save has finished (a no-op for synchronous saves)."""
        failure = None
        with OrbaxNoise(self._detail) as noise:
            try:
                self._mgr.wait_until_finished()
            except Exception as e:  # noqa: BLE001
                noise.failed = True
                failure = self._save_failure(None, e)
        if failure is not None:
            self._save_failed(failure)

    def close(self):
        """Waits for pending saves and releases orbax's resources."""
        # orbax's close() does not wait for the clean-up of old temporary directories that its
        # constructor starts on a thread: a process ending right after (a refused resume) had
        # that thread fail at interpreter shutdown with a 40-line traceback after its error line.
        pending = getattr(self._mgr, "_cleanup_tmp_directory_future", None)
        if pending is not None:
            with OrbaxNoise(self._detail) as noise:
                try:
                    pending.result()
                except Exception as e:  # noqa: BLE001 - a failed clean-up loses nothing
                    noise.failed = True
                    self._detail(f"cleaning up temporary checkpoint directories failed: {_brief(e)}")
        self._mgr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    # -- restoring -------------------------------------------------------------------------

    def restore(self, step: int | None = None, *, target, config: Mapping | None = None) -> tuple[int, Any]:
        """Restores a checkpoint onto the structure, shapes, dtypes and shardings of `target`.

        Arguments:
            step: the step to restore; None restores the newest checkpoint that passes
                every check, falling back to older ones (each rejected one is logged in
                one line with its path once an older one is restored, and all of them in the
                one error when none is; unless the manager is read-only, damaged ones newer
                than the one restored are renamed to `<step>.corrupt` so that later saves
                of those steps are possible, while ones that merely do not match `target`
                are left in place).
            target: a pytree like the saved state, of arrays or `jax.ShapeDtypeStruct`s
                (with `sharding` to restore sharded). NumPy leaves come back as NumPy.
            config: the resolved config the state is restored for, or None. When given,
                a checkpoint saved under a config that trains differently (its
                `config_digest`, see `training_config`) raises `ConfigChangedError`
                instead of being restored; a checkpoint saved without a config is accepted.

        Returns:
            (step, state) with `state` verified against the manifest: same paths, shapes
            and dtypes as `target`, and each array's sha256 equal to the saved one.

        Raises:
            CheckpointError: no checkpoint, an explicit `step` that fails a check, or (step
                None) no checkpoint that passes; the message names the path and the fault.
        """
        if step is not None:
            state = self._load(int(step), target)
            self._check_config(int(step), config)
            return int(step), state
        failures = []
        for _ in range(_RELISTS):
            # orbax's own listing, so that half-written directories are reported and moved aside too.
            vanished = False
            for candidate in self.listed_steps():
                try:
                    state = self._load(candidate, target)
                except CheckpointError as e:
                    if self.read_only and not self._step_path(candidate).exists():
                        vanished = True  # the training run's retention removed it while it was read
                        continue
                    failures.append((candidate, e))
                    continue
                self._check_config(candidate, config)
                # Said only now that an older one is used: when none is, the one error below names
                # them all (a warning each before it made N + 1 lines).
                for _, e in failures:
                    logger.warning("%s; using checkpoint %d instead", e, candidate)
                if not self.read_only:
                    self._quarantine([s for s, e in failures if isinstance(e, CheckpointCorruptError)])
                return candidate, state
            if not vanished:
                break
            self._mgr.reload()  # the newer checkpoints the training run saved meanwhile
            failures = []
        if not failures:
            raise CheckpointError(f"no checkpoint to restore in {self.directory}")
        mismatches = [getattr(e, "problems", None) for _, e in failures]
        if all(mismatches):  # not damaged: another model's (or another layout's) arrays
            steps = ", ".join(str(s) for s, _ in failures)
            example = next((p for p in mismatches[0] if p.startswith("'params/")), mismatches[0][0])
            raise CheckpointError(f"no usable checkpoint in {self.directory}: its checkpoints (steps {steps}) "
                                  f"hold arrays that differ from this run's state ({example}, and "
                                  f"{len(mismatches[0]) - 1} more, in {self._step_path(failures[0][0])}): "
                                  "another model's or optimiser's; start a new run with --workdir DIR")
        raise CheckpointError(f"no usable checkpoint in {self.directory}: "
                              + "; ".join(str(e) for _, e in failures))

    def _check_config(self, step: int, config: Mapping | None):
        """Raises `ConfigChangedError` when checkpoint `step` was saved under a config that trains
        differently from `config`. Checkpoints without a recorded config pass (older ones)."""
        if config is None:
            return
        meta = self.metadata(step)
        saved, digest = meta.get("config"), meta.get("config_digest")
        if digest is None and isinstance(saved, Mapping):
            digest = config_digest(saved)
        if digest is None or digest == config_digest(config):
            return
        if isinstance(saved, Mapping) and not config_changes(saved, config):
            return  # saved before keys were added that this config leaves at their defaults
        what = change_summary(config_changes(saved, config)) if isinstance(saved, Mapping) else "its config digest differs"
        raise ConfigChangedError(f"checkpoint {self._step_path(step)} was trained under another config "
                                 f"({what}); {CONFIG_WAYS_ON}")

    def _load(self, step: int, target):
        path = self._step_path(step)
        if not path.is_dir():
            steps = ", ".join(str(s) for s in sorted(self.listed_steps())) or "none"
            raise CheckpointError(f"no checkpoint for step {step}: {path} does not exist "
                                  f"(steps saved: {steps})")
        if not (path / _COMMIT_MARKER).is_file():
            raise CheckpointCorruptError(f"checkpoint {path} is half-written: no {_COMMIT_MARKER}")
        meta = self.metadata(step)
        if meta.get("step") != step:  # e.g. `cp -a 30 40`: the name is not what the files hold
            raise CheckpointCorruptError(f"checkpoint {path} holds step {meta.get('step')} by its manifest, "
                                         f"not {step} as named")
        saved = {entry["path"]: entry for entry in meta["arrays"]}
        named, treedef = files.named_leaves(target)
        abstract = [files.abstract(name, x) for name, x in named]
        self._check_matches(path, saved, [(name, a) for (name, _), a in zip(named, abstract)])
        unreadable = files.unreadable_value(path / _STATE)
        if unreadable is not None:
            key, e = unreadable
            self._detail(f"reading value {key} of checkpoint {path / _STATE} failed:\n"
                         + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
            raise CheckpointCorruptError(f"checkpoint {path / _STATE} could not be read ({key}: {_brief(e)})"
                                         f"{self._where_detail()}")
        failure = None
        with OrbaxNoise(self._detail) as noise:
            try:
                restored = self._mgr.restore(step, args=ocp.args.Composite(
                    **{_STATE: ocp.args.StandardRestore(treedef.unflatten(abstract))}))[_STATE]
            except Exception as e:  # noqa: BLE001 - a failed read of committed files is damage
                noise.failed = True
                self._detail(f"reading checkpoint {path / _STATE} failed:\n"
                             + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
                failure = (f"checkpoint {path / _STATE} could not be read ({_brief(e)})"
                           f"{self._where_detail()}")
        if failure is not None:  # raised unchained, see _save_failed
            raise CheckpointCorruptError(failure)
        named_restored = files.named_leaves(restored)[0]
        for name, x in named_restored:
            entry = saved[name]
            if list(x.shape) != entry["shape"] or str(np.dtype(x.dtype)) != entry["dtype"]:
                raise CheckpointCorruptError(f"checkpoint {path / _STATE}: array {name!r} read back as "
                                             f"{x.dtype}{list(x.shape)}, saved as {entry['dtype']}{entry['shape']}")
            digest = entry["sha256"] and files.sha256(x)
            if digest and digest != entry["sha256"]:
                raise CheckpointCorruptError(f"checkpoint {path / _STATE}: array {name!r} fails its sha256 "
                                             f"check (saved {entry['sha256'][:16]}..., read {digest[:16]}...)")
        for name, x in named_restored:
            if name == self.step_leaf and (value := int(np.asarray(jax.device_get(x)))) != step:
                raise CheckpointCorruptError(f"checkpoint {path / _STATE}: its state is at step {value}, "
                                             f"not {step} as named")
        return restored

    @staticmethod
    def _check_matches(path: Path, saved: dict, target: list):
        problems = []
        for name, x in target:
            entry = saved.get(name)
            if entry is None:
                problems.append(f"{name!r} is in the target but not in the checkpoint")
            elif entry["shape"] != list(x.shape) or entry["dtype"] != str(np.dtype(x.dtype)):
                problems.append(f"{name!r} is {entry['dtype']}{tuple(entry['shape'])} in the checkpoint, "
                                f"{np.dtype(x.dtype)}{tuple(x.shape)} in the target")
        wanted = dict(target)
        problems += [f"{name!r} is in the checkpoint but not in the target" for name in saved if name not in wanted]
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            error = CheckpointError(f"checkpoint {path} does not match the target: "
                                    + "; ".join(problems[:5]) + more)
            error.problems = problems
            raise error

    def set_aside_newer(self, step: int):
        """Renames every checkpoint newer than ``step`` to ``<step>.mismatch``: a resumed run
        continues from ``step`` and will save those steps again (orbax would refuse every save
        up to a newer step it lists)."""
        self._quarantine([s for s in self.listed_steps() if s > step], _MISMATCH_SUFFIX, "non-matching")

    def _quarantine(self, steps: list[int], suffix: str = _QUARANTINE_SUFFIX, what: str = "damaged"):
        """Renames damaged step directories so orbax no longer counts them (it skips newer steps otherwise)."""
        if not steps or self.read_only or jax.process_index() != 0:
            return
        for step in steps:
            path = self._step_path(step)
            aside, n = path.with_name(path.name + suffix), 1
            while aside.exists():  # the same step was damaged before
                n += 1
                aside = path.with_name(f"{path.name}{suffix}-{n}")
            try:
                path.rename(aside)
                logger.warning("moved %s checkpoint %s to %s", what, path, aside)
            except OSError as e:
                logger.warning("could not move damaged checkpoint %s aside: %s", path, e)
        self._mgr.reload()
