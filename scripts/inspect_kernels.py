"""Compile the Pallas kernels for an H100 on any machine and report what the GPU would run.

Without a GPU, a kernel's speed cannot be measured, but most of what decides
it can be read from the machine code: whether global loads are vectorised
(16-byte ``ld.global.v4``) or scalar, whether the implicit-GEMM operands are
staged through ``cp.async`` (Triton's software pipelining), whether the dots
run on Hopper's ``wgmma`` tensor-core path, and the registers, spills and
shared memory per program.  This script lowers each benchmark shape of
``scripts/bench_kernels.py`` (forward and both gradients) for an abstract
H100 (the lowering in ``tests/pallas/test_pallas_lowering.py``), hands each
kernel's Triton IR to Triton's own compiler for ``sm_90a`` (the same passes XLA
runs on Pallas modules), and prints a row per kernel::

    python scripts/inspect_kernels.py --groups resnet50,pool

It needs the ``triton`` package (``pip install triton==3.6.0``, the version on
the lent H100s), which is neither a dependency of jaxcnn nor needed on a GPU
machine, and jax 0.11.2: it reads each kernel's Triton module through a
private hook of jax's Pallas lowering, which older jax versions lack.  The
block configs are those :mod:`pallas_kernels.autotune` would pick on the
given device kind (its shipped ``tuned.json`` entries, else its defaults);
``--candidates`` inspects every candidate the tuner would time instead.

``--mosaic`` reports the Mosaic GPU (Hopper) kernels instead, from their lowered modules
(TMA loads and stores, mbarriers, ``ldmatrix``/``stmatrix``, ``setmaxnreg``, the ``wgmma``
shapes), per kernel: the dense convolutions (plain and with BatchNorm fused), then the
pooling and depthwise window kernels; with ``--candidates``, every tile configuration the
tuner can choose on the device kind, a row per kernel and configuration: the dense
convolution's forward (plain and each fused form), input and weight gradients
(``dense_candidates``), then the window kernels' (``window_candidates``).  It needs jax
>= 0.11 (checked on 0.11.2 and 0.12.0.1, whose TMA loads are inline PTX), not triton.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp

from pallas_kernels import autotune

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
try:
    import _bench_common as bc
finally:
    sys.path.pop(0)

H100 = "NVIDIA H100 80GB HBM3"
_SHARED_MEMORY_LIMITS = {H100: 227 * 1024}  # what the tuner allows one program there
TRITON_TARGET = "__gpu$xla.gpu.triton"


class Unavailable(RuntimeError):
    """Triton, or the jax internals this inspection reads, are missing."""


def _lowering_module():
    try:
        from jax._src.pallas.triton import lowering
    except ImportError as e:
        raise Unavailable(f"jax {jax.__version__} has no Pallas Triton lowering: {e}") from e
    if not hasattr(lowering, "lower_jaxpr_to_triton_module"):
        raise Unavailable(f"jax {jax.__version__}: Pallas Triton lowering hook not found")
    return lowering


@contextlib.contextmanager
def _capturing():
    """Collects ``(kernel name, Triton IR text)`` for every Pallas kernel lowered inside."""
    lowering = _lowering_module()
    original = lowering.lower_jaxpr_to_triton_module
    seen: list = []

    def capture(*args, **kwargs):
        result = original(*args, **kwargs)
        text = result.module.operation.get_asm(enable_debug_info=False)
        name = re.search(r"tt\.func (?:public )?@([\w$.]+)", text)
        seen.append((name.group(1) if name else "?", text))
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        yield seen
    finally:
        lowering.lower_jaxpr_to_triton_module = original


@contextlib.contextmanager
def as_device_kind(kind: str):
    """Makes :mod:`pallas_kernels.autotune` pick configs as it would on ``kind``."""
    original = autotune.device_kind
    autotune.device_kind = lambda: kind
    try:
        yield
    finally:
        autotune.device_kind = original


def _abstract_gpu(kind: str):
    from jax.sharding import AbstractDevice, AbstractMesh
    device = AbstractDevice(device_kind=kind, num_cores=132, platform="gpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=device))


def _launches(stablehlo) -> list:
    """``(name, num_warps, num_stages)`` of every Triton custom call, in module order."""
    from jax._src.lib.mlir import ir
    return [(ir.StringAttr(cfg["name"]).value, ir.IntegerAttr(cfg["num_warps"]).value,
             ir.IntegerAttr(cfg["num_stages"]).value)
            for cfg in _custom_call_configs(stablehlo.operation, TRITON_TARGET)]


def _custom_call_configs(operation, target: str):
    """The ``mhlo.backend_config`` (an ``ir.DictAttr``) of every ``stablehlo.custom_call`` to
    ``target`` in ``operation``, nested regions included, in module order."""
    from jax._src.lib.mlir import ir
    for region in operation.regions:
        for block in region.blocks:
            for inner in block.operations:
                o = inner.operation
                if (o.name == "stablehlo.custom_call"
                        and ir.StringAttr(o.attributes["call_target_name"]).value == target):
                    yield ir.DictAttr(o.attributes["mhlo.backend_config"])
                yield from _custom_call_configs(o, target)


def _lower_for_cuda(fn, args):
    """``jit(fn)`` traced and lowered for CUDA afresh, so that what is looked up or captured
    while tracing and lowering (tiles, launches, Triton modules) happens on every call: a new
    function each time, with ``fn``'s own ``jax.jit`` (if it is jitted) taken off, so that
    ``fn``'s body is traced again and the lowering runs again.  A function that ``fn`` calls
    through ``jax.jit`` may still be served from JAX's trace cache: the kernels' ops have
    none.  JAX's caches are left alone: they are the process's."""
    body = fn.__wrapped__ if isinstance(fn, jax.stages.Wrapped) else fn
    return jax.jit(lambda *a: body(*a)).trace(*args).lower(lowering_platforms=("cuda",))


def lower_kernels(fn, *args, kind: str = H100) -> list:
    """``[(name, num_warps, num_stages, ttir_text)]`` of the kernels ``jit(fn)`` launches on ``kind``."""
    with _capturing() as seen, _abstract_gpu(kind), as_device_kind(kind):
        lowered = _lower_for_cuda(fn, args)
    pending = list(seen)
    out = []
    for name, warps, stages in _launches(lowered.compiler_ir("stablehlo")):
        i = next((i for i, (n, _) in enumerate(pending) if n == name), None)
        if i is None:
            raise RuntimeError(f"no captured Triton module for kernel {name!r}")
        out.append((name, warps, stages, pending.pop(i)[1]))
    return out


@dataclasses.dataclass
class KernelReport:
    """What Triton compiled one kernel into (counts are static instructions in the PTX)."""
    name: str
    num_warps: int
    num_stages: int
    regs: int | None
    spill_bytes: int | None
    shared_bytes: int
    ld_scalar: int  # ld.global without .v2/.v4
    ld_scalar_narrow: int  # those reading under 32 bits: unvectorised 8/16-bit data
    ld_vector: int  # ld.global.v2 / .v4
    cp_async: int  # cp.async (global -> shared, pipelined)
    cp_async_narrow: int  # those copying under 16 bytes (one element at a time)
    wgmma: int
    mma_sync: int
    st_scalar: int
    st_vector: int

    @property
    def scalar_loads(self) -> bool:
        return self.ld_scalar > 0


def _triton():
    try:
        import triton
        from triton._C.libtriton import ir
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError as e:
        raise Unavailable(f"the triton package is needed ({e}); "
                          "pip install triton==3.6.0") from e
    return triton, ir, GPUTarget, CUDABackend


def compile_ttir(text: str, num_warps: int, num_stages: int, capability: int = 90):
    """Triton's ``CompiledKernel`` for one kernel's IR, built for ``sm_{capability}``.

    Parsing a file puts its path in the module's locations; the cleaned module is written
    with this call's temporary path replaced by a fixed name, so its text (which Triton's
    cache is keyed on) depends on ``text`` alone: a kernel compiled before, by this process
    or another, is read back from Triton's cache instead of compiled again."""
    triton, ir, GPUTarget, CUDABackend = _triton()
    target = GPUTarget("cuda", capability, 32)
    with tempfile.TemporaryDirectory() as tmp:
        ctx = ir.context()
        ir.load_dialects(ctx)
        CUDABackend(target).load_dialects(ctx)
        src = os.path.join(tmp, "k.ttir")
        with open(src, "w", encoding="utf-8") as f:
            f.write(text)
        module = ir.parse_mlir_module(src, ctx)
        module.context = ctx
        # XLA cleans a Pallas module with Triton's TTIR passes (canonicalise, combine
        # dot+add, CSE) before lowering; compiling from a .ttir file skips that stage.
        module = CUDABackend.make_ttir(module, {}, None, capability)
        with open(src, "w", encoding="utf-8") as f:
            f.write(str(module).replace(src, "kernel.ttir"))
        return triton.compile(src, target=target,
                              options=dict(num_warps=num_warps, num_stages=num_stages))


