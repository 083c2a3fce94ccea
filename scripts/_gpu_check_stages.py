"""The stages of ``scripts/gpu_check.py``, each run in its own process by that script.

A stage is a list of *units* (one kernel family, one training-step variant, one shape).
Each unit's figures are appended to ``$OUT/gpu_check.jsonl`` the moment they are measured
(:meth:`Context.emit`).  A unit records ``started`` before it runs and ``done`` or
``failed`` after; a failed unit ends the process (exit :data:`RELAUNCH`), since a GPU fault
can leave the process's CUDA context unusable, and the parent starts the stage again, which
skips every unit already recorded (one started and never ended is recorded ``crashed``).

``--dry-run`` runs every stage on the CPU with tiny shapes, one timing call each and one
tile candidate per launch; the Mosaic kernels run in GPU interpret mode (jax >= 0.11; on
older jax their units are recorded as skipped).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from jaxcnn import functional as F
from jaxcnn.functional import conv_bn as fcb
from jaxcnn.functional import tuning
from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_window as mw

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import _bench_common as bc  # noqa: E402
    import _gpu_check_report as report  # noqa: E402
    import _gpu_check_tiles as tiles  # noqa: E402
finally:
    sys.path.pop(0)

RELAUNCH = report.RELAUNCH  # a unit failed: start the stage again for the units left
BF16 = jnp.dtype(jnp.bfloat16)
FWD_TOL, GRAD_TOL = 3e-2, 5e-2  # bfloat16 results against float32 XLA, relative to max |ref|


@dataclasses.dataclass
class Context:
    """What a stage's units share: where figures go, whether this is a dry run, and how to
    time a function (median of :attr:`repeats` calls after one warm-up; one call when dry)."""
    stage: str
    out: str
    dry: bool
    repeats: int = 10

    @property
    def jsonl(self) -> str:
        return os.path.join(self.out, report.JSONL)

    def emit(self, kind: str, **fields) -> None:
        """Appends one record and flushes it to disk before returning."""
        report.append_record(self.jsonl, {"stage": self.stage, "kind": kind,
                                          "time": round(time.time(), 3), **fields})

    def records(self, kind: str | None = None) -> list:
        return [r for r in report.read_records(self.jsonl)
                if kind is None or r.get("kind") == kind]

    def timer(self, fn, *args) -> float:
        if not self.dry:
            return autotune.time_call(fn, *args, repeats=self.repeats)
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t0

    @property
    def max_candidates(self) -> int:
        return 1 if self.dry else tiles.PER_LAUNCH

    def family_failed(self, family: str) -> bool:
        """Whether the ``correct`` stage found ``family`` wrong (or could not run it)."""
        return any(r.get("family") == family and not r.get("ok")
                   for r in self.records("correct"))


def run_units(ctx: Context, units) -> int:
    """Runs ``units`` (``[(name, fn)]``) not yet recorded in this stage (nor finished by a
    check carried over with ``--resume``); returns 0, or :data:`RELAUNCH` after the first
    unit that raised (recorded with its error)."""
    status = {r["unit"]: r["status"] for r in ctx.records("unit")
              if r["stage"] == ctx.stage or r.get("carried")}
    for name, fn in units:
        if status.get(name) == "started":
            ctx.emit("unit", unit=name, status="crashed")
        if name in status:
            continue
        ctx.emit("unit", unit=name, status="started")
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # recorded; the stage starts again in a fresh process
            ctx.emit("unit", unit=name, status="failed", seconds=time.perf_counter() - t0,
                     error=f"{type(e).__name__}: {e}"[:2000],
                     traceback=traceback.format_exc()[-3000:])
            return RELAUNCH
        ctx.emit("unit", unit=name, status="done", seconds=round(time.perf_counter() - t0, 2))
    return 0


def _mosaic_skip(ctx: Context, unit: str) -> bool:
    """Records ``unit`` as skipped where this jax cannot build the Mosaic kernels."""
    reason = mc.unavailable_reason()
    if reason is not None:
        ctx.emit("skip", unit=unit, reason=f"Mosaic GPU: {reason}")
    return reason is not None


# --- env ----------------------------------------------------------------------------------

def _command(argv) -> str:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unavailable ({type(e).__name__})"
    return (done.stdout or done.stderr).strip()


def _cuda_versions() -> dict:
    """The CUDA runtime, driver and cuDNN versions jaxlib sees (empty off CUDA)."""
    from jax._src import lib
    versions = getattr(lib, "cuda_versions", None)
    out = {}
    for name in ("cuda_runtime_get_version", "cuda_driver_get_version", "cudnn_get_version"):
        try:
            out[name.removesuffix("_get_version")] = getattr(versions, name)()
        except Exception:  # not a CUDA jaxlib, or an older one
            continue
    return out


def _module_version(name: str):
    try:
        module = __import__(name)
    except Exception:  # absent, or broken beside this jax
        return None
    return getattr(module, "__version__", "unknown")


def _torch_versions() -> dict:
    try:
        import torch
    except Exception:
        return {"torch": None}
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "torch_cudnn": cudnn}


def _environment_info() -> str:
    try:
        return jax.print_environment_info(return_string=True)[:3000]
    except Exception as e:  # informative only
        return f"unavailable ({type(e).__name__})"


def stage_env(ctx: Context) -> int:
    device = jax.devices()[0]
    ctx.emit("env", python=platform.python_version(), platform=platform.platform(),
             cpus=os.cpu_count(), jax=jax.__version__, jaxlib=_module_version("jaxlib"),
             backend=jax.default_backend(), device_kind=device.device_kind,
             device_count=jax.device_count(),
             compute_capability=getattr(device, "compute_capability", None),
             triton=_module_version("triton"), flax=_module_version("flax"),
             optax=_module_version("optax"), **_cuda_versions(), **_torch_versions(),
             mosaic=mc.unavailable_reason() or "available",
             jax_environment=_environment_info())
    if not ctx.dry:
        ctx.emit("env", nvidia_smi=_command(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"]), nvidia_smi_header=_command(["nvidia-smi"])[:1200])
    return 0


# --- correct ------------------------------------------------------------------------------

def _normal(key, shape, scale=1.0):
    return (scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)).astype(BF16)


def _with_grads(fn):
    """``jit`` of ``args -> (fn(*args), grads)``: the outputs and the gradients of the sum of
    their squares (in float32) with respect to every argument, in one program."""
    def both(*args):
        out, pull = jax.vjp(fn, *args)
        cts = jax.tree.map(lambda o: (2 * o.astype(jnp.float32)).astype(o.dtype), out)
        return out, pull(cts)
    return jax.jit(both)


def _errors(fn, ref, args) -> dict:
    """Largest error of ``fn``'s outputs and of the gradients of a loss of them (every
    argument's), each relative to ``ref``'s (float32 XLA on the same values)."""
    got, grads = _with_grads(fn)(*args)
    want, wants = _with_grads(ref)(*[a.astype(jnp.float32) for a in args])
    return {"fwd_err": max(bc.rel_err(a, b) for a, b in zip(jax.tree.leaves(got),
                                                              jax.tree.leaves(want))),
            "grad_errs": [bc.rel_err(a, b) for a, b in zip(grads, wants)]}


def _families(dry: bool) -> list:
    """``[(family, fn, ref, args)]``: each kernel family at one small shape."""
    n, h, c = (1, 8, 16) if dry else (4, 16, 64)
    x, xs = _normal(0, (n, h, h, c)), _normal(5, (n, 2 * h, 2 * h, c))
    k = 1 if dry else 3
    w, w2 = _normal(1, (k, k, c, c), 0.2), _normal(2, (3, 3, 1, c), 0.3)
    scale = 1 + 0.1 * jax.random.normal(jax.random.key(3), (c,))
    shift = 0.1 * jax.random.normal(jax.random.key(4), (c,))
    p = dict(padding=k // 2)
    s2 = dict(stride=2, padding=k // 2)
    dw = dict(padding=1, groups=c)
    pool = dict(kernel_size=3 if not dry else 2, stride=2, padding=1 if not dry else 0)
    out = []
    for backend in ("mosaic", "triton"):
        def conv(kw, be=backend):
            return (lambda x, w: pk.conv2d(x, w, **kw, backend=be),
                    lambda x, w: F.conv2d(x, w, **kw, impl="xla"))
        out += [(f"{backend}_dense", *conv(p), (x, w)),
                (f"{backend}_dense_stride2", *conv(s2), (xs, w)),
                (f"{backend}_depthwise", *conv(dw), (x, w2))]
        for op in ("max_pool2d", "avg_pool2d"):
            out.append((f"{backend}_{op}",
                        lambda x, op=op, be=backend: getattr(pk, op)(x, **pool, backend=be),
                        lambda x, op=op: getattr(F, op)(x, **pool, impl="xla"), (x,)))
        if backend == "mosaic":
            for form in ("stats", "bnrelu+stats"):
                fused, _, xla = load_script("bench_mgpu")._fused_fns(p, form != "stats")
                out.append((f"mosaic_fused_{form}", lambda x, w, f=fused: f(x, w, scale, shift),
                            lambda x, w, f=xla: f(x, w, scale, shift), (x, w)))
    out.append(("mosaic_batch_norm",
                lambda x: F.batch_norm_train(x, scale, shift, grad="explicit", relu=True,
                                             impl="pallas"),
                lambda x: F.batch_norm_train(x, scale, shift, grad="explicit", relu=True,
                                             impl="xla"), (x,)))
    out.append(("triton_bn_relu_conv",
                lambda x, w: pk.bn_relu_conv2d(x, w, scale=scale, shift=shift, **p),
                lambda x, w: F.conv2d(jax.nn.relu(x * scale + shift), w, **p, impl="xla"),
                (x, w)))
    return out


def stage_correct(ctx: Context) -> int:
    units = []
    for family, fn, ref, args in _families(ctx.dry):
        def unit(family=family, fn=fn, ref=ref, args=args):
            if family.startswith("mosaic") and _mosaic_skip(ctx, family):
                return
            try:
                errs = _errors(fn, ref, args)
            except Exception as e:
                ctx.emit("correct", family=family, ok=False, error=f"{type(e).__name__}: {e}"[:1500])
                raise
            ok = errs["fwd_err"] <= FWD_TOL and max(errs["grad_errs"]) <= GRAD_TOL
            ctx.emit("correct", family=family, ok=bool(ok), **errs,
                     shapes=[list(a.shape) for a in args])
        units.append((family, unit))
    return run_units(ctx, units)


# --- the training step --------------------------------------------------------------------

def load_script(name: str):
    """``scripts/<name>.py`` as a module, loaded once (registered before it runs, as its
    dataclasses need)."""
    key = f"_gpu_check_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(HERE, f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


def _step_case(ctx: Context) -> tuple:
    """``(bench_train case, batch, steps, reps, warmup)``: ResNet-50 at 256, or a dry run's
    MNIST CNN at batch 2 (the same code; a ResNet would take most of the dry run to compile)."""
    if ctx.dry:
        return "mnist_cnn", 2, 1, 1, 0
    return "resnet50", 256, 5, 3, 1


def _step_unit(ctx: Context, framework: str, **variant):
    """A unit timing one training step (``framework`` ``jaxcnn`` with ``variant`` = impl,
    bn_grad, conv_bn; or ``torch.compile``) and recording it."""
    bt = load_script("bench_train")
    case, batch, steps, reps, warmup = _step_case(ctx)
    args = argparse.Namespace(batch=batch, steps=steps, reps=reps, warmup=warmup)

    def unit():
        if framework == "jaxcnn":
            seconds = bt.bench_jaxcnn(case, args, True, variant["impl"], variant["bn_grad"],
                                      variant["conv_bn"])
        else:
            seconds = bt.bench_torch(case, args, compiled=True,
                                     backend="eager" if ctx.dry else "inductor")
        ctx.emit("step", model=case, framework=framework, batch=batch, dtype="bfloat16",
                 step_ms=1e3 * seconds, img_s=batch / seconds,
                 mfu=bt.mfu(case, batch, seconds, True), **variant)
    return unit


def _variant_name(impl, bn_grad, conv_bn) -> str:
    return f"jaxcnn impl={impl} bn_grad={bn_grad} conv_bn={conv_bn}"


def stage_resnet50(ctx: Context) -> int:
    """XLA's convolutions with the explicit BatchNorm (the default), then with autodiff's."""
    variants = [dict(impl="xla", bn_grad=g, conv_bn="off") for g in ("explicit", "autodiff")]
    return run_units(ctx, [(_variant_name(**v), _step_unit(ctx, "jaxcnn", **v)) for v in variants])


def stage_torch(ctx: Context) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        ctx.emit("skip", unit="torch.compile", reason="torch is not installed")
        return 0
    return run_units(ctx, [("torch.compile", _step_unit(ctx, "torch.compile"))])


def stage_resnet50_more(ctx: Context) -> int:
    """The closed-form BatchNorm and the fused Conv-BatchNorm kernels (where ``correct``
    passed them)."""
    variants = [dict(impl="xla", bn_grad="closed_form", conv_bn="off")]
    if ctx.family_failed("mosaic_fused_stats") or ctx.family_failed("mosaic_fused_bnrelu+stats"):
        ctx.emit("skip", unit="conv_bn=mosaic", reason="a fused family failed `correct`")
    elif mc.unavailable_reason() is None and not ctx.dry:  # a dry run interprets each conv
        variants.append(dict(impl="xla", bn_grad="explicit", conv_bn="mosaic"))
    return run_units(ctx, [(_variant_name(**v), _step_unit(ctx, "jaxcnn", **v))
                           for v in variants])


def stage_resnet50_auto(ctx: Context) -> int:
    """``impl="auto"`` and ``conv_bn="auto"``: the kernels chosen by this run's verdicts."""
    variant = dict(impl="auto", bn_grad="explicit", conv_bn="auto")
    return run_units(ctx, [(_variant_name(**variant), _step_unit(ctx, "jaxcnn", **variant))])


