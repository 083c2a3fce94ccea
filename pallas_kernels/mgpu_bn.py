"""Training BatchNorm's per-channel reductions for Hopper (sm_90a) in Pallas **Mosaic GPU**.

An NHWC activation is viewed as ``(M, C)``, ``M = N * H * W``; bfloat16, float16 or float32
in, float32 out.  Each kernel reads its inputs once, in ``(64, block_c)`` tiles that TMA
copies into a ring of ``stages`` shared-memory slots (mbarrier pipeline).  A CTA reduces
:func:`tiles_per_cta` consecutive row tiles of one channel block into one float32
accumulator pair per element position of the tile, in registers (no reduction across
threads in the loop), reduces those over the tile's 64 rows once at the end and writes one
partial pair per channel; XLA combines the CTAs' few partials in a fixed order.

* :func:`channel_stats` ``(x) -> (mean, biased var)``: per position, Welford's running mean
  and sum of squared deviations; per CTA, Chan's parallel formula over the positions; across
  CTAs, the same formula in :func:`pallas_kernels.mgpu_conv.combine_tile_stats` (the fused
  Conv+BN kernel's combine).  No ``E[x^2] - E[x]^2`` cancellation, whatever the offset.
* :func:`channel_grad_sums` ``(dy, x, mean, invstd) -> (sum dy', sum dy' * xhat)``,
  ``xhat = (x - mean) * invstd``, ``dy'`` = ``dy`` where the ReLU passed it
  (``relu_out > 0``, a third input read once; or ``x * a + c > 0``, the mask recomputed
  from ``x``, nothing more read), else ``dy``.

Tails (``M`` and ``C`` not multiples of the tile) are TMA's zero fill, masked by row.
Tiles: a tuned :class:`BnConfig` per launch (:class:`BnCall`, chosen by the GPU check among
:func:`candidates`: at most three), else the first candidate.  What the kernels cannot run
(jax < 0.11, other dtypes, rows not a multiple of 16 bytes) raises
:class:`~jaxcnn.errors.KernelUnsupported`.  Not differentiable themselves:
``jaxcnn.functional.norm.batch_norm_train`` calls them inside its custom VJPs.  Unmeasured
until the GPU check races them (``docs/batch_norm.md``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcnn.errors import KernelUnsupported
from pallas_kernels import mgpu_conv as mc

F32 = jnp.float32
TILE_M = mc.TILE_M  # rows per tile: the WGMMA register layout's 64
DTYPES = (*mc.DTYPES, jnp.dtype(F32))
SMS = 132  # H100/H200 streaming multiprocessors: the grid aims at many CTAs a multiprocessor,
WAVES = 16  # so that the last, partial wave of CTAs is a small share of the time
IN_FLIGHT = 32 * 1024  # bytes of each input a CTA's slots hold: a few CTAs fit a multiprocessor


@dataclasses.dataclass(frozen=True)
class BnConfig:
    """Tiles of the BatchNorm reduction kernels.

    Attributes:
        block_c: channels per CTA (multiple of 16, <= 256); wider than ``C`` reads zeros.
        stages: row tiles in flight per CTA (shared-memory slots per input, >= 2).
    """
    block_c: int = 64
    stages: int = 4

    def __post_init__(self):
        if self.block_c % 16 or not 16 <= self.block_c <= 256:
            raise ValueError(f"BnConfig.block_c must be a multiple of 16 in [16, 256], got "
                             f"{self.block_c}")
        if self.stages < 2:
            raise ValueError(f"BnConfig.stages must be >= 2, got {self.stages}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BnConfig":
        return cls(**d)


def check_supported(op: str, shape, dtype) -> None:
    """Raises :class:`~jaxcnn.errors.KernelUnsupported` (one line) where the kernels cannot
    reduce an array of ``shape`` (``(..., C)``) and ``dtype``."""
    reason = mc.unavailable_reason()
    if reason is not None:
        raise KernelUnsupported(f"{op}: {reason}")
    if jnp.dtype(dtype) not in DTYPES:
        raise KernelUnsupported(f"{op}: dtype {jnp.dtype(dtype).name} unsupported "
                                "(bfloat16, float16, float32)")
    if len(shape) < 2 or int(np.prod(shape[:-1])) < 1:
        raise KernelUnsupported(f"{op}: shape {tuple(shape)} has no rows to reduce")
    if (shape[-1] * jnp.dtype(dtype).itemsize) % 16:
        raise KernelUnsupported(f"{op}: C={shape[-1]} rows of {jnp.dtype(dtype).name} are "
                                "not a multiple of 16 bytes (TMA strides)")


def block_c(c: int, cfg: BnConfig) -> int:
    """Channels per CTA: the config's, or ``C`` rounded up to 16 when that is narrower."""
    return min(cfg.block_c, mc.pl_cdiv(c, 16) * 16)


