"""Keeping orbax's and asyncio's reports of checkpoint failures out of the user's terminal.

orbax logs whole tracebacks from its background threads, and asyncio reports its abandoned
coroutines and futures long after the failure that left them; the checkpoint manager reports
each failure in one line instead. Everything that filters them is here, so that it can be
deleted as a unit once orbax is quiet:

* :class:`OrbaxNoise`: around each orbax call of :class:`~jaxcnn.train.checkpoint.CheckpointManager`,
  its log records and unraisable exceptions go to the manager's detail log instead.
* :func:`quiet_abandoned_orbax_coroutines`: installed once by the command-line tools, for the
  reports that come after the manager has returned (at garbage collection or exit).
"""
from __future__ import annotations

import gc
import logging
import sys
import traceback


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


class OrbaxNoise:
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
    for f in [f for f in asyncio_log.filters if isinstance(f, LateOrbaxFutures)]:
        asyncio_log.removeFilter(f)
    asyncio_log.addFilter(LateOrbaxFutures(log_path))


def _append(log_path: str | None, text: str) -> None:
    if log_path is None:
        return
    try:
        with open(log_path, "a", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
    except OSError:
        pass


class LateOrbaxFutures(logging.Filter):
    """asyncio's "Future exception was never retrieved" for a TensorStore read that orbax
    abandoned after a failed restore: it is logged when the future is collected, which may be
    long after the restore reported the damage in one line (so `OrbaxNoise` is gone by then).
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