# --- kernels against XLA ------------------------------------------------------------------

def _shapes(script: str, names, dry_shapes) -> list:
    """The rows of ``scripts/<script>.py``'s ``SHAPES`` named ``names`` (``dry_shapes`` for a
    dry run), with their batch applied."""
    if dry_shapes is not None:
        return dry_shapes
    rows = {row[1]: row for row in load_script(script).SHAPES}
    return [rows[name] for name in names]


DENSE = ("res3x3 56x64", "res3x3 28x128", "res3x3 14x256", "res3x3 7x512", "1x1 56x64->256")
DENSE_DRY = [("dry", "dry 1x1 8x16", (8, 8, 16), {}, (1, 1, 16, 16), 1)]


def _kept_candidates(ctx: Context):
    return tiles.candidate_fn(tiles.load(), ctx.max_candidates)


def _tiles_chosen(fn, args) -> dict:
    """``{kernel key: tiles}`` each Mosaic launch of ``fn`` runs with now (the tuned ones,
    else the defaults)."""
    out = {}
    for call in tiles.launches(fn, args):
        dense = isinstance(call, mc.DenseCall)
        tuned = mc.tuned_config(call) if dense else mw.tuned_config(call)
        out[call.key] = tiles.describe(call.fit(tuned or (mc.DEFAULT if dense else mw.DEFAULT)))
    return out