def _ptxas_usage(ptx: str, capability: int) -> tuple:
    """(registers, spill store bytes) from ``ptxas -v``, or (None, None) if it is absent."""
    triton = _triton()[0]
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None, None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w", encoding="utf-8") as f:
            f.write(ptx)
        arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
        r = subprocess.run([ptxas, "-v", "--gpu-name", arch, src, "-o", os.devnull],
                           capture_output=True, text=True, check=False)
    regs = re.search(r"Used (\d+) registers", r.stderr)
    spill = re.search(r"(\d+) bytes spill stores", r.stderr)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def _bits(opcode_suffix: str) -> int:
    """Width in bits of the type ending a PTX opcode such as ``.global.L1::evict_last.b16``."""
    width = re.search(r"\.[bsuf](8|16|32|64|128)$", opcode_suffix)
    return int(width.group(1)) if width else 32


def report(name: str, num_warps: int, num_stages: int, text: str,
           capability: int = 90, usage: bool = True) -> KernelReport:
    """Compiles one kernel and counts what matters for its speed; without ``usage``, its
    registers and spills are not asked of ``ptxas -v`` (a second assembly) and read None."""
    kernel = compile_ttir(text, num_warps, num_stages, capability)
    ptx = kernel.asm["ptx"]
    loads = re.findall(r"^\s*(?:@%p\d+\s+)?ld\.global(\S*)", ptx, re.M)
    stores = re.findall(r"^\s*(?:@%p\d+\s+)?st\.global(\S*)", ptx, re.M)
    copies = re.findall(r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^\]]+\],\s*\[[^\]]+\],\s*(0x[0-9a-fA-F]+|\d+)",
                        ptx)
    regs, spill = _ptxas_usage(ptx, capability) if usage else (None, None)
    vec = re.compile(r"\.v[248]\.")
    return KernelReport(
        name=name, num_warps=num_warps, num_stages=num_stages, regs=regs, spill_bytes=spill,
        shared_bytes=int(kernel.metadata.shared),
        ld_scalar=sum(not vec.search(op + ".") for op in loads),
        ld_scalar_narrow=sum(not vec.search(op + ".") and _bits(op) < 32 for op in loads),
        ld_vector=sum(bool(vec.search(op + ".")) for op in loads),
        cp_async=len(copies),
        cp_async_narrow=sum(int(size, 0) < 16 for size in copies),
        wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
        st_scalar=sum(not vec.search(op + ".") for op in stores),
        st_vector=sum(bool(vec.search(op + ".")) for op in stores))


