#!/usr/bin/env python3
"""Times the Mosaic GPU (Hopper) convolution against the Triton kernel and XLA (cuDNN), same run.

Usage (on an H100/H200, jax >= 0.11)::

    python scripts/bench_mgpu.py [--groups resnet50,bottleneck,mnist] [--batch N]
                                 [--repeats 20] [--no-grad] [--sweep] [--tune] [--fused]
                                 [--json out.json]

Per shape (bfloat16, batch 256 unless ``--batch``) it prints the forward time of
the Mosaic kernel (``pallas_kernels.conv2d(..., backend="mosaic")``), the Triton
kernel (``backend="triton"``) and XLA (``impl="xla"``: cuDNN on a GPU), the
Mosaic kernel's TFLOP/s and its speed relative to XLA (above 1: faster), the
same for forward + both gradients, and the largest difference of its forward
from XLA's relative to XLA's largest value (a wrong result on the GPU shows
here first).

``--sweep`` times every :class:`~pallas_kernels.mgpu_conv.MgpuConfig` of a
small grid (block_n, block_k, stages, warp specialisation) per shape and
reports the fastest.
``--tune`` races the Mosaic op against XLA with the autotuner and stores the
verdict keyed with ``backend="mosaic"`` in the user's cache (with ``--sweep``,
the fastest forward tiles too, which ``pallas_kernels.conv2d`` then uses): only
such a measurement lets ``impl="auto"`` choose the Mosaic kernel.

``--fused`` times BatchNorm fused into the convolution instead
(:mod:`pallas_kernels.mgpu_fused`), per shape in its two forms: ``stats`` (the
convolution also returns its output's batch mean and variance, against the
convolution followed by ``jnp.mean``/``jnp.var`` of its output) and ``bnrelu+stats``
(BatchNorm + ReLU applied to the input in the kernel's prologue as well, against
``relu(x * scale + shift)`` materialised first), each against the same unfused chain
with the Mosaic convolution and with XLA's (cuDNN); forward, and forward + backward of
a loss of all three outputs.  With ``--tune`` it stores each form's race against XLA
where ``Choices(conv_bn="auto")`` looks it up: the only way ``"auto"`` ever fuses.

On a CPU backend the kernels would run in interpret mode, which is no
benchmark: the script says so and exits 0 unless ``--force`` (a smoke test
of the script itself; use ``--batch 1 --groups mnist``).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from jaxcnn import functional as F  # noqa: E402
from jaxcnn.functional import conv_bn as fcb  # noqa: E402
from jaxcnn.functional import tuning  # noqa: E402
from pallas_kernels import autotune  # noqa: E402
from pallas_kernels import mgpu_conv as mc  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _bench_common as bc  # noqa: E402
finally:
    sys.path.pop(0)

_P1 = dict(padding=1)
# (group, name, x shape NHWC, kwargs, w shape HWIO, batch)
SHAPES = [
    ("resnet50", "res3x3 56x64", (56, 56, 64), _P1, (3, 3, 64, 64), 256),
    ("resnet50", "res3x3 28x128", (28, 28, 128), _P1, (3, 3, 128, 128), 256),
    ("resnet50", "res3x3 14x256", (14, 14, 256), _P1, (3, 3, 256, 256), 256),
    ("resnet50", "res3x3 7x512", (7, 7, 512), _P1, (3, 3, 512, 512), 256),
    ("bottleneck", "1x1 56x64->256", (56, 56, 64), {}, (1, 1, 64, 256), 256),
    ("bottleneck", "1x1 56x256->64", (56, 56, 256), {}, (1, 1, 256, 64), 256),
    ("bottleneck", "1x1 28x512->128", (28, 28, 512), {}, (1, 1, 512, 128), 256),
    ("bottleneck", "1x1 14x1024->256", (14, 14, 1024), {}, (1, 1, 1024, 256), 256),
    ("bottleneck", "1x1 7x2048->512", (7, 7, 2048), {}, (1, 1, 2048, 512), 256),
    ("mnist", "mnist conv2", (26, 26, 32), {}, (3, 3, 32, 64), 128),
]
GROUPS = sorted({s[0] for s in SHAPES})
SWEEP = mc.SWEEP


def _fns(kw, config=None):
    """(Mosaic, Triton, XLA) forward functions of ``(x, w)``."""
    return (lambda x, w: pk.conv2d(x, w, **kw, backend="mosaic", config=config),
            lambda x, w: pk.conv2d(x, w, **kw, backend="triton"),
            lambda x, w: F.conv2d(x, w, **kw, impl="xla"))


FUSED_FORMS = ("stats", "bnrelu+stats")


def _fused_fns(kw, prologue):
    """(fused, unfused Mosaic, unfused XLA) functions of ``(x, w, scale, shift)`` returning
    ``(y, mean, var)``: the convolution of ``x`` (of ``relu(x * scale + shift)`` with the
    prologue) and its output's batch statistics."""
    def act(x, scale, shift):
        if not prologue:
            return x
        return jnp.maximum(x.astype(jnp.float32) * scale + shift, 0.0).astype(x.dtype)

    def stats(y):
        yf = y.astype(jnp.float32)
        return y, jnp.mean(yf, axis=(0, 1, 2)), jnp.var(yf, axis=(0, 1, 2))

    def fused(x, w, scale, shift):
        return fcb.conv2d_bn(x, w, **kw, stats=True,
                             input_scale=scale if prologue else None,
                             input_shift=shift if prologue else None)
    return (fused,
            lambda x, w, s, t: stats(pk.conv2d(act(x, s, t), w, **kw, backend="mosaic")),
            lambda x, w, s, t: stats(F.conv2d(act(x, s, t), w, **kw, impl="xla")))