def _dense_unit(ctx: Context, name, hwc, kw, w_shape, batch):
    def unit():
        bk = load_script("bench_kernels")
        x_shape = (batch, *hwc)
        x, w = bk._args("conv2d", x_shape, w_shape, BF16)
        arrays, static = tuning.canonical_call("conv2d", (x, w), kw)
        entry = autotune.tune_op("conv2d", arrays, {**static, "backend": "mosaic"},
                                 xla=lambda *a: F.conv2d(*a, **static, impl="xla"),
                                 timer=ctx.timer, candidate_fn=_kept_candidates(ctx))
        flops = bk.work("conv2d", x_shape, kw, w_shape, BF16.itemsize)[0]
        mosaic = lambda x, w: pk.conv2d(x, w, **kw, backend="mosaic")  # noqa: E731
        ctx.emit("conv", name=name, x_shape=list(x_shape), w_shape=list(w_shape), kwargs=kw,
                 **_race_fields(entry, flops, 3 * flops), tiles=_tiles_chosen(mosaic, (x, w)))
    return unit


def _race_fields(entry: dict, flops: float, grad_flops: float) -> dict:
    """A tuner entry as milliseconds, ratios (XLA time over the kernel's: above 1, the
    kernel is faster) and TFLOP/s."""
    out = {"mosaic_ms": 1e3 * entry["pallas_s"], "xla_ms": 1e3 * entry["xla_s"],
           "fwd_ratio": entry["xla_s"] / entry["pallas_s"]}
    if "pallas_grad_s" in entry:
        out.update(mosaic_grad_ms=1e3 * entry["pallas_grad_s"],
                   xla_grad_ms=1e3 * entry["xla_grad_s"],
                   grad_ratio=entry["xla_grad_s"] / entry["pallas_grad_s"])
    if flops:
        out.update(mosaic_tflops=flops / entry["pallas_s"] / 1e12,
                   xla_tflops=flops / entry["xla_s"] / 1e12)
        if "pallas_grad_s" in entry:
            out.update(mosaic_grad_tflops=grad_flops / entry["pallas_grad_s"] / 1e12,
                       xla_grad_tflops=grad_flops / entry["xla_grad_s"] / 1e12)
    return out


