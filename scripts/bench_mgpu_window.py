#!/usr/bin/env python3
"""Times the Mosaic GPU (Hopper) pooling and depthwise kernels against Triton and XLA, same run.

Usage (on an H100/H200, jax >= 0.11)::

    python scripts/bench_mgpu_window.py [--groups pool,mobilenet,convnext,mnist] [--batch N]
                                        [--repeats 20] [--no-grad] [--tune [--retune]]
                                        [--json out.json]

Per shape (bfloat16, batch 256 unless ``--batch``) it prints the forward time of the
Mosaic kernels (``pallas_kernels.max_pool2d/avg_pool2d/conv2d(..., backend="mosaic")``),
the Triton kernels (``backend="triton"``) and XLA (``impl="xla"``), the Mosaic
forward's effective bandwidth (the bytes it must move: input, output and filters, over
its time; these ops are bandwidth-bound, so compare with ~3.0 TB/s on an H100), its
speed relative to XLA (above 1: faster), the same for forward + backward, and the
largest difference of its forward from XLA's relative to XLA's largest value, and the
tiles each Mosaic kernel ran with (``fwd``/``bwd``, ``fwd``/``dgrad``/``wgrad``:
``w<tile row>c<channels>s<slots>[/<split>]``, tuned or the defaults).

``--tune`` first tunes each shape with the autotuner (``backend="mosaic"``): it times
every candidate :class:`~pallas_kernels.mgpu_window.WindowConfig` of each Mosaic kernel
(:meth:`~pallas_kernels.mgpu_window.WindowCall.candidates`, within the device's shared
memory), keeps the fastest in the user's cache under this device kind, then races the
tuned op against XLA and stores that verdict, keyed with ``backend="mosaic"``: only such
a measurement lets ``impl="auto"`` choose these kernels.  The shape is then timed with
its tuned tiles.  A shape whose verdict is already in the user's cache is not tuned
again unless ``--retune``, so a run cut short resumes where it stopped.  On a CPU backend
the kernels would run in interpret mode, which is no benchmark: the script says so and
exits 0 unless ``--force`` (a smoke test of the script itself; use ``--batch 1 --groups
mnist``).
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

import pallas_kernels as pk  # noqa: E402
from jaxcnn import functional as F  # noqa: E402
from jaxcnn.functional import tuning  # noqa: E402
from pallas_kernels import autotune  # noqa: E402
from pallas_kernels import mgpu_conv as mc  # noqa: E402,F401 (the tests read mc)
from pallas_kernels import mgpu_window as mw  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _bench_common as bc  # noqa: E402
finally:
    sys.path.pop(0)


def _dw(c, stride=1, k=3):
    return dict(stride=stride, padding=k // 2, groups=c), (k, k, 1, c)


# (group, name, op, x shape HWC, kwargs, w shape or None, batch)
SHAPES = [
    ("pool", "maxpool 3x3/2 112x64", "max_pool2d", (112, 112, 64),
     dict(kernel_size=3, stride=2, padding=1), None, 256),
    ("pool", "avgpool 2x2/2 56x128", "avg_pool2d", (56, 56, 128), dict(kernel_size=2), None, 256),
    ("pool", "avgpool 3x3/1 28x192", "avg_pool2d", (28, 28, 192),
     dict(kernel_size=3, stride=1, padding=1, count_include_pad=False), None, 256),
    ("mobilenet", "dw 112x32", "conv2d", (112, 112, 32), *_dw(32), 256),
    ("mobilenet", "dw 112x96/2", "conv2d", (112, 112, 96), *_dw(96, 2), 256),
    ("mobilenet", "dw 56x144", "conv2d", (56, 56, 144), *_dw(144), 256),
    ("mobilenet", "dw 28x192", "conv2d", (28, 28, 192), *_dw(192), 256),
    ("mobilenet", "dw 14x576", "conv2d", (14, 14, 576), *_dw(576), 256),
    ("mobilenet", "dw 7x960", "conv2d", (7, 7, 960), *_dw(960), 256),
    ("convnext", "dw7x7 56x96", "conv2d", (56, 56, 96), *_dw(96, k=7), 128),
    ("convnext", "dw7x7 14x384", "conv2d", (14, 14, 384), *_dw(384, k=7), 128),
    ("mnist", "maxpool 2x2 24x64", "max_pool2d", (24, 24, 64), dict(kernel_size=2), None, 128),
    ("mnist", "dw 3x3 12x64", "conv2d", (12, 12, 64), *_dw(64), 128),
]
GROUPS = sorted({s[0] for s in SHAPES})


def _args(op, x_shape, w_shape, dtype):
    """Random operands: a ReLU'd input for max pooling (many ties, as after a ReLU)."""
    kx, kw = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, x_shape, jnp.float32)
    if w_shape is None:
        return ((jax.nn.relu(x) if op == "max_pool2d" else x).astype(dtype),)
    w = jax.random.normal(kw, w_shape, jnp.float32) / math.sqrt(math.prod(w_shape[:2]))
    return x.astype(dtype), w.astype(dtype)


def _fns(op, kw):
    """(Mosaic, Triton, XLA) forward functions of the op's arrays."""
    return (lambda *a: getattr(pk, op)(*a, **kw, backend="mosaic"),
            lambda *a: getattr(pk, op)(*a, **kw, backend="triton"),
            lambda *a: getattr(F, op)(*a, **kw, impl="xla"))