def _time_fused(fn, args, repeats, grad):
    if not grad:
        return autotune.time_call(jax.jit(fn), *args, repeats=repeats)

    def loss(*a):
        y, mean, var = fn(*a)
        return jnp.sum(y.astype(jnp.float32) ** 2) + jnp.sum(mean) + jnp.sum(var)
    return autotune.time_call(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))), *args,
                              repeats=repeats)


def fused_rows(name, group, x_shape, kw, w_shape, opts, bk):
    """Times both fused forms of one shape; returns their JSON rows (printing each)."""
    dtype = jnp.dtype(jnp.bfloat16)
    x, w = bk._args("conv2d", x_shape, w_shape, dtype)
    c = x_shape[3]
    rng = np.random.default_rng(0)
    scale = jnp.asarray(1 + 0.1 * rng.standard_normal(c), jnp.float32)
    shift = jnp.asarray(0.1 * rng.standard_normal(c), jnp.float32)
    args = (x, w, scale, shift)
    rows = []
    for form in FUSED_FORMS:
        prologue = form != "stats"
        try:
            fns = _fused_fns(kw, prologue)
            t = [_time_fused(f, args, opts.repeats, False) for f in fns]
            g = [float("nan")] * 3
            if not opts.no_grad:
                g = [_time_fused(f, args, opts.repeats, True) for f in fns]
            err = max(bc.rel_err(a, b)
                      for a, b in zip(jax.jit(fns[0])(*args), jax.jit(fns[2])(*args)))
            if opts.tune and not opts.no_grad:
                static = fcb.tuned_static(x.shape, w.shape, **kw_geometry(kw),
                                          prologue=prologue, stats=True)
                autotune.store_op_entry(fcb.TUNED_OP, (x, w), static, {
                    "fused_s": t[0], "xla_s": t[2], "fused_grad_s": g[0], "xla_grad_s": g[2],
                    "fwd_faster": t[0] < t[2], "grad_faster": g[0] < g[2]})
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18} {form:<13}", e, name=name, form=form))
            continue
        print(f"{name:<18} {form:<13} {x_shape[0]:>4} {1e3 * t[0]:>9.3f} {1e3 * t[1]:>9.3f} "
              f"{1e3 * t[2]:>8.3f} {t[2] / t[0]:>7.2f} {1e3 * g[0]:>9.3f} {1e3 * g[1]:>9.3f} "
              f"{1e3 * g[2]:>9.3f} {g[2] / g[0]:>7.2f} {err:>8.1e}", flush=True)
        rows.append({"group": group, "name": name, "form": form, "x_shape": list(x_shape),
                     "kwargs": kw, "fused_ms": 1e3 * t[0], "mosaic_unfused_ms": 1e3 * t[1],
                     "xla_ms": 1e3 * t[2], "fused_grad_ms": 1e3 * g[0],
                     "mosaic_unfused_grad_ms": 1e3 * g[1], "xla_grad_ms": 1e3 * g[2],
                     "max_rel_err": err})
    return rows