def stage_dense(ctx: Context) -> int:
    if _mosaic_skip(ctx, "dense") or _skip_failed(ctx, ("mosaic_dense",)):
        return 0
    return run_units(ctx, [(name, _dense_unit(ctx, name, hwc, kw, w_shape, batch))
                           for _, name, hwc, kw, w_shape, batch in
                           _shapes("bench_mgpu", DENSE, DENSE_DRY if ctx.dry else None)])


def _skip_failed(ctx: Context, families) -> bool:
    failed = [f for f in families if ctx.family_failed(f)]
    if failed:
        ctx.emit("skip", unit=ctx.stage, reason=f"failed `correct`: {failed}")
    return bool(failed)


FUSED = ("res3x3 28x128", "1x1 56x256->64")
FUSED_DRY = [("dry", "dry 1x1 8x16", (8, 8, 16), {}, (1, 1, 16, 16), 1)]


def _fused_unit(ctx: Context, name, hwc, kw, w_shape, batch, form):
    def unit():
        bm, bk = load_script("bench_mgpu"), load_script("bench_kernels")
        x_shape = (batch, *hwc)
        x, w = bk._args("conv2d", x_shape, w_shape, BF16)
        c = hwc[2]
        scale = 1 + 0.1 * jax.random.normal(jax.random.key(3), (c,))
        shift = 0.1 * jax.random.normal(jax.random.key(4), (c,))
        args, prologue = (x, w, scale, shift), form != "stats"
        fused, _, xla = bm._fused_fns(kw, prologue)
        autotune.store_kernels(autotune.tune_kernels(fused, args,
                                                     candidate_fn=_kept_candidates(ctx)))
        entry = {"pallas_s": ctx.timer(jax.jit(fused), *args),
                 "xla_s": ctx.timer(jax.jit(xla), *args),
                 "pallas_grad_s": ctx.timer(autotune._loss_grad(fused, args), *args),
                 "xla_grad_s": ctx.timer(autotune._loss_grad(xla, args), *args)}
        static = fcb.tuned_static(x.shape, w.shape, **bm.kw_geometry(kw), prologue=prologue,
                                  stats=True)
        autotune.store_op_entry(fcb.TUNED_OP, (x, w), static, {
            "fused_s": entry["pallas_s"], "xla_s": entry["xla_s"],
            "fused_grad_s": entry["pallas_grad_s"], "xla_grad_s": entry["xla_grad_s"],
            "fwd_faster": entry["pallas_s"] < entry["xla_s"],
            "grad_faster": entry["pallas_grad_s"] < entry["xla_grad_s"]})
        ctx.emit("fused", name=name, form=form, x_shape=list(x_shape), **_race_fields(entry, 0, 0),
                 tiles=_tiles_chosen(fused, args))
    return unit