def inspect(fn, *args, kind: str = H100, capability: int = 90, names=None,
            usage: bool = True) -> list:
    """A :class:`KernelReport` for every kernel ``jit(fn)`` launches on ``kind`` (of those
    named in ``names`` if given: only they are compiled, each a Triton compilation);
    ``usage`` as :func:`report`'s."""
    return [report(*k, capability=capability, usage=usage)
            for k in lower_kernels(fn, *args, kind=kind) if names is None or k[0] in names]


def _row(shape: str, r: KernelReport, cfg: str = "") -> str:
    flag = "SCALAR LOADS" if r.scalar_loads else ""
    return (f"{shape:<18} {r.name:<24} {cfg:<20} {r.num_warps:>2}w{r.num_stages}s "
            f"{'?' if r.regs is None else r.regs:>4} {'?' if r.spill_bytes is None else r.spill_bytes:>5} "
            f"{r.shared_bytes // 1024:>5} {r.ld_vector:>5} {r.ld_scalar:>5} {r.cp_async:>5} "
            f"{r.wgmma:>5} {r.mma_sync:>4} {r.st_vector:>5} {r.st_scalar:>5}  {flag}")


def main(argv=None) -> int:
    bk = bc.load_script("bench_kernels")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bc.add_options(parser, bk.GROUPS, timing=False)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--device-kind", default=H100,
                        help="device kind whose tuned configs to use")
    parser.add_argument("--candidates", action="store_true",
                        help="inspect every config the autotuner would time, per kernel (with "
                             "--mosaic: the dense convolution's, fused forms included, and the "
                             "pooling and depthwise window kernels' tiles)")
    parser.add_argument("--mosaic", action="store_true",
                        help="report the Mosaic GPU (Hopper) conv/pool kernels instead: TMA, "
                             "wgmma, mbarrier per kernel (needs jax >= 0.11, not triton)")
    opts = parser.parse_args(argv)
    groups = bc.chosen_groups(parser, opts, bk.GROUPS)
    if opts.mosaic:
        return main_mosaic(opts, bk)
    try:
        _triton()
        _lowering_module()
    except Unavailable as e:
        print(f"inspect_kernels: {e}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(opts.dtype)
    print(f"jax {jax.__version__}  triton {_triton()[0].__version__}  target sm_90a  "
          f"configs of: {opts.device_kind}  dtype: {dtype.name}")
    print(f"{'shape':<18} {'kernel':<24} {'config':<20} {'launch':>5} {'regs':>4} {'spill':>5} "
          f"{'smemK':>5} {'ldvec':>5} {'ldsca':>5} {'cpasy':>5} {'wgmma':>5} {'mma':>4} "
          f"{'stvec':>5} {'stsca':>5}")
    rows, failed = [], 0
    for group, name, op, hwc, kw, w_shape, batch in bk.SHAPES:
        if group not in groups:
            continue
        x_shape = (opts.batch or batch, *hwc)
        args = [jax.ShapeDtypeStruct(a.shape, a.dtype)
                for a in jax.eval_shape(lambda: bk._args(op, x_shape, w_shape, dtype))]
        kernel, _ = bk._fns(op, {**kw, "interpret": False}, backend="triton")
        fns = [kernel, bk._grad_of(kernel, len(args))]
        try:
            found = []
            if opts.candidates:
                found = _candidates(fns[1], args, opts.device_kind)
            for fn in [] if opts.candidates else fns:
                for r in inspect(fn, *args, kind=opts.device_kind):
                    if r.name not in {f.name for f in found}:
                        found.append(r)
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18}", e, shape=name))
            failed += 1
            continue
        for item in found:
            r, cfg = item if isinstance(item, tuple) else (item, "")
            print(_row(name, r, cfg), flush=True)
            rows.append({"shape": name, "config": cfg, **dataclasses.asdict(r)})
    bc.write_json(opts.json, {"jax": jax.__version__, "triton": _triton()[0].__version__,
                              "device_kind": opts.device_kind, "dtype": dtype.name,
                              "rows": rows})
    return 1 if failed else 0


