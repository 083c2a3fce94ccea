#!/usr/bin/env python3
"""Times the Mosaic GPU (Hopper) convolution against the Triton kernel and XLA (cuDNN), same run.

Usage (on an H100/H200, jax >= 0.11)::

    python scripts/bench_mgpu.py [--groups resnet50,bottleneck,mnist] [--batch N]
                                 [--repeats 20] [--no-grad] [--tune [--retune]] [--fused]
                                 [--json out.json]

Per shape (bfloat16, batch 256 unless ``--batch``) it prints the forward time of
the Mosaic kernel (``pallas_kernels.conv2d(..., backend="mosaic")``), the Triton
kernel (``backend="triton"``) and XLA (``impl="xla"``: cuDNN on a GPU), the
Mosaic kernel's TFLOP/s and its speed relative to XLA (above 1: faster), the
same for forward + both gradients, and the largest difference of its forward
from XLA's relative to XLA's largest value (a wrong result on the GPU shows
here first).

``--tune`` first tunes each shape with the autotuner (``backend="mosaic"``): it times
every candidate :class:`~pallas_kernels.mgpu_conv.MgpuConfig` of each Mosaic kernel the
call launches, forward, input gradient and weight gradient
(:meth:`~pallas_kernels.mgpu_conv.DenseCall.candidates`: tile row, channel tiles,
reduction chunk, slots, warp specialisation, weight-gradient split, within the device's
shared memory), keeps the fastest in the user's cache under this device kind (where
``pallas_kernels.conv2d`` then finds them), then races the tuned op against XLA and
stores that verdict keyed with ``backend="mosaic"``: only such a measurement lets
``impl="auto"`` choose the Mosaic kernel.  The shape is then timed with its tuned tiles
(the ``tiles`` column: ``w<tile row>n<channels>k<chunk>s<slots>[ws][/<split>]`` per part).
A shape whose verdict is already in the user's cache is not tuned again unless
``--retune``, so a run cut short resumes where it stopped.  ``--sweep`` is the old name
of ``--tune``.  Tiles are tuned on a GPU only: in interpret mode (``--force`` on a CPU)
``--tune`` races the default tiles only (:func:`tiles_tunable`).

``--fused`` times BatchNorm fused into the convolution instead
(:mod:`pallas_kernels.mgpu_fused`), per shape in its two forms: ``stats`` (the
convolution also returns its output's batch mean and variance, against the
convolution followed by ``jnp.mean``/``jnp.var`` of its output) and ``bnrelu+stats``
(BatchNorm + ReLU applied to the input in the kernel's prologue as well, against
``relu(x * scale + shift)`` materialised first), each against the same unfused chain
with the Mosaic convolution and with XLA's (cuDNN); forward, and forward + backward of
a loss of all three outputs.  With ``--tune`` each form's kernels are tuned first (the
fused forward's tiles keyed by its form, the gradients' as the plain op's), then its race
against XLA is stored where ``Choices(conv_bn="auto")`` looks it up: the only way
``"auto"`` ever fuses.

On a CPU backend the kernels would run in interpret mode, which is no
benchmark: the script says so and exits 0 unless ``--force`` (a smoke test
of the script itself; use ``--batch 1 --groups mnist``).
"""
from __future__ import annotations

import argparse
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


def _fns(kw, config=None):
    """(Mosaic, Triton, XLA) forward functions of ``(x, w)``."""
    return (lambda x, w: pk.conv2d(x, w, **kw, backend="mosaic", config=config),
            lambda x, w: pk.conv2d(x, w, **kw, backend="triton"),
            lambda x, w: F.conv2d(x, w, **kw, impl="xla"))


def _mosaic_cached(op, arrays, static) -> bool:
    """Whether the user's cache holds this call's race for this device kind (a resumed run
    tunes it no more)."""
    mine = autotune.load_cache().get(autotune.device_kind(), {}).get("ops", {})
    return autotune.op_key(op, arrays, static) in mine


def tiles_tunable() -> bool:
    """Whether ``--tune`` times tile candidates: on a GPU only.  In interpret mode (``--force``
    on a CPU) it would time the interpreter, one compilation per candidate, for nothing:
    there ``--tune`` only races the op (default tiles) against XLA."""
    return jax.default_backend() == "gpu"