def stage_fused(ctx: Context) -> int:
    if _mosaic_skip(ctx, "fused") or _skip_failed(
            ctx, ("mosaic_fused_stats", "mosaic_fused_bnrelu+stats")):
        return 0
    return run_units(ctx, [(f"{name} {form}", _fused_unit(ctx, name, hwc, kw, w_shape, batch, form))
                           for _, name, hwc, kw, w_shape, batch in
                           _shapes("bench_mgpu", FUSED, FUSED_DRY if ctx.dry else None)
                           for form in _fused_forms(ctx)])


def _fused_forms(ctx: Context) -> tuple:
    """Both fused forms; a dry run times the one with the prologue only (the same code)."""
    forms = load_script("bench_mgpu").FUSED_FORMS
    return forms[-1:] if ctx.dry else forms


WINDOW = ("maxpool 3x3/2 112x64", "dw 112x32", "dw 56x144")
WINDOW_DRY = [("dry", "dry maxpool 2x2/2", "max_pool2d", (4, 8, 16),
               dict(kernel_size=2, stride=2), None, 1),
              ("dry", "dry dw 3x3", "conv2d", (4, 8, 16), dict(padding=1, groups=16),
               (3, 3, 1, 16), 1)]
_FAMILY = {"max_pool2d": "mosaic_max_pool2d", "avg_pool2d": "mosaic_avg_pool2d",
           "conv2d": "mosaic_depthwise"}


