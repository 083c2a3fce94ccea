#!/usr/bin/env python3
"""Times overlapping / padded max pooling on the CPU: XLA's reduce_window (its gradient
a select-and-scatter) against jaxcnn's strided-tap rewrite, forward and forward+backward,
in the same run (``jaxcnn/functional/_cpu_lowering.py``, docs/BENCHMARKS.md CPU item 3).

Usage::

    python scripts/bench_cpu_pool.py [--dtype float32] [--repeats 10] [--rounds 3]
                                     [--shapes stem16,stem128,s1] [--batch N]

Shapes: ``stem16`` ResNet's stem pool 16x112x112x64 3x3/2 pad 1; ``stem128`` the same
on 128x24x24x64; ``s1`` 3x3 stride 1 pad 1 on 32x28x28x64; ``k2s1`` 2x2 stride 1, no
padding, on 32x28x28x64; ``tiled`` 2x2/2 on
128x24x24x64 (the reshape rewrite, for comparison).  Each of ``--rounds`` rounds times
XLA then the rewrite (median of ``--repeats`` calls each, ms); the row is the median
over rounds, so a busy machine hurts both alike.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _bench_common as bc
finally:
    sys.path.pop(0)

from jaxcnn import _geometry as geo  # noqa: E402
from jaxcnn.functional import _cpu_lowering as lowering  # noqa: E402

SHAPES = {
    "stem16": ((16, 112, 112, 64), 3, 2, 1),
    "stem128": ((128, 24, 24, 64), 3, 2, 1),
    "s1": ((32, 28, 28, 64), 3, 1, 1),
    "k2s1": ((32, 28, 28, 64), 2, 1, 0),
    "tiled": ((128, 24, 24, 64), 2, 2, 0),
}


def pools(shape, kernel, stride, padding, dtype=jnp.float32):
    """``(xla, rewrite)``: the two lowerings of this pooling, functions of ``x``."""
    k, s, d, _, run_pads, out_hw = geo.pool_geometry("bench", shape, kernel, stride, padding,
                                                     1, False)
    xla = lambda x: geo.xla_max_pool(x, k, s, d, run_pads, out_hw)  # noqa: E731
    if s == k and not any(p for pair in run_pads for p in pair):
        rewrite = lowering.max_pool2d_rewrite(jax.ShapeDtypeStruct(shape, dtype), k, s, d,
                                              run_pads, out_hw)
    else:
        rewrite = lambda x: lowering._strided_max_pool(x, k, s, run_pads, out_hw)  # noqa: E731
    return xla, rewrite


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--shapes", default="stem16,stem128,s1")
    p.add_argument("--batch", type=int, default=None, help="replaces each shape's batch")
    opts = p.parse_args(argv)
    names = opts.shapes.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        print(f"bench_cpu_pool: unknown --shapes {unknown}; known: {sorted(SHAPES)}",
              file=sys.stderr)
        return 2
    dtype = jnp.dtype(opts.dtype)
    print(bc.versions(jax.devices()[0].device_kind, dtype))
    print(f"{'shape':44s} {'fwd xla':>8s} {'fwd new':>8s} {'f+b xla':>8s} {'f+b new':>8s}"
          f" {'f+b x':>6s}")
    for name in names:
        shape, kernel, stride, padding = SHAPES[name]
        shape = shape if opts.batch is None else (opts.batch, *shape[1:])
        x = jnp.asarray(np.random.default_rng(0).standard_normal(shape), dtype)
        xla, rewrite = pools(shape, kernel, stride, padding, dtype)
        times = {key: [] for key in ("fx", "fn", "bx", "bn")}
        for _ in range(opts.rounds):
            for grad, pre in ((False, "f"), (True, "b")):
                times[pre + "x"].append(bc.time_fn(xla, (x,), opts.repeats, grad) * 1e3)
                times[pre + "n"].append(bc.time_fn(rewrite, (x,), opts.repeats, grad) * 1e3)
        fx, fn, bx, bn = (float(np.median(times[k])) for k in ("fx", "fn", "bx", "bn"))
        label = f"{name} {'x'.join(map(str, shape))} {kernel}x{kernel}/{stride} pad {padding}"
        print(f"{label:44s} {fx:8.2f} {fn:8.2f} {bx:8.2f} {bn:8.2f} {bx / bn:6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
