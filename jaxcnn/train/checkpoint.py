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
import gc
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
import yaml
from orbax.checkpoint import checkpoint_managers as ocp_managers

from jaxcnn.errors import CheckpointCorruptError, CheckpointError, ConfigChangedError  # noqa: F401  (re-exported)
from jaxcnn.train.config import config_changes, config_digest, other_model
from jaxcnn.train.rundir import RunDir

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


_CONFIG_WAYS_ON = ("start a new run with --workdir DIR, or continue this one under the new config "
                   "with checkpoint.on_config_change=continue")


def _summary(changes: list[str], limit: int = 6) -> str:
    more = f" (and {len(changes) - limit} more)" if len(changes) > limit else ""
    return ", ".join(changes[:limit]) + more


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


def _record_text(record: logging.LogRecord) -> str:
    """A log record's message with its traceback, as the checkpoint log keeps it."""
    text = record.getMessage()
    if record.exc_info:
        text += "\n" + "".join(traceback.format_exception(*record.exc_info))
    return text


def _unraisable_text(info) -> str:
    """An unraisable exception's report, as `sys.unraisablehook`'s default would print it."""
    lines = traceback.format_exception(info.exc_type, info.exc_value, info.exc_traceback) \
        if info.exc_value is not None else []
    return f"{info.err_msg or 'Exception ignored in'}: {info.object!r}\n" + "".join(lines)


class _OrbaxNoise:
    """While active, orbax's log records (its background threads log whole tracebacks before the
    error reaches us) and the unraisable exceptions of coroutines orbax abandons after a failed
    read or write go to `sink` (the manager's detail log) instead of stderr.

    Scoped: a filter on the `absl` and `orbax` loggers and `sys.unraisablehook`, both put back
    on exit. After a failure (`failed` set) the abandoned coroutines are collected before exit,
    so that their reports arrive while the sink is in place.
    """

    # asyncio: "Task/Future exception was never retrieved" for the tasks and tensorstore futures
    # orbax abandons, reported when they are collected.
    _LOGGERS = ("absl", "orbax", "asyncio")

    def __init__(self, sink):
        self.sink = sink
        self.failed = False
        self._hook = None

    def filter(self, record: logging.LogRecord) -> bool:
        text = _record_text(record)
        if "orbax" not in record.pathname and not record.name.startswith("orbax") and (
                record.name != "asyncio" or ("orbax" not in text and "never retrieved" not in text)):
            return True
        self.sink(f"{record.levelname} {record.name}: {text}")
        return False

    def _unraisable(self, info):
        self.sink(_unraisable_text(info))

    def __enter__(self):
        for name in self._LOGGERS:
            logging.getLogger(name).addFilter(self)
        self._hook, sys.unraisablehook = sys.unraisablehook, self._unraisable
        return self

    def __exit__(self, *exc_info):
        try:
            if self.failed or exc_info[0] is not None:
                gc.collect()
        finally:
            sys.unraisablehook = self._hook
            for name in self._LOGGERS:
                logging.getLogger(name).removeFilter(self)


def _from_orbax(info) -> bool:
    """Whether an unraisable exception was left by an orbax coroutine or task."""
    where = repr(info.object) + "".join(traceback.format_tb(info.exc_traceback)) \
        if info.exc_traceback is not None else repr(info.object)
    return "orbax" in where or "tensorstore" in where.lower()


def quiet_abandoned_orbax_coroutines(log_path: str | None = None) -> None:
    """For the command-line tools, which own their process: reports of exceptions in coroutines
    that orbax abandoned after a failed read ("Exception ignored in: <coroutine ...>", with a
    TensorStore spec of some 60 lines) go to `log_path` (or nowhere) instead of stderr, also when
    the coroutine is collected after the restore that failed has already reported it in one line.
    Every other unraisable exception still reaches the previous hook.
    """
    previous = sys.unraisablehook

    def hook(info):
        if not _from_orbax(info):
            return previous(info)
        _append(log_path, _unraisable_text(info))

    sys.unraisablehook = hook
    asyncio_log = logging.getLogger("asyncio")
    for f in [f for f in asyncio_log.filters if isinstance(f, _LateOrbaxFutures)]:
        asyncio_log.removeFilter(f)
    asyncio_log.addFilter(_LateOrbaxFutures(log_path))


def _append(log_path: str | None, text: str) -> None:
    if log_path is None:
        return
    try:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError:
        pass