_LAUNCHES = {"dense": "jaxcnn_conv", "depthwise": "jaxcnn_depthwise",
             "max_pool2d": "jaxcnn_max_pool", "avg_pool2d": "jaxcnn_avg_pool"}


def launch_names(kernel: str) -> set:
    """Launched kernel names of an autotune kernel (``"dense_fwd"`` -> ``{"jaxcnn_conv_fwd"}``)."""
    family, part = kernel.rsplit("_", 1)
    names = {f"{_LAUNCHES[family]}_{part}"}
    if family == "max_pool2d" and part == "fwd":  # the same tiles serve the forward alone
        names.add(f"{_LAUNCHES[family]}_infer")
    return names


def _candidates(fn, args, kind, kernels=None) -> list:
    """``[(report, config text)]`` for every candidate config of every kernel ``fn`` runs (of
    the autotune kernels named in ``kernels``, such as ``{"depthwise_wgrad"}``, if given)."""
    with as_device_kind(kind), autotune._recording() as rec, _abstract_gpu(kind):
        _lower_for_cuda(fn, args)
    out = []
    limit = _SHARED_MEMORY_LIMITS.get(kind)
    for key, (kernel, g, co, dtype) in rec.items():
        if kernels is not None and kernel not in kernels:
            continue
        for cfg in autotune.candidates(kernel, g, co):
            if limit is not None and autotune.shared_memory_estimate(kernel, cfg, dtype) > limit:
                continue  # the tuner skips it too
            with autotune.override({key: cfg}):
                # only the tuned kernel's launches: the others keep their configs
                reports = inspect(fn, *args, kind=kind, names=launch_names(kernel))
            text = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}" + (
                f"/{cfg.split}" if cfg.split > 1 else "")
            out += [(r, text) for r in reports]
    return out


