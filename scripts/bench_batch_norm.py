#!/usr/bin/env python3
"""Training BatchNorm, forward + backward per layer, against PyTorch's ``nn.BatchNorm2d``.

    python scripts/bench_batch_norm.py [--batch 128] [--dtype float32] [--reps 15]
                                       [--grads explicit,autodiff,closed_form]
                                       [--shapes 32x32x64,...] [--json out.json]

At each BatchNorm shape of ResNet-18 on CIFAR (32x32x64, 16x16x128, 8x8x256, 4x4x512;
batch 128) it times, in the same process, one training step of the layer alone:
``F.batch_norm_train`` in each ``--grads`` form (forward, then the backward of a given
output cotangent, the statistics' cotangents zero, as a network sees them) and PyTorch's
``nn.BatchNorm2d`` forward and ``backward`` in its default NCHW layout and in
channels-last; then the same with the ReLU that follows it in the network (jaxcnn's
``relu=True``, PyTorch's ``nn.ReLU`` after the layer).  Each figure is the median of
``--reps`` calls after warm-up; the ratio column is each row's time over PyTorch's NCHW
one.  ``jaxcnn.cpu.configure()`` runs first, as the command-line tools do, so PyTorch
shares jaxcnn's malloc settings in this process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxcnn import functional as F  # noqa: E402

SHAPES = ((32, 32, 64), (16, 16, 128), (8, 8, 256), (4, 4, 512))


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def jaxcnn_step(x, dy, grad: str, relu: bool):
    """A compiled step: ``(y, dx, dscale, dbias)`` of the layer for cotangent ``dy``."""
    c = x.shape[-1]
    scale, bias = jnp.ones((c,), jnp.float32), jnp.zeros((c,), jnp.float32)
    zeros = jnp.zeros((c,), jnp.float32)

    def step(x, scale, bias, dy):
        out, pull = jax.vjp(lambda *a: F.batch_norm_train(*a, grad=grad, relu=relu),
                            x, scale, bias)
        return out[0], pull((dy, zeros, zeros))
    compiled = jax.jit(step).lower(x, scale, bias, dy).compile()
    return lambda: jax.block_until_ready(compiled(x, scale, bias, dy))


def torch_step(x, dy, relu: bool, channels_last: bool):
    import torch
    layer = torch.nn.BatchNorm2d(x.shape[-1])
    tx = torch.from_numpy(np.ascontiguousarray(np.asarray(x, np.float32).transpose(0, 3, 1, 2)))
    tdy = torch.from_numpy(np.ascontiguousarray(np.asarray(dy, np.float32).transpose(0, 3, 1, 2)))
    if channels_last:
        tx = tx.contiguous(memory_format=torch.channels_last)
        tdy = tdy.contiguous(memory_format=torch.channels_last)
    tx.requires_grad_(True)

    def step():
        tx.grad = None
        layer.zero_grad(set_to_none=True)
        y = layer(tx)
        if relu:
            y = torch.relu(y)
        y.backward(tdy)
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--grads", default=",".join(F.BATCH_NORM_GRADS))
    parser.add_argument("--shapes", default=",".join("x".join(map(str, s)) for s in SHAPES),
                        help="comma-separated HxWxC (default: ResNet-18-CIFAR's)")
    parser.add_argument("--json", help="also write the rows here")
    opts = parser.parse_args(argv)
    grads = opts.grads.split(",")
    try:
        shapes = [tuple(int(v) for v in s.split("x")) for s in opts.shapes.split(",")]
    except ValueError:
        parser.error(f"--shapes: expected HxWxC,..., got {opts.shapes!r}")
    for g in grads:
        if g not in F.BATCH_NORM_GRADS:
            parser.error(f"--grads: unknown {g!r}; choose from {F.BATCH_NORM_GRADS}")
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    print(f"# {jax.devices()[0].device_kind}  jax {jax.__version__}  torch {torch_version}  "
          f"batch {opts.batch}  {opts.dtype}")
    rng = np.random.default_rng(0)
    rows = []
    for relu in (False, True):
        for hwc in shapes:
            shape = (opts.batch, *hwc)
            x = jnp.asarray(rng.standard_normal(shape, np.float32) + 0.5, opts.dtype)
            dy = jnp.asarray(rng.standard_normal(shape, np.float32), opts.dtype)
            times = {f"jaxcnn {g}": median_ms(jaxcnn_step(x, dy, g, relu), opts.reps)
                     for g in grads}
            if torch_version and opts.dtype == "float32":
                times["torch NCHW"] = median_ms(torch_step(x, dy, relu, False), opts.reps)
                times["torch channels-last"] = median_ms(torch_step(x, dy, relu, True),
                                                         opts.reps)
            ref = times.get("torch NCHW")
            for name, ms in times.items():
                rows.append({"shape": list(shape), "relu": relu, "impl": name, "ms": ms,
                             "vs_torch": ms / ref if ref else None})
                print(f"{'BN+ReLU' if relu else 'BN':8s} {str(hwc):16s} {name:22s} "
                      f"{ms:9.2f} ms" + (f"  {ms / ref:5.2f}x torch NCHW" if ref else ""),
                      flush=True)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "torch": torch_version, "argv": sys.argv, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
