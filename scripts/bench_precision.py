#!/usr/bin/env python3
"""Step time and peak device memory of one training step, fp32 against bf16.

    python scripts/bench_precision.py                      # ResNet-50, batch 256, 224x224 (GPU-sized)
    python scripts/bench_precision.py --batch 8 --size 64  # a CPU-sized run

Both policies train the same model on the same synthetic ImageNet-shaped batch
each in a fresh child process (a device's peak-memory counter only ever
grows, so one process would report the larger run's peak for both);
compilation is excluded and the median of ``--iters`` timed steps is
reported, with the ratio bf16 / fp32.  Peak memory is the device's own peak
where the backend reports it (GPU), else XLA's compiled memory analysis of the
step (arguments + outputs + temporaries).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax

from jaxcnn import models
from jaxcnn import precision as P
from jaxcnn.data import SyntheticSpec, synthetic_batch
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_train_step


def measure(model_name, policy_name, batch, size, classes, iters, warmup):
    policy = P.get_policy(policy_name)
    model = models.get(model_name, num_classes=classes)
    tx = optax.sgd(0.1, momentum=0.9)
    state = create_train_state(model, tx, jax.random.PRNGKey(0), (batch, size, size, 3),
                               loss_scale=P.make_loss_scale(policy.default_loss_scale), policy=policy)
    host = synthetic_batch(SyntheticSpec((size, size, 3), classes), 0, seed=0, batch_size=batch)
    data = jax.device_put(host)
    step = jax.jit(make_train_step(model, tx, policy=policy).step, donate_argnums=0)
    compiled = step.lower(state, data).compile()
    analysis = compiled.memory_analysis()
    static_bytes = None
    if analysis is not None:
        static_bytes = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes
                        + analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
    for _ in range(warmup):
        state, m = compiled(state, data)
    jax.block_until_ready(m)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        state, m = compiled(state, data)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    stats = jax.devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return {"policy": policy_name, "step_s": statistics.median(times), "img_s": batch / statistics.median(times),
            "peak_bytes": peak, "compiled_bytes": static_bytes, "loss": float(m["loss"])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--policy", help=argparse.SUPPRESS)  # internal: measure one, print JSON
    args = p.parse_args(argv)
    if args.policy:
        print(json.dumps(measure(args.model, args.policy, args.batch, args.size, args.classes,
                                 args.iters, args.warmup)))
        return 0
    dev = jax.devices()[0]
    print(f"device: {dev.device_kind} ({jax.default_backend()}), jax {jax.__version__}, "
          f"model {args.model}, batch {args.batch}, {args.size}x{args.size}x3")
    rows = []
    for name in ("fp32", "bf16"):
        child = subprocess.run(
            [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
             "--policy", name], capture_output=True, text=True, check=False)
        if child.returncode != 0:
            print(f"error: the {name} run failed:\n{child.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))

    def mib(x):
        return "n/a" if x is None else f"{x / 2**20:,.0f} MiB"

    print(f"{'policy':8} {'step':>10} {'img/s':>10} {'peak memory':>14} {'compiled step':>14}")
    for r in rows:
        print(f"{r['policy']:8} {r['step_s'] * 1000:8.1f}ms {r['img_s']:10.1f} {mib(r['peak_bytes']):>14} "
              f"{mib(r['compiled_bytes']):>14}")
    fp32, bf16 = rows
    print(f"bf16/fp32 step time ratio: {bf16['step_s'] / fp32['step_s']:.3f} "
          f"(speed-up {fp32['step_s'] / bf16['step_s']:.2f}x)")
    for key in ("peak_bytes", "compiled_bytes"):
        if fp32[key] and bf16[key]:
            print(f"bf16/fp32 {key.replace('_', ' ')} ratio: {bf16[key] / fp32[key]:.3f}")
    if not all(np.isfinite(r["loss"]) for r in rows):
        print("error: a non-finite loss", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