def _no_candidates(kernel, call, co):
    return []


def tune(x, w, kw, retune: bool = False) -> bool:
    """Tunes one shape's Mosaic kernels (their tiles, where :func:`tiles_tunable`, then the
    race against XLA that ``impl="auto"`` reads) unless the user's cache holds that race
    already and not ``retune``; returns whether it tuned."""
    arrays, static = tuning.canonical_call("conv2d", (x, w), kw)
    mosaic = {**static, "backend": "mosaic"}
    if not retune and _mosaic_cached("conv2d", arrays, mosaic):
        return False
    more = {} if tiles_tunable() else {"candidate_fn": _no_candidates}
    autotune.tune_op("conv2d", arrays, mosaic,
                     xla=lambda *a: F.conv2d(*a, **static, impl="xla"), **more)
    return True


def tiles(fn, args) -> dict:
    """``{part: MgpuConfig}`` the dense Mosaic kernels of ``fn(*args)`` and its gradients run
    with (the forward's in its fused form): the tuned tiles of this device kind, else the
    defaults, as each launch fits them."""
    def loss(*a):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a)))
    with autotune._recording() as launched:  # the dense kernels' lookups, by key
        jax.eval_shape(jax.grad(loss, argnums=tuple(range(len(args)))), *args)
    calls = sorted((mc.KERNELS.index(k), call) for k, call, _, _ in launched.values()
                   if k in mc.KERNELS)
    return {call.part: call.fit(mc.tuned_config(call) or mc.DEFAULT) for _, call in calls}


def tiles_text(parts: dict) -> str:
    return " ".join(f"{part} w{c.tile_w}n{c.block_n}k{c.block_k}s{c.stages}"
                    + ("ws" if c.warp_specialized else "")
                    + (f"/{c.split}" if c.split > 1 else "") for part, c in parts.items())


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
            static = fcb.tuned_static(x.shape, w.shape, **kw_geometry(kw),
                                      prologue=prologue, stats=True)
            if opts.tune and tiles_tunable() and (
                    opts.retune or not _mosaic_cached(fcb.TUNED_OP, (x, w), static)):
                # The fused op's kernels' tiles first (its forward keyed by its form).
                autotune.store_kernels(autotune.tune_kernels(fns[0], args))
            chosen = tiles(fns[0], args)
            t = [_time_fused(f, args, opts.repeats, False) for f in fns]
            g = [float("nan")] * 3
            if not opts.no_grad:
                g = [_time_fused(f, args, opts.repeats, True) for f in fns]
            err = max(bc.rel_err(a, b)
                      for a, b in zip(jax.jit(fns[0])(*args), jax.jit(fns[2])(*args)))
            if opts.tune and not opts.no_grad:
                autotune.store_op_entry(fcb.TUNED_OP, (x, w), static, {
                    "fused_s": t[0], "xla_s": t[2], "fused_grad_s": g[0], "xla_grad_s": g[2],
                    "fwd_faster": t[0] < t[2], "grad_faster": g[0] < g[2]})
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18} {form:<13}", e, name=name, form=form))
            continue
        print(f"{name:<18} {form:<13} {x_shape[0]:>4} {1e3 * t[0]:>9.3f} {1e3 * t[1]:>9.3f} "
              f"{1e3 * t[2]:>8.3f} {t[2] / t[0]:>7.2f} {1e3 * g[0]:>9.3f} {1e3 * g[1]:>9.3f} "
              f"{1e3 * g[2]:>9.3f} {g[2] / g[0]:>7.2f} {err:>8.1e}  {tiles_text(chosen)}",
              flush=True)
        rows.append({"group": group, "name": name, "form": form, "x_shape": list(x_shape),
                     "kwargs": kw, "fused_ms": 1e3 * t[0], "mosaic_unfused_ms": 1e3 * t[1],
                     "xla_ms": 1e3 * t[2], "fused_grad_ms": 1e3 * g[0],
                     "mosaic_unfused_grad_ms": 1e3 * g[1], "xla_grad_ms": 1e3 * g[2],
                     "max_rel_err": err,
                     "tiles": {part: c.to_dict() for part, c in chosen.items()}})
    return rows


