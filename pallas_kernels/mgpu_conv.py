"""Dense convolution for Hopper (sm_90a) in Pallas **Mosaic GPU**: TMA, wgmma, mbarriers.

The same implicit GEMM as the Triton kernels of :mod:`pallas_kernels.conv`, written for the
Mosaic GPU backend (jax >= 0.11), used on H100/H200 for the shapes it supports and tested on
the CPU in GPU interpret mode.

* :func:`conv_forward`: NHWC x HWIO, any stride, dilation and padding, bfloat16/float16 in,
  float32 accumulation; optional bias, residual and ReLU in the epilogue, and the BatchNorm
  fusions (per-tile statistics of the output, ``stats=True``, merged by
  :func:`combine_tile_stats`; a ``relu(x * scale + shift)`` prologue on the input) that
  :mod:`pallas_kernels.mgpu_fused` differentiates.
* :func:`conv_dgrad` (input gradient, by the forward kernel on ``dy``) and
  :func:`conv_wgrad` (weight gradient, a deterministic split-K without atomics).
* Tiles per call and device kind come from :class:`MgpuConfig` verdicts
  (:func:`tuning_calls`, :class:`DenseCall`); :func:`smem_bytes` and
  :func:`wgrad_smem_bytes` count the shared memory, and a configuration over
  :data:`MAX_SMEM` is refused in one line before lowering.
* What it cannot run (stride > 4, groups > 1, float32, channel counts that are not a
  multiple of 8, negative padding) raises :class:`~jaxcnn.errors.KernelUnsupported`, which
  the dispatcher turns into the Triton/XLA path.

The kernel bodies (:func:`_implicit_gemm`'s ``body``, :func:`conv_wgrad`'s) are the stated
exception to the 80-line rule. How the kernels work (tiles, the K loop and why the input
operand is restaged, the pipeline, zero padding, the epilogue): ``docs/design/mgpu_conv.md``.
Measurements: ``docs/BENCHMARKS.md``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcnn.errors import KernelUnsupported

F32 = jnp.float32
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
TILE_M = 64  # output pixels per CTA: one warpgroup's wgmma M
HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")
MIN_JAX = (0, 11)


def _jax_version() -> tuple[int, int]:
    parts = jax.__version__.split(".")
    return int(parts[0]), int(parts[1])


def unavailable_reason() -> str | None:
    """Why Mosaic GPU kernels cannot be built with this jax, or None when they can."""
    if _jax_version() < MIN_JAX:
        return f"jax {jax.__version__} < 0.11 (the Mosaic GPU kernels need jax >= 0.11)"
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as e:  # pragma: no cover - depends on the jax build
        return f"jax.experimental.pallas.mosaic_gpu does not import: {e}"
    missing = [a for a in ("InterpretGPUParams", "LoweringSemantics", "Layout", "wgmma",
                           "copy_gmem_to_smem", "TilingTransform", "SwizzleTransform",
                           "OOBFillMode")
               if not hasattr(plgpu, a)]
    if missing:
        return f"jax {jax.__version__}: mosaic_gpu lacks {missing}"
    return None


def is_hopper(device_kind: str, compute_capability: str | None = None) -> bool:
    """Whether ``device_kind`` (``jax.Device.device_kind``) names a Hopper GPU, or the
    device's ``compute_capability`` (CUDA devices: ``"9.0"``) says sm_90."""
    if compute_capability is not None and str(compute_capability).startswith("9."):
        return True
    kind = device_kind.upper()
    return any(k in kind for k in HOPPER_KINDS)


def device_capability() -> str | None:
    """The first device's CUDA compute capability (``"9.0"``), None off CUDA."""
    return getattr(jax.devices()[0], "compute_capability", None)


def _plgpu():
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnsupported(f"Mosaic GPU conv: {reason}")
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles of the Mosaic GPU convolution kernels.

    Attributes:
        tile_w: output pixels per row of the 64-pixel tile (power of two, <= 64);
            None picks the widest that fits the output width (either widened where a
            tile row's TMA copy would not be a multiple of 128 bytes:
            :func:`fit_tile_w`).
        block_n: output channels per CTA (multiple of 16, <= 256; the 32-byte
            swizzle is the smallest Mosaic accepts).
        block_k: input channels per K step (16, 32 or 64 for 16-bit types).
        stages: pipeline depth (shared-memory slots per operand, >= 2).
        split: weight gradient only: how many CTAs share the pixel reduction.
        warp_specialized: forward/input gradient only: a second warpgroup issues the
            TMA copies (``setmaxnreg`` moves registers to the computing one), which
            hands slots back through "consumed" mbarriers.  Off until a GPU says
            which is faster.
    """
    tile_w: int | None = None
    block_n: int = 128
    block_k: int = 64
    stages: int = 3
    split: int = 1
    warp_specialized: bool = False

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "MgpuConfig":
        """The config of a tuned-cache entry; TypeError/ValueError for a malformed one (the
        checks the kernels make when they run it)."""
        cfg = cls(**d)
        for name in ("block_n", "block_k", "stages", "split"):
            if type(getattr(cfg, name)) is not int:
                raise TypeError(f"MgpuConfig.{name} must be an int, got "
                                f"{getattr(cfg, name)!r}")
        if not isinstance(cfg.warp_specialized, bool):
            raise TypeError(f"MgpuConfig.warp_specialized must be a bool, got "
                            f"{cfg.warp_specialized!r}")
        _check_config(cfg, cfg.block_k, cfg.block_n)
        if cfg.split < 1:
            raise ValueError(f"MgpuConfig.split must be >= 1, got {cfg.split}")
        return cfg


DEFAULT = MgpuConfig()
PARTS = ("fwd", "dgrad", "wgrad")
# The forward grid ``scripts/bench_mgpu.py`` used to sweep, kept for the tests that lower
# each of it; the tuner's grids are :data:`BLOCK_N`, :data:`BLOCK_K`, :data:`STAGES` below.
SWEEP = tuple(MgpuConfig(block_n=bn, block_k=bk, stages=st, warp_specialized=ws)
              for bn in (64, 128, 256) for bk in (32, 64) for st in (2, 4)
              for ws in (False, True))


@dataclasses.dataclass(frozen=True)
class _Geom:
    n: int
    sh: int  # stride: the input arrives as sh*sw phase images (phase decomposition)
    sw: int
    c: int
    kh: int
    kw: int
    dh: int
    dw: int
    oh: int
    ow: int
    co: int
    h: int = 0  # the unpadded input's height and width, and its top/left padding: where
    w: int = 0  # the input prologue's padded positions are (they stay zero after it)
    pt: int = 0
    pleft: int = 0


def check_supported(x_shape, w_shape, dtype, *, stride=(1, 1), pads=((0, 0), (0, 0)),
                    groups=1, max_stride: int = 4) -> None:
    """Raises :class:`~jaxcnn.errors.KernelUnsupported` (one line naming the reason) when the
    Mosaic GPU forward cannot run this convolution; returns None when it can."""
    op = "Mosaic GPU conv"
    reason = unavailable_reason()
    if reason is not None:
        raise KernelUnsupported(f"{op}: {reason}")
    if jnp.dtype(dtype) not in DTYPES:
        raise KernelUnsupported(f"{op}: dtype {jnp.dtype(dtype).name} unsupported "
                                "(bfloat16/float16 only)")
    if groups != 1:
        raise KernelUnsupported(f"{op}: groups={groups} unsupported (dense only)")
    if not all(1 <= s <= max_stride for s in stride):
        raise KernelUnsupported(f"{op}: stride {tuple(stride)} unsupported (1 to {max_stride})")
    c, co = x_shape[3], w_shape[3]
    for name, v in (("C_in", c), ("C_out", co)):
        if v % 8:
            raise KernelUnsupported(
                f"{op}: {name}={v} is not a multiple of 8 (TMA needs 16-byte strides)")
    if any(p < 0 for pair in pads for p in pair):
        raise KernelUnsupported(f"{op}: negative padding {pads} unsupported")


def pick_tile_w(ow: int) -> int:
    """The widest power of two <= min(ow, 64): each tile row is one TMA window."""
    t = 1
    while t * 2 <= min(ow, TILE_M):
        t *= 2
    return t


# A TMA copy into shared memory must move a multiple of this many bytes (Mosaic GPU's
# lowering splits the mbarrier's expected bytes evenly over the warpgroup's 128 threads:
# "Only copies transferring a number of bytes divisible by the warpgroup size").
COPY_BYTES = 128


def fit_tile_w(width: int, tile_w: int | None, row_bytes) -> int:
    """Output pixels per tile row of a launch ``width`` pixels wide: ``tile_w`` (None: the
    widest power of two that fits, :func:`pick_tile_w`), at most that widest, then widened
    to the narrowest power of two at which every tile-row copy into shared memory (one per
    entry of ``row_bytes``, the bytes that copy moves per pixel) is a whole number of
    :data:`COPY_BYTES`.  A widened row's columns past ``width`` read TMA's zero fill (or
    input the stored outputs do not need) and are never stored.  With 16-bit types and
    channel tiles of 16 or more that is at most 4 pixels."""
    widest = pick_tile_w(width)
    tw = min(tile_w or widest, widest)
    while any((tw * b) % COPY_BYTES for b in row_bytes) and tw < TILE_M:
        tw *= 2
    return tw


def forward_tile_w(width: int, cfg: MgpuConfig, c: int, co: int, dtype,
                   residual_dtype=None) -> int:
    """The forward kernel's tile row (:func:`fit_tile_w`) for ``C_in = c``, ``C_out = co``:
    its input rows (``block_k`` channels) and, with a residual, its residual rows
    (``block_n`` channels) are TMA copies."""
    rows = [_block_k(c, cfg) * jnp.dtype(dtype).itemsize]
    if residual_dtype is not None:
        rows.append(_block_n(co, cfg) * jnp.dtype(residual_dtype).itemsize)
    return fit_tile_w(width, cfg.tile_w, rows)


def wgrad_tile_w(width: int, cfg: MgpuConfig, co: int, dtype) -> int:
    """The weight-gradient kernel's tile row (:func:`fit_tile_w`): its input rows (64
    channels) and ``dy`` rows (``block_n`` channels) are TMA copies."""
    it = jnp.dtype(dtype).itemsize
    return fit_tile_w(width, cfg.tile_w, (TILE_M * it, _block_n(co, cfg) * it))


def bias_rows(bn: int) -> int:
    """Length of the float32 bias slot of a ``bn``-channel tile: ``bn`` rounded up so that
    its one TMA copy is a whole number of :data:`COPY_BYTES` (the extra entries are zeros
    or the next tile's, never read)."""
    return pl_cdiv(bn * 4, COPY_BYTES) * COPY_BYTES // 4


def _swizzle(plgpu, elems: int, itemsize: int) -> int:
    return plgpu.find_swizzle(elems * itemsize * 8)


def _block_k(c: int, cfg: MgpuConfig) -> int:
    bk = cfg.block_k
    while bk > 16 and bk // 2 >= c:
        bk //= 2
    return bk


def _block_n(co: int, cfg: MgpuConfig) -> int:
    bn = cfg.block_n
    while bn > 16 and bn // 2 >= co:
        bn //= 2
    return bn


def _check_config(cfg: MgpuConfig, bk: int, bn: int) -> None:
    if bk not in (16, 32, 64):
        raise ValueError(f"MgpuConfig.block_k must be 16, 32 or 64, got {cfg.block_k}")
    if bn % 16 or not 16 <= bn <= 256:
        raise ValueError(f"MgpuConfig.block_n must be a multiple of 16 in [16, 256], got "
                         f"{cfg.block_n}")
    if cfg.stages < 2:
        raise ValueError(f"MgpuConfig.stages must be >= 2, got {cfg.stages}")
    if cfg.tile_w is not None and (cfg.tile_w < 1 or TILE_M % cfg.tile_w):
        raise ValueError(f"MgpuConfig.tile_w must divide {TILE_M}, got {cfg.tile_w}")


# Shared memory one CTA may use on sm_90 (227 KiB, the opt-in maximum Mosaic checks against).
MAX_SMEM = 232448
_REDUCTION_SCRATCH = 128 * 4 * 4  # plgpu.CompilerParams.reduction_scratch_bytes' default
_BARRIER = 8


def smem_bytes(cfg: MgpuConfig, c: int, co: int, dtype, *, bias=False, residual_dtype=None,
               prologue=False, stats=False) -> int:
    """Shared memory the forward kernel's scratch takes for ``C_in = c``, ``C_out = co``
    (the sum Mosaic checks against :data:`MAX_SMEM` when it lowers the kernel)."""
    it = jnp.dtype(dtype).itemsize
    bk, bn, st = _block_k(c, cfg), _block_n(co, cfg), cfg.stages
    total = 2 * st * TILE_M * bk * it + st * bk * bn * it + TILE_M * bn * it + st * _BARRIER
    total += st * 2 * bk * 4 if prologue else 0
    total += 2 * bn * 4 + _REDUCTION_SCRATCH if stats else 0
    total += st * _BARRIER if cfg.warp_specialized else 0
    total += bias_rows(bn) * 4 if bias else 0
    if residual_dtype is not None:
        total += TILE_M * bn * jnp.dtype(residual_dtype).itemsize
    return total + (_BARRIER if bias or residual_dtype is not None else 0)


def _interpret_params(plgpu, interpret, detect_races: bool):
    if not interpret:
        return None
    return plgpu.InterpretGPUParams(detect_races=detect_races)


def _lane_params(plgpu):
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane)