MOSAIC_TARGET = "mosaic_gpu_v2"
_MOSAIC_FEATURES = {
    # what each field means -> patterns (regular expressions) in the kernel's serialized MLIR
    # module: an NVVM operation's name, or the PTX of an inline-assembly instruction
    "tma_load": (rb"nvvm\.cp\.async\.bulk\.tensor\.shared\.cluster\.global",  # jax 0.11
                 rb"cp\.async\.bulk\.tensor\.[1-5]d\.shared::(?:cta|cluster)\.global"),  # 0.12
    "bulk_load": (rb"cp\.async\.bulk\.shared::(?:cta|cluster)\.global",),
    "tma_store": (rb"nvvm\.cp\.async\.bulk\.tensor\.global\.shared\.cta",
                  rb"cp\.async\.bulk\.tensor\.global\.shared", rb"cp\.async\.bulk\.global\.shared"),
    "mbarrier": (rb"nvvm\.mbarrier\.try_wait\.parity",),
    "setmaxnreg": (rb"setmaxnreg",),
    "ldmatrix": (rb"nvvm\.ldmatrix",),
    "stmatrix": (rb"nvvm\.stmatrix",),
}


@dataclasses.dataclass
class MosaicReport:
    """What one Mosaic GPU kernel's lowered module uses (presence, not counts: the module is
    MLIR bytecode, which names each operation once in its string table)."""
    name: str
    tma_load: bool  # cp.async.bulk.tensor global -> shared (TMA; jax 0.12 emits it as PTX)
    bulk_load: bool  # non-tensor cp.async.bulk global -> shared: no zero fill past a row
    tma_store: bool  # cp.async.bulk[.tensor] shared -> global
    wgmma: tuple  # the wgmma.mma_async shapes/types, e.g. "m64n128k16.f32.bf16.bf16"
    mbarrier: bool
    setmaxnreg: bool  # warp specialisation's register rebalancing
    ldmatrix: bool
    stmatrix: bool


def lower_mosaic_kernels(fn, *args, kind: str = H100) -> list:
    """``[(kernel name, module bytes)]`` of the Mosaic GPU kernels ``jit(fn)`` launches on ``kind``,
    lowered offline for CUDA in the abstract-mesh recipe (no GPU needed)."""
    from jax._src.lib.mlir import ir
    with _abstract_gpu(kind), as_device_kind(kind):
        lowered = _lower_for_cuda(fn, args)
    out = []
    for cfg in _custom_call_configs(lowered.compiler_ir("stablehlo").operation, MOSAIC_TARGET):
        module = ir.StringAttr(cfg["module"]).value_bytes
        name = re.search(rb"jaxcnn_mgpu_[a-z_]*[a-z]", module)
        out.append((name.group(0).decode() if name else "?", module))
    return out


def mosaic_report(name: str, module: bytes) -> MosaicReport:
    flags = {k: any(re.search(p, module) for p in pats) for k, pats in _MOSAIC_FEATURES.items()}
    shapes = sorted({m.decode() for m in re.findall(
        rb"wgmma\.mma_async\.sync\.aligned\.([a-z0-9.]+)", module)})
    return MosaicReport(name=name, wgmma=tuple(shapes), **flags)


def inspect_mosaic(fn, *args, kind: str = H100) -> list:
    """A :class:`MosaicReport` for every Mosaic GPU kernel ``jit(fn)`` launches on ``kind``."""
    return [mosaic_report(n, m) for n, m in lower_mosaic_kernels(fn, *args, kind=kind)]


def _mosaic_row(shape: str, r: MosaicReport, cfg: str = "") -> str:
    yes = lambda b: "yes" if b else "-"  # noqa: E731
    return (f"{shape:<18} {r.name:<33} {yes(r.tma_load):>7} {yes(r.tma_store):>8} "
            f"{yes(r.mbarrier):>8} {yes(r.ldmatrix):>8} {yes(r.stmatrix):>8} "
            f"{yes(r.setmaxnreg):>10}  "
            f"{','.join(r.wgmma) or ('NO WGMMA' if 'mgpu_conv' in r.name else '-')}"
            + (f"  {cfg}" if cfg else ""))


