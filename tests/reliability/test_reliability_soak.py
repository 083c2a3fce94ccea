"""Long runs: host memory and step time stay flat, and nothing is compiled again after warm-up.

The tiny run goes through the real trainer (prefetch thread, logging, checkpoints with retention);
at every training log record the test samples the process's resident memory (VmRSS) and the
number of XLA compilations so far (JAX's ``backend_compile_duration`` monitoring event). The long
soak runs in a fresh process, as ``jaxcnn-train`` does (the trainer caps glibc's malloc arenas
when it starts, which only a process that has not started JAX's threads yet can do).
"""
import json
import os
import subprocess
import sys
import threading

import jax
import numpy as np
import pytest

from jaxcnn.train import _build, _plan
from jaxcnn.train.cli import train_main
from jaxcnn.train.metrics import MetricsWriter
from reliability_lib import subprocess_env, tiny_args, tiny_npz

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(workdir, steps, log_every, ckpt_every):
    """Trains ``steps`` steps in this process; returns (samples, threads before, threads after)
    where samples are ``(step, rss bytes, step_time_ms, compilations so far)`` at each training
    log record."""
    compiles, samples = [], []

    def on_duration(event, duration, *args, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    class Sampling(MetricsWriter):
        def write(self, step, kind, values):
            super().write(step, kind, values)
            if kind == "train":
                samples.append((step, rss_bytes(), float(values["step_time_ms"]), len(compiles)))

    data = tiny_npz(os.path.join(workdir, "d.npz"))
    threads = threading.active_count()
    runner = sys.modules["jaxcnn.train.run"]  # the module (jaxcnn.train.run is the function)
    original, runner.MetricsWriter = runner.MetricsWriter, Sampling
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        code = train_main(tiny_args(data, f"train.steps={steps}", f"logging.log_every={log_every}",
                                    f"checkpoint.every={ckpt_every}", "checkpoint.keep=2", "logging.progress=none",
                                    "data.prefetch=2", "--workdir", os.path.join(workdir, "w")))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        runner.MetricsWriter = original
    assert code == 0
    return samples, threads, threading.active_count()


def soak_in_fresh_process(workdir, **kwargs):
    """:func:`soak` in a new Python process (this file run as a script)."""
    done = subprocess.run([sys.executable, __file__, str(workdir), json.dumps(kwargs)], env=subprocess_env(),
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    samples, before, after = json.loads(done.stdout.strip().splitlines()[-1])
    return [tuple(s) for s in samples], before, after


def check_flat(samples, warm_step, max_growth, max_slowdown):
    """After ``warm_step``: no compilation, RSS growth under ``max_growth`` bytes, and the fastest
    logging interval of the last quarter at most ``max_slowdown`` times slower than the fastest of the
    first quarter (the fastest, because other jobs on the machine only ever add time: a step that
    really gets slower, e.g. by recompiling or by work growing with the step count, moves it too)."""
    warm = [s for s in samples if s[0] >= warm_step]
    steps, rss, step_ms, compiled = (np.array(c) for c in zip(*warm))
    assert compiled[-1] == compiled[0], f"{compiled[-1] - compiled[0]} compilations after step {warm_step}"
    growth = int(rss[-1] - rss[0])
    assert growth < max_growth, f"RSS grew {growth / 2**20:.1f} MiB from step {steps[0]} to {steps[-1]}"
    quarter = max(1, len(warm) // 4)
    early, late = step_ms[:quarter].min(), step_ms[-quarter:].min()
    assert late < max_slowdown * early + 1.0, f"step time went from {early:.2f} ms to {late:.2f} ms"
    return {"steps": int(steps[-1]), "rss_start_mib": round(float(rss[0]) / 2**20, 1),
            "rss_growth_mib": round(growth / 2**20, 2), "rss_max_growth_mib": round(float(rss.max() - rss[0]) / 2**20, 2),
            "step_ms_early": round(float(early), 2), "step_ms_late": round(float(late), 2),
            "compilations_after_warmup": int(compiled[-1] - compiled[0])}


def test_short_soak_300_steps(tmp_path):
    samples, before, after = soak(tmp_path, steps=300, log_every=10, ckpt_every=50)
    assert [s[0] for s in samples] == list(range(10, 301, 10))
    assert samples[0][3] > 0  # the listener sees compilations: the warm-up compiled the step
    result = check_flat(samples, warm_step=60, max_growth=24 * 2**20, max_slowdown=2.0)
    assert after == before, "threads left behind (prefetcher)"
    print(f"\nshort soak: {result}")


def test_checkpoint_save_compiles_nothing_and_restores_onto_the_shardings(tmp_path):
    """A save writes host copies of the arrays: nothing is compiled (orbax's device path compiled
    a slice program per leaf and device, 56 of them holding 87 MB for this state on 8 devices), and
    restoring puts every array back bit for bit on the sharding it had."""
    from jaxcnn.train.checkpoint import CheckpointManager
    from jaxcnn.train.config import load_config

    args = tiny_args(tiny_npz(tmp_path / "d.npz"))
    cfg = load_config(args[0], args[1:])
    run = _build.build_run(cfg)
    plan = _plan.make_plan(cfg, run.model, run.input_shape, _build.abstract_state(run))
    state = jax.jit(lambda: _build.init_state(run), out_shardings=plan.state_shardings)()
    assert len(state.params["fc1"]["w"].sharding.device_set) == 8
    compiles = []

    def on_duration(event, duration, *args, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    with CheckpointManager(tmp_path / "ck", keep=2) as manager:
        jax.monitoring.register_event_duration_secs_listener(on_duration)
        try:
            assert manager.save(1, state)
        finally:
            jax.monitoring.unregister_event_duration_listener(on_duration)
        step, restored = manager.restore(target=plan.abstract_state)
    assert step == 1 and compiles == [], f"{len(compiles)} compilations during a save"
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves(restored)):
        assert b.sharding == a.sharding, path
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes() and a.dtype == b.dtype, path


@pytest.mark.slow
def test_soak_20000_steps(tmp_path):
    samples, before, after = soak_in_fresh_process(tmp_path, steps=20_000, log_every=200, ckpt_every=1000)
    result = check_flat(samples, warm_step=2000, max_growth=32 * 2**20, max_slowdown=2.0)
    # A leak shows as a trend that does not flatten, so the trend is fitted over the second half
    # (the first saves start orbax's and tensorstore's threads): 512 bytes per step would be
    # 10 MB per 20,000 steps.
    late = [s for s in samples if s[0] >= 10_000]
    slope = np.polyfit([s[0] for s in late], [s[1] for s in late], 1)[0]
    assert slope < 512, f"RSS trend {slope:.0f} bytes per step over steps 10,000-20,000"
    assert after == before
    print(f"\nsoak: {result}, RSS trend over the second half {slope:.1f} bytes/step")


if __name__ == "__main__":  # run by soak_in_fresh_process: WORKDIR JSON-KWARGS -> JSON on the last line
    jax.config.update("jax_default_matmul_precision", "highest")  # as tests/conftest.py sets it
    print(json.dumps(soak(sys.argv[1], **json.loads(sys.argv[2]))))
