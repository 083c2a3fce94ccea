"""Pieces shared by every kernel: block configs, convolution geometry, masked loads.

All kernels here are written for the Pallas Triton lowering (NVIDIA GPUs) and
run unchanged on the CPU with ``interpret=True``.  Triton's rules shape the
code: every block dimension is a power of two, edge blocks are not masked for
us (every load and store carries a mask), dots are 2-D with equal input dtypes
and float32 accumulation.  Operands that are gathered (an input pixel per
output pixel and tap) are passed whole (``memory_space=pl.ANY``) and read with
integer-array indices; the interpreter supports that form (all indices
arrays, no mixed slices), the Triton lowering turns it into pointer offsets.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

F32 = jnp.float32


def interpret_default(interpret: bool | None) -> bool:
    """``interpret`` as given, else True unless the default backend is a GPU."""
    if interpret is not None:
        return bool(interpret)
    return jax.default_backend() != "gpu"


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def pow2_block(n: int, lo: int, hi: int) -> int:
    """A power-of-two block covering ``n`` if it can, clamped to ``[lo, hi]``."""
    return max(lo, min(hi, next_pow2(n)))


@dataclasses.dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch parameters of one kernel launch.

    Arguments:
        block_m: rows (pixels) per program.
        block_n: columns (output channels, or channels for elementwise kernels)
            per program.
        block_k: reduction chunk (input channels, or output channels for the
            input gradient) per inner step.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining stages.
        split: number of independent partial sums the weight gradient splits
            ``N * H_out * W_out`` into (reduced afterwards in a fixed order).
    """
    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split: int = 1

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1 or v & (v - 1):
                raise ValueError(f"BlockConfig: {name} must be a power of two, got {v!r}")
        for name in ("num_stages", "split"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"BlockConfig: {name} must be a positive int, got {v!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BlockConfig":
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ValueError(f"BlockConfig: unknown keys {sorted(unknown)}")
        return cls(**d)

    def compiler_params(self):
        return plt.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


class ConvGeometry(NamedTuple):
    """Static shape of a 2-D window op over an NHWC input (conv or pool).

    ``pt``/``pl`` are the top/left pads; the bottom/right ones are implied by
    ``oh``/``ow`` (positions past the input are masked, never read).
    """
    n: int
    h: int
    w: int
    c: int
    kh: int
    kw: int
    sh: int
    sw: int
    dh: int
    dw: int
    pt: int
    pl: int
    oh: int
    ow: int

    @property
    def m_out(self) -> int:
        return self.n * self.oh * self.ow

    @property
    def m_in(self) -> int:
        return self.n * self.h * self.w

    @property
    def taps(self) -> int:
        return self.kh * self.kw


def geometry(x_shape, window, stride, dilation, pads, out_hw) -> ConvGeometry:
    """:class:`ConvGeometry` from an input shape and already-validated arguments."""
    n, h, w, c = x_shape
    return ConvGeometry(n, h, w, c, window[0], window[1], stride[0], stride[1],
                        dilation[0], dilation[1], pads[0][0], pads[1][0], out_hw[0], out_hw[1])


def divmod_static(a, b: int):
    """``(a // b, a % b)`` for non-negative ``a`` and a static ``b >= 1``.

    Plain ``lax.div``/``lax.rem`` (truncating, which equals flooring here):
    ``jnp``'s floor-division wrappers trip the Triton lowering's type checks.
    """
    if b == 1:
        return a, jnp.zeros_like(a)
    b = jnp.asarray(b, a.dtype)
    return lax.div(a, b), lax.rem(a, b)


def split_pixels(m, oh: int, ow: int):
    """Flat pixel indices ``m`` -> ``(n, row, col)`` for an ``(oh, ow)`` image."""
    rest, col = divmod_static(m, ow)
    n, row = divmod_static(rest, oh)
    return n, row, col


def input_rows(n, oh, ow, i, j, g: ConvGeometry):
    """Flat input pixel read by output pixels ``(n, oh, ow)`` at tap ``(i, j)``.

    Returns ``(rows, valid)``; rows falling in the padding are invalid (and
    pointed at row 0 so that even an unmasked read stays in bounds).
    """
    ih = oh * g.sh - g.pt + i * g.dh
    iw = ow * g.sw - g.pl + j * g.dw
    valid = (ih >= 0) & (ih < g.h) & (iw >= 0) & (iw < g.w)
    return jnp.where(valid, (n * g.h + ih) * g.w + iw, 0), valid


def output_rows(n, ih, iw, i, j, g: ConvGeometry):
    """Flat output pixel whose tap ``(i, j)`` reads input pixels ``(n, ih, iw)``.

    The inverse of :func:`input_rows`, used by the gradients with respect to
    the input: an input pixel receives from output pixel ``(oh, ow)`` when
    ``oh * sh + i * dh - pt == ih`` has an integer solution inside the output.
    """
    th = ih + g.pt - i * g.dh
    tw = iw + g.pl - j * g.dw
    (oh, rh), (ow, rw) = divmod_static(jnp.maximum(th, 0), g.sh), divmod_static(
        jnp.maximum(tw, 0), g.sw)
    valid = (th >= 0) & (tw >= 0) & (rh == 0) & (rw == 0) & (oh < g.oh) & (ow < g.ow)
    return jnp.where(valid, (n * g.oh + oh) * g.ow + ow, 0), valid


def channel_tile(cfg: BlockConfig, g: ConvGeometry, *, inverse: bool = False):
    """This program's tile of a per-channel (depthwise or pooling) kernel.

    Grid axis 0 walks blocks of ``cfg.block_m`` flat output pixels (input pixels with
    ``inverse``), axis 1 blocks of ``cfg.block_n`` channels.  Returns
    ``(pixels, rows, row_ok, cols, col_ok)``: ``rows`` the flat pixel indices,
    ``pixels`` them as ``(n, row, col)``, and the masks of those inside the array.
    """
    rows = arange_block(0, cfg.block_m)
    cols = arange_block(1, cfg.block_n)
    count, (h, w) = (g.m_in, (g.h, g.w)) if inverse else (g.m_out, (g.oh, g.ow))
    return split_pixels(rows, h, w), rows, rows < count, cols, cols < g.c


def tap_rows(pixels, tap, row_ok, col_ok, g: ConvGeometry, *, inverse: bool = False):
    """Rows of tap ``tap`` (flat ``i * KW + j``) for a block of pixels, and the tile mask.

    ``pixels`` is ``(n, row, col)`` of output pixels (the input rows they read, as
    :func:`input_rows`) or, with ``inverse``, of input pixels (the output rows that read
    them, as :func:`output_rows`).  Returns ``(rows, mask)``: ``mask`` is the
    ``(rows, cols)`` tile of valid taps within ``row_ok`` and ``col_ok``, ready for
    :func:`gather` as ``gather(ref, rows[:, None], cols[None, :], mask, other)``.
    """
    rows, ok = (output_rows if inverse else input_rows)(*pixels, *divmod_static(tap, g.kw), g)
    return rows, (ok & row_ok)[:, None] & col_ok[None, :]


def gather(ref, idx0, idx1, mask, other):
    """``ref[idx0, idx1]`` (broadcast) where ``mask``, ``other`` elsewhere.

    Masked-off lanes are never read, on the GPU as in the interpreter, so
    their indices may point anywhere (past the channel tail, say).  They are
    deliberately left as computed: replacing them (``where(mask, idx, 0)``)
    hides from Triton that the channel index is contiguous: every load then
    compiles to scalar reads, which Triton can neither vectorise nor pipeline
    through ``cp.async`` (``scripts/inspect_kernels.py`` shows the difference).
    """
    shape = jnp.broadcast_shapes(jnp.shape(idx0), jnp.shape(idx1), jnp.shape(mask))
    i0 = jnp.broadcast_to(idx0, shape)
    i1 = jnp.broadcast_to(idx1, shape)
    return plt.load(ref.at[i0, i1], mask=jnp.broadcast_to(mask, shape), other=other)


def scatter(ref, idx0, idx1, value, mask):
    """``ref[idx0, idx1] = value`` (broadcast) where ``mask``: :func:`gather`'s inverse."""
    shape = jnp.shape(value)
    plt.store(ref.at[jnp.broadcast_to(idx0, shape), jnp.broadcast_to(idx1, shape)],
              value.astype(ref.dtype), mask=jnp.broadcast_to(mask, shape))


def gather1d(ref, idx, mask, other):
    """``ref[idx]`` where ``mask``, ``other`` elsewhere, for a 1-D ``ref``."""
    return plt.load(ref.at[idx], mask=mask, other=other)


def bn_relu(a, scale_ref, shift_ref, cols, col_ok, valid):
    """The fused BatchNorm-apply + ReLU on a loaded ``(rows, cols)`` tile.

    ``relu(a * scale + shift)`` per input channel, then zero wherever the tile
    lies outside the input: padding is applied after the BatchNorm and ReLU,
    so padded positions stay exactly zero (not ``relu(shift)``).
    """
    s = gather1d(scale_ref, cols, col_ok, 0.0).astype(F32)
    t = gather1d(shift_ref, cols, col_ok, 0.0).astype(F32)
    y = jnp.maximum(a.astype(F32) * s[None, :] + t[None, :], 0.0)
    return jnp.where(valid, y, 0.0).astype(a.dtype)


def epilogue(acc, rows, row_ok, cols, col_ok, bias_ref, res_ref, relu: bool):
    """``relu?(acc + bias + residual)`` on a float32 ``(block_m, block_n)`` tile."""
    if bias_ref is not None:
        acc = acc + gather1d(bias_ref, cols, col_ok, 0.0).astype(F32)[None, :]
    if res_ref is not None:
        mask = row_ok[:, None] & col_ok[None, :]
        acc = acc + gather(res_ref, rows[:, None], cols[None, :], mask, 0.0).astype(F32)
    if relu:
        acc = jnp.maximum(acc, 0.0)
    return acc


def store_block(o_ref, value, row_ok, col_ok):
    """Stores a ``(block_m, block_n)`` tile into its output block, masking the edges."""
    plt.store(o_ref, value.astype(o_ref.dtype), mask=row_ok[:, None] & col_ok[None, :])


ANY = pl.BlockSpec(memory_space=pl.ANY)


def block2d(bm: int, bn: int) -> pl.BlockSpec:
    """Block ``(bm, bn)`` of a 2-D output, indexed by the first two grid axes."""
    return pl.BlockSpec((bm, bn), lambda i, j, *_: (i, j))


def arange_block(axis: int, size: int):
    """Global indices covered by this program along grid ``axis``."""
    return pl.program_id(axis) * size + jnp.arange(size)
