"""Shared pieces of the fault-injection suite: a tiny training run, subprocess runs, comparisons.

The tiny run is ``mnist_cnn`` on a 96-image 10x10 ``.npz`` dataset at batch 8: real training
through the real trainer (``jaxcnn.train.cli``), small enough to run many times. Subprocess runs
share a JAX persistent compilation cache, so only the first one pays for compilation; the
cache holds the same executables a fresh compile makes, so results stay bitwise comparable.
"""
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import xla_cache

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "mnist_cnn.yaml")

# orbax writes a step under this name and renames it to "<step>" once complete.
TMP_MARK = ".orbax-checkpoint-tmp"
COMMIT_MARKER = "commit_success.txt"


def tiny_npz(path, seed=0, n_train=64, n_test=32, classes=4):
    """A learnable 10x10 grey-level dataset (brightness encodes the label) as an ``.npz``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, n_train + n_test)
    x = (rng.random((n_train + n_test, 10, 10)) * 60 + labels[:, None, None] * 50).astype(np.uint8)
    np.savez(path, x_train=x[:n_train], y_train=labels[:n_train], x_test=x[n_train:], y_test=labels[n_train:])
    return str(path)


def tiny_args(data_path, *extra):
    """Config file and overrides of the tiny run (constant lr, so its length does not change a step)."""
    return [CONFIG, "model.name=mnist_cnn", "data.source=npz", f"data.path={data_path}",
            "data.batch_size=8", "data.eval_batch_size=32", "data.prefetch=1", "optim.name=adam",
            "optim.lr=0.003", "optim.schedule.name=constant", "train.eval_every=null",
            "logging.log_every=1", "logging.progress=lines", *extra]


CHECKPOINTED_STEPS = 12

# orbax leaves tensorstore callbacks behind after a failed read or write; they report at a later
# garbage collection (see tests/train/test_checkpoint.py), which the tests force at their end.
ORBAX_LEFTOVER_WARNINGS = [
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
    pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")]


def checkpointed_args(data, workdir, *extra):
    """A CHECKPOINTED_STEPS-step tiny run with a checkpoint every 2 steps, all of them kept."""
    return tiny_args(data, f"train.steps={CHECKPOINTED_STEPS}", "checkpoint.every=2",
                     "checkpoint.keep=10", "logging.log_every=4", *extra, "--workdir", str(workdir))


def subprocess_env(cache_dir=None):
    """Environment of a trainer subprocess: this checkout first on the path, unbuffered output, and
    the suite's matmul precision (tests/conftest.py sets it with jax.config, which no subprocess
    inherits): a run in this process and one in a subprocess compile the same programs, so the
    subprocess loads them from a shared cache and their parameters compare bit for bit."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    if jax.config.jax_default_matmul_precision is not None:
        env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
    if cache_dir is not None:
        env.update(xla_cache.jax_cache_vars(cache_dir))
    return env


def train_command(args):
    return [sys.executable, "-m", "jaxcnn.train.cli", *map(str, args)]


def run_cli(args, *, cache_dir=None, timeout=300):
    """Runs ``jaxcnn-train`` to completion in a subprocess; returns the CompletedProcess (text)."""
    return subprocess.run(train_command(args), env=subprocess_env(cache_dir), capture_output=True,
                          text=True, timeout=timeout)


class Killable:
    """A trainer subprocess whose output is collected by a thread, so the test can watch and kill it."""

    def __init__(self, args, *, cache_dir=None):
        self.proc = subprocess.Popen(train_command(args), env=subprocess_env(cache_dir), text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def saw(self, text: str) -> bool:
        return any(text in line for line in list(self.lines))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self):
        self.proc.kill()  # SIGKILL: no handler runs, nothing is flushed or cleaned up
        return self.finish()

    def finish(self, timeout=300):
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=30)
        return self.proc.returncode


def wait_for(condition, proc: Killable, timeout=300, poll=0.002):
    """Polls ``condition()`` until true (returns True) or the process ends first (returns False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if not proc.alive():
            return bool(condition())
        time.sleep(poll)
    raise TimeoutError(f"condition not met in {timeout} s; output so far:\n{proc.output}")


def step_dirs(ckpt_dir):
    """``(complete, partial)``: steps renamed into place with orbax's commit marker and our manifest,
    and names of the directories of saves still in progress (or killed)."""
    complete, partial = [], []
    if not os.path.isdir(ckpt_dir):
        return complete, partial
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name)
        if TMP_MARK in name:
            partial.append(name)
        elif name.isdigit() and os.path.isfile(os.path.join(path, COMMIT_MARKER)) \
                and os.path.isdir(os.path.join(path, "meta")):
            complete.append(int(name))
    return sorted(complete), sorted(partial)


def resumed_step(output: str):
    """The step a trainer run reported resuming from, or None when it started afresh."""
    found = re.findall(r"resumed from step (\d+):", output)
    return int(found[-1]) if found else None


def flatten(tree, prefix=""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield prefix + key, np.asarray(value)


def assert_params_bitwise_equal(path_a, path_b):
    """The ``params.npz`` (parameters and model state) of two runs hold identical bits."""
    from jaxcnn.interop import load_npz
    a, b = (dict(flatten({"params": p, "state": s})) for p, s in (load_npz(path_a), load_npz(path_b)))
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert a[key].tobytes() == b[key].tobytes(), f"{key} differs between {path_a} and {path_b}"