def main_mosaic(opts, bk) -> int:
    """``--mosaic``: the Mosaic GPU kernels of each benchmark shape: dense convolutions, then
    the window kernels of the pooling and depthwise ones."""
    import pallas_kernels.mgpu_conv as mc
    reason = mc.unavailable_reason()
    if reason is not None:
        print(f"inspect_kernels: {reason}", file=sys.stderr)
        return 2
    dtype = jnp.dtype(opts.dtype)
    print(f"jax {jax.__version__}  Mosaic GPU  target sm_90a  dtype: {dtype.name}")
    print(f"{'shape':<18} {'kernel':<33} {'tmaLoad':>7} {'tmaStore':>8} {'mbarrier':>8} "
          f"{'ldmatrix':>8} {'stmatrix':>8} {'setmaxnreg':>10}  wgmma")
    rows, failed = [], 0
    for group, name, op, hwc, kw, w_shape, batch in bk.SHAPES:
        if group not in opts.groups.split(",") or op != "conv2d" or kw.get("groups", 1) != 1:
            continue
        x_shape = (opts.batch or batch, *hwc)
        args = (jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype))
        pads = _explicit_pads(kw.get("padding", 0), w_shape)
        stride = _pair(kw.get("stride", 1))
        try:
            mc.check_supported(x_shape, w_shape, dtype, stride=stride, pads=pads)
        except NotImplementedError as e:
            print(f"{name:<18} skipped: {e}")
            continue

        if opts.candidates:
            try:
                found = dense_candidates(args, stride=stride, pads=pads, kind=opts.device_kind)
            except Exception as e:  # report and go on: one shape must not hide the others
                rows.append(bc.failure(f"{name:<18}", e, shape=name))
                failed += 1
                continue
            for kernel, cfg, r in found:
                print(_mosaic_row(name, r, dense_config_text(cfg)), flush=True)
                rows.append({"shape": name, "kernel": kernel, "config": dense_config_text(cfg),
                             **dataclasses.asdict(r)})
            continue
        ss = jax.ShapeDtypeStruct((x_shape[3],), jnp.float32)
        for fused in (False, True):  # the plain op, then BatchNorm fused in (mgpu_fused)
            try:
                reports = inspect_mosaic(_mosaic_op(pads, stride, fused), *args,
                                         *((ss, ss) if fused else ()), kind=opts.device_kind)
            except Exception as e:  # report and go on: one shape must not hide the others
                rows.append(bc.failure(f"{name:<18}", e, shape=name, fused=fused))
                failed += 1
                continue
            for r in reports:
                print(_mosaic_row(name, r), flush=True)
                rows.append({"shape": name, "fused": fused, **dataclasses.asdict(r)})
    failed += _mosaic_window_rows(opts, bk, dtype, rows)
    bc.write_json(opts.json, {"jax": jax.__version__, "backend": "mosaic_gpu",
                              "dtype": dtype.name, "rows": rows})
    return 1 if failed else 0


def _mosaic_op(pads, stride, fused: bool):
    """Forward and both gradients of one Mosaic convolution (keeping the output, so the
    forward is lowered too); ``fused``: with the BatchNorm+ReLU prologue and the
    statistics epilogue (:func:`pallas_kernels.mgpu_fused.conv2d`), cotangents for all
    three outputs."""
    import pallas_kernels.mgpu_conv as mc
    import pallas_kernels.mgpu_fused as mf
    if not fused:
        def plain(x, w):
            y, vjp = jax.vjp(lambda x, w: mc.conv2d(x, w, stride=stride, padding=pads), x, w)
            return y, vjp(y)
        return plain

    def fused_op(x, w, scale, shift):
        out, vjp = jax.vjp(lambda *a: mf.conv2d(*a[:2], stride=stride, padding=pads,
                                                input_scale=a[2], input_shift=a[3],
                                                stats=True), x, w, scale, shift)
        return out, vjp(out)
    return fused_op


def dense_config_text(cfg) -> str:
    """A dense :class:`~pallas_kernels.mgpu_conv.MgpuConfig` in a column: ``w16n128k64s3``
    (tile row, output channels, reduction chunk, slots), ``ws`` when warp-specialised,
    ``/4`` for a weight-gradient split."""
    return (f"w{cfg.tile_w}n{cfg.block_n}k{cfg.block_k}s{cfg.stages}"
            + ("ws" if cfg.warp_specialized else "") + (f"/{cfg.split}" if cfg.split > 1 else ""))


