"""Long runs: host memory and step time stay flat, and nothing is compiled again after warm-up.

The tiny run goes through the real trainer (prefetch thread, logging, checkpoints with retention);
at every training log record the test samples the process's resident memory (VmRSS) and the
number of XLA compilations so far (JAX's ``backend_compile_duration`` monitoring event).
"""
import threading

import jax
import numpy as np
import pytest

import jaxcnn.train.loop as loop
from jaxcnn.train.cli import train_main
from jaxcnn.train.metrics import MetricsWriter
from reliability_lib import tiny_args, tiny_npz

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def soak(tmp_path, monkeypatch, steps, log_every, ckpt_every):
    """Trains ``steps`` steps; returns (samples, threads before, threads after) where samples are
    ``(step, rss bytes, step_time_ms, compilations so far)`` at each training log record."""
    compiles, samples = [], []

    def on_duration(event, duration, *args, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    class Sampling(MetricsWriter):
        def write(self, step, kind, values):
            super().write(step, kind, values)
            if kind == "train":
                samples.append((step, rss_bytes(), float(values["step_time_ms"]), len(compiles)))

    monkeypatch.setattr(loop, "MetricsWriter", Sampling)
    data = tiny_npz(tmp_path / "d.npz")
    threads = threading.active_count()
    jax.monitoring.register_event_duration_secs_listener(on_duration)
    try:
        code = train_main(tiny_args(data, f"train.steps={steps}", f"logging.log_every={log_every}",
                                    f"checkpoint.every={ckpt_every}", "checkpoint.keep=2", "logging.progress=none",
                                    "data.prefetch=2", "--workdir", str(tmp_path / "w")))
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
    assert code == 0
    return samples, threads, threading.active_count()


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


def test_short_soak_300_steps(tmp_path, monkeypatch):
    samples, before, after = soak(tmp_path, monkeypatch, steps=300, log_every=10, ckpt_every=50)
    assert [s[0] for s in samples] == list(range(10, 301, 10))
    assert samples[0][3] > 0  # the listener sees compilations: the warm-up compiled the step
    result = check_flat(samples, warm_step=60, max_growth=24 * 2**20, max_slowdown=2.0)
    assert after == before, "threads left behind (prefetcher)"
    print(f"\nshort soak: {result}")


@pytest.mark.slow
def test_soak_20000_steps(tmp_path, monkeypatch):
    samples, before, after = soak(tmp_path, monkeypatch, steps=20_000, log_every=200, ckpt_every=1000)
    result = check_flat(samples, warm_step=2000, max_growth=32 * 2**20, max_slowdown=2.0)
    # A leak shows as a trend that does not flatten. Memory taken by the first checkpoint saves
    # (allocator arenas of orbax's and tensorstore's threads) levels off within ~10 saves, so the
    # trend is fitted over the second half: 512 bytes per step would be 10 MB per 20,000 steps.
    late = [s for s in samples if s[0] >= 10_000]
    slope = np.polyfit([s[0] for s in late], [s[1] for s in late], 1)[0]
    assert slope < 512, f"RSS trend {slope:.0f} bytes per step over steps 10,000-20,000"
    assert after == before
    print(f"\nsoak: {result}, RSS trend over the second half {slope:.1f} bytes/step")
