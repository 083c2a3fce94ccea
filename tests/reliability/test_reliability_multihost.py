"""Multi-process faults: a peer that never joins, or dies mid-run, ends every other process.

Two trainer processes on this machine form one run through ``jax.distributed`` (gloo collectives
on CPU), each with one CPU device. The survivor must exit with code 1, within the configured
``distributed.timeout_s`` of the fault (plus start-up), with one ``jaxcnn-train: error:`` line
naming the missing or lost process and the timeout: no Python traceback, no abort by XLA.
"""
import re
import socket
import time

import pytest

from reliability_lib import Killable, tiny_args, tiny_npz, wait_for

TIMEOUT_S = 10
# Start-up (imports, a first compilation on a loaded 2-core machine) on top of the timeout.
SLACK_S = 60
# What XLA prints when it ends a process itself (fatal log line, C++ terminate, abort).
XLA_FATAL = ("Terminating process because", "terminate called", "Check failed", "*** SIGABRT",
             "Fatal Python error")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_args(data, workdir, port, pid, steps=4):
    return tiny_args(data, f"train.steps={steps}", "checkpoint.enabled=false", "logging.log_every=50",
                     "data.batch_size=8", "distributed.mode=on", f"distributed.coordinator_address=127.0.0.1:{port}",
                     "distributed.num_processes=2", f"distributed.process_id={pid}",
                     f"distributed.timeout_s={TIMEOUT_S}", "--workdir", str(workdir))


def start(args):
    """One trainer process with a single CPU device (the suite's 8-device flag is for in-process tests)."""
    import os
    env_flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = env_flags.replace("--xla_force_host_platform_device_count=8", "")
    try:
        return Killable(args)
    finally:
        os.environ["XLA_FLAGS"] = env_flags


def assert_ended_clearly(proc: Killable, since: float, what: str, expected: str, limit_s: float):
    """Exit code 1 within ``limit_s`` of ``since``, and one error line matching ``expected`` that
    names the timeout; nothing from XLA ending the process and no Python traceback."""
    code = proc.finish(timeout=TIMEOUT_S + SLACK_S + 60)
    elapsed = time.monotonic() - since
    out = proc.output
    assert code == 1, f"{what}: exit code {code}\n{out[-3000:]}"
    assert "Traceback (most recent call last)" not in out, f"{what}: Python traceback\n{out[-3000:]}"
    fatal = [m for m in XLA_FATAL if m in out]
    assert not fatal, f"{what}: XLA ended the process ({fatal})\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("jaxcnn-train: error:")]
    assert len(errors) == 1, f"{what}: {len(errors)} error lines\n{out[-3000:]}"
    assert re.search(expected, errors[0]), f"{what}: {errors[0]!r} does not match {expected!r}"
    assert re.search(rf"\b{TIMEOUT_S} s\b|timeout_s={TIMEOUT_S} s", errors[0]), errors[0]
    assert elapsed < limit_s, f"{what}: took {elapsed:.1f} s (limit {limit_s} s)"
    print(f"\n{what}: exit {code} after {elapsed:.1f} s: {errors[0]}")
    return elapsed


def assert_worker_ended_after_coordinator_died(proc: Killable, since: float):
    """Known limitation (docs/RELIABILITY.md): a worker learns of the coordinator's death from two
    sides at once, its failed gloo collective (the trainer's line) and JAX's coordination client,
    whose error poll fails at once and makes XLA end the process (its one ``Terminating process``
    line, then SIGABRT after a C++ stack trace). Whichever comes first ends it, within a second."""
    code = proc.finish(timeout=TIMEOUT_S + SLACK_S + 60)
    elapsed = time.monotonic() - since
    out = proc.output
    assert code != 0, f"exit code 0\n{out[-3000:]}"
    assert "Traceback (most recent call last)" not in out, f"Python traceback\n{out[-3000:]}"
    ours = [line for line in out.splitlines() if line.startswith("jaxcnn-train: error:")]
    assert len(ours) <= 1, out[-3000:]
    xla = "Terminating process because the JAX distributed service detected fatal errors"
    assert (ours and re.search(r"process 1 of 2 lost process 0 \(the coordinator\) during a collective.*"
                               rf"timeout_s={TIMEOUT_S} s", ours[0])) \
        or (xla in out and "leader task was preempted/died" in out), out[-3000:]
    assert elapsed < TIMEOUT_S, f"took {elapsed:.1f} s"
    said = ours[0] if ours else next(line for line in out.splitlines() if xla in line)
    print(f"\nprocess 1 after process 0 died: exit {code} after {elapsed:.1f} s: {said[:200]}")


@pytest.mark.parametrize("present", [0, 1])
def test_peer_that_never_joins_ends_the_other_process(tmp_path, present):
    """Only process ``present`` starts; the other one never does."""
    data = tiny_npz(tmp_path / "d.npz")
    port = free_port()
    started = time.monotonic()
    proc = start(process_args(data, tmp_path / "w", port, present))
    expected = (r"^jaxcnn-train: error: process 0 of 2: process 1 never joined within 10 s" if present == 0
                else rf"^jaxcnn-train: error: process 1 of 2 could not reach coordinator 127\.0\.0\.1:{port} "
                     r"within 10 s")
    elapsed = assert_ended_clearly(proc, started, f"process {present} alone", expected, TIMEOUT_S + SLACK_S)
    assert elapsed >= TIMEOUT_S, f"gave up after {elapsed:.1f} s, before distributed.timeout_s"


@pytest.mark.parametrize("victim", [1, 0])
def test_peer_killed_mid_run_ends_the_other_process(tmp_path, victim):
    """Process ``victim`` is killed (SIGKILL) while both train; 0 is the coordinator."""
    data = tiny_npz(tmp_path / "d.npz")
    port = free_port()
    procs = [start(process_args(data, tmp_path / "w", port, pid, steps=100_000)) for pid in (0, 1)]
    try:
        # Only process 0 prints; the steps are collective, so process 1 is training too.
        assert wait_for(lambda: procs[0].saw("first step (compilation included)"), procs[0], timeout=240,
                        poll=0.1), procs[0].output + procs[1].output
        procs[victim].kill()
        killed_at = time.monotonic()
        if victim == 1:
            # The step's gloo collective fails at once; the survivor does not wait for the coordination
            # service's heartbeat timeout (XLA would abort it then).
            assert_ended_clearly(procs[0], killed_at, "process 0 after process 1 died",
                                 r"^jaxcnn-train: error: process 0 of 2 lost process 1 during a collective",
                                 TIMEOUT_S)
        else:
            assert_worker_ended_after_coordinator_died(procs[1], killed_at)
    finally:
        for proc in procs:
            if proc.alive():
                proc.kill()