def tune(op, args, kw, retune: bool = False) -> bool:
    """Tunes one shape's Mosaic kernels (their tiles, then the race against XLA that
    ``impl="auto"`` reads) unless the user's cache holds that race already and not
    ``retune``; returns whether it tuned."""
    arrays, static = tuning.canonical_call(op, args, kw)
    mosaic = {**static, "backend": "mosaic"}
    mine = autotune.load_cache().get(autotune.device_kind(), {}).get("ops", {})
    if not retune and autotune.op_key(op, arrays, mosaic) in mine:
        return False
    autotune.tune_op(op, arrays, mosaic,
                     xla=lambda *a: getattr(F, op)(*a, **static, impl="xla"))
    return True


def tiles(op, args, kw) -> dict:
    """``{part: WindowConfig}`` the Mosaic op runs with on these arrays, forward and
    backward: the tuned tiles of this device kind, else the defaults."""
    mosaic = _fns(op, kw)[0]
    with autotune._recording() as launched:  # the window kernels' lookups, by key
        jax.eval_shape(jax.grad(lambda *a: jnp.sum(mosaic(*a).astype(jnp.float32)),
                                argnums=tuple(range(len(args)))), *args)
    calls = sorted((mw.KERNELS.index(k), call) for k, call, _, _ in launched.values()
                   if k in mw.KERNELS)
    return {call.part: call.fit(mw.tuned_config(call) or mw.DEFAULT) for _, call in calls}


def tiles_text(parts: dict) -> str:
    return " ".join(f"{part} w{c.tile_w}c{c.block_c}s{c.stages}"
                    + (f"/{c.split}" if c.split > 1 else "") for part, c in parts.items())


def _bytes(x_shape, y_shape, w_shape, itemsize):
    """Bytes the forward must move at least: the input once, the output, the filters."""
    return itemsize * (math.prod(x_shape) + math.prod(y_shape)
                       + (math.prod(w_shape) if w_shape else 0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_options(parser, GROUPS)
    parser.add_argument("--tune", action="store_true",
                        help="first tune each shape's Mosaic tiles and store them with a "
                             "backend='mosaic' verdict in the user's cache")
    parser.add_argument("--retune", action="store_true",
                        help="with --tune, tune shapes already in the user's cache again")
    opts = parser.parse_args(argv)
    groups = bc.chosen_groups(parser, opts, GROUPS)
    status = bc.mosaic_preflight("bench_mgpu_window", opts.force)
    if status is not None:
        return status
    kind = autotune.device_kind()
    dtype = jnp.dtype(jnp.bfloat16)
    print(bc.versions(kind, dtype))
    print(f"{'shape':<22} {'N':>4} {'mosaic ms':>9} {'triton ms':>9} {'xla ms':>8} "
          f"{'GB/s':>7} {'xla/mos':>7} {'grad m ms':>9} {'grad t ms':>9} {'grad x ms':>9} "
          f"{'xla/mos':>7} {'max err':>8}  tiles")
    rows = []
    for group, name, op, hwc, kw, w_shape, batch in SHAPES:
        if group not in groups:
            continue
        x_shape = (opts.batch or batch, *hwc)
        args = _args(op, x_shape, w_shape, dtype)
        try:
            if opts.tune:
                tune(op, args, kw, opts.retune)
            chosen = tiles(op, args, kw)
            mosaic, triton, xla = _fns(op, kw)
            t = [bc.time_fn(f, args, opts.repeats, False) for f in (mosaic, triton, xla)]
            g = [float("nan")] * 3
            if not opts.no_grad:
                g = [bc.time_fn(f, args, opts.repeats, True) for f in (mosaic, triton, xla)]
            ref = jax.jit(xla)(*args)
            err = bc.rel_err(jax.jit(mosaic)(*args), ref)
            nbytes = _bytes(x_shape, ref.shape, w_shape, dtype.itemsize)
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<22}", e, name=name))
            continue
        print(f"{name:<22} {x_shape[0]:>4} {1e3 * t[0]:>9.3f} {1e3 * t[1]:>9.3f} "
              f"{1e3 * t[2]:>8.3f} {nbytes / t[0] / 1e9:>7.0f} {t[2] / t[0]:>7.2f} "
              f"{1e3 * g[0]:>9.3f} {1e3 * g[1]:>9.3f} {1e3 * g[2]:>9.3f} {g[2] / g[0]:>7.2f} "
              f"{err:>8.1e}  {tiles_text(chosen)}", flush=True)
        rows.append({"group": group, "name": name, "op": op, "x_shape": list(x_shape),
                     "kwargs": kw, "mosaic_ms": 1e3 * t[0], "triton_ms": 1e3 * t[1],
                     "xla_ms": 1e3 * t[2], "mosaic_grad_ms": 1e3 * g[0],
                     "triton_grad_ms": 1e3 * g[1], "xla_grad_ms": 1e3 * g[2],
                     "gbps": nbytes / t[0] / 1e9, "max_rel_err": err,
                     "tiles": {part: c.to_dict() for part, c in chosen.items()}})
    bc.write_json(opts.json, {"device_kind": kind, "jax": jax.__version__, "dtype": dtype.name,
                              "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
