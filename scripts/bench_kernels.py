#!/usr/bin/env python3
"""Times the Pallas kernels against XLA (cuDNN on a GPU), per shape, in the same run.

Usage::

    python scripts/bench_kernels.py [--tune] [--dtype bfloat16] [--groups resnet50,pool]
                                    [--batch N] [--repeats 20] [--json out.json] [--force]

Shapes (batch 256 unless ``--batch``; the MNIST CNN at 128):

- ``resnet50``: ResNet-50's 3x3 convolutions (56²x64, 28²x128, 14²x256, 7²x512);
- ``stem``: the 7x7 stride-2 stem on 224²x3;
- ``mobilenet``: MobileNetV2's depthwise 3x3 layers (stride 1 and 2);
- ``mnist``: the MNIST CNN's two convolutions;
- ``pool``: ResNet's 3x3 stride-2 max-pool on 112²x64;
- ``fused``: BatchNorm-apply + ReLU fused into the 3x3 convolution's input
  load (``pallas_kernels.bn_relu_conv2d``) against XLA's ``conv(relu(x*s+t))``.

Per shape it prints the forward time of the kernel and of XLA, their ratio
(XLA / Pallas: above 1 means the kernel is faster), the kernel's TFLOP/s and
GB/s (minimum traffic: inputs read once, output written once), the fraction of
the roofline it reaches (the larger of FLOPs / peak and bytes / measured
bandwidth, over the measured time), and the forward+backward times and ratio.
The bandwidth is measured in the same run (an elementwise pass over 1 GiB);
the peak FLOP/s comes from the device-kind table (dense bf16, TF32 for
float32).  ``--tune`` runs the autotuner for each shape first and so fills
the cache ``impl="auto"`` reads; a shape already in that cache (the user's, not
the shipped table) is not tuned again unless ``--retune``, so a run cut short
resumes where it stopped.

On a CPU backend the kernels run in the Pallas interpreter, which is no
benchmark: the script says so and exits 0 unless ``--force``.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels as pk
from jaxcnn import functional as F
from jaxcnn.functional import tuning
from jaxcnn.summary import peak_flops
from pallas_kernels import autotune

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _bench_common as bc  # noqa: E402
finally:
    sys.path.pop(0)

# (group, name, op, x shape NHWC, static kwargs, weight shape HWIO or None, batch)
_R = dict(padding=1)
SHAPES = [
    ("resnet50", "res3x3 56x64", "conv2d", (56, 56, 64), _R, (3, 3, 64, 64), 256),
    ("resnet50", "res3x3 28x128", "conv2d", (28, 28, 128), _R, (3, 3, 128, 128), 256),
    ("resnet50", "res3x3 14x256", "conv2d", (14, 14, 256), _R, (3, 3, 256, 256), 256),
    ("resnet50", "res3x3 7x512", "conv2d", (7, 7, 512), _R, (3, 3, 512, 512), 256),
    ("stem", "stem 7x7/2", "conv2d", (224, 224, 3), dict(stride=2, padding=3), (7, 7, 3, 64), 256),
    ("mobilenet", "dw 112x32", "conv2d", (112, 112, 32), dict(padding=1, groups=32),
     (3, 3, 1, 32), 256),
    ("mobilenet", "dw 112x96/2", "conv2d", (112, 112, 96), dict(stride=2, padding=1, groups=96),
     (3, 3, 1, 96), 256),
    ("mobilenet", "dw 56x144", "conv2d", (56, 56, 144), dict(padding=1, groups=144),
     (3, 3, 1, 144), 256),
    ("mobilenet", "dw 56x144/2", "conv2d", (56, 56, 144), dict(stride=2, padding=1, groups=144),
     (3, 3, 1, 144), 256),
    ("mobilenet", "dw 28x192", "conv2d", (28, 28, 192), dict(padding=1, groups=192),
     (3, 3, 1, 192), 256),
    ("mobilenet", "dw 14x384", "conv2d", (14, 14, 384), dict(padding=1, groups=384),
     (3, 3, 1, 384), 256),
    ("mobilenet", "dw 14x576", "conv2d", (14, 14, 576), dict(padding=1, groups=576),
     (3, 3, 1, 576), 256),
    ("mobilenet", "dw 7x960", "conv2d", (7, 7, 960), dict(padding=1, groups=960),
     (3, 3, 1, 960), 256),
    ("mnist", "mnist conv1", "conv2d", (28, 28, 1), {}, (3, 3, 1, 32), 128),
    ("mnist", "mnist conv2", "conv2d", (26, 26, 32), {}, (3, 3, 32, 64), 128),
    ("pool", "maxpool 3x3/2", "max_pool2d", (112, 112, 64),
     dict(kernel_size=3, stride=2, padding=1), None, 256),
    ("fused", "bnrelu+3x3 56x64", "bn_relu_conv2d", (56, 56, 64), _R, (3, 3, 64, 64), 256),
    ("fused", "bnrelu+3x3 28x128", "bn_relu_conv2d", (28, 28, 128), _R, (3, 3, 128, 128), 256),
    ("fused", "bnrelu+3x3 14x256", "bn_relu_conv2d", (14, 14, 256), _R, (3, 3, 256, 256), 256),
]
GROUPS = sorted({s[0] for s in SHAPES})


def out_hw(x_shape, kw, w_shape):
    """(H_out, W_out) of a conv or pool call."""
    k = w_shape[:2] if w_shape is not None else (kw["kernel_size"],) * 2
    s, p = kw.get("stride", 1), kw.get("padding", 0)
    return tuple((n + 2 * p - kk) // s + 1 for n, kk in zip(x_shape[1:3], k))


def work(op, x_shape, kw, w_shape, itemsize):
    """(forward FLOPs, minimum forward bytes) of one call."""
    n, _, _, c = x_shape
    ho, wo = out_hw(x_shape, kw, w_shape)
    if w_shape is None:  # pooling: compares, not FLOPs
        return 0, itemsize * (math.prod(x_shape) + n * ho * wo * c)
    kh, kw_, ci, co = w_shape
    flops = 2 * n * ho * wo * co * kh * kw_ * ci
    nbytes = itemsize * (math.prod(x_shape) + math.prod(w_shape) + n * ho * wo * co)
    return flops, nbytes


def measure_bandwidth(repeats: int, mib: int = 1024) -> float:
    """Bytes/s of an elementwise pass (read + write) over ``mib`` MiB, as HBM bandwidth."""
    x = jnp.ones((mib << 18,), jnp.float32)
    f = jax.jit(lambda a: a * 2)
    return 2 * x.nbytes / autotune.time_call(f, x, repeats=repeats)


def _args(op, x_shape, w_shape, dtype):
    kx, kw, ks = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, x_shape, jnp.float32).astype(dtype)
    if op == "max_pool2d":
        return (jax.nn.relu(x),)  # many ties, as after a ReLU
    w = (jax.random.normal(kw, w_shape, jnp.float32) / math.sqrt(math.prod(w_shape[:3])))
    args = (x, w.astype(dtype))
    if op == "bn_relu_conv2d":
        c = x_shape[-1]
        args += (1 + 0.1 * jax.random.normal(ks, (c,)), 0.1 * jax.random.normal(kx, (c,)))
    return args


def _fns(op, kw, backend=None):
    """(Pallas forward, XLA forward) taking the same positional arrays; ``backend`` picks the
    convolution and pooling kernels (``"triton"``, ``"mosaic"``, or None: by device kind)."""
    if op == "bn_relu_conv2d":
        def kernel(x, w, scale, shift):
            return pk.bn_relu_conv2d(x, w, scale=scale, shift=shift, **kw)

        def xla(x, w, scale, shift):
            a = jax.nn.relu(x.astype(jnp.float32) * scale + shift).astype(x.dtype)
            return F.conv2d(a, w, **kw, impl="xla")
        return kernel, xla
    kernel_kw = {**kw, "backend": backend} if op in ("conv2d", "max_pool2d", "avg_pool2d") else kw
    return (lambda *a: getattr(pk, op)(*a, **kernel_kw),
            lambda *a: getattr(F, op)(*a, **kw, impl="xla"))


def _grad_of(fn, n_args):
    """Forward and backward of ``fn`` with respect to its first two arrays (x, w)."""
    return bc.grad_of(fn, range(min(n_args, 2)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_options(parser, GROUPS)
    parser.add_argument("--tune", action="store_true",
                        help="autotune each shape first (those not in the user's cache yet)")
    parser.add_argument("--retune", action="store_true",
                        help="with --tune, tune shapes already in the user's cache again")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--bandwidth-mib", type=int, default=1024,
                        help="size of the bandwidth-measuring pass")
    parser.add_argument("--backend", default="triton", choices=("triton", "mosaic", "auto"),
                        help="convolution kernels to time: Triton (what --tune measures), the "
                             "Mosaic GPU Hopper kernels (scripts/bench_mgpu.py compares both), "
                             "or auto: by device kind")
    opts = parser.parse_args(argv)
    groups = bc.chosen_groups(parser, opts, GROUPS)
    if bc.not_a_benchmark(opts.force, "the Pallas interpreter"):
        return 0
    dtype = jnp.dtype(opts.dtype)
    kind = autotune.device_kind()
    peak = peak_flops(kind, bf16=dtype == jnp.bfloat16)
    bw = measure_bandwidth(opts.repeats, opts.bandwidth_mib)
    print(f"{bc.versions(kind, dtype)}  cache: {autotune.cache_path()}")
    print(f"measured bandwidth: {bw / 1e9:.0f} GB/s   peak: "
          f"{'unknown' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}")
    print(f"{'shape':<18} {'N':>4} {'pallas ms':>10} {'xla ms':>9} {'xla/pal':>8} "
          f"{'TFLOP/s':>8} {'GB/s':>7} {'roofline':>8} {'grad p ms':>10} {'grad x ms':>10} "
          f"{'xla/pal':>8}")
    rows = []
    for group, name, op, hwc, kw, w_shape, batch in SHAPES:
        if group not in groups:
            continue
        x_shape = (opts.batch or batch, *hwc)
        args = _args(op, x_shape, w_shape, dtype)
        kernel, xla = _fns(op, kw, None if opts.backend == "auto" else opts.backend)
        try:
            if opts.tune and op != "bn_relu_conv2d" and (
                    opts.retune or not tuning.tuned_here(op, args, kw)):
                tuning.tune_op(op, args, kw)
            fns = [jax.jit(kernel), jax.jit(xla)]
            if not opts.no_grad:
                fns += [_grad_of(kernel, len(args)), _grad_of(xla, len(args))]
            t = [autotune.time_call(f, *args, repeats=opts.repeats) for f in fns]
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18}", e, name=name))
            continue
        flops, nbytes = work(op, x_shape, kw, w_shape, dtype.itemsize)
        ideal = max(flops / peak if peak and flops else 0.0, nbytes / bw)
        row = {"group": group, "name": name, "op": op, "x_shape": list(x_shape),
               "kwargs": kw, "pallas_ms": 1e3 * t[0], "xla_ms": 1e3 * t[1],
               "tflops": flops / t[0] / 1e12, "gbs": nbytes / t[0] / 1e9,
               "xla_tflops": flops / t[1] / 1e12, "roofline": ideal / t[0],
               "xla_roofline": ideal / t[1]}
        if len(t) == 4:
            row.update(pallas_grad_ms=1e3 * t[2], xla_grad_ms=1e3 * t[3])
        rows.append(row)
        grad = (f"{row['pallas_grad_ms']:>10.3f} {row['xla_grad_ms']:>10.3f} "
                f"{t[3] / t[2]:>8.2f}" if len(t) == 4 else "")
        print(f"{name:<18} {x_shape[0]:>4} {row['pallas_ms']:>10.3f} {row['xla_ms']:>9.3f} "
              f"{t[1] / t[0]:>8.2f} {row['tflops']:>8.1f} {row['gbs']:>7.0f} "
              f"{row['roofline']:>8.0%} {grad}", flush=True)
    bc.write_json(opts.json, {"device": kind, "jax": jax.__version__, "dtype": dtype.name,
                              "bandwidth_gbs": bw / 1e9, "peak_tflops": peak and peak / 1e12,
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