def dense_calls(x, w, *, stride, pads) -> dict:
    """``{kernel: DenseCall}`` of every dense Mosaic kernel the tuner times for a convolution
    (no bias or residual): the forward in its plain and three fused forms, the input
    gradient where it has a kernel, the weight gradient."""
    import pallas_kernels.mgpu_conv as mc
    out = {}
    for prologue in (False, True):
        for stats in (False, True):
            calls = mc.tuning_calls(x.shape, w.shape, x.dtype, stride=stride, pads=pads,
                                    dilation=(1, 1), prologue=prologue, stats=stats)
            out.update({call.kernel: call for call in calls.values()})
    return {k: out[k] for k in mc.KERNELS if out[k].runs()}


def dense_only(call):
    """``fn(x, w, scale, shift, dy)`` launching only ``call``'s dense Mosaic kernel (a
    :class:`~pallas_kernels.mgpu_conv.DenseCall` without bias or residual): the forward
    alone, in its fused form (``scale``/``shift`` the prologue's); a gradient from the
    cotangent ``dy`` (the input gradient's phases for a strided call)."""
    import pallas_kernels.mgpu_conv as mc
    import pallas_kernels.mgpu_fused as mf
    geometry = dict(stride=call.stride, padding=call.pads, dilation=call.dilation)
    if call.part == "fwd":
        pro, stats = "bnrelu" in call.kernel, call.kernel.endswith("stats")
        return lambda x, w, s, t, dy: mf.conv2d(
            x, w, **geometry, input_scale=s if pro else None, input_shift=t if pro else None,
            stats=stats)
    which = 1 if call.part == "wgrad" else 0
    return lambda x, w, s, t, dy: jax.vjp(
        lambda x, w: mc.conv2d(x, w, **geometry), x, w)[1](dy)[which]


def dense_candidates(args, *, stride, pads, kind: str = H100, pick=None) -> list:
    """``[(kernel, config, report)]``: every tile configuration the tuner can choose for each
    dense Mosaic kernel of ``conv(x, w)`` (``args``: abstract ``x``, ``w``) on ``kind`` (the
    candidates within that device's shared memory), each lowered for it with only its kernel
    (:func:`dense_only`) and reported.  ``pick``, if given, maps each kernel's list of
    candidates to those to lower (a test's sample of them)."""
    import pallas_kernels.mgpu_conv as mc
    x, w = args
    ss = jax.ShapeDtypeStruct((x.shape[3],), jnp.float32)
    dy = jax.ShapeDtypeStruct(jax.eval_shape(
        lambda x, w: mc.conv2d(x, w, stride=stride, padding=pads), x, w).shape, x.dtype)
    out = []
    for kernel, call in dense_calls(x, w, stride=stride, pads=pads).items():
        fn = dense_only(call)
        cfgs = call.candidates(_SHARED_MEMORY_LIMITS.get(kind))
        for cfg in pick(cfgs) if pick else cfgs:
            with autotune.override({call.key: cfg}):
                reports = inspect_mosaic(fn, x, w, ss, ss, dy, kind=kind)
            out += [(kernel, cfg, r) for r in reports if r.name == f"jaxcnn_{kernel}"]
    return out


def mosaic_window_call(op: str, kw: dict, grads: bool = True):
    """``fn(x[, w])`` returning the output and its gradients through the Mosaic GPU pooling or
    depthwise kernels (:mod:`pallas_kernels.mgpu_pool`, :mod:`pallas_kernels.mgpu_depthwise`)
    for a benchmark call ``op(x[, w], **kw)``; without ``grads``, the output alone."""
    import pallas_kernels.mgpu_depthwise as md
    import pallas_kernels.mgpu_pool as mp
    if op in ("max_pool2d", "avg_pool2d"):
        def run(x):
            return getattr(mp, op)(x, **kw)
    else:
        stride = _pair(kw.get("stride", 1))

        def run(x, w):
            return md.conv2d(x, w, stride=stride,
                             padding=_explicit_pads(kw.get("padding", 0), w.shape))

    def fwd_and_grads(*args):  # keeps y: the forward is lowered too
        y, vjp = jax.vjp(run, *args)
        return y, vjp(y)
    return fwd_and_grads if grads else run


def window_config_text(cfg) -> str:
    """A :class:`~pallas_kernels.mgpu_window.WindowConfig` in a column: ``w16c64s3`` (tile row,
    channels, slots), ``/4`` for a weight-gradient split."""
    return f"w{cfg.tile_w}c{cfg.block_c}s{cfg.stages}" + (f"/{cfg.split}" if cfg.split > 1 else "")