def _window_unit(ctx: Context, name, op, hwc, kw, w_shape, batch):
    def unit():
        bw = load_script("bench_mgpu_window")
        if ctx.family_failed(_FAMILY[op]):
            ctx.emit("skip", unit=name, reason=f"{_FAMILY[op]} failed `correct`")
            return
        bandwidth = [r["bytes_per_s"] for r in ctx.records("bandwidth")]
        if not bandwidth:
            mib = 1 if ctx.dry else 1024
            bandwidth = [load_script("bench_kernels").measure_bandwidth(ctx.repeats, mib)]
            ctx.emit("bandwidth", bytes_per_s=bandwidth[0], mib=mib)
        x_shape = (batch, *hwc)
        args = bw._args(op, x_shape, w_shape, BF16)
        arrays, static = tuning.canonical_call(op, args, kw)
        entry = autotune.tune_op(op, arrays, {**static, "backend": "mosaic"},
                                 xla=lambda *a: getattr(F, op)(*a, **static, impl="xla"),
                                 timer=ctx.timer, candidate_fn=_kept_candidates(ctx))
        y_shape = jax.eval_shape(lambda *a: getattr(F, op)(*a, **kw, impl="xla"), *args).shape
        nbytes = bw._bytes(x_shape, y_shape, w_shape, BF16.itemsize)
        mosaic = bw._fns(op, kw)[0]
        ctx.emit("window", name=name, op=op, x_shape=list(x_shape), kwargs=kw,
                 **_race_fields(entry, 0, 0), bytes=nbytes,
                 mosaic_bandwidth_fraction=nbytes / entry["pallas_s"] / bandwidth[0],
                 xla_bandwidth_fraction=nbytes / entry["xla_s"] / bandwidth[0],
                 tiles=_tiles_chosen(mosaic, args))
    return unit


def stage_window(ctx: Context) -> int:
    if _mosaic_skip(ctx, "window"):
        return 0
    return run_units(ctx, [(name, _window_unit(ctx, name, op, hwc, kw, w_shape, batch))
                           for _, name, op, hwc, kw, w_shape, batch in
                           _shapes("bench_mgpu_window", WINDOW, WINDOW_DRY if ctx.dry else None)])