def tma_load(plgpu, src, dst, barrier) -> None:
    """The TMA copy of the global-memory window ``src`` into the shared-memory ``dst``,
    arriving on ``barrier``, with every element outside ``src``'s array read as zero,
    explicitly (``OOBFillMode.ZEROS``): the kernels' bottom/right padding and their row,
    channel and weight tails are that zero fill, and jax makes no promise about the
    default mode (ZEROS on jax 0.11 and 0.12).  The mode also keeps Mosaic off its
    non-tensor bulk copy, which it may use for a contiguous window under the other modes
    and which bounds the window by the end of the whole array only (a window past a row's
    end would read the next row)."""
    plgpu.copy_gmem_to_smem(src, dst, barrier, oob_mode=plgpu.OOBFillMode.ZEROS)


def smem_store(plgpu, ref, value, *, swizzled: bool) -> None:
    """``ref[...] = value`` into shared memory, the transfer jax 0.11 lowers it to on every
    supported jax: an optimised (bank-conflict-free) store into a ``swizzled`` tile, a plain
    one into an unswizzled tile, and no read of the old contents.

    jax 0.12 lowers the assignment as a swap that also loads the old contents and demands
    an optimised transfer for both, which Mosaic cannot plan for an unswizzled tile in
    ``wgmma``'s fragment layout (``TransferPlanDerivationError``); its ``plgpu.store``
    takes ``optimized`` and reads nothing.  jax 0.11 has no ``plgpu.store``, and its
    assignment already stores unswizzled tiles unoptimised (the old value it loads is
    unused)."""
    if hasattr(plgpu, "store"):
        plgpu.store(ref, value, optimized=swizzled)
    else:
        ref[...] = value


def _scratch_types(plgpu, cfg: MgpuConfig, dtype, bk: int, bn: int, th: int, transforms, *,
                   has_pro: bool, stats: bool, has_bias: bool, residual_dtype) -> list:
    """The forward kernel's shared memory and barriers, in the order its ``body`` takes them:
    the unswizzled and swizzled input slots, the weight slots, the output tile, the slots'
    barriers; then the prologue's scale/shift slots, the statistics, the "consumed"
    barriers (warp specialisation), the bias and residual and their barrier, each when used."""
    stages, has_res = cfg.stages, residual_dtype is not None
    return [
        plgpu.SMEM((stages, TILE_M, bk), dtype),
        plgpu.SMEM((stages, TILE_M, bk), dtype, transforms=transforms),
        plgpu.SMEM((stages, bk, bn), dtype, transforms=transforms),
        plgpu.SMEM((TILE_M, bn), dtype),
        plgpu.Barrier(num_arrivals=th + 1 + int(has_pro), num_barriers=stages),
    ] + ([plgpu.SMEM((stages, 2, bk), F32)] if has_pro else []) \
      + ([plgpu.SMEM((2, bn), F32)] if stats else []) \
      + ([plgpu.Barrier(num_arrivals=1, num_barriers=stages)] if cfg.warp_specialized else []) \
      + ([plgpu.SMEM((bias_rows(bn),), F32)] if has_bias else []) \
      + ([plgpu.SMEM((TILE_M, bn), residual_dtype)] if has_res else []) \
      + ([plgpu.Barrier(num_arrivals=int(has_bias) + th * int(has_res))] if has_bias or has_res else [])


