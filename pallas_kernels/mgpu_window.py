"""The per-channel window kernel behind the Mosaic GPU (Hopper) pooling and depthwise ops.

Pooling and depthwise convolution have no channel reduction for ``wgmma``: every
output element combines the ``KH x KW`` taps of its own channel on the vector units,
so the work is moving bytes.  :func:`tap_reduce` is the one kernel skeleton both ops
use, forward and input gradient:

- **Tiles.**  A CTA (one warpgroup) owns ``64`` output pixels x ``block_c`` channels.
  The 64 pixels are a ``tile_h x tile_w`` rectangle of one image (``tile_w`` a power
  of two <= the output width), as in :mod:`pallas_kernels.mgpu_conv`, so every tile
  row is a contiguous run of NHWC memory.  Every TMA copy into shared memory must move a
  multiple of 128 bytes (:data:`COPY_BYTES`, Mosaic's rule): a row of fewer bytes is
  widened (:func:`tile_w`: at most 8 pixels; its columns past the output read zeros and
  are never stored) and the filter table gets zero rows (:func:`table_rows`).
  Grid: ``(N * tiles, ceil(C / block_c))``.
- **Taps.**  The caller lays its operands out so that every tap reads a stride-1
  window: tap ``t`` of operand ``k`` is the window ``src[k][phase_t * N + n,
  oh + qh_t, ow + qw_t, c]`` (the stride phases of :func:`phases`, or a padded
  ``dy`` for the gradients).  Per tap, one TMA copy per tile row brings that
  window of every operand into a shared-memory slot (``stages`` slots, one mbarrier
  each); reads past the operand's bottom/right are TMA's zero fill.
- **Combine.**  Each tap's tiles are loaded into registers (``wgmma``'s fragment
  layout, which any 64 x 8k tile has) and folded into the caller's accumulator by
  ``combine`` (max with the tap index, sum, multiply-add with a per-channel filter
  row that was TMA-loaded once); ``commit_smem`` (a warpgroup barrier) then frees the
  slot, which is refilled with tap ``t + stages`` at once.  The tap loop is unrolled
  (taps are static: at most 49 for a 7x7 window).
- **Epilogue.**  ``finish`` turns the accumulator into the outputs (it receives each
  element's output row and column, for the average pool's divisor), which are
  stored to shared memory and written with one TMA store per valid tile row, the
  last column tile as exact power-of-two pieces (never relying on clipping at a row
  end; channel tails are clipped by the tensor TMA), as the dense kernel does.

Nothing here has been timed on a GPU.  Every input pixel is read by ``KH x KW /
(sh x sw)`` tiles on average; the repeats come from L2, HBM sees it about once.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn.errors import KernelUnsupported
from pallas_kernels import mgpu_conv as mc

F32 = jnp.float32
TILE_M = mc.TILE_M
DTYPES = mc.DTYPES


@dataclasses.dataclass(frozen=True)
class WindowConfig:
    """Tiles of the Mosaic GPU pooling and depthwise kernels.

    Attributes:
        tile_w: output pixels per row of the 64-pixel tile (power of two); None picks
            the widest that fits the output width (either widened where a row copy would
            not be a multiple of 128 bytes: :func:`tile_w`).
        block_c: channels per CTA (multiple of 8, <= 256); a channel count below it
            takes the whole channel dimension.
        stages: taps in flight (shared-memory slots, >= 1).
        split: depthwise weight gradient only: CTAs sharing the pixel reduction.
    """
    tile_w: int | None = None
    block_c: int = 64
    stages: int = 3
    split: int = 1

    def __post_init__(self):
        if self.tile_w is not None and (self.tile_w < 1 or TILE_M % self.tile_w):
            raise ValueError(f"WindowConfig.tile_w must divide {TILE_M}, got {self.tile_w}")
        if self.block_c % 8 or not 8 <= self.block_c <= 256:
            raise ValueError(f"WindowConfig.block_c must be a multiple of 8 in [8, 256], got "
                             f"{self.block_c}")
        if self.stages < 1 or self.split < 1:
            raise ValueError(f"WindowConfig.stages and .split must be >= 1, got "
                             f"{self.stages}, {self.split}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "WindowConfig":
        """The config of a tuned-cache entry; TypeError/ValueError for a malformed one."""
        return cls(**d)


DEFAULT = WindowConfig()


def check_supported(op: str, x_shape, dtype, stride, *, max_stride: int = 4) -> None:
    """Raises :class:`~jaxcnn.errors.KernelUnsupported` (one line) where the Mosaic GPU
    window kernels cannot run ``op`` on this input; returns None where they can."""
    reason = mc.unavailable_reason()
    if reason is not None:
        raise KernelUnsupported(f"{op}: {reason}")
    if jnp.dtype(dtype) not in DTYPES:
        raise KernelUnsupported(f"{op}: dtype {jnp.dtype(dtype).name} unsupported "
                                "(bfloat16/float16 only)")
    if x_shape[3] % 8:
        raise KernelUnsupported(f"{op}: C={x_shape[3]} is not a multiple of 8 (TMA needs "
                                "16-byte strides)")
    if not all(1 <= s <= max_stride for s in stride):
        raise KernelUnsupported(f"{op}: stride {tuple(stride)} unsupported (1 to {max_stride})")


def on_hopper(device_kind: str | None = None) -> bool:
    """Whether ``device_kind`` (default: the first device's, with its compute capability)
    is a Hopper GPU, where the Mosaic GPU kernels are chosen by default."""
    if device_kind is not None:
        return mc.is_hopper(device_kind)
    from pallas_kernels import autotune
    return mc.is_hopper(autotune.device_kind(), mc.device_capability())


def check_config(op: str, config) -> None:
    """``config`` must be None or :class:`WindowConfig` (or, where ``op`` takes per-part tiles,
    a dict of them): one clear error for a Triton ``BlockConfig`` or a dense ``MgpuConfig``."""
    parts = config.values() if isinstance(config, dict) else [config]
    bad = [type(c).__name__ for c in parts if c is not None and not isinstance(c, WindowConfig)]
    if bad:
        raise ValueError(f"{op}: config must be a WindowConfig (the Mosaic GPU window kernels' "
                         f"tiles), got {bad[0]}")


def block_c(c: int, cfg: WindowConfig) -> int:
    return c if c <= cfg.block_c else cfg.block_c


# A TMA copy into shared memory must move a multiple of this many bytes (Mosaic GPU's
# lowering splits the mbarrier's expected bytes evenly over the warpgroup's 128 threads).
COPY_BYTES = mc.COPY_BYTES


def tile_w(width: int, bc: int, cfg: WindowConfig, itemsize: int = 2) -> int:
    """Output pixels per tile row for a launch ``width`` wide with ``bc`` channels: the
    config's (or the widest power of two <= ``width``, at most 64), widened to the
    narrowest power of two whose row copy (``tile_w * bc * itemsize`` bytes) is a multiple
    of :data:`COPY_BYTES` (the dense kernels' rule, :func:`mgpu_conv.fit_tile_w`); the
    columns past ``width`` read TMA's zero fill and are never stored."""
    return mc.fit_tile_w(width, cfg.tile_w, [bc * itemsize])


def table_rows(rows: int, bc: int) -> int:
    """Rows of a float32 ``(rows, bc)`` table in shared memory padded so that its one TMA
    copy is a multiple of :data:`COPY_BYTES`."""
    while (rows * bc * 4) % COPY_BYTES:
        rows += 1
    return rows


def phases(x, pads, stride, fill, *, view: bool = True):
    """``x`` padded by ``pads`` (with ``fill``) and split into its ``sh * sw`` stride phases:
    ``(sh * sw * N, ceil(Hp / sh), ceil(Wp / sw), C)``, phase ``a * sw + b`` holding rows
    ``a::sh`` and columns ``b::sw`` of the padded input.  One XLA copy; none at stride 1
    without padding.

    Strided, without padding, on sizes the stride divides (a 2x2/2 pool), and with ``view``,
    the phases are a free view instead, ``(N, H / sh, sh, W / sw, sw * C)``: phase
    ``(a, b)`` is index ``a`` of axis 2 and channels ``b * C ... (b + 1) * C`` (no copy).
    """
    (pt, pb), (pleft, pr) = pads
    sh, sw = stride
    n, h, w, c = x.shape
    if view and (sh, sw) != (1, 1) and not (pt or pb or pleft or pr) and not (h % sh or w % sw):
        return x.reshape(n, h // sh, sh, w // sw, sw * c)
    pb += -(h + pt + pb) % sh
    pr += -(w + pleft + pr) % sw
    if pt or pb or pleft or pr:
        x = jnp.pad(x, ((0, 0), (pt, pb), (pleft, pr), (0, 0)), constant_values=fill)
    if sh == sw == 1:
        return x
    hs, ws = x.shape[1] // sh, x.shape[2] // sw
    x = x.reshape(n, hs, sh, ws, sw, c).transpose(2, 4, 0, 1, 3, 5)
    return x.reshape(sh * sw * n, hs, ws, c)


def forward_taps(kernel_hw, stride, dilation=(1, 1)):
    """``[(phase, qh, qw)]`` of each tap ``(i, j)`` (row-major) in the :func:`phases` layout."""
    (kh, kw), (sh, sw), (dh, dw) = kernel_hw, stride, dilation
    out = []
    for i in range(kh):
        for j in range(kw):
            rh, rw = i * dh, j * dw
            out.append(((rh % sh) * sw + rw % sw, rh // sh, rw // sw))
    return out


def tap_reduce(srcs, taps, *, n: int, out_hw, c: int, out_dtypes, init, combine, finish,
               weights=None, config: WindowConfig | None = None, interpret=False,
               detect_races=False, name: str):
    """Runs the window kernel; returns one ``(n, OH, OW, c)`` array per ``out_dtypes``.

    Arguments:
        srcs: operands ``(P * n, Hs, Ws, >= c)`` read per tap (16-bit floats or int16), or
            the 5-D phase view of :func:`phases`.
        taps: ``[(phase, qh, qw)]`` per tap, static.
        init(shape, layout): the accumulator, a tuple of ``shape`` arrays (``(64,
            block_c)``; ``layout`` is their register layout).
        combine(t, acc, vals, w_row, pos): the accumulator after tap ``t``; ``vals`` holds
            the operands' ``(64, block_c)`` tiles, ``w_row(t)`` row ``t`` of ``weights``
            broadcast to the tile (float32), ``pos`` each element's output ``(row, column)``
            (int32 tiles).
        finish(acc, pos, w_row): the output tiles.
        weights: optional float32 ``(rows, C')`` (``C'`` a multiple of ``block_c``), one
            TMA copy per CTA.
    """
    plgpu = mc._plgpu()
    from jax.experimental import pallas as pl
    cfg = config or DEFAULT
    oh, ow = out_hw
    bc = block_c(c, cfg)
    tw = tile_w(ow, bc, cfg, max(jnp.dtype(s.dtype).itemsize for s in srcs))
    th = TILE_M // tw
    tiles_h, tiles_w = mc.pl_cdiv(oh, th), mc.pl_cdiv(ow, tw)
    tail = ow - (tiles_w - 1) * tw
    ntaps = len(taps)
    stages = min(cfg.stages, ntaps)
    layout = plgpu.Layout.WGMMA
    has_w = weights is not None
    if has_w:  # zero rows: the table's one copy a whole number of COPY_BYTES
        extra = table_rows(weights.shape[0], bc) - weights.shape[0]
        if extra:
            weights = jnp.pad(weights, ((0, extra), (0, 0)))

    def body(*refs):
        refs = list(refs)
        src_refs = [refs.pop(0) for _ in srcs]
        w_ref = refs.pop(0) if has_w else None
        out_refs = [refs.pop(0) for _ in out_dtypes]
        slots = [refs.pop(0) for _ in srcs]
        out_smem = [refs.pop(0) for _ in out_dtypes]
        bars = refs.pop(0)
        if has_w:
            w_smem, w_bar = refs
        mi, ci = lax.axis_index("m"), lax.axis_index("c")
        img = mi // (tiles_h * tiles_w)
        rest = mi % (tiles_h * tiles_w)
        oh0, col = (rest // tiles_w) * th, rest % tiles_w
        ow0, c0 = col * tw, ci * bc

        def issue(t, slot):
            phase, qh, qw = taps[t]
            for src, buf in zip(src_refs, slots):
                for r in range(th):
                    if len(src.shape) == 5:  # the phase view: (n, Hs, sh, Ws, sw * c)
                        # (A channel tail reads the next phase's first channels, not zeros:
                        # values of channels past c, which are never stored.)
                        a, b = divmod(phase, src.shape[4] // c)
                        window = src.at[img, oh0 + r + qh, a, pl.ds(ow0 + qw, tw),
                                        pl.ds(b * c + c0, bc)]
                    else:
                        window = src.at[phase * n + img, oh0 + r + qh, pl.ds(ow0 + qw, tw),
                                        pl.ds(c0, bc)]
                    mc.tma_load(plgpu, window, buf.at[slot, pl.ds(r * tw, tw)], bars.at[slot])

        if has_w:
            mc.tma_load(plgpu, w_ref.at[:, pl.ds(c0, bc)], w_smem, w_bar)
        for t in range(stages):
            issue(t, t)
        if has_w:
            plgpu.barrier_wait(w_bar)

        def w_row(t):
            row = plgpu.load(w_smem.at[t], layout=layout.reduce(0))
            return lax.broadcast_in_dim(row, (TILE_M, bc), [1])

        p = plgpu.broadcasted_iota(jnp.int32, (TILE_M, bc), 0, layout=layout)
        pos = (oh0 + lax.div(p, tw), ow0 + lax.rem(p, tw))  # each element's output pixel
        acc = init((TILE_M, bc), layout)
        for t in range(ntaps):
            slot = t % stages
            plgpu.barrier_wait(bars.at[slot])
            vals = [plgpu.load(buf.at[slot], layout=layout, optimized=False) for buf in slots]
            acc = combine(t, acc, vals, w_row, pos)
            if t + stages < ntaps:
                plgpu.commit_smem()  # every thread has read the slot: refill it
                issue(t + stages, slot)
        outs = finish(acc, pos, w_row)
        for o, smem in zip(outs, out_smem):
            mc.smem_store(plgpu, smem, o.astype(smem.dtype), swizzled=False)
        plgpu.commit_smem()
        for r in range(th):
            def store(off, size, r=r):
                for smem, o_ref in zip(out_smem, out_refs):
                    plgpu.copy_smem_to_gmem(
                        smem.at[pl.ds(r * tw + off, size)],
                        o_ref.at[img, oh0 + r, pl.ds(ow0 + off, size), pl.ds(c0, bc)])

            row_ok = oh0 + r < oh
            if tail == tw:
                pl.when(row_ok)(lambda store=store: store(0, tw))
            else:
                pl.when(row_ok & (col < tiles_w - 1))(lambda store=store: store(0, tw))

                @pl.when(row_ok & (col == tiles_w - 1))
                def _tail(store=store):
                    for off, size in mc._pieces(tail):
                        store(off, size)
        plgpu.wait_smem_to_gmem(0)

    scratch = [plgpu.SMEM((stages, TILE_M, bc), s.dtype) for s in srcs]
    scratch += [plgpu.SMEM((TILE_M, bc), d) for d in out_dtypes]
    scratch.append(plgpu.Barrier(num_arrivals=th * len(srcs), num_barriers=stages))
    if has_w:
        scratch += [plgpu.SMEM((weights.shape[0], bc), F32), plgpu.Barrier(num_arrivals=1)]
    kernel = plgpu.kernel(
        body,
        out_type=tuple(jax.ShapeDtypeStruct((n, oh, ow, c), d) for d in out_dtypes),
        grid=(n * tiles_h * tiles_w, mc.pl_cdiv(c, bc)),
        grid_names=("m", "c"),
        scratch_types=scratch,
        compiler_params=mc._lane_params(plgpu),
        interpret=mc._interpret_params(plgpu, interpret, detect_races),
        kernel_name=name,
    )
    return kernel(*srcs, *([weights] if has_w else []))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pad_channels(a, multiple: int):
    """``a`` with its last dimension zero-padded to a multiple of ``multiple``."""
    extra = -a.shape[-1] % multiple
    if not extra:
        return a
    return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


# --- tuning: each launch's tiles, per shape and device kind --------------------------------

# The tuner's kernels: the op, then the part whose tiles it keys (pooling: forward and
# backward; depthwise: forward, input and weight gradients).
KERNELS = ("mgpu_max_pool_fwd", "mgpu_max_pool_bwd", "mgpu_avg_pool_fwd", "mgpu_avg_pool_bwd",
           "mgpu_depthwise_fwd", "mgpu_depthwise_dgrad", "mgpu_depthwise_wgrad")
# The grid the tuner times per launch, fitted to the shape (:meth:`WindowCall.candidates`):
# channel tiles, taps in flight, and the widest tile row with half of it.
BLOCK_C = (32, 64, 128, 256)
STAGES = (2, 4)
_BARRIER = 8  # bytes of one mbarrier in shared memory
_SMS = 132  # an H100's streaming multiprocessors: sizes the weight gradient's splits


@dataclasses.dataclass(frozen=True)
class WindowCall:
    """One Mosaic window-kernel launch as the tuner sees it: what its tiles are cached under
    and what decides which tiles fit.

    Attributes:
        kernel: one of :data:`KERNELS`.
        x_shape: the op's input ``(N, H, W, C)``.
        window, stride, dilation: ``(KH, KW)`` and the op's pairs.
        pads: ``((top, bottom), (left, right))`` as the op runs them (pooling: with the
            ``ceil_mode`` overhang).
        out_hw: the op's output ``(OH, OW)``.
        dtype: the input's dtype name.
    """
    kernel: str
    x_shape: tuple
    window: tuple
    stride: tuple
    pads: tuple
    dilation: tuple
    out_hw: tuple
    dtype: str

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"WindowCall: kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def key(self) -> str:
        """Autotune-cache key of this launch's tiles."""
        dims = (f"x={list(self.x_shape)},k={list(self.window)},stride={list(self.stride)},"
                f"pads={[list(p) for p in self.pads]},dilation={list(self.dilation)}")
        return f"{self.kernel}|{dims}|{self.dtype}"

    @property
    def part(self) -> str:
        return self.kernel.rsplit("_", 1)[1]

    def launch_width(self) -> int:
        """Output width of the launched kernel: the op's, or a stride phase's of the padded
        input for the gradients gathered by phase (the pooling backward pads both sides)."""
        if self.part not in ("bwd", "dgrad"):
            return self.out_hw[1]
        (pleft, pr), w = self.pads[1], self.x_shape[2]
        return cdiv(w + pleft + (pr if self.part == "bwd" else 0), self.stride[1])

    def taps(self) -> int:
        """Taps one launch reduces: the window's, or the most any stride phase receives."""
        (kh, kw), (sh, sw), (dh, dw) = self.window, self.stride, self.dilation
        if self.part not in ("bwd", "dgrad"):
            return kh * kw
        rows = max(sum(1 for i in range(kh) if i * dh % sh == a) for a in range(sh))
        cols = max(sum(1 for j in range(kw) if j * dw % sw == b) for b in range(sw))
        return rows * cols

    def fit(self, cfg: WindowConfig) -> WindowConfig:
        """``cfg`` as this launch runs it: the tile row, channel tile, slots and split it
        would be clamped to (equal fitted configs compile to the same kernel)."""
        bc = block_c(self.x_shape[3], cfg)
        tw = tile_w(self.launch_width(), bc, cfg, jnp.dtype(self.dtype).itemsize)
        stages, split = min(cfg.stages, self.taps()), 1
        if self.kernel == "mgpu_depthwise_wgrad":  # slots over output tiles, shared by splits
            oh, ow = self.out_hw
            stages = cfg.stages
            split = min(cfg.split, self.x_shape[0] * cdiv(oh, TILE_M // tw) * cdiv(ow, tw))
        return WindowConfig(tile_w=tw, block_c=bc, stages=stages,
                            split=split)

    def smem_bytes(self, cfg: WindowConfig) -> int:
        """Shared memory the launch's scratch takes with ``cfg`` (the sum Mosaic checks
        against the device's limit when it lowers the kernel): the slots of the staged
        operands, the output tiles, the float32 filter table or accumulator, mbarriers."""
        cfg = self.fit(cfg)
        it = jnp.dtype(self.dtype).itemsize  # the max pool's int16 index is as wide
        tile = TILE_M * cfg.block_c
        if self.kernel == "mgpu_depthwise_wgrad":  # x and dy slots, a float32 accumulator
            return 2 * cfg.stages * tile * it + tile * 4 + cfg.stages * _BARRIER
        staged = 2 if self.kernel == "mgpu_max_pool_bwd" else 1  # dy and the tap index
        outs = 2 if self.kernel == "mgpu_max_pool_fwd" else 1  # y and the tap index
        total = (staged * cfg.stages + outs) * tile * it + cfg.stages * _BARRIER
        if self.kernel in ("mgpu_depthwise_fwd", "mgpu_depthwise_dgrad"):
            rows = self.taps() + (self.part == "fwd")  # the filters (and the bias row)
            total += table_rows(rows, cfg.block_c) * cfg.block_c * 4 + _BARRIER
        return total

    def candidates(self, limit: int | None = None) -> list:
        """The fitted, distinct :class:`WindowConfig` s worth timing for this launch, the
        default's first; those over ``limit`` bytes of shared memory left out; none where
        the kernels cannot run the call."""
        try:
            check_supported(self.kernel, self.x_shape, self.dtype, self.stride)
        except KernelUnsupported:
            return []
        widest = mc.pick_tile_w(self.launch_width())
        splits = (1,)
        if self.kernel == "mgpu_depthwise_wgrad":  # about one and four CTAs per SM
            ctas = self.taps() * cdiv(self.x_shape[3], 64)
            one = 1 << max(0, (cdiv(_SMS, ctas) - 1).bit_length())
            splits = (one, 4 * one)
        grid = [WindowConfig(tile_w=tw, block_c=bc, stages=st, split=sp)
                for tw in sorted({widest, max(1, widest // 2)}, reverse=True)
                for bc in BLOCK_C for st in STAGES for sp in splits]
        out = []
        for cfg in [DEFAULT, *grid]:
            cfg = self.fit(cfg)
            if cfg not in out and (limit is None or self.smem_bytes(cfg) <= limit):
                out.append(cfg)
        return out


def tuned_config(call: WindowCall) -> WindowConfig | None:
    """The tiles the tuner chose for ``call`` on this device kind (an active
    :func:`pallas_kernels.autotune.override`, else the user's cache over ``tuned.json``),
    or None: a pure lookup, safe while tracing.  The launch is recorded for
    :func:`pallas_kernels.autotune.tune_op`, which times :meth:`WindowCall.candidates`."""
    from pallas_kernels import autotune
    return autotune.mosaic_config(call, WindowConfig)


def part_configs(op: str, config, calls: dict) -> tuple:
    """The tiles of each part of an op, in the order of ``calls`` (``{part: WindowCall}``):
    ``config`` (one :class:`WindowConfig` for all, or a dict by part), a part not given
    taking its tuned tiles (:func:`tuned_config`), else :data:`DEFAULT`."""
    check_config(op, config)
    from pallas_kernels import autotune
    return autotune.mosaic_part_configs(op, config, calls, WindowConfig, DEFAULT)


__all__ = ["WindowConfig", "DEFAULT", "check_supported", "check_config", "on_hopper",
           "phases", "forward_taps", "tap_reduce", "pad_channels", "block_c", "tile_w",
           "table_rows", "COPY_BYTES", "cdiv",
           "WindowCall", "KERNELS", "tuned_config", "part_configs"]