# ResNet-50's BatchNorm inputs (batch 256), most activation read per step first (layers x
# size: 4 x 56x56x256, 5 x 28x28x512, 7 x 14x14x1024, 6 x 56x56x64, the stem, 7 x 28x28x128,
# 11 x 14x14x256, 4 x 7x7x2048): a check cut short has measured the ones that weigh most.
BATCH_NORM = ((56, 56, 256), (28, 28, 512), (14, 14, 1024), (56, 56, 64), (112, 112, 64),
              (28, 28, 128), (14, 14, 256), (7, 7, 2048))
BATCH_NORM_DRY = ((8, 8, 16),)


def _batch_norm_fns(relu: bool = True) -> dict:
    """The explicit BatchNorm's two reductions, the Mosaic kernels' and XLA's:
    ``{"stats": (kernel, xla)}`` of ``x`` and ``{"sums": (kernel, xla)}`` of ``(dy, x, a, c)``
    (the backward's ``Σ g·x, Σ g``, ``g = dy`` masked by ``x·a + c > 0`` with ``relu``, as
    ``norm.affine_relu_sums`` takes them).  A ``kernel`` is ``kernel(config)`` -> the function
    with those tiles: passed, not looked up while tracing, so no cached trace can run other
    tiles than the ones a timing is stored under (:func:`_fastest_tiles`)."""
    from jaxcnn.functional import norm
    from pallas_kernels import mgpu_bn as mb
    interpret = jax.default_backend() != "gpu"  # the dry run

    def stats(config):
        return lambda x: mb.channel_stats(x, config=config, interpret=interpret)

    def sums(config):
        def fn(dy, x, a, c):
            zero = jnp.zeros_like(a)
            return mb.channel_grad_sums(dy, x, zero, zero + 1, relu_affine=(a, c) if relu else None,
                                        config=config, interpret=interpret)
        return fn
    return {"stats": (stats, lambda x: norm.moments(x, kernel=False)),
            "sums": (sums, lambda dy, x, a, c: norm.affine_relu_sums(dy, x, a, c, relu=relu,
                                                                     kernel=False))}


def _fastest_tiles(ctx: Context, call, kernel, args):
    """Times ``kernel(config)`` for each kept candidate of ``call`` (at most
    ``ctx.max_candidates``), stores the fastest in the autotune cache (where the kernels
    look their tiles up) and returns ``(seconds, tiles)``."""
    best = None
    for cfg in call.candidates(mc.MAX_SMEM)[:ctx.max_candidates]:
        t = ctx.timer(jax.jit(kernel(cfg)), *args)
        if best is None or t < best[0]:
            best = (t, cfg)
    autotune.store_kernels({call.key: best[1]})
    return best


def _batch_norm_unit(ctx: Context, hwc):
    def unit():
        from pallas_kernels import mgpu_bn as mb
        if ctx.family_failed("mosaic_batch_norm"):
            ctx.emit("skip", unit=f"batch_norm {hwc}", reason="mosaic_batch_norm failed `correct`")
            return
        batch = 2 if ctx.dry else 256
        x = _normal(6, (batch, *hwc), 2.0) + 1
        dy = _normal(7, x.shape)
        a = 1 + 0.1 * jax.random.normal(jax.random.key(8), (hwc[2],))
        c = 0.1 * jax.random.normal(jax.random.key(9), (hwc[2],))
        m, dtype = x.size // hwc[2], BF16.name
        stats_fn, stats_xla = _batch_norm_fns()["stats"]
        stats_s, stats_cfg = _fastest_tiles(ctx, mb.BnCall("mgpu_bn_stats", m, hwc[2], dtype),
                                            stats_fn, (x,))
        xla_s = ctx.timer(jax.jit(stats_xla), x)
        for relu in (True, False):  # the sums with the ReLU's mask (4 table rows) and without (2)
            sums_fn, sums_xla = _batch_norm_fns(relu)["sums"]
            sums_s, sums_cfg = _fastest_tiles(
                ctx, mb.BnCall("mgpu_bn_grad_sums", m, hwc[2], dtype, 2, 4 if relu else 2),
                sums_fn, (dy, x, a, c))
            entry = {"pallas_s": stats_s, "xla_s": xla_s, "pallas_grad_s": sums_s,
                     "xla_grad_s": ctx.timer(jax.jit(sums_xla), dy, x, a, c)}
            entry.update(fwd_faster=entry["pallas_s"] < entry["xla_s"],
                         grad_faster=entry["pallas_grad_s"] < entry["xla_grad_s"],
                         measures="fwd: the statistics pass; grad: the backward's two sums"
                                  + (" with the ReLU's mask" if relu else ""))
            autotune.store_op_entry("batch_norm", (x,), {"backend": "mosaic", "relu": relu}, entry)
            nbytes = x.size * BF16.itemsize
            ctx.emit("batchnorm", name=f"{hwc[0]}x{hwc[1]}x{hwc[2]}" + (" relu" if relu else ""),
                     x_shape=list(x.shape), **_race_fields(entry, 0, 0),
                     mosaic_gb_s=nbytes / stats_s / 1e9, mosaic_grad_gb_s=2 * nbytes / sums_s / 1e9,
                     tiles={"mgpu_bn_stats": f"c{stats_cfg.block_c}s{stats_cfg.stages}",
                            "mgpu_bn_grad_sums": f"c{sums_cfg.block_c}s{sums_cfg.stages}"})
    return unit


