"""Times the Pallas kernels against XLA, per shape: forward and forward+backward.

Usage::

    python scripts/bench_kernels.py [--force] [--tune] [--dtype bfloat16] [--repeats 20] [--batch 32]

Prints one row per shape: op, shape, Pallas time, XLA time and their ratio
(XLA / Pallas: above 1 means the kernel is faster).  On a CPU backend the
kernels run in the Pallas interpreter, which is no benchmark, so the script
says so and exits 0 unless ``--force``.  ``--tune`` runs the autotuner for
each shape first (and so fills the cache ``impl="auto"`` reads).
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxcnn import functional as F
from pallas_kernels import autotune

# (op, x shape NHWC, static kwargs, weight shape HWIO or None): ResNet/MobileNet-like layers.
SHAPES = [
    ("conv2d", (32, 56, 56, 64), dict(padding=1), (3, 3, 64, 64)),
    ("conv2d", (32, 28, 28, 128), dict(stride=2, padding=1), (3, 3, 128, 256)),
    ("conv2d", (32, 56, 56, 256), dict(), (1, 1, 256, 64)),
    ("conv2d", (32, 224, 224, 3), dict(stride=2, padding=3), (7, 7, 3, 64)),
    ("conv2d", (32, 56, 56, 144), dict(padding=1, groups=144), (3, 3, 1, 144)),
    ("conv2d", (32, 28, 28, 192), dict(stride=2, padding=1, groups=192), (3, 3, 1, 192)),
    ("max_pool2d", (32, 112, 112, 64), dict(kernel_size=3, stride=2, padding=1), None),
    ("avg_pool2d", (32, 56, 56, 256), dict(kernel_size=2), None),
]


def _args(x_shape, w_shape, dtype):
    key_x, key_w = jax.random.split(jax.random.key(0))
    x = jax.random.normal(key_x, x_shape, jnp.float32).astype(dtype)
    if w_shape is None:
        return (x,)
    return x, jax.random.normal(key_w, w_shape, jnp.float32).astype(dtype)


def _grad_of(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) ** 2)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="run even on a CPU backend")
    parser.add_argument("--tune", action="store_true", help="autotune each shape first")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch", type=int, default=32, help="batch size N of every shape")
    opts = parser.parse_args(argv)
    backend = jax.default_backend()
    if backend != "gpu" and not opts.force:
        print(f"backend is {backend!r}: the kernels would run in the Pallas interpreter, "
              "which is not a benchmark. Pass --force to time it anyway.")
        return 0
    dtype = jnp.dtype(opts.dtype)
    print(f"device: {autotune.device_kind()}  dtype: {dtype.name}  cache: {autotune.cache_path()}")
    print(f"{'op':<11} {'x shape':<22} {'kwargs':<34} {'pallas ms':>10} {'xla ms':>9} "
          f"{'xla/pallas':>10} {'grad p ms':>10} {'grad x ms':>10} {'ratio':>6}")
    for op, x_shape, kw, w_shape in SHAPES:
        x_shape = (opts.batch, *x_shape[1:])
        args = _args(x_shape, w_shape, dtype)
        if opts.tune:
            autotune.tune_op(op, args, kw)

        def kernel(*a, op=op, kw=kw):
            return getattr(pk, op)(*a, **kw)

        def xla(*a, op=op, kw=kw):
            return getattr(F, op)(*a, **kw, impl="xla")

        row = []
        for fn in (jax.jit(kernel), jax.jit(xla), _grad_of(kernel), _grad_of(xla)):
            row.append(1e3 * autotune.time_call(fn, *args, repeats=opts.repeats))
        p, x, gp, gx = row
        print(f"{op:<11} {str(x_shape):<22} {str(kw):<34} {p:>10.3f} {x:>9.3f} {x / p:>10.2f} "
              f"{gp:>10.3f} {gx:>10.3f} {gx / gp:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