class _LateOrbaxFutures(logging.Filter):
    """asyncio's "Future exception was never retrieved" for a TensorStore read that orbax
    abandoned after a failed restore: it is logged when the future is collected, which may be
    long after the restore reported the damage in one line (so `_OrbaxNoise` is gone by then).
    Such records go to `log_path` (or nowhere); every other asyncio record passes."""

    def __init__(self, log_path: str | None):
        super().__init__()
        self.log_path = log_path

    def filter(self, record: logging.LogRecord) -> bool:
        text = _record_text(record)
        if "never retrieved" not in text or not any(
                mark in text.lower() for mark in ("orbax", "tensorstore", "ocdbt")):
            return True
        _append(self.log_path, f"{record.levelname} {record.name}: {text}")
        return False


class DataFileError(Exception):
    """A data file of a checkpoint's database is missing or shorter than a value it holds."""


def _unreadable_value(directory: Path, batch: int = 16) -> tuple[str, Exception] | None:
    """The first value of an OCDBT checkpoint directory that cannot be read (a truncated or
    missing data file), as ``(key, error)``, or None when every value can be read.

    Found before orbax reads the same values: orbax gives up at the first failed read while the
    others are still in flight, and their completions then print "Event loop is closed"
    tracebacks from TensorStore's threads long after the damage was reported (nothing in Python
    can catch those). The check reads only the database's index (its manifest and b-tree nodes,
    a few KB for a model's state): each value it lists lies at a byte range of a data file,
    and the file must be there and reach that far (`_short_data_file`), which ``stat`` tells
    without reading the arrays (it read every value, in every process, before). An index this
    does not understand falls back to reading every value (`_unreadable_by_reading`). A
    directory that is not an OCDBT database, or whose manifest cannot be opened, is left to
    orbax (which reports it in one line: it has not started any read then).
    """
    if not (directory / "manifest.ocdbt").is_file():
        return None
    import tensorstore as ts

    try:
        base = ts.KvStore.open(f"file://{directory.resolve()}/").result()
        manifest = ts.ocdbt.dump(base).result()
    except Exception:  # noqa: BLE001 - orbax reports an unreadable index in its own words
        return None
    try:
        return _short_data_file(directory, base, manifest)
    except (KeyError, TypeError, ValueError, AttributeError):  # an index of another form
        return _unreadable_by_reading(directory, batch)


def _data_ref(text: str) -> tuple[str, int]:
    """``("BASE/REL", end)`` of an OCDBT reference ``"value:BASE:REL:OFFSET:LENGTH"`` (a value)
    or ``"btreenode:BASE:REL:OFFSET:LENGTH"`` (an index node): the file, relative to the
    database, and the byte just past the range."""
    head, offset, length = text.rsplit(":", 2)
    _, base, rel = head.split(":", 2)
    if not rel or int(offset) < 0 or int(length) < 0:
        raise ValueError(f"not a data reference: {text!r}")
    return base + rel, int(offset) + int(length)


def _key_text(key) -> str:
    """A key of the index dump (bytes), as text."""
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


def _short_data_file(directory: Path, base, manifest: dict) -> tuple[str, Exception] | None:
    """`_unreadable_value` from the index alone: walks the newest version's b-tree (dumping each
    node, which reads it) and checks every referenced data file's size with ``stat``."""
    import tensorstore as ts

    versions = manifest["versions"]
    if not versions:
        return None
    root = versions[-1]["root"].get("location")
    pending = [("the database index", root)] if root else []
    sizes = {}
    while pending:
        key, ref = pending.pop()
        rel, end = _data_ref(ref)
        if rel not in sizes:
            path = directory / rel
            sizes[rel] = path.stat().st_size if path.is_file() else None
        if sizes[rel] is None:
            return key, DataFileError(f"data file {directory / rel} is missing")
        if sizes[rel] < end:
            return key, DataFileError(f"data file {directory / rel} holds {sizes[rel]} bytes; "
                                      f"{key} ends at byte {end} (truncated)")
        if ref.startswith("btreenode:"):
            try:
                node = ts.ocdbt.dump(base, ref).result()
            except Exception as e:  # noqa: BLE001 - a damaged index node
                return key, e
            for entry in node["entries"]:
                name = _key_text(entry.get("key", entry.get("key_prefix", "")))
                pending.extend((name, v) for v in entry.values()
                               if isinstance(v, str) and v.startswith(("value:", "btreenode:")))
    return None


def _unreadable_by_reading(directory: Path, batch: int = 16) -> tuple[str, Exception] | None:
    """`_unreadable_value` by reading every value, synchronously and waiting for every read it
    started, `batch` at a time (dropped at once, so memory holds a few arrays at most)."""
    import tensorstore as ts

    try:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory.resolve()}/"}).result()
        keys = list(kv.list().result())
    except Exception:  # noqa: BLE001 - orbax reports an unreadable index in its own words
        return None
    first = None
    for start in range(0, len(keys), batch):
        reads = [(key, kv.read(key)) for key in keys[start:start + batch]]
        for key, read in reads:  # wait for every read started, failed or not
            try:
                read.result()
            except Exception as e:  # noqa: BLE001 - any failed read of a committed value is damage
                if first is None:
                    first = (key.decode(errors="replace"), e)
        if first is not None:
            return first
    return None


