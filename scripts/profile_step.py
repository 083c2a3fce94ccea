#!/usr/bin/env python3
"""Where a jaxcnn training step spends its device time: kernels grouped by kind, then the top ones.

    python scripts/profile_step.py                                   # GPU: ResNet-50, batch 256, bf16
    python scripts/profile_step.py --model mnist_cnn --batch 128 --size 28 --channels 1 --policy fp32

Compiles the step (SGD momentum, synthetic batch), times ``--steps`` steps, then
traces ``--trace-steps`` more with ``jax.profiler`` and sums the device's kernel
times per step from the Perfetto trace: convolutions (cuDNN/CUTLASS), GEMMs,
reductions (BatchNorm statistics and their gradients), other XLA fusions, and
our own Pallas kernels (``jaxcnn_*``).  ``--out`` keeps the trace and the
compiled HLO.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import optax

from jaxcnn import functional as F
from jaxcnn import layers as L
from jaxcnn import models
from jaxcnn import precision as P
from jaxcnn.data import SyntheticSpec, synthetic_batch
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_train_step

KINDS = [("pallas", r"^jaxcnn_"),
         ("convolution", r"conv|cudnn|xmma|implicit|wgrad|dgrad|fprop"),
         ("gemm", r"gemm|cutlass|cublas|nvjet"),
         ("reduction fusion", r"reduc"),
         ("other fusion", r"fusion"),
         ("copy/memset", r"memcpy|memset|copy")]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def device_kernel_times(trace_file: str, steps: int) -> collections.Counter:
    """Microseconds per step of each kernel on a device (not host) track of the trace."""
    with gzip.open(trace_file) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, n in names.items() if "/device:" in n}
    totals: collections.Counter = collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in device:
            totals[e["name"]] += e.get("dur", 0) / steps
    return totals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--channels", type=int, default=3)
    p.add_argument("--classes", type=int, default=1000)
    p.add_argument("--policy", default="bf16")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--trace-steps", type=int, default=3)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--bn-grad", default="auto", choices=["auto", *F.BATCH_NORM_GRADS],
                   help="BatchNorm backward form (see F.batch_norm_train)")
    p.add_argument("--out", help="keep the trace and the HLO here")
    args = p.parse_args(argv)
    out = args.out or tempfile.mkdtemp(prefix="jaxcnn-profile-")
    os.makedirs(out, exist_ok=True)
    shape = (args.batch, args.size, args.size, args.channels)
    model = models.get(args.model, num_classes=args.classes)
    policy = P.get_policy(args.policy)
    tx = optax.sgd(0.01, momentum=0.9)
    state = create_train_state(model, tx, jax.random.PRNGKey(0), shape,
                               loss_scale=P.make_loss_scale(policy.default_loss_scale), policy=policy)
    data = jax.device_put(synthetic_batch(SyntheticSpec(shape[1:], args.classes), 0, seed=0,
                                          batch_size=args.batch))
    step = jax.jit(make_train_step(model, tx, policy=policy,
                                   choices=L.Choices(batch_norm_grad=args.bn_grad)).step,
                   donate_argnums=0)
    step = step.lower(state, data).compile()
    with open(f"{out}/step.hlo.txt", "w", encoding="utf-8") as f:
        f.write(step.as_text())
    for _ in range(2):
        state, m = step(state, data)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        state, m = step(state, data)
    jax.block_until_ready(m)
    wall = (time.perf_counter() - t0) / args.steps
    with jax.profiler.trace(f"{out}/trace", create_perfetto_trace=True):
        for _ in range(args.trace_steps):
            state, m = step(state, data)
        jax.block_until_ready(m)
    trace_file = sorted(glob.glob(f"{out}/trace/**/perfetto_trace.json.gz", recursive=True))[-1]
    totals = device_kernel_times(trace_file, args.trace_steps)
    busy = sum(totals.values())
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}: {args.model} batch {args.batch} "
          f"{args.size}x{args.size}x{args.channels} {args.policy} bn={args.bn_grad}: step {wall * 1e3:.2f} ms, "
          f"device kernels {busy / 1e3:.2f} ms/step")
    if not totals:
        print("(no device kernel track in the trace: on a CPU backend XLA runs on host threads)")
        return 0
    kinds: collections.Counter = collections.Counter()
    for name, t in totals.items():
        kinds[kind_of(name)] += t
    for k, t in kinds.most_common():
        print(f"  {k:<18} {t / 1e3:8.2f} ms  {t / busy:6.1%}")
    print(f"top {args.top} kernels (ms/step):")
    for name, t in totals.most_common(args.top):
        print(f"  {t / 1e3:8.3f}  {kind_of(name):<18} {name[:110]}")
    print(f"trace and HLO in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