def smem_bytes(cfg: BnConfig, c: int, dtype, *, streams: int = 1, table_rows: int = 0) -> int:
    """Shared memory of a launch: ``streams`` input rings of ``stages`` tiles, the float32
    per-channel table (``table_rows`` rows), the ``(2, block_c)`` partial, the reduction
    scratch and the barriers (the sum Mosaic checks against ``MAX_SMEM``)."""
    bc, it = block_c(c, cfg), jnp.dtype(dtype).itemsize
    return (streams * cfg.stages * TILE_M * bc * it + table_rows * bc * 4 + 2 * bc * 4
            + mc._REDUCTION_SCRATCH + (cfg.stages + bool(table_rows)) * mc._BARRIER)


def candidates(c: int, dtype, *, streams: int = 1, table_rows: int = 0) -> list:
    """At most three configs for ``C = c``: 64, 128 and 32 channels a CTA (its 128 threads
    hold two float32 accumulators per element of a ``(64, block_c)`` tile: 64 channels
    keep them at 64 registers a thread, 128 at 128), each with the slots that keep about
    :data:`IN_FLIGHT` bytes of each input in flight (2 to 8), dropping any over the shared
    memory limit and duplicates; the first is the default."""
    out = []
    it = jnp.dtype(dtype).itemsize
    for want in (64, 128, 32):
        bc = block_c(c, BnConfig(block_c=want))
        stages = int(min(8, max(2, IN_FLIGHT // (TILE_M * bc * it))))
        cfg = BnConfig(block_c=bc, stages=stages)
        if cfg not in out and smem_bytes(cfg, c, dtype, streams=streams,
                                         table_rows=table_rows) <= mc.MAX_SMEM:
            out.append(cfg)
    return out


def tiles_per_cta(m: int, c: int, cfg: BnConfig) -> int:
    """Row tiles one CTA reduces: about :data:`WAVES` CTAs per multiprocessor over both grid
    axes (never fewer tiles than slots), a multiple of ``stages`` so the loop is static."""
    tiles = mc.pl_cdiv(m, TILE_M)
    ctas_m = max(1, (WAVES * SMS) // mc.pl_cdiv(c, block_c(c, cfg)))
    per = max(cfg.stages, mc.pl_cdiv(tiles, ctas_m))
    return mc.pl_cdiv(per, cfg.stages) * cfg.stages


def _launch(kind, streams, table, *, m, c, cfg, reducer, interpret, detect_races, name):
    """The reduction kernel over ``streams`` (``(m, c)`` arrays read tile by tile) with an
    optional ``(rows, cp)`` float32 per-channel ``table``: returns the ``(ctas_m, 2, cp)``
    float32 partials.  ``reducer = (step, finish)``: ``step(vals, table_rows, valid, t,
    carry)`` folds the CTA's ``t``-th tile (``vals``: the streams' float32 ``(64, block_c)``
    tiles; ``table_rows``: the table's rows as ``(block_c,)`` vectors; ``valid``: its rows
    inside ``m``) into a carry of two ``(64, block_c)`` float32 arrays, one accumulator per
    element position (no reduction across threads in the loop); ``finish(carry, left)``
    (``left``: the CTA's rows inside ``m``) reduces them to the CTA's two ``(block_c,)``
    partials."""
    plgpu = mc._plgpu()
    from jax.experimental import pallas as pl
    bc, stages = block_c(c, cfg), cfg.stages
    per = tiles_per_cta(m, c, cfg)
    ctas_m, cp = mc.pl_cdiv(mc.pl_cdiv(m, TILE_M), per), mc.pl_cdiv(c, bc) * bc
    need = smem_bytes(cfg, c, streams[0].dtype, streams=len(streams),
                      table_rows=0 if table is None else table.shape[0])
    if need > mc.MAX_SMEM:
        raise KernelUnsupported(f"{kind}: {cfg} needs {need} bytes of shared memory (more "
                                f"than {mc.MAX_SMEM})")
    wg, lane = plgpu.Layout.WGMMA, plgpu.Layout.WGMMA.reduce(0)
    ns = len(streams)

    def body(*refs):
        refs = list(refs)
        ins = [refs.pop(0) for _ in range(ns)]
        t_ref = refs.pop(0) if table is not None else None
        o_ref = refs.pop(0)
        bufs = [refs.pop(0) for _ in range(ns)]
        t_smem = refs.pop(0) if table is not None else None
        st_smem, bars = refs.pop(0), refs.pop(0)
        t_bar = refs.pop(0) if table is not None else None
        mi, ci = lax.axis_index("m"), lax.axis_index("c")
        c0, first = ci * bc, mi * per

        def issue(t, slot):
            for src, buf in zip(ins, bufs):
                mc.tma_load(plgpu, src.at[pl.ds((first + t) * TILE_M, TILE_M), pl.ds(c0, bc)],
                            buf.at[slot], bars.at[slot])

        rows = None
        if table is not None:  # one copy before the loop, on its own barrier
            mc.tma_load(plgpu, t_ref.at[:, pl.ds(c0, bc)], t_smem, t_bar)
        for s in range(min(stages, per)):
            issue(first * 0 + s, s)  # traced starts: TMA zero-fills an overhanging window
        if table is not None:
            plgpu.barrier_wait(t_bar)
            rows = [plgpu.load(t_smem.at[r], layout=lane) for r in range(table.shape[0])]
        row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE_M, bc), 0), wg)
        zero = plgpu.layout_cast(jnp.zeros((TILE_M, bc), F32), wg)
        left = m - first * TILE_M  # the CTA's rows inside m (>= 1)
        step, finish = reducer

        def group(g, carry):
            for slot in range(stages):
                t = g * stages + slot
                plgpu.barrier_wait(bars.at[slot])
                vals = [plgpu.load(b.at[slot], layout=wg, optimized=False).astype(F32)
                        for b in bufs]
                plgpu.commit_smem()  # every thread has read the slot: refill it
                pl.when(t + stages < per)(lambda t=t, slot=slot: issue(t + stages, slot))
                carry = step(vals, rows, row < left - t * TILE_M, t, carry)
            return carry

        s1, s2 = finish(lax.fori_loop(0, per // stages, group, (zero, zero)), row, left)
        mc.smem_store(plgpu, st_smem.at[0], s1, swizzled=False)
        mc.smem_store(plgpu, st_smem.at[1], s2, swizzled=False)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(st_smem, o_ref.at[mi, :, pl.ds(c0, bc)])
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((stages, TILE_M, bc), s.dtype) for s in streams]
    scratch += [plgpu.SMEM((table.shape[0], bc), F32)] if table is not None else []
    scratch += [plgpu.SMEM((2, bc), F32),
                plgpu.Barrier(num_arrivals=ns, num_barriers=stages)]
    scratch += [plgpu.Barrier(num_arrivals=1)] if table is not None else []
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((ctas_m, 2, cp), F32),
        grid=(ctas_m, cp // bc), grid_names=("m", "c"), scratch_types=scratch,
        compiler_params=mc._lane_params(plgpu),
        interpret=mc._interpret_params(plgpu, interpret, detect_races), kernel_name=name)
    return kernel(*streams, *([] if table is None else [table]))


@dataclasses.dataclass(frozen=True)
class BnCall:
    """One launch of a BatchNorm reduction kernel as the tuner sees it (the Mosaic call
    protocol of :mod:`pallas_kernels.autotune`): its tiles are cached under :attr:`key`.

    Attributes:
        kernel: ``"mgpu_bn_stats"`` or ``"mgpu_bn_grad_sums"``.
        m, c: the ``(M, C)`` view of the reduced arrays.
        dtype: their dtype's name.
        streams, table_rows: input arrays read tile by tile; rows of the per-channel table.
    """
    kernel: str
    m: int
    c: int
    dtype: str
    streams: int = 1
    table_rows: int = 0

    @property
    def key(self) -> str:
        return (f"{self.kernel}|m={self.m},c={self.c},streams={self.streams},"
                f"table={self.table_rows}|{self.dtype}")

    def fit(self, cfg: BnConfig) -> BnConfig:
        """``cfg`` as this launch runs it (its channel block clamped to ``C``)."""
        return dataclasses.replace(cfg, block_c=block_c(self.c, cfg))

    def smem_bytes(self, cfg: BnConfig) -> int:
        return smem_bytes(cfg, self.c, self.dtype, streams=self.streams,
                          table_rows=self.table_rows)

    def candidates(self, limit: int | None = None) -> list:
        """:func:`candidates` (the default first), within ``limit`` bytes if given."""
        return [k for k in candidates(self.c, self.dtype, streams=self.streams,
                                      table_rows=self.table_rows)
                if limit is None or self.smem_bytes(k) <= limit]


def _config(op, call: BnCall, config) -> BnConfig:
    """``config``, else the tiles tuned for ``call`` on this device kind, else the default."""
    if config is None:
        from pallas_kernels import autotune
        return autotune.mosaic_config(call, BnConfig) or call.candidates()[0]
    if not isinstance(config, BnConfig):
        raise ValueError(f"{op}: config must be a BnConfig, got {type(config).__name__}")
    return config


def cta_rows(m: int, c: int, cfg: BnConfig) -> np.ndarray:
    """Rows of ``m`` each CTA of the ``m`` grid axis reduces, in grid order (static)."""
    per = tiles_per_cta(m, c, cfg) * TILE_M
    return np.minimum(per, m - np.arange(0, m, per)).astype(np.float32)


def channel_stats(x, *, config: BnConfig | None = None, interpret: bool = False,
                  detect_races: bool = False):
    """Per-channel ``(mean, biased variance)`` of ``x`` ``(..., C)``, float32 ``(C,)`` each,
    from one read of ``x``: centred per-tile partials merged by Chan's formula in the
    kernel (per CTA) and then across CTAs (:func:`mgpu_conv.combine_tile_stats`).

    Arguments:
        x: bfloat16, float16 or float32, ``C * itemsize`` a multiple of 16 bytes.
        config: tiles (:class:`BnConfig`); None takes the tuned ones for this launch
            (:class:`BnCall`), else :func:`candidates`' first.
        interpret, detect_races: Mosaic GPU interpret mode and its race detector.
    """
    op = "Mosaic GPU channel_stats"
    check_supported(op, x.shape, x.dtype)
    c = x.shape[-1]
    x2 = x.reshape(-1, c)
    cfg = _config(op, BnCall("mgpu_bn_stats", x2.shape[0], c, jnp.dtype(x.dtype).name), config)
    partial = _launch(op, [x2], None, m=x2.shape[0], c=c, cfg=cfg,
                      reducer=(_stats_step, functools.partial(_stats_finish, cfg, x2.shape[0], c)),
                      interpret=interpret, detect_races=detect_races,
                      name="jaxcnn_mgpu_bn_stats")
    return mc.combine_tile_stats(partial[:, :, :c], cta_rows(x2.shape[0], c, cfg))


def _stats_step(vals, _, valid, t, carry):
    """Welford's update of each element position's running mean and sum of squared
    deviations: a position inside ``m`` in the CTA's tile ``t`` was inside in all ``t``
    before it, so its count is ``t + 1`` (one scalar reciprocal for the tile)."""
    (x,), (mean, m2) = vals, carry
    delta = jnp.where(valid, x - mean, 0.0)
    mean = mean + delta * (1.0 / (t + 1).astype(F32))
    return mean, m2 + delta * (x - mean)


def _stats_finish(cfg, m, c, carry, row, left):
    """The CTA's ``(sum, sum of squares about its mean)`` from its 64 positions' running
    pairs, by Chan's formula (each position holds ``ceil((left - row) / 64)`` rows)."""
    mean_r, m2_r = carry
    per = tiles_per_cta(m, c, cfg)
    full = (left // TILE_M).astype(F32)  # scalars; then the positions of a last part tile
    n_r = jnp.minimum(jnp.where(row < left % TILE_M, full + 1.0, full), float(per))
    total = jnp.sum(n_r * mean_r, axis=0)
    mean = total / jnp.minimum(left, per * TILE_M).astype(F32)
    d = mean_r - lax.broadcast_in_dim(mean, mean_r.shape, [1])
    return total, jnp.sum(m2_r, axis=0) + jnp.sum(n_r * d * d, axis=0)


def channel_grad_sums(dy, x, mean, invstd, *, relu_out=None, relu_affine=None,
                      config: BnConfig | None = None, interpret: bool = False,
                      detect_races: bool = False):
    """``(sum dy', sum dy' * xhat)`` per channel, float32 ``(C,)`` each, with ``xhat = (x -
    mean) * invstd``, from one read of each input.

    Arguments:
        dy, x: ``(..., C)``, the same shape and dtype (:func:`check_supported`).
        mean, invstd: ``(C,)`` (cast to float32).
        relu_out: optional, like ``dy``: ``dy' = dy`` where ``relu_out > 0``, else 0
            (a ReLU after the normalisation, its output read once).
        relu_affine: optional ``(a, c)``, ``(C,)`` each: ``dy' = dy`` where
            ``x * a + c > 0`` (the ReLU's mask recomputed from ``x``, as
            ``batch_norm_train``'s explicit form does); not with ``relu_out``.
        config, interpret, detect_races: as :func:`channel_stats`.
    """
    op = "Mosaic GPU channel_grad_sums"
    check_supported(op, x.shape, x.dtype)
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"{op}: dy {dy.shape} {dy.dtype} differs from x {x.shape} {x.dtype}")
    if relu_out is not None and relu_affine is not None:
        raise ValueError(f"{op}: give relu_out or relu_affine, not both")
    if relu_out is not None and (relu_out.shape, relu_out.dtype) != (x.shape, x.dtype):
        raise ValueError(f"{op}: relu_out {relu_out.shape} {relu_out.dtype} differs from x "
                         f"{x.shape} {x.dtype}")
    c = x.shape[-1]
    streams = [dy.reshape(-1, c), x.reshape(-1, c)]
    if relu_out is not None:
        streams.append(relu_out.reshape(-1, c))
    vecs = [mean, invstd, *(relu_affine or ())]
    call = BnCall("mgpu_bn_grad_sums", streams[0].shape[0], c, jnp.dtype(x.dtype).name,
                  len(streams), len(vecs))
    cfg = _config(op, call, config)
    cp = mc.pl_cdiv(c, block_c(c, cfg)) * block_c(c, cfg)
    table = jnp.pad(jnp.stack([jnp.asarray(v, F32) for v in vecs]), ((0, 0), (0, cp - c)))
    reducer = (_grad_step(relu_out is not None, relu_affine is not None), _sum_rows)
    partial = _launch(op, streams, table, m=streams[0].shape[0], c=c, cfg=cfg,
                      reducer=reducer, interpret=interpret, detect_races=detect_races,
                      name="jaxcnn_mgpu_bn_grad_sums")
    sums = mc.fixed_order_sum(partial[:, :, :c])
    return sums[0], sums[1]


def _grad_step(relu_out: bool, relu_affine: bool):
    """The tile step of :func:`channel_grad_sums`, accumulating ``dy'`` and ``dy' * xhat``
    per element position: the zero fill of the tails adds nothing (``dy`` reads zero
    there), so no row mask."""
    def step(vals, rows, _, __, carry):
        dy, x = vals[0], vals[1]
        wide = [lax.broadcast_in_dim(r, x.shape, [1]) for r in rows]
        if relu_out:
            dy = jnp.where(vals[2] > 0, dy, 0.0)
        elif relu_affine:
            dy = jnp.where(x * wide[2] + wide[3] > 0, dy, 0.0)
        return carry[0] + dy, carry[1] + dy * ((x - wide[0]) * wide[1])
    return step


def _sum_rows(carry, _, __):
    return jnp.sum(carry[0], axis=0), jnp.sum(carry[1], axis=0)