def _path_name(keypath) -> str:
    return jax.tree_util.keystr(keypath, simple=True, separator="/") or "<root>"


def _as_array(name: str, x):
    """Leaves are stored as arrays; Python and NumPy scalars become 0-d NumPy arrays."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"checkpoint leaf {name!r} is a typed PRNG key ({x.dtype}); store "
                "jax.random.key_data(key) (a uint32 array) instead")
        return x
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (np.generic, bool, int, float)):
        return np.asarray(x)
    raise TypeError(f"checkpoint leaf {name!r} has unsupported type {type(x).__name__}; "
                    "expected a jax.Array, numpy array or scalar")


def _named_leaves(tree) -> tuple[list[tuple[str, Any]], Any]:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(_path_name(kp), x) for kp, x in pairs], treedef


def _sha256(x) -> str | None:
    """sha256 of the array's bytes (C order) from a host copy; None when this process cannot see all of it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    host = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    return hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()


def _to_host(arrays: list) -> list:
    """NumPy copies of the arrays this process sees whole (what is hashed and written); others as they are.

    Writing host copies rather than `jax.Array`s keeps orbax off its device path, which
    splits each replicated array into one slice per device with a jitted slice program:
    for the 29-leaf train state of the test run on 8 CPU devices, the first save compiled
    56 programs that then held 87 MB of host memory for the life of the process.
    """
    whole = [i for i, x in enumerate(arrays) if isinstance(x, jax.Array) and x.is_fully_addressable]
    out = list(arrays)
    for i, host in zip(whole, jax.device_get([arrays[i] for i in whole])):  # one batched transfer
        out[i] = np.asarray(host)
    return out


def _describe(name: str, x) -> dict:
    return {"path": name, "shape": list(x.shape), "dtype": str(np.dtype(x.dtype)), "sha256": _sha256(x)}


def _abstract(name: str, x):
    """Restore target for one leaf: NumPy leaves come back as NumPy, everything else as jax.Array."""
    if isinstance(x, jax.ShapeDtypeStruct):
        # Without a sharding orbax falls back to the one saved in the checkpoint (or to
        # NumPy when that file is gone); the default device keeps the result predictable.
        if x.sharding is None:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return _as_array(name, x)  # orbax reads only the shape and dtype of a NumPy target


def _metric_value(metrics: Mapping | None, key: str) -> float | None:
    if not metrics or key not in metrics:
        return None
    value = float(metrics[key])
    return value if math.isfinite(value) else None


def _jsonable(metrics: Mapping | None) -> dict | None:
    if metrics is None:
        return None
    out = {}
    for k, v in metrics.items():
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} is not a number: {v!r}") from None
        # Strict JSON has no NaN/inf; "nan", "inf" and "-inf" read back through float().
        out[str(k)] = value if math.isfinite(value) else repr(value)
    return out