def window_launch_names(kernel: str) -> set:
    """Launched kernel names of a window kernel the tuner times (``"mgpu_max_pool_fwd"`` ->
    the max pool's forward with and without its tap index)."""
    names = {f"jaxcnn_{kernel}"}
    if kernel == "mgpu_max_pool_fwd":  # the same tiles serve the forward alone
        names.add("jaxcnn_mgpu_max_pool_infer")
    return names


def window_candidates(op: str, kw: dict, args, kind: str = H100, pick=None) -> list:
    """``[(kernel, config, report)]``: every tile configuration the tuner can choose for each
    Mosaic window kernel of ``op(*args, **kw)`` on ``kind`` (its candidates within that
    device's shared memory), each lowered for it and reported, launch by launch.  Each
    candidate is lowered with only what its kernel needs: a forward alone (the max pool's
    with and without its tap index), a gradient with its cotangent (and the max pool's
    forward, whose index it reads).  ``pick`` as :func:`dense_candidates`'."""
    import pallas_kernels.mgpu_window as mw
    run = mosaic_window_call(op, kw, grads=False)
    ct = jax.eval_shape(run, *args)

    def only(kernel):
        if kernel == "mgpu_max_pool_fwd":
            return lambda *a: (run(*a[:-1]), jax.vjp(run, *a[:-1])[0])
        if kernel.endswith("_fwd"):
            return lambda *a: run(*a[:-1])
        which = 1 if kernel.endswith("_wgrad") else 0  # dw, else dx
        return lambda *a: jax.vjp(run, *a[:-1])[1](a[-1])[which]

    with as_device_kind(kind), autotune._recording() as launched:
        jax.eval_shape(mosaic_window_call(op, kw), *args)
    out = []
    for key, (kernel, call, _, _) in sorted(launched.items()):
        if kernel not in mw.KERNELS:
            continue
        cfgs = call.candidates(_SHARED_MEMORY_LIMITS.get(kind))
        for cfg in pick(cfgs) if pick else cfgs:
            with autotune.override({key: cfg}):
                reports = inspect_mosaic(only(kernel), *args, ct, kind=kind)
            out += [(kernel, cfg, r) for r in reports if r.name in window_launch_names(kernel)]
    return out


def _mosaic_window_rows(opts, bk, dtype, rows) -> int:
    """The pooling and depthwise benchmark shapes' Mosaic window kernels (TMA, mbarrier):
    rows printed and appended to ``rows`` (with ``--candidates``, a row per kernel and
    candidate tile configuration); returns how many shapes failed to lower."""
    failed = 0
    for group, name, op, hwc, kw, w_shape, batch in bk.SHAPES:
        depthwise = op == "conv2d" and kw.get("groups", 1) != 1
        if group not in opts.groups.split(",") or not (depthwise or op.endswith("pool2d")):
            continue
        x = jax.ShapeDtypeStruct((opts.batch or batch, *hwc), dtype)
        args = (x,) if w_shape is None else (x, jax.ShapeDtypeStruct(w_shape, dtype))
        try:
            if opts.candidates:
                found = [(r, window_config_text(cfg)) for _, cfg, r in window_candidates(
                    op, kw, args, kind=opts.device_kind)]
            else:
                found = [(r, "") for r in inspect_mosaic(mosaic_window_call(op, kw), *args,
                                                        kind=opts.device_kind)]
        except NotImplementedError as e:  # KernelUnsupported: one line naming the reason
            print(f"{name:<18} skipped: {e}")
            continue
        except Exception as e:  # report and go on: one shape must not hide the others
            rows.append(bc.failure(f"{name:<18}", e, shape=name))
            failed += 1
            continue
        for r, cfg in found:
            print(_mosaic_row(name, r, cfg), flush=True)
            rows.append({"shape": name, **({"config": cfg} if cfg else {}),
                         **dataclasses.asdict(r)})
    return failed


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def _explicit_pads(padding, w_shape):
    if padding == "same":
        return tuple(((k - 1) // 2, k - 1 - (k - 1) // 2) for k in w_shape[:2])
    if isinstance(padding, int):
        return ((padding, padding), (padding, padding))
    return tuple(_pair(p) for p in padding)


if __name__ == "__main__":
    sys.exit(main())