def _implicit_gemm(x, w3, bias, residual, gm: _Geom, cfg: MgpuConfig, *, relu, interpret,
                   detect_races, name, in_ss=None, stats=False):
    """``y[n, oh, ow, :] = sum_{tap, c} x[n, oh + i*dh, ow + j*dw, c] * w3[tap, c, :gm.co]``,
    then ``+ bias + residual`` and ReLU on the float32 accumulator (each optional).

    ``x`` is already padded at the top/left; reads past its bottom/right are TMA zero fill.
    ``w3``'s last dimension is padded to a multiple of ``block_n``: the swizzled TMA
    tiles it by the swizzle width, which must divide it; so is ``bias`` (float32).

    ``in_ss``: optional ``(2, kc * block_k)`` float32 per-input-channel scale (row 0) and
    shift (row 1), zeros past ``C_in``: the input prologue ``relu(x * scale + shift)`` on
    every input tile before the multiply, with the positions that are padding (outside the
    ``gm.h x gm.w`` image) set to zero after it.  ``stats``: also return the per-CTA
    partials ``(tiles_m, 2, cop)`` float32 (row 0: sum, row 1: sum of squares about the
    tile's mean) of the stored (rounded) output over the tile's pixels inside the output.
    """
    plgpu = _plgpu()
    dtype = x.dtype
    itemsize = jnp.dtype(dtype).itemsize
    bk, bn = _block_k(gm.c, cfg), _block_n(gm.co, cfg)
    _check_config(cfg, bk, bn)
    # No tile row wider than the output's, unless a narrower one's copies are too small.
    tw = forward_tile_w(gm.ow, cfg, gm.c, gm.co, dtype,
                        residual.dtype if residual is not None else None)
    th = TILE_M // tw
    stages = cfg.stages
    taps = gm.kh * gm.kw
    kc = pl_cdiv(gm.c, bk)
    nsteps = taps * kc
    tiles_h, tiles_w = pl_cdiv(gm.oh, th), pl_cdiv(gm.ow, tw)
    tail = gm.ow - (tiles_w - 1) * tw  # valid columns of the last column tile
    # wgmma wants both operands in the same swizzle: the widest that both tiles' rows fill.
    swz = min(_swizzle(plgpu, bn, itemsize), _swizzle(plgpu, bk, itemsize))
    w_transforms = (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))
    from jax.experimental import pallas as pl

    has_bias, has_res, has_pro = bias is not None, residual is not None, in_ss is not None
    smem = smem_bytes(cfg, gm.c, gm.co, dtype, bias=has_bias, prologue=has_pro, stats=stats,
                      residual_dtype=residual.dtype if has_res else None)
    if smem > MAX_SMEM:
        raise KernelUnsupported(f"Mosaic GPU conv: {cfg} needs {smem} bytes of shared memory "
                                f"(more than {MAX_SMEM}) for C_in={gm.c}, C_out={gm.co}")
    if has_pro and in_ss.shape != (2, kc * bk):
        raise AssertionError(f"prologue scale/shift {in_ss.shape} != {(2, kc * bk)}")
    tiles_m = gm.n * tiles_h * tiles_w
    log_tw = tw.bit_length() - 1  # tw is a power of two: pixel p is (p >> log_tw, p & tw-1)

    def pixel_rc(cols):
        """(tile row, tile column) of each element of a ``(TILE_M, cols)`` WGMMA fragment."""
        p = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE_M, cols), 0),
                              plgpu.Layout.WGMMA)
        return lax.shift_right_logical(p, log_tw), lax.bitwise_and(p, tw - 1)

    def body(*refs):
        refs = list(refs)
        x_ref, w_ref = refs.pop(0), refs.pop(0)
        bias_ref = refs.pop(0) if has_bias else None
        res_ref = refs.pop(0) if has_res else None
        ss_ref = refs.pop(0) if has_pro else None
        o_ref = refs.pop(0)
        st_ref = refs.pop(0) if stats else None
        a_smem, a_sw, b_smem, o_smem, bars, *epi_scratch = refs
        ss_smem = epi_scratch.pop(0) if has_pro else None
        st_smem = epi_scratch.pop(0) if stats else None
        consumed_scratch = []
        if cfg.warp_specialized:
            consumed_scratch.append(epi_scratch.pop(0))
        mi, ni = lax.axis_index("m"), lax.axis_index("n")
        img = mi // (tiles_h * tiles_w)
        rest = mi % (tiles_h * tiles_w)
        oh0 = (rest // tiles_w) * th
        col = rest % tiles_w
        ow0 = col * tw
        co0 = ni * bn

        def issue(s, slot):
            tap, cc = s // kc, s % kc
            (qh, qw), phase = _tap_offset(tap, gm)
            for r in range(th):
                tma_load(plgpu, x_ref.at[phase * gm.n + img, oh0 + r + qh,
                                         pl.ds(ow0 + qw, tw), pl.ds(cc * bk, bk)],
                         a_smem.at[slot, pl.ds(r * tw, tw)], bars.at[slot])
            tma_load(plgpu, w_ref.at[tap, pl.ds(cc * bk, bk), pl.ds(co0, bn)],
                     b_smem.at[slot], bars.at[slot])
            if has_pro:  # this step's channel chunk of the prologue's scale and shift
                tma_load(plgpu, ss_ref.at[:, pl.ds(cc * bk, bk)], ss_smem.at[slot],
                         bars.at[slot])

        # A traced zero keeps the first windows' starts dynamic: Pallas rejects static
        # windows that overhang the array, which TMA zero-fills.
        zero = ni * 0
        if has_bias or has_res:
            *epi_smem, epi_bar = epi_scratch
            bias_smem = epi_smem.pop(0) if has_bias else None
            res_smem = epi_smem.pop(0) if has_res else None

        def load_epilogue_operands():  # issued first: they load during the main loop
            if has_bias:  # bias_rows(bn) entries: a whole number of COPY_BYTES
                tma_load(plgpu, bias_ref.at[pl.ds(co0 + zero, bias_rows(bn))], bias_smem,
                         epi_bar)
            if has_res:
                for r in range(th):
                    tma_load(plgpu,
                             res_ref.at[img, oh0 + r + zero, pl.ds(ow0, tw), pl.ds(co0, bn)],
                             res_smem.at[pl.ds(r * tw, tw)], epi_bar)

        def prologue(a, s, slot):
            """``relu(a * scale + shift)`` of step ``s``'s input tile, zero where the tile
            reads padding: the convolution of the normalised, rectified activation."""
            (qh, qw), (ph, pw) = _tap_offset(s // kc, gm, split_phase=True)
            lane = plgpu.Layout.WGMMA.reduce(0)
            scale = lax.broadcast_in_dim(plgpu.load(ss_smem.at[slot, 0], layout=lane),
                                         (TILE_M, bk), [1])
            shift = lax.broadcast_in_dim(plgpu.load(ss_smem.at[slot, 1], layout=lane),
                                         (TILE_M, bk), [1])
            r, c = pixel_rc(bk)
            # Row/column of the unpadded input this element reads (phase-image row
            # oh0 + r + qh is padded row (oh0 + r + qh) * sh + ph).
            xr = (oh0 + qh + r) * gm.sh + (ph - gm.pt)
            xc = (ow0 + qw + c) * gm.sw + (pw - gm.pleft)
            inside = (xr >= 0) & (xr < gm.h) & (xc >= 0) & (xc < gm.w)
            act = jnp.maximum(a.astype(F32) * scale + shift, 0.0)
            return jnp.where(inside, act, 0.0).astype(dtype)

        def mma(acc_ref, s, slot):
            plgpu.barrier_wait(bars.at[slot])
            # Restage the (unswizzled, tap-shifted) input tile into the swizzled layout
            # wgmma reads; the previous user of this slot (step s - stages) finished at
            # step s - stages + 1 (stages >= 2).
            a = plgpu.load(a_smem.at[slot], layout=plgpu.Layout.WGMMA, optimized=False)
            smem_store(plgpu, a_sw.at[slot], prologue(a, s, slot) if has_pro else a,
                       swizzled=True)
            plgpu.commit_smem()
            plgpu.wgmma(acc_ref, a_sw.at[slot], b_smem.at[slot])
            plgpu.wgmma_wait(1)  # step s-1's wgmma is done with its slot

        def steps(body_fn):
            """``body_fn(s, slot)`` for s < nsteps, unrolled by ``stages``: static slots."""
            def group(g, carry):
                for slot in range(stages):
                    s = g * stages + slot
                    pl.when(s < nsteps)(functools.partial(body_fn, s, slot))
                return carry
            lax.fori_loop(0, pl_cdiv(nsteps, stages), group, None)

        def epilogue(acc_ref):
            plgpu.wgmma_wait(0)
            acc = acc_ref[...]
            if has_bias or has_res:
                plgpu.barrier_wait(epi_bar)
            if has_bias:
                b = plgpu.load(bias_smem.at[pl.ds(0, bn)], layout=plgpu.Layout.WGMMA.reduce(0))
                acc = acc + lax.broadcast_in_dim(b, (TILE_M, bn), [1])
            if has_res:
                acc = acc + plgpu.load(res_smem, layout=plgpu.Layout.WGMMA,
                                       optimized=False).astype(F32)
            if relu:
                acc = jnp.maximum(acc, 0.0)
            y = acc.astype(dtype)
            smem_store(plgpu, o_smem, y, swizzled=False)
            if stats:  # of the stored values, over the tile's pixels inside the output
                r, c = pixel_rc(bn)
                inside = (oh0 + r < gm.oh) & (ow0 + c < gm.ow)
                yf = jnp.where(inside, y.astype(F32), 0.0)
                total = jnp.sum(yf, axis=0)
                count = (jnp.minimum(th, gm.oh - oh0) * jnp.minimum(tw, gm.ow - ow0)).astype(F32)
                # Squares about the tile's own mean: no E[y^2] - E[y]^2 cancellation.
                centred = jnp.where(inside, yf - lax.broadcast_in_dim(total / count,
                                                                      (TILE_M, bn), [1]), 0.0)
                smem_store(plgpu, st_smem.at[0], total, swizzled=False)
                smem_store(plgpu, st_smem.at[1], jnp.sum(centred * centred, axis=0),
                           swizzled=False)
            plgpu.commit_smem()
            if stats:  # this CTA's partials: one row of the (tiles_m, 2, cop) buffer
                plgpu.copy_smem_to_gmem(st_smem, st_ref.at[mi, :, pl.ds(co0, bn)])
            for r in range(th):
                def store(off, size, r=r):
                    plgpu.copy_smem_to_gmem(
                        o_smem.at[pl.ds(r * tw + off, size)],
                        o_ref.at[img, oh0 + r, pl.ds(ow0 + off, size), pl.ds(co0, bn)])

                row_ok = oh0 + r < gm.oh
                if tail == tw:
                    pl.when(row_ok)(lambda: store(0, tw))
                else:
                    pl.when(row_ok & (col < tiles_w - 1))(lambda: store(0, tw))

                    @pl.when(row_ok & (col == tiles_w - 1))
                    def _tail():
                        for off, size in _pieces(tail):
                            store(off, size)
            plgpu.wait_smem_to_gmem(0)

        if not cfg.warp_specialized:
            def scoped(acc_ref):
                load_epilogue_operands()
                for s in range(min(stages, nsteps)):
                    issue(zero + s, s)

                def step(s, slot):
                    mma(acc_ref, s, slot)
                    nxt = s - 1 + stages

                    @pl.when((s >= 1) & (nxt < nsteps))
                    def _refill():
                        issue(nxt, (slot - 1) % stages)
                steps(step)
                epilogue(acc_ref)

            pl.run_scoped(scoped, plgpu.ACC((TILE_M, bn), F32))
            return

        # Warp-specialised: warpgroup 1 only issues TMA copies (few registers), warpgroup 0
        # restages, multiplies and runs the epilogue; "consumed" barriers hand slots back.
        consumed = consumed_scratch[0]
        wg = lax.axis_index("wg")

        @pl.when(wg == 1)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")
            load_epilogue_operands()

            def produce(s, slot):
                pl.when(s >= stages)(lambda: plgpu.barrier_wait(consumed.at[slot]))
                issue(s, slot)
            steps(produce)

        @pl.when(wg == 0)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")

            def scoped(acc_ref):
                def consume(s, slot):
                    mma(acc_ref, s, slot)  # waits until step s - 1's wgmma is done
                    # Hand step s - 1's slot back, where the producer will wait for it.
                    pl.when((s >= 1) & (s - 1 + stages < nsteps))(
                        lambda: plgpu.barrier_arrive(consumed.at[(slot - 1) % stages]))
                steps(consume)
                epilogue(acc_ref)

            pl.run_scoped(scoped, plgpu.ACC((TILE_M, bn), F32))

    out_type = jax.ShapeDtypeStruct((gm.n, gm.oh, gm.ow, gm.co), dtype)
    if stats:
        out_type = (out_type, jax.ShapeDtypeStruct((tiles_m, 2, w3.shape[2]), F32))
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(tiles_m, pl_cdiv(gm.co, bn)),
        grid_names=("m", "n"),
        scratch_types=_scratch_types(plgpu, cfg, dtype, bk, bn, th, w_transforms, has_pro=has_pro,
                                     stats=stats, has_bias=has_bias,
                                     residual_dtype=residual.dtype if has_res else None),
        compiler_params=_lane_params(plgpu),
        interpret=_interpret_params(plgpu, interpret, detect_races),
        kernel_name=name,
        **(dict(num_threads=2, thread_name="wg") if cfg.warp_specialized else {}),
    )
    return kernel(x, w3, *[a for a in (bias, residual, in_ss) if a is not None])


def _out_hw(hw, kernel_hw, stride, pads, dilation):
    return tuple((n + lo + hi - d * (k - 1) - 1) // s + 1 for n, k, s, (lo, hi), d in
                 zip(hw, kernel_hw, stride, pads, dilation))


def _tap_offset(tap, gm: _Geom, split_phase: bool = False):
    """``((row, column) offset, phase)`` of tap ``tap`` in the phase-decomposed input: tap
    ``(i, j)`` reads input row ``oh * sh + i * dh``, which is row ``oh + (i * dh) // sh`` of
    phase ``(i * dh) % sh``.  With ``split_phase`` the phase is ``(row phase, column
    phase)``."""
    i, j = tap // gm.kw, tap % gm.kw
    rh, rw = i * gm.dh, j * gm.dw
    if split_phase:
        return (rh // gm.sh, rw // gm.sw), (rh % gm.sh, rw % gm.sw)
    return (rh // gm.sh, rw // gm.sw), (rh % gm.sh) * gm.sw + rw % gm.sw


def _phases(x, pads, stride):
    """``x`` padded at the top/left (bottom/right padding is TMA zero fill) and split into its
    ``sh * sw`` stride phases, ``(sh * sw * N, ceil(Hp / sh), ceil(Wp / sw), C)`` with phase
    ``a * sw + b`` holding rows ``a::sh`` and columns ``b::sw``: one XLA copy (none at stride 1
    without top/left padding)."""
    (pt, _), (pleft, _) = pads
    sh, sw = stride
    n, h, w, c = x.shape
    extra_h, extra_w = -(h + pt) % sh, -(w + pleft) % sw  # whole phases; zeros, never read
    if pt or pleft or extra_h or extra_w:
        x = jnp.pad(x, ((0, 0), (pt, extra_h), (pleft, extra_w), (0, 0)))
    if sh == sw == 1:
        return x
    hs, ws = x.shape[1] // sh, x.shape[2] // sw
    x = x.reshape(n, hs, sh, ws, sw, c).transpose(2, 4, 0, 1, 3, 5)
    return x.reshape(sh * sw * n, hs, ws, c)


def _pieces(width: int) -> list[tuple[int, int]]:
    """``(offset, size)`` windows of power-of-two sizes that tile ``[0, width)`` exactly."""
    out, off = [], 0
    for bit in reversed(range(width.bit_length())):
        if width >> bit & 1:
            out.append((off, 1 << bit))
            off += 1 << bit
    return out


def pl_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def wgrad_tile_copies(plgpu, x_ref, dy_ref, x_buf, dy_buf, bars, *, n, tap, tiles_hw,
                      tile_hw, chans):
    """``issue(t, slot)`` of a weight-gradient reduction over output tiles (the dense kernel's
    and the depthwise one's): the TMA copies of output tile ``t`` (image-major, then the
    ``tile_hw`` tiles of each image row-major) into ``slot`` of ``x_buf`` and ``dy_buf``, per
    tile row the input window tap ``(phase, qh, qw)`` reads (``x_ref`` in the phase layout of
    :func:`_phases`) and that row of ``dy``, all arriving on ``bars[slot]``.  ``chans`` are
    the input's and ``dy``'s channel windows (``pl.ds``)."""
    from jax.experimental import pallas as pl
    (tiles_h, tiles_w), (th, tw), (phase, qh, qw) = tiles_hw, tile_hw, tap
    x_chans, dy_chans = chans

    def issue(t, slot):
        img = t // (tiles_h * tiles_w)
        rest = t % (tiles_h * tiles_w)
        oh0, ow0 = (rest // tiles_w) * th, (rest % tiles_w) * tw
        for r in range(th):
            # Pixels past the output read zeros from dy (TMA fill), so they add nothing.
            tma_load(plgpu, x_ref.at[phase * n + img, oh0 + r + qh, pl.ds(ow0 + qw, tw), x_chans],
                     x_buf.at[slot, pl.ds(r * tw, tw)], bars.at[slot])
            tma_load(plgpu, dy_ref.at[img, oh0 + r, pl.ds(ow0, tw), dy_chans],
                     dy_buf.at[slot, pl.ds(r * tw, tw)], bars.at[slot])
    return issue


def wgrad_tile_loop(issue, step, *, first, count, stages: int, per_split: int) -> None:
    """The pipeline of a weight-gradient reduction over a CTA's ``count`` output tiles from
    ``first``: ``issue`` (:func:`wgrad_tile_copies`) fills the ``stages`` slots, then
    ``step(s, slot)`` runs for each tile ``s < count`` (it waits on the slot, consumes it
    and refills a slot: there the kernels differ), unrolled by ``stages`` so that every slot
    index is static."""
    from jax.experimental import pallas as pl
    for s in range(stages):
        pl.when(s < count)(functools.partial(issue, first + s, s))

    def group(g, carry):
        for slot in range(stages):
            pl.when(g * stages + slot < count)(functools.partial(step, g * stages + slot, slot))
        return carry

    lax.fori_loop(0, pl_cdiv(per_split, stages), group, None)


def _prologue_operand(input_scale, input_shift, c: int, cfg: MgpuConfig):
    """The prologue's ``(2, K)`` float32 scale and shift, zeros past ``C_in`` up to whole
    channel chunks (``relu(0 * 0 + 0) = 0``)."""
    for nm, v in (("input_scale", input_scale), ("input_shift", input_shift)):
        if tuple(v.shape) != (c,):
            raise ValueError(f"Mosaic GPU conv: {nm} shape {tuple(v.shape)} != ({c},)")
    kp = pl_cdiv(c, _block_k(c, cfg)) * _block_k(c, cfg)
    return jnp.pad(jnp.stack([input_scale.astype(F32), input_shift.astype(F32)]), ((0, 0), (0, kp - c)))


def conv_forward(x, w, b=None, residual=None, *, relu=False, stride=(1, 1),
                 pads=((0, 0), (0, 0)), dilation=(1, 1), config: MgpuConfig | None = None,
                 interpret: bool = False, detect_races: bool = False,
                 name: str = "jaxcnn_mgpu_conv_fwd", input_scale=None, input_shift=None,
                 stats: bool = False):
    """Dense convolution ``(N, H, W, C_in) x (KH, KW, C_in, C_out)`` on Mosaic GPU.

    Arguments:
        x, w: bfloat16 or float16, NHWC and HWIO.
        b: optional ``(C_out,)``, residual: optional ``(N, OH, OW, C_out)`` (x's dtype),
            added to the float32 accumulator in the epilogue, then ``relu`` if set.
        input_scale, input_shift: optional ``(C_in,)`` each (both or neither): the
            input prologue, ``conv(relu(x * input_scale + input_shift))`` computed in
            float32 on each input tile and rounded to ``x``'s dtype before the multiply
            (a folded BatchNorm + ReLU); the padding is of that activation (zeros).
        stats: also return the per-channel batch mean and biased variance (float32) of
            the output as stored (after bias, residual, ReLU and rounding), BatchNorm's
            training statistics: each CTA writes its tile's sum and sum of squares about
            the tile's mean, which :func:`combine_tile_stats` adds up in a fixed order
            (deterministic, no atomics).
        stride: ``(sh, sw)``; above 1 the input is split into its stride phases
            first (one XLA copy), so every tap reads a stride-1 window of one phase.
        pads: ``((top, bottom), (left, right))``, each >= 0.
        dilation: ``(dh, dw)``.
        config: tiles (:class:`MgpuConfig`); None takes the defaults.
        interpret: run in Mosaic GPU interpret mode (on the CPU).
        detect_races: with ``interpret``, run the interpreter's race detector.
        name: the kernel's name (the input gradient runs this kernel as
            ``jaxcnn_mgpu_conv_dgrad``); the forward's default gets ``_bnrelu`` with the
            prologue and ``_stats`` with the statistics appended.

    Returns:
        ``(N, OH, OW, C_out)`` in ``x.dtype`` (float32 accumulation); with ``stats``,
        ``(y, mean, var)``, the last two ``(C_out,)`` float32.

    Raises:
        KernelUnsupported: for a call the kernel cannot run (see :func:`check_supported`).
    """
    stride = tuple(stride)
    if (input_scale is None) != (input_shift is None):
        raise ValueError("Mosaic GPU conv: give both input_scale and input_shift, or neither")
    check_supported(x.shape, w.shape, x.dtype, stride=stride, pads=pads)
    if x.dtype != w.dtype:
        raise ValueError(f"Mosaic GPU conv: x and w dtypes differ ({x.dtype}, {w.dtype})")
    n, h, wd, c = x.shape
    kh, kw, _, co = w.shape
    oh, ow = _out_hw((h, wd), (kh, kw), stride, pads, dilation)
    if oh < 1 or ow < 1:
        raise ValueError(f"Mosaic GPU conv: empty output {oh}x{ow} for x {x.shape}, w {w.shape}")
    x = _phases(x, pads, stride)
    gm = _Geom(n=n, sh=stride[0], sw=stride[1], c=c, kh=kh, kw=kw, dh=dilation[0],
               dw=dilation[1], oh=oh, ow=ow, co=co, h=h, w=wd, pt=pads[0][0],
               pleft=pads[1][0])
    cfg = config or DEFAULT
    in_ss = None if input_scale is None else _prologue_operand(input_scale, input_shift, c, cfg)
    w3 = w.reshape(kh * kw, c, co)
    bn = _block_n(co, cfg)
    cop = pl_cdiv(co, bn) * bn
    if co % bn:  # the swizzled weight tiles need C_out a multiple of the tile (tiny XLA pad)
        w3 = jnp.pad(w3, ((0, 0), (0, 0), (0, cop - co)))
    if b is not None:  # padded so that the last tile's bias copy stays in bounds
        b = jnp.pad(b.astype(F32), (0, cop - co + bias_rows(bn) - bn))
    if residual is not None and residual.shape != (n, oh, ow, co):
        raise ValueError(f"Mosaic GPU conv: residual shape {residual.shape} != output "
                         f"{(n, oh, ow, co)}")
    if name == "jaxcnn_mgpu_conv_fwd":  # the fused variants, by name in profiles and reports
        name += "_bnrelu" * (input_scale is not None) + "_stats" * bool(stats)
    out = _implicit_gemm(x, w3, b, residual, gm, cfg, relu=bool(relu), interpret=interpret,
                         detect_races=detect_races, name=name, in_ss=in_ss, stats=bool(stats))
    if not stats:
        return out
    y, partial = out
    tw = forward_tile_w(ow, cfg, c, co, x.dtype, None if residual is None else residual.dtype)
    return (y, *combine_tile_stats(partial[:, :, :co], _tile_counts(gm, tw)))


def _tile_counts(gm: _Geom, tw: int):
    """Output pixels of each forward tile (its rows and columns inside the output), in the
    order of the grid's ``m`` axis, for tile rows ``tw`` wide: ``(tiles_m,)`` float32
    (static)."""
    th = TILE_M // tw
    rows = np.minimum(th, gm.oh - np.arange(0, gm.oh, th))
    cols = np.minimum(tw, gm.ow - np.arange(0, gm.ow, tw))
    per_image = (rows[:, None] * cols[None, :]).reshape(-1)
    return np.tile(per_image, gm.n).astype(np.float32)


def combine_tile_stats(partial, counts):
    """Batch ``(mean, biased variance)`` per channel from per-tile ``(sum, sum of squares
    about the tile's mean)`` partials ``(tiles, 2, C)`` of ``counts[t]`` pixels each, by
    Chan's parallel formula ``M2 = sum_t M2_t + sum_t n_t (mean_t - mean)^2``, every sum
    in a fixed pairwise order (deterministic)."""
    n = float(sum(float(c) for c in counts))  # static: the counts come from the geometry
    counts = jnp.asarray(counts, F32)[:, None]
    mean = fixed_order_sum(partial[:, 0]) / n
    tile_mean = partial[:, 0] / counts
    m2 = fixed_order_sum(partial[:, 1]) + fixed_order_sum(counts * jnp.square(tile_mean - mean))
    return mean, m2 / n


def fixed_order_sum(partial):
    """``partial.sum(axis=0)`` as a pairwise tree of elementwise adds over the leading axis
    (zero-padded to a power of two): the same order on every run and every backend,
    whatever XLA's reduction emitter would do."""
    t = partial.shape[0]
    size = 1 << max(t - 1, 0).bit_length()
    if size != t:
        partial = jnp.pad(partial, ((0, size - t),) + ((0, 0),) * (partial.ndim - 1))
    while partial.shape[0] > 1:
        half = partial.shape[0] // 2
        partial = partial[:half] + partial[half:]
    return partial[0]


def conv_dgrad(dy, w, *, x_hw, stride=(1, 1), pads=((0, 0), (0, 0)), dilation=(1, 1),
               config: MgpuConfig | None = None, interpret: bool = False,
               detect_races: bool = False):
    """Input gradient of :func:`conv_forward`, ``(N, H, W, C_in)`` in ``dy``'s dtype.

    Stride 1: the forward kernel on ``dy`` with the flipped, transposed weights (a
    full correlation), padded so it returns ``x_hw``.  Stride ``s`` (dilation 1): by
    phase decomposition of the input gradient.  Input row ``r`` of the padded input
    with ``r % s == a`` receives only the taps ``i = a, a + s, ...``, from output rows
    ``r // s - k``: per phase ``(a, b)`` that is a stride-1 correlation of ``dy`` with
    those taps flipped (``ceil((KH - a) / s) x ceil((KW - b) / s)`` of them: 4, 2, 2
    and 1 for a 3x3/2, nine in all), run by the forward kernel; XLA interleaves the
    ``s * s`` phase results and crops the padding (one pass over ``dx``).  A phase no
    tap reaches (1x1/2) is zeros.

    Raises:
        KernelUnsupported: for a strided, dilated forward; when the correlation would
            need negative padding (a forward padded by more than its dilated window);
            or when the channels do not fit.
    """
    stride = tuple(stride)
    kh, kw = w.shape[:2]
    dh, dw = dilation
    (pt, pb), (pleft, pr) = pads
    kwargs = dict(config=config, interpret=interpret, detect_races=detect_races,
                  name="jaxcnn_mgpu_conv_dgrad")
    if stride == (1, 1):
        back = ((dh * (kh - 1) - pt, dh * (kh - 1) - pb),
                (dw * (kw - 1) - pleft, dw * (kw - 1) - pr))
        dx = conv_forward(dy, jnp.flip(w, (0, 1)).transpose(0, 1, 3, 2), pads=back,
                          dilation=dilation, **kwargs)
    else:
        if tuple(dilation) != (1, 1):
            raise KernelUnsupported(f"Mosaic GPU conv: no input-gradient kernel for stride "
                                    f"{stride} with dilation {tuple(dilation)}")
        dx = _strided_dgrad(dy, w, x_hw, stride, pads, kwargs)
    if dx.shape[1:3] != tuple(x_hw):
        raise AssertionError(f"dgrad shape {dx.shape} does not match input {x_hw}")
    return dx


def _strided_dgrad(dy, w, x_hw, stride, pads, kwargs):
    n, oh, ow, _ = dy.shape
    kh, kw, c, _ = w.shape
    sh, sw = stride
    (pt, _), (pleft, _) = pads
    mh, mw = pl_cdiv(pt + x_hw[0], sh), pl_cdiv(pleft + x_hw[1], sw)  # rows per phase
    if mh < oh or mw < ow:  # over-padded at the bottom/right: negative correlation padding
        raise KernelUnsupported(f"Mosaic GPU conv: negative padding in the strided input "
                                f"gradient (pads {pads}, stride {stride})")
    check_supported((n, oh, ow, dy.shape[3]), (1, 1, dy.shape[3], c), dy.dtype)
    rows = []
    for a in range(sh):
        cols = []
        for b in range(sw):
            taps = w[a::sh, b::sw]  # (ceil((KH - a) / sh), ceil((KW - b) / sw), C_in, C_out)
            ka, kb = taps.shape[:2]
            if ka == 0 or kb == 0:
                cols.append(jnp.zeros((n, mh, mw, c), dy.dtype))
                continue
            cols.append(conv_forward(
                dy, jnp.flip(taps, (0, 1)).transpose(0, 1, 3, 2),
                pads=((ka - 1, mh - oh), (kb - 1, mw - ow)), **kwargs))
        rows.append(jnp.stack(cols))
    phases = jnp.stack(rows)  # (sh, sw, N, mh, mw, C): padded row m * sh + a, column ...
    dx = phases.transpose(2, 3, 0, 4, 1, 5).reshape(n, mh * sh, mw * sw, c)
    return dx[:, pt:pt + x_hw[0], pleft:pleft + x_hw[1]]


def conv_wgrad(x, dy, *, kernel_hw, stride=(1, 1), pads=((0, 0), (0, 0)), dilation=(1, 1),
               config: MgpuConfig | None = None, interpret: bool = False,
               detect_races: bool = False):
    """Weight gradient of :func:`conv_forward`, ``(KH, KW, C_in, C_out)`` float32.

    ``dw[tap, c, co] = sum_p x[p * stride + tap, c] * dy[p, co]`` over all output pixels
    ``p`` (the input split into its stride phases as in the forward):
    a GEMM whose reduction runs over ``N * OH * OW``.  ``config.split`` CTAs share
    that reduction per output tile, each writing a float32 partial; XLA sums the
    partials in a fixed order (deterministic, no atomics).

    Raises:
        KernelUnsupported: as :func:`check_supported`.
    """
    kh, kw = kernel_hw
    stride = tuple(stride)
    check_supported(x.shape, (kh, kw, x.shape[3], dy.shape[3]), x.dtype, stride=stride,
                    pads=pads)
    if x.dtype != dy.dtype:
        raise ValueError(f"Mosaic GPU wgrad: x and dy dtypes differ ({x.dtype}, {dy.dtype})")
    plgpu = _plgpu()
    from jax.experimental import pallas as pl
    cfg = config or DEFAULT
    n, h, wd, c = x.shape
    co = dy.shape[3]
    oh, ow = dy.shape[1:3]
    if (oh, ow) != _out_hw((h, wd), kernel_hw, stride, pads, dilation):
        raise ValueError(f"Mosaic GPU wgrad: dy {dy.shape} does not match x {x.shape}")
    x = _phases(x, pads, stride)
    gm = _Geom(n=n, sh=stride[0], sw=stride[1], c=c, kh=kh, kw=kw, dh=dilation[0],
               dw=dilation[1], oh=oh, ow=ow, co=co)
    dtype = x.dtype
    itemsize = jnp.dtype(dtype).itemsize
    bm = TILE_M  # input channels per CTA (wgmma M)
    bn = _block_n(co, cfg)
    _check_config(cfg, 64, bn)
    if cfg.split < 1:
        raise ValueError(f"MgpuConfig.split must be >= 1, got {cfg.split}")
    tw = wgrad_tile_w(ow, cfg, co, dtype)
    th = TILE_M // tw  # the K step: 64 output pixels, a th x tw rectangle
    stages = cfg.stages
    taps = kh * kw
    tiles_h, tiles_w = pl_cdiv(oh, th), pl_cdiv(ow, tw)
    tiles = n * tiles_h * tiles_w
    split = min(cfg.split, tiles)
    per_split = pl_cdiv(tiles, split)
    cp, cop = pl_cdiv(c, bm) * bm, pl_cdiv(co, bn) * bn  # partials padded: in-bounds stores

    swz = min(_swizzle(plgpu, bm, itemsize), _swizzle(plgpu, bn, itemsize))  # wgmma: equal

    def tr(cols):
        return (plgpu.TilingTransform((8, swz // itemsize)), plgpu.SwizzleTransform(swz))

    def body(x_ref, dy_ref, o_ref, x_un, dy_un, x_sw, dy_sw, o_smem, bars):
        tap, ci, ni, si = (lax.axis_index(a) for a in ("tap", "c", "n", "s"))
        (qh, qw), phase = _tap_offset(tap, gm)
        c0, co0 = ci * bm, ni * bn
        first = si * per_split
        count = jnp.minimum(per_split, tiles - first)
        issue = wgrad_tile_copies(plgpu, x_ref, dy_ref, x_un, dy_un, bars, n=n,
                                  tap=(phase, qh, qw), tiles_hw=(tiles_h, tiles_w),
                                  tile_hw=(th, tw), chans=(pl.ds(c0, bm), pl.ds(co0, bn)))

        def scoped(acc_ref):
            def step(s, slot):
                plgpu.barrier_wait(bars.at[slot])
                for un, sw in ((x_un, x_sw), (dy_un, dy_sw)):
                    smem_store(plgpu, sw.at[slot], plgpu.load(
                        un.at[slot], layout=plgpu.Layout.WGMMA, optimized=False), swizzled=True)
                plgpu.commit_smem()
                # (C x pixels) @ (pixels x C_out): the input tile read transposed.
                plgpu.wgmma(acc_ref, x_sw.at[slot].T, dy_sw.at[slot])
                plgpu.wgmma_wait(1)
                nxt = s - 1 + stages

                @pl.when((s >= 1) & (nxt < count))
                def _refill():
                    issue(first + nxt, (slot - 1) % stages)

            wgrad_tile_loop(issue, step, first=first, count=count, stages=stages,
                            per_split=per_split)
            plgpu.wgmma_wait(0)
            smem_store(plgpu, o_smem, acc_ref[...], swizzled=False)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(o_smem, o_ref.at[si, tap, pl.ds(c0, bm), pl.ds(co0, bn)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, plgpu.ACC((bm, bn), F32))

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split, taps, cp, cop), F32),
        grid=(taps, cp // bm, cop // bn, split),
        grid_names=("tap", "c", "n", "s"),
        scratch_types=[
            plgpu.SMEM((stages, TILE_M, bm), dtype),
            plgpu.SMEM((stages, TILE_M, bn), dtype),
            plgpu.SMEM((stages, TILE_M, bm), dtype, transforms=tr(bm)),
            plgpu.SMEM((stages, TILE_M, bn), dtype, transforms=tr(bn)),
            plgpu.SMEM((bm, bn), F32),
            plgpu.Barrier(num_arrivals=2 * th, num_barriers=stages),
        ],
        compiler_params=_lane_params(plgpu),
        interpret=_interpret_params(plgpu, interpret, detect_races),
        kernel_name="jaxcnn_mgpu_conv_wgrad",
    )
    partial = kernel(x, dy)
    return jnp.sum(partial, axis=0)[:, :c, :co].reshape(kh, kw, c, co)


# --- tuning: each launch's tiles, per shape and device kind --------------------------------

# The tuner's kernels: the forward (plain, and the fused forms of
# :mod:`pallas_kernels.mgpu_fused`, whose prologue and statistics change its shared memory
# and registers), the input gradient (the forward kernel on ``dy``) and the weight gradient.
FWD_KERNELS = ("mgpu_conv_fwd", "mgpu_conv_fwd_bnrelu", "mgpu_conv_fwd_stats",
               "mgpu_conv_fwd_bnrelu_stats")
KERNELS = FWD_KERNELS + ("mgpu_conv_dgrad", "mgpu_conv_wgrad")
# The grid the tuner times per launch, fitted to the shape (:meth:`DenseCall.candidates`):
# channel tiles, reduction chunks (forward and input gradient), slots, the widest tile row
# and half of it (from 16 pixels: no tile of more than 8 rows), warp specialisation
# (forward and input gradient) and, for the weight gradient, two splits.
BLOCK_N = (64, 128, 256)
BLOCK_K = (32, 64)
STAGES = (2, 4)
_SMS = 132  # an H100's streaming multiprocessors: sizes the weight gradient's splits


@dataclasses.dataclass(frozen=True)
class DenseCall:
    """One dense Mosaic kernel launch as the tuner sees it (the Mosaic-call protocol of
    :mod:`pallas_kernels.autotune`: ``key``, ``fit``, ``smem_bytes``, ``candidates``): what
    its tiles are cached under and what decides which tiles fit.

    Attributes:
        kernel: one of :data:`KERNELS` (the fused forwards by their prologue/statistics).
        x_shape, w_shape: the op's ``(N, H, W, C_in)`` and ``(KH, KW, C_in, C_out)``.
        stride, pads, dilation: as the op runs them (``pads`` explicit pairs).
        dtype: the input's dtype name.
        bias, residual: whether the forward's epilogue reads them (their shared memory).
    """
    kernel: str
    x_shape: tuple
    w_shape: tuple
    stride: tuple
    pads: tuple
    dilation: tuple
    dtype: str
    bias: bool = False
    residual: bool = False

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"DenseCall: kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def part(self) -> str:
        return "fwd" if self.kernel in FWD_KERNELS else self.kernel.rsplit("_", 1)[1]

    @property
    def key(self) -> str:
        """Autotune-cache key of this launch's tiles."""
        dims = (f"x={list(self.x_shape)},w={list(self.w_shape)},stride={list(self.stride)},"
                f"pads={[list(p) for p in self.pads]},dilation={list(self.dilation)}")
        epilogue = "+".join(n for n, on in (("bias", self.bias), ("residual", self.residual))
                            if on and self.part == "fwd")
        return f"{self.kernel}|{dims}{epilogue and f',epilogue={epilogue}'}|{self.dtype}"

    def out_hw(self) -> tuple:
        return _out_hw(self.x_shape[1:3], self.w_shape[:2], self.stride, self.pads,
                       self.dilation)

    def channels(self) -> tuple:
        """``(reduced, produced)`` channels of the launched GEMM: the input gradient's are
        the forward's swapped."""
        c, co = self.x_shape[3], self.w_shape[3]
        return (co, c) if self.part == "dgrad" else (c, co)

    def launch_width(self) -> int:
        """Output width of the launched kernel: the op's, the input's for a stride-1 input
        gradient, a stride phase's of the padded input for a strided one."""
        if self.part != "dgrad":
            return self.out_hw()[1]
        if self.stride[1] == 1:
            return self.x_shape[2]
        return pl_cdiv(self.pads[1][0] + self.x_shape[2], self.stride[1])

    def runs(self) -> bool:
        """Whether the kernel runs for this call (the input gradient falls back to XLA where
        it has no kernel: :func:`conv_dgrad`)."""
        try:
            check_supported(self.x_shape, self.w_shape, self.dtype, stride=self.stride,
                            pads=self.pads)
        except KernelUnsupported:
            return False
        if min(self.out_hw()) < 1:
            return False
        if self.part != "dgrad":
            return True
        (kh, kw), (dh, dw), ((pt, pb), (pleft, pr)) = self.w_shape[:2], self.dilation, self.pads
        if tuple(self.stride) == (1, 1):  # the full correlation's padding, >= 0
            return min(dh * (kh - 1) - pt, dh * (kh - 1) - pb, dw * (kw - 1) - pleft,
                       dw * (kw - 1) - pr) >= 0
        oh, ow = self.out_hw()
        mh = pl_cdiv(pt + self.x_shape[1], self.stride[0])
        return tuple(self.dilation) == (1, 1) and mh >= oh and self.launch_width() >= ow

    def fit(self, cfg: MgpuConfig) -> MgpuConfig:
        """``cfg`` as this launch runs it: the tile row, channel tiles and split it would be
        clamped to, the fields it ignores at their defaults (equal fitted configs compile to
        the same kernel)."""
        c_red, c_out = self.channels()
        bn = _block_n(c_out, cfg)
        if self.part == "wgrad":  # 64 input channels a CTA; no warp-specialised form
            tw = wgrad_tile_w(self.launch_width(), cfg, c_out, self.dtype)
            oh, ow = self.out_hw()
            tiles = self.x_shape[0] * pl_cdiv(oh, TILE_M // tw) * pl_cdiv(ow, tw)
            return MgpuConfig(tile_w=tw, block_n=bn, block_k=DEFAULT.block_k,
                              stages=cfg.stages, split=max(1, min(cfg.split, tiles)))
        tw = forward_tile_w(self.launch_width(), cfg, c_red, c_out, self.dtype,
                            self.dtype if self.residual and self.part == "fwd" else None)
        return MgpuConfig(tile_w=tw, block_n=bn, block_k=_block_k(c_red, cfg),
                          stages=cfg.stages, warp_specialized=cfg.warp_specialized)

    def smem_bytes(self, cfg: MgpuConfig) -> int:
        """Shared memory the launch's scratch takes with ``cfg`` (the sum Mosaic checks
        against the device's limit when it lowers the kernel): :func:`smem_bytes` for the
        forward kernel (with this call's prologue, statistics, bias and residual; the
        input gradient's channels swapped), :func:`wgrad_smem_bytes` for the weight
        gradient."""
        cfg = self.fit(cfg)
        c_red, c_out = self.channels()
        if self.part == "wgrad":
            return wgrad_smem_bytes(cfg, c_out, self.dtype)
        if self.part == "dgrad":
            return smem_bytes(cfg, c_red, c_out, self.dtype)
        return smem_bytes(cfg, c_red, c_out, self.dtype, bias=self.bias,
                          residual_dtype=self.dtype if self.residual else None,
                          prologue="bnrelu" in self.kernel, stats=self.kernel.endswith("stats"))

    def candidates(self, limit: int | None = None) -> list:
        """The fitted, distinct :class:`MgpuConfig` s worth timing for this launch, the
        default's first; those over ``limit`` bytes of shared memory (and over
        :data:`MAX_SMEM`, which the forward kernel refuses) left out; none where the kernel
        does not run for the call."""
        if not self.runs():
            return []
        widest = pick_tile_w(self.launch_width())
        rows = sorted({widest, widest // 2 if widest >= 16 else widest}, reverse=True)
        if self.part == "wgrad":  # about one and four CTAs per SM
            ctas = self.w_shape[0] * self.w_shape[1] * pl_cdiv(self.x_shape[3], TILE_M) * \
                pl_cdiv(self.w_shape[3], DEFAULT.block_n)
            one = 1 << max(0, (pl_cdiv(_SMS, ctas) - 1).bit_length())
            grid = [MgpuConfig(tile_w=tw, block_n=bn, stages=st, split=sp)
                    for tw in rows for bn in BLOCK_N for st in STAGES for sp in (one, 4 * one)]
        else:
            grid = [MgpuConfig(tile_w=tw, block_n=bn, block_k=bk, stages=st,
                               warp_specialized=ws)
                    for tw in rows for bn in BLOCK_N for bk in BLOCK_K for st in STAGES
                    for ws in (False, True)]
        cap = MAX_SMEM if limit is None else min(limit, MAX_SMEM)
        out = []
        for cfg in [DEFAULT, *grid]:
            cfg = self.fit(cfg)
            if cfg not in out and self.smem_bytes(cfg) <= cap:
                out.append(cfg)
        return out


def wgrad_smem_bytes(cfg: MgpuConfig, co: int, dtype) -> int:
    """Shared memory the weight-gradient kernel's scratch takes for ``C_out = co``: the
    unswizzled and swizzled slots of both operands (64 input channels and ``block_n``
    output channels by 64 pixels), the float32 output tile and the slots' mbarriers."""
    it = jnp.dtype(dtype).itemsize
    bn, st = _block_n(co, cfg), cfg.stages
    return 2 * st * TILE_M * (TILE_M + bn) * it + TILE_M * bn * 4 + st * _BARRIER


def tuning_calls(x_shape, w_shape, dtype, *, stride, pads, dilation, bias=False,
                 residual=False, prologue=False, stats=False) -> dict:
    """``{"fwd", "dgrad", "wgrad"}``: the :class:`DenseCall` whose tiles each kernel of a dense
    Mosaic convolution looks up and the tuner times (the forward named by its fused
    prologue and statistics)."""
    fwd = "mgpu_conv_fwd" + "_bnrelu" * bool(prologue) + "_stats" * bool(stats)
    common = dict(x_shape=tuple(x_shape), w_shape=tuple(w_shape), stride=tuple(stride),
                  pads=tuple(map(tuple, pads)), dilation=tuple(dilation),
                  dtype=jnp.dtype(dtype).name)
    return {"fwd": DenseCall(fwd, **common, bias=bool(bias), residual=bool(residual)),
            "dgrad": DenseCall("mgpu_conv_dgrad", **common),
            "wgrad": DenseCall("mgpu_conv_wgrad", **common)}


def tuned_config(call: DenseCall) -> MgpuConfig | None:
    """The tiles the tuner chose for ``call`` on this device kind (an active
    :func:`pallas_kernels.autotune.override`, else the user's cache over ``tuned.json``), or
    None: a pure lookup, safe while tracing; a malformed entry warns and gives None.  The
    launch is recorded for :func:`pallas_kernels.autotune.tune_op`."""
    from pallas_kernels import autotune
    return autotune.mosaic_config(call, MgpuConfig)


def part_configs(op: str, config, calls: dict) -> tuple:
    """``(fwd, dgrad, wgrad)`` tiles: ``config`` (one :class:`MgpuConfig` for all, or a dict by
    part), a part not given taking its tuned tiles (:func:`tuned_config` of ``calls[part]``,
    from :func:`tuning_calls`), else :data:`DEFAULT`."""
    from pallas_kernels import autotune
    return autotune.mosaic_part_configs(op, config, calls, MgpuConfig, DEFAULT)


# --- the differentiable op ---------------------------------------------------------------

BACKWARDS = ("mosaic", "xla")
_DIMS = ("NHWC", "HWIO", "NHWC")


def conv2d(x, w, b=None, *, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1),
           residual=None, relu=False, backward="mosaic", config=None, interpret=False,
           detect_races=False):
    """``relu?(conv(x, w) + b + residual)`` with the Mosaic GPU kernels and a ``custom_vjp``.

    The structure of :func:`pallas_kernels.conv2d`: the forward kernel, then the
    backward as the input-gradient and weight-gradient kernels (``backward="mosaic"``)
    or XLA's convolution gradients (``"xla"``).  Bias, residual and ReLU are applied in
    the forward kernel's epilogue, on the float32 accumulator.  Where the input gradient
    has no kernel (strided and dilated, or padded by more than the dilated window), XLA
    computes it.

    Arguments:
        x: ``(N, H, W, C_in)``; w: ``(KH, KW, C_in, C_out)``; bfloat16 or float16.
        b: optional ``(C_out,)``; residual: optional, the output's shape.
        stride: ``(sh, sw)``; padding: ``((top, bottom), (left, right))``; dilation:
            ``(dh, dw)``.
        config: one :class:`MgpuConfig` or ``{"fwd"|"dgrad"|"wgrad": MgpuConfig}``; a
            part not given takes its tuned tiles (:func:`tuned_config`, keyed by
            :func:`tuning_calls`), else the defaults.
        interpret: run in Mosaic GPU interpret mode; detect_races: its race detector.

    Raises:
        KernelUnsupported: for a call the kernels cannot run (:func:`check_supported`).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"Mosaic GPU conv2d: backward must be one of {BACKWARDS}, got "
                         f"{backward!r}")
    pads = tuple(tuple(int(p) for p in pair) for pair in padding)
    dilation = tuple(int(d) for d in dilation)
    stride = tuple(int(v) for v in stride)
    check_supported(x.shape, w.shape, x.dtype, stride=stride, pads=pads)
    cfgs = part_configs("Mosaic GPU conv2d", config, tuning_calls(
        x.shape, w.shape, x.dtype, stride=stride, pads=pads, dilation=dilation,
        bias=b is not None, residual=residual is not None))
    static = (pads, dilation, bool(relu), backward, cfgs, bool(interpret), bool(detect_races),
              stride)
    return _conv(static, x, w, b, residual)


def _forward(static, x, w, b, residual):
    pads, dilation, relu, _, (cfg, _, _), interpret, races, stride = static
    return conv_forward(x, w, b, residual, relu=relu, stride=stride, pads=pads,
                        dilation=dilation, config=cfg, interpret=interpret,
                        detect_races=races)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, x, w, b, residual):
    return _forward(static, x, w, b, residual)


def _conv_fwd(static, x, w, b, residual):
    y = _forward(static, x, w, b, residual)
    return y, (x, w, b, residual, y if static[2] else None)


def _conv_bwd(static, saved, dy):
    pads, dilation, relu, backward, (_, cfg_d, cfg_w), interpret, races, stride = static
    x, w, b, residual, y = saved
    if relu:
        dy = jnp.where(y > 0, dy, jnp.zeros_like(dy))
    db = None if b is None else jnp.sum(dy.astype(F32), axis=(0, 1, 2)).astype(b.dtype)
    dres = None if residual is None else dy.astype(residual.dtype)
    dx, dw = input_and_weight_grads(x, w, dy, stride=stride, pads=pads, dilation=dilation,
                                    backward=backward, configs=(cfg_d, cfg_w),
                                    interpret=interpret, detect_races=races)
    return dx, dw, db, dres


def input_and_weight_grads(x, w, dy, *, stride, pads, dilation, backward, configs, interpret,
                           detect_races):
    """``(dx, dw)`` of ``conv(x, w)`` for the output cotangent ``dy``, in ``x``'s and ``w``'s
    dtypes: the input- and weight-gradient kernels (``backward="mosaic"``; XLA where the
    input gradient has no kernel) or XLA's convolution gradients (``"xla"``)."""
    conv = functools.partial(lax.conv_general_dilated, window_strides=stride, padding=pads,
                             rhs_dilation=dilation, dimension_numbers=_DIMS)
    if backward == "xla":
        _, vjp = jax.vjp(conv, x, w)
        dx, dw = vjp(dy.astype(x.dtype))
        return dx, dw
    cfg_d, cfg_w = configs
    dy = dy.astype(x.dtype)
    try:
        dx = conv_dgrad(dy, w, x_hw=x.shape[1:3], stride=stride, pads=pads, dilation=dilation,
                        config=cfg_d, interpret=interpret, detect_races=detect_races)
    except KernelUnsupported:  # a static property of the call: decided while tracing
        dx = jax.vjp(lambda x_: conv(x_, w), x)[1](dy)[0]
    dw = conv_wgrad(x, dy, kernel_hw=w.shape[:2], stride=stride, pads=pads, dilation=dilation,
                    config=cfg_w, interpret=interpret, detect_races=detect_races)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_conv.defvjp(_conv_fwd, _conv_bwd)