def stage_batchnorm(ctx: Context) -> int:
    """Training BatchNorm's reductions at ResNet-50's shapes (batch 256): the Mosaic kernels
    (their fastest kept tiles) against XLA's, each verdict stored where ``impl="auto"``
    reads it (op ``"batch_norm"``)."""
    if _mosaic_skip(ctx, "batchnorm"):
        return 0
    return run_units(ctx, [(f"batch_norm {'x'.join(map(str, hwc))}", _batch_norm_unit(ctx, hwc))
                           for hwc in (BATCH_NORM_DRY if ctx.dry else BATCH_NORM)])


def tile_plan_calls() -> list:
    """Every Mosaic launch the ``dense``, ``fused`` and ``window`` stages time on the GPU
    (what ``gpu_check_tiles.json`` keeps a shortlist for)."""
    bm, bw = load_script("bench_mgpu"), load_script("bench_mgpu_window")
    calls = []
    for _, _, hwc, kw, w_shape, batch in _shapes("bench_mgpu", DENSE, None):
        x = jax.ShapeDtypeStruct((batch, *hwc), BF16)
        w = jax.ShapeDtypeStruct(w_shape, BF16)
        calls += tiles.launches(lambda x, w, kw=kw: pk.conv2d(x, w, **kw, backend="mosaic"),
                                (x, w))
    for _, _, hwc, kw, w_shape, batch in _shapes("bench_mgpu", FUSED, None):
        c = jax.ShapeDtypeStruct((hwc[2],), jnp.float32)
        args = (jax.ShapeDtypeStruct((batch, *hwc), BF16), jax.ShapeDtypeStruct(w_shape, BF16),
                c, c)
        for form in bm.FUSED_FORMS:
            calls += tiles.launches(bm._fused_fns(kw, form != "stats")[0], args)
    for _, _, op, hwc, kw, w_shape, batch in _shapes("bench_mgpu_window", WINDOW, None):
        args = [jax.ShapeDtypeStruct((batch, *hwc), BF16)]
        if w_shape is not None:
            args.append(jax.ShapeDtypeStruct(w_shape, BF16))
        calls += tiles.launches(bw._fns(op, kw)[0], args)
    return calls


# The stages by name; their order and shares of the budget are scripts/gpu_check.py's.
FUNCTIONS = {"env": stage_env, "correct": stage_correct, "resnet50": stage_resnet50,
             "torch": stage_torch, "dense": stage_dense, "resnet50_more": stage_resnet50_more,
             "fused": stage_fused, "window": stage_window, "batchnorm": stage_batchnorm,
             "resnet50_auto": stage_resnet50_auto}

__all__ = ["Context", "FUNCTIONS", "RELAUNCH", "run_units", "tile_plan_calls"]
