"""Kill -9 at random points of a training run, then resume: nothing is lost and nothing changes.

Each chain trains the tiny run (16 steps, a checkpoint after every step) in a subprocess,
SIGKILLs it at a point drawn from a seeded generator (while a checkpoint is being written,
right after one is committed, or at a random time), restarts it with the default
``checkpoint.resume=auto`` and repeats; the last restart runs to the end. Checked:

* every restart resumes from the newest complete checkpoint on disk at the moment of the kill
  (or starts afresh when there is none), never from a half-written one;
* a ``params.npz`` left behind by a killed run is a complete file;
* the finished run's parameters and model state are bitwise equal to an uninterrupted run's.
"""
import os
import time
from typing import NamedTuple

import numpy as np
import pytest

import xla_cache
from jaxcnn.train.metrics import read_metrics

from reliability_lib import (Killable, assert_params_bitwise_equal, resumed_step, step_dirs, tiny_args,
                             tiny_npz, wait_for)

TOTAL_STEPS = 16


class Setup(NamedTuple):
    data: str
    cache: str
    reference: str      # params.npz of the uninterrupted run
    window_s: float     # how long the uninterrupted run took in process (time-based kills)


def run_args(setup_or_data, workdir):
    data = setup_or_data if isinstance(setup_or_data, str) else setup_or_data.data
    return tiny_args(data, f"train.steps={TOTAL_STEPS}", "checkpoint.every=1", "checkpoint.keep=3",
                     "--workdir", str(workdir))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The uninterrupted run, in this process: it compiles the killed runs' programs, which they
    load from the suite's compilation cache.  Its whole length (configuration to saved parameters,
    without a fresh interpreter's start) bounds the time-based kills, which wait from the killed
    run's precision line, before it loads its programs."""
    from jaxcnn.train.cli import train_main
    base = tmp_path_factory.mktemp("kill")
    data = tiny_npz(base / "d.npz")
    cache = xla_cache.directory() or str(base / "jax_cache")  # without the suite's: the killed runs'
    started = time.monotonic()
    assert train_main(run_args(data, base / "ref")) == 0
    return Setup(data, cache, str(base / "ref" / "params.npz"), time.monotonic() - started)


def _trigger(mode, proc, ckpt, start, rng, window_s):
    """Waits for the kill point of ``mode``; returns False when the run ended first."""
    if mode == "time":
        if not wait_for(lambda: proc.saw("[jaxcnn] precision"), proc):
            return False
        time.sleep(rng.uniform(0, window_s))
        return proc.alive()
    target = start + int(rng.integers(1, TOTAL_STEPS - start + 1))
    if mode == "mid_save":
        def writing():
            return any(int(name.split(".")[0]) >= target for name in step_dirs(ckpt)[1])
        return wait_for(writing, proc, poll=0.001)
    assert mode == "after_commit"
    return wait_for(lambda: os.path.isdir(os.path.join(ckpt, str(target))), proc, poll=0.001)


def kill_chain(setup, workdir, modes, rng):
    """Runs the tiny training in ``workdir``, killing it once per entry of ``modes``, then lets it finish
    (a run that ends before its kill point ends the chain).

    Returns ``(kills delivered, kills that left a half-written checkpoint behind)``.
    """
    ckpt = os.path.join(workdir, "checkpoints")
    expected, delivered, mid_write = None, 0, 0
    for mode in list(modes) + [None]:
        proc = Killable(run_args(setup, workdir), cache_dir=setup.cache)
        if mode is not None and _trigger(mode, proc, ckpt, expected or 0, rng, setup.window_s):
            code = proc.kill()
        else:
            code = proc.finish()
        out = proc.output
        # Where this run started from, when it got far enough to say.
        if proc.saw("resumed from step"):
            assert resumed_step(out) == expected, f"expected a resume from {expected}:\n{out}"
        elif proc.saw("first step took"):
            assert expected is None, f"started afresh although checkpoint {expected} exists:\n{out}"
        if code == 0:  # the last run, or one that finished before its kill point came
            break
        assert mode is not None and code == -9, out
        delivered += 1
        complete, partial = step_dirs(ckpt)
        mid_write += bool(partial)
        expected = complete[-1] if complete else None
        params = os.path.join(workdir, "params.npz")
        if os.path.exists(params):  # a killed run must not leave a truncated result behind
            from jaxcnn.interop import load_npz
            load_npz(params)
    assert_params_bitwise_equal(os.path.join(workdir, "params.npz"), setup.reference)
    assert step_dirs(ckpt)[1] == [], "a finished run left a half-written checkpoint behind"
    # metrics.jsonl holds each logged step once: the records of steps redone after a resume
    # replace those the killed run wrote, as if it had never been killed.
    records = read_metrics(workdir)
    for kind in ("train", "eval"):
        steps = [r["step"] for r in records if r["kind"] == kind]
        assert steps == sorted(set(steps)), f"{kind} records out of order or repeated: {steps}"
    return delivered, mid_write


def test_kill_during_checkpoint_write_and_after_commit_then_resume_is_bitwise(setup, tmp_path):
    rng = np.random.default_rng(0)
    delivered, mid_write = kill_chain(setup, str(tmp_path / "w"), ["mid_save", "after_commit"], rng)
    assert delivered == 2
    if mid_write == 0:  # the write finished between seeing it and the kill: try once more
        delivered, mid_write = kill_chain(setup, str(tmp_path / "w2"), ["mid_save"], rng)
    assert mid_write >= 1, "no kill landed while a checkpoint was being written"


@pytest.mark.slow
def test_kill_minus_9_at_random_points_20_times(setup, tmp_path):
    kills = mid_write = chains = 0
    seed = 0
    while kills < 20:
        rng = np.random.default_rng(1000 + seed)
        modes = list(rng.choice(["mid_save", "after_commit", "time"], size=3))
        got, mid = kill_chain(setup, str(tmp_path / f"chain{seed}"), modes, rng)
        kills, mid_write, chains, seed = kills + got, mid_write + mid, chains + 1, seed + 1
        assert seed < 30, f"only {kills} kills delivered in {seed} chains"
    print(f"\nkill -9 survived: {kills} kills in {chains} chains, {mid_write} during a checkpoint write")
    assert mid_write >= 3