# tensorstore (which writes the arrays) reports OS errors as ValueError with this tag.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def _errno_of(exc: BaseException) -> int | None:
    """The OS error number behind a failed write: from an OSError in the chain or tensorstore's message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        if match := _OS_ERROR_CODE.search(str(exc)):
            return int(match.group(1))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


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
        with _OrbaxNoise(self._detail):  # read-only: orbax warns that it is, twice
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
        for step in self._listed_steps():
            path = self._step_path(step)
            if not (path / _COMMIT_MARKER).is_file():
                self._warn_once(f"ignoring half-written checkpoint {path}: no {_COMMIT_MARKER}")
            elif not (path / _META).is_dir():
                self._warn_once(f"ignoring checkpoint {path}: its manifest ({_META}/) is missing")
            else:
                steps.append(step)
        return sorted(steps)

    def _listed_steps(self) -> list[int]:
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
                value = _metric_value(self.metadata(step).get("metrics"), self.best_metric)
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
        leaves, treedef = _named_leaves(state)
        names = [name for name, _ in leaves]
        leaves = list(zip(names, _to_host([_as_array(name, x) for name, x in leaves])))
        meta = {"format": _FORMAT, "step": step, "arrays": [_describe(n, x) for n, x in leaves],
                "metrics": _jsonable(metrics), "config": config_dict,
                "config_digest": None if config_dict is None else config_digest(config_dict)}
        try:
            json.dumps(meta, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"config_dict/metrics for step {step} are not JSON-serialisable: {e}") from None
        rank = None
        if self.keep_best:
            value = _metric_value(metrics, self.best_metric)
            worst = -math.inf if self.best_mode == "max" else math.inf
            rank = {_RANK_KEY: worst if value is None else value}
        args = ocp.args.Composite(**{_STATE: ocp.args.StandardSave(treedef.unflatten([x for _, x in leaves])),
                                     _META: ocp.args.JsonSave(meta)})
        failure = None
        with _OrbaxNoise(self._detail) as noise:
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
        code = _errno_of(exc)
        cause = _brief(exc)
        if code is not None:
            cause = f"{errno.errorcode.get(code, 'errno')} (errno {code}): {os.strerror(code)}; {cause}"
        what = "a background checkpoint save" if step is None else f"saving checkpoint step {step}"
        return f"{what} to {self.directory} failed: {cause}; previous checkpoints are kept{self._where_detail()}"

    def _save_failed(self, message: str) -> bool:
        # Raised without the orbax exception chained: it holds the abandoned coroutines, whose
        # reports would reach stderr whenever it is freed (see _OrbaxNoise).
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
        with _OrbaxNoise(self._detail) as noise:
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
            with _OrbaxNoise(self._detail) as noise:
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
        # orbax's own listing, so that half-written directories are reported and moved aside too.
        for candidate in self._listed_steps():
            try:
                state = self._load(candidate, target)
            except CheckpointError as e:
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
        what = _summary(config_changes(saved, config)) if isinstance(saved, Mapping) else "its config digest differs"
        raise ConfigChangedError(f"checkpoint {self._step_path(step)} was trained under another config "
                                 f"({what}); {_CONFIG_WAYS_ON}")

    def _load(self, step: int, target):
        path = self._step_path(step)
        if not path.is_dir():
            steps = ", ".join(str(s) for s in sorted(self._listed_steps())) or "none"
            raise CheckpointError(f"no checkpoint for step {step}: {path} does not exist "
                                  f"(steps saved: {steps})")
        if not (path / _COMMIT_MARKER).is_file():
            raise CheckpointCorruptError(f"checkpoint {path} is half-written: no {_COMMIT_MARKER}")
        meta = self.metadata(step)
        if meta.get("step") != step:  # e.g. `cp -a 30 40`: the name is not what the files hold
            raise CheckpointCorruptError(f"checkpoint {path} holds step {meta.get('step')} by its manifest, "
                                         f"not {step} as named")
        saved = {entry["path"]: entry for entry in meta["arrays"]}
        named, treedef = _named_leaves(target)
        abstract = [_abstract(name, x) for name, x in named]
        self._check_matches(path, saved, [(name, a) for (name, _), a in zip(named, abstract)])
        unreadable = _unreadable_value(path / _STATE)
        if unreadable is not None:
            key, e = unreadable
            self._detail(f"reading value {key} of checkpoint {path / _STATE} failed:\n"
                         + "".join(traceback.format_exception(type(e), e, e.__traceback__)))
            raise CheckpointCorruptError(f"checkpoint {path / _STATE} could not be read ({key}: {_brief(e)})"
                                         f"{self._where_detail()}")
        failure = None
        with _OrbaxNoise(self._detail) as noise:
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
        named_restored = _named_leaves(restored)[0]
        for name, x in named_restored:
            entry = saved[name]
            if list(x.shape) != entry["shape"] or str(np.dtype(x.dtype)) != entry["dtype"]:
                raise CheckpointCorruptError(f"checkpoint {path / _STATE}: array {name!r} read back as "
                                             f"{x.dtype}{list(x.shape)}, saved as {entry['dtype']}{entry['shape']}")
            digest = entry["sha256"] and _sha256(x)
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
    if not manager._listed_steps():
        if resume == "must":
            raise CheckpointError(f"resume='must' but there is no checkpoint in {manager.directory}")
        return None
    step, state = manager.restore(target=target, config=config)
    # Newer checkpoints that do not match this run (another model's) would make orbax refuse every
    # save of this run up to their step: move them aside as well.
    manager._quarantine([s for s in manager._listed_steps() if s > step], _MISMATCH_SUFFIX,
                        "non-matching")
    return step, state


# -- the run directory's config and its history ---------------------------------------------------

CONFIG_FILE = RunDir.CONFIG  # re-exported names; the layout is RunDir's
CONFIG_HISTORY = RunDir.CONFIG_HISTORY


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
                                 f"({_summary(changes)}); with {why} this run starts afresh and would replace "
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
                                     f"({_summary(changes, 3)}); start a new run with --workdir DIR")
        raise ConfigChangedError(f"{workdir} was trained under another config ({_summary(changes)}); "
                                 f"{_CONFIG_WAYS_ON}")
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
            shutil.copyfile(path, os.path.join(history, "from_step_0.yaml"))
        _write_yaml(os.path.join(history, f"from_step_{int(step)}.yaml"), config_dict)
    _write_yaml(path, config_dict)


def _write_yaml(path: str, data: Mapping) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(data), f, sort_keys=False)
    os.replace(tmp, path)