def kw_geometry(kw):
    """``stride``, ``padding``, ``dilation`` of a shape's keyword arguments (defaults 1, 0, 1)."""
    return dict(stride=kw.get("stride", 1), padding=kw.get("padding", 0),
                dilation=kw.get("dilation", 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_options(parser, GROUPS)
    parser.add_argument("--sweep", action="store_true", help="time a grid of Mosaic tiles")
    parser.add_argument("--tune", action="store_true",
                        help="store a backend='mosaic' verdict per shape in the user's cache")
    parser.add_argument("--fused", action="store_true",
                        help="time BatchNorm fused into the convolution (statistics epilogue, "
                             "BatchNorm+ReLU prologue) against the unfused chains")
    opts = parser.parse_args(argv)
    if opts.fused and opts.sweep:
        parser.error("--fused times the default or cached tiles; run --sweep separately")
    groups = bc.chosen_groups(parser, opts, GROUPS)
    status = bc.mosaic_preflight("bench_mgpu", opts.force)
    if status is not None:
        return status
    bk = bc.load_script("bench_kernels")
    kind = autotune.device_kind()
    dtype = jnp.dtype(jnp.bfloat16)
    print(bc.versions(kind, dtype))
    if opts.fused:
        return _main_fused(opts, groups, bk, kind)
    print(f"{'shape':<18} {'N':>4} {'mosaic ms':>9} {'triton ms':>9} {'xla ms':>8} "
          f"{'TFLOP/s':>8} {'xla/mos':>7} {'grad m ms':>9} {'grad t ms':>9} {'grad x ms':>9} "
          f"{'xla/mos':>7} {'max err':>8}  config")
    rows = []
    for group, name, hwc, kw, w_shape, batch in SHAPES:
        if group not in groups:
            continue
        x_shape = (opts.batch or batch, *hwc)
        x, w = bk._args("conv2d", x_shape, w_shape, dtype)
        flops, _ = bk.work("conv2d", x_shape, kw, w_shape, dtype.itemsize)
        try:
            config = None
            if opts.sweep:
                timed = []
                for cfg in SWEEP:
                    try:
                        timed.append((bc.time_fn(_fns(kw, cfg)[0], (x, w), opts.repeats,
                                                 False), cfg))
                    except Exception as e:  # e.g. over the shared-memory limit
                        print(f"  {name}: {cfg} skipped: {type(e).__name__}: "
                              f"{str(e).splitlines()[0][:120]}")
                config = min(timed, key=lambda t: t[0])[1] if timed else None
            mosaic, triton, xla = _fns(kw, config)
            t = [bc.time_fn(f, (x, w), opts.repeats, False) for f in (mosaic, triton, xla)]
            g = [float("nan")] * 3
            if not opts.no_grad:
                g = [bc.time_fn(f, (x, w), opts.repeats, True) for f in (mosaic, triton, xla)]
            err = bc.rel_err(jax.jit(mosaic)(x, w), jax.jit(xla)(x, w))
            if opts.tune:
                arrays, static = tuning.canonical_call("conv2d", (x, w), kw)
                if config is not None:  # the swept tiles, then the verdict measured with them
                    mc.store_config("fwd", x.shape, w.shape, static["stride"],
                                    static["padding"], static["dilation"], x.dtype, config)
                autotune.tune_op("conv2d", arrays, {**static, "backend": "mosaic"},
                                 xla=lambda *a, s=static: F.conv2d(*a, **s, impl="xla"))
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18}", e, name=name))
            continue
        cfg_text = "default" if config is None else (
            f"n{config.block_n}k{config.block_k}s{config.stages}"
            + ("ws" if config.warp_specialized else ""))
        print(f"{name:<18} {x_shape[0]:>4} {1e3 * t[0]:>9.3f} {1e3 * t[1]:>9.3f} "
              f"{1e3 * t[2]:>8.3f} {flops / t[0] / 1e12:>8.1f} {t[2] / t[0]:>7.2f} "
              f"{1e3 * g[0]:>9.3f} {1e3 * g[1]:>9.3f} {1e3 * g[2]:>9.3f} {g[2] / g[0]:>7.2f} "
              f"{err:>8.1e}  {cfg_text}", flush=True)
        rows.append({"group": group, "name": name, "x_shape": list(x_shape), "kwargs": kw,
                     "mosaic_ms": 1e3 * t[0], "triton_ms": 1e3 * t[1], "xla_ms": 1e3 * t[2],
                     "mosaic_grad_ms": 1e3 * g[0], "triton_grad_ms": 1e3 * g[1],
                     "xla_grad_ms": 1e3 * g[2], "tflops": flops / t[0] / 1e12,
                     "max_rel_err": err,
                     "config": None if config is None else dataclasses.asdict(config)})
    bc.write_json(opts.json, {"device_kind": kind, "jax": jax.__version__, "dtype": dtype.name,
                              "rows": rows})
    return 0


def _main_fused(opts, groups, bk, kind) -> int:
    print(f"{'shape':<18} {'form':<13} {'N':>4} {'fused ms':>9} {'unfus ms':>9} {'xla ms':>8} "
          f"{'xla/fus':>7} {'grad f ms':>9} {'grad u ms':>9} {'grad x ms':>9} {'xla/fus':>7} "
          f"{'max err':>8}")
    rows = []
    for group, name, hwc, kw, w_shape, batch in SHAPES:
        if group in groups:
            rows += fused_rows(name, group, (opts.batch or batch, *hwc), kw, w_shape, opts, bk)
    bc.write_json(opts.json, {"device_kind": kind, "jax": jax.__version__, "dtype": "bfloat16",
                              "fused": True, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
