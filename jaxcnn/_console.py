"""The console scripts' entry points (pyproject.toml ``[project.scripts]``).

Each imports its command's module only once it is running, inside its Ctrl-C handling: the
command's import (JAX, orbax, ...) takes 0.5-2 s, and a Ctrl-C in it (``jaxcnn-train --help``
interrupted) printed a ``KeyboardInterrupt`` traceback from the script's own ``from ...
import``. Now it is one line, ``PROG: interrupted``, and exit code 130, as once the command
runs. This module and ``jaxcnn/__init__`` (whose names load on first use) import nothing
heavy. Nothing else imports this module.
"""
from __future__ import annotations

import importlib
import os
import signal
import sys

_COMMANDS = {
    "jaxcnn-train": ("jaxcnn.train.cli", "train_main"),
    "jaxcnn-eval": ("jaxcnn.train.cli", "eval_main"),
    "jaxcnn-plot": ("jaxcnn.train.plot", "main"),
    "jaxcnn-export": ("jaxcnn.export.cli", "main"),
    "jaxcnn-predict": ("jaxcnn.predict", "main"),
    "jaxcnn-data": ("jaxcnn.data.cli", "main"),
}


def _interrupted(prog: str, own_process: bool = True) -> int:
    """One line and exit code 130, ending the process at once when the command owns it: the
    interpreter's exit after an import that Ctrl-C cut short (or under XLA threads still
    compiling) is no place to run exit hooks. Buffered output written before the signal is
    flushed first. Called with an ``argv`` (in a test's process), it returns 130."""
    if not own_process:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream: nothing more to say on it
            pass
    try:
        os.write(2, f"{prog}: interrupted\n".encode())
    finally:
        os._exit(130)
    return 130  # pragma: no cover (os._exit does not return)


def _import_main(prog: str, own_process: bool):
    """The command's entry function, imported with SIGINT ending the process at once (one
    line, exit 130) rather than raising ``KeyboardInterrupt``: raised while a C extension
    initialises (jaxlib's ``_jax`` imports NumPy), it came out as the extension's own
    traceback and an ``ImportError``. Nothing is lost: the command has not started."""
    module, func = _COMMANDS[prog]
    previous = None
    try:
        if own_process:
            previous = signal.signal(signal.SIGINT, lambda signum, frame: _interrupted(prog))
    except ValueError:  # not the main thread: no signal to handle here
        pass
    try:
        return getattr(importlib.import_module(module), func)
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


def run(prog: str, argv=None) -> int:
    """Runs the console script ``prog`` (a key of ``_COMMANDS``) on ``argv`` (None: the
    process's own arguments)."""
    try:
        main = _import_main(prog, argv is None)
        return main(argv)
    except KeyboardInterrupt:  # anywhere the command does not handle it
        return _interrupted(prog, argv is None)


def train(argv=None) -> int:
    return run("jaxcnn-train", argv)


def evaluate(argv=None) -> int:
    return run("jaxcnn-eval", argv)


def plot(argv=None) -> int:
    return run("jaxcnn-plot", argv)


def export(argv=None) -> int:
    return run("jaxcnn-export", argv)


def predict(argv=None) -> int:
    return run("jaxcnn-predict", argv)


def data(argv=None) -> int:
    return run("jaxcnn-data", argv)