def kw_geometry(kw):
    """``stride``, ``padding``, ``dilation`` of a shape's keyword arguments (defaults 1, 0, 1)."""
    return dict(stride=kw.get("stride", 1), padding=kw.get("padding", 0),
                dilation=kw.get("dilation", 1))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_options(parser, GROUPS)
    parser.add_argument("--tune", action="store_true",
                        help="first tune each shape's Mosaic tiles and store them with a "
                             "backend='mosaic' verdict in the user's cache")
    parser.add_argument("--sweep", action="store_true",
                        help="the old name of --tune (the plain convolution's)")
    parser.add_argument("--retune", action="store_true",
                        help="with --tune, tune shapes already in the user's cache again")
    parser.add_argument("--fused", action="store_true",
                        help="time BatchNorm fused into the convolution (statistics epilogue, "
                             "BatchNorm+ReLU prologue) against the unfused chains")
    opts = parser.parse_args(argv)
    if opts.fused and opts.sweep:
        parser.error("--sweep is the old name of --tune for the plain convolution; with "
                     "--fused, pass --tune")
    opts.tune = opts.tune or opts.sweep
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
          f"{'xla/mos':>7} {'max err':>8}  tiles")
    rows = []
    for group, name, hwc, kw, w_shape, batch in SHAPES:
        if group not in groups:
            continue
        x_shape = (opts.batch or batch, *hwc)
        x, w = bk._args("conv2d", x_shape, w_shape, dtype)
        flops, _ = bk.work("conv2d", x_shape, kw, w_shape, dtype.itemsize)
        try:
            if opts.tune:
                tune(x, w, kw, opts.retune)
            mosaic, triton, xla = _fns(kw)
            chosen = tiles(mosaic, (x, w))
            t = [bc.time_fn(f, (x, w), opts.repeats, False) for f in (mosaic, triton, xla)]
            g = [float("nan")] * 3
            if not opts.no_grad:
                g = [bc.time_fn(f, (x, w), opts.repeats, True) for f in (mosaic, triton, xla)]
            err = bc.rel_err(jax.jit(mosaic)(x, w), jax.jit(xla)(x, w))
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18}", e, name=name))
            continue
        print(f"{name:<18} {x_shape[0]:>4} {1e3 * t[0]:>9.3f} {1e3 * t[1]:>9.3f} "
              f"{1e3 * t[2]:>8.3f} {flops / t[0] / 1e12:>8.1f} {t[2] / t[0]:>7.2f} "
              f"{1e3 * g[0]:>9.3f} {1e3 * g[1]:>9.3f} {1e3 * g[2]:>9.3f} {g[2] / g[0]:>7.2f} "
              f"{err:>8.1e}  {tiles_text(chosen)}", flush=True)
        rows.append({"group": group, "name": name, "x_shape": list(x_shape), "kwargs": kw,
                     "mosaic_ms": 1e3 * t[0], "triton_ms": 1e3 * t[1], "xla_ms": 1e3 * t[2],
                     "mosaic_grad_ms": 1e3 * g[0], "triton_grad_ms": 1e3 * g[1],
                     "xla_grad_ms": 1e3 * g[2], "tflops": flops / t[0] / 1e12,
                     "max_rel_err": err,
                     "tiles": {part: c.to_dict() for part, c in chosen.items()}})
    bc.write_json(opts.json, {"device_kind": kind, "jax": jax.__version__, "dtype": dtype.name,
                              "rows": rows})
    return 0


def _main_fused(opts, groups, bk, kind) -> int:
    print(f"{'shape':<18} {'form':<13} {'N':>4} {'fused ms':>9} {'unfus ms':>9} {'xla ms':>8} "
          f"{'xla/fus':>7} {'grad f ms':>9} {'grad u ms':>9} {'grad x ms':>9} {'xla/fus':>7} "
          f"{'max err':>8}  tiles")
    rows = []
    for group, name, hwc, kw, w_shape, batch in SHAPES:
        if group in groups:
            rows += fused_rows(name, group, (opts.batch or batch, *hwc), kw, w_shape, opts, bk)
    bc.write_json(opts.json, {"device_kind": kind, "jax": jax.__version__, "dtype": "bfloat16",
                              "fused": True, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
