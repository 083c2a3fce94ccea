"""Depthwise convolution kernels (groups == C_in == C_out): forward, dgrad, wgrad.

Each channel is convolved with its own ``KH x KW`` filter, so there is no
channel reduction to hand to a matrix unit: a program owns a
``(block_m pixels, block_n channels)`` tile and accumulates ``x * w`` over the
taps in float32 on the vector units.  XLA runs this op slowly on GPUs (it
becomes a grouped convolution), which is where a kernel can win.

The weight gradient splits the pixel reduction into ``cfg.split`` ranges with
one float32 partial per tap each, added afterwards in a fixed order (no
atomics); each of its programs sums all taps, so ``dy`` is read once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common as cm
from pallas_kernels._common import F32, BlockConfig, ConvGeometry
from pallas_kernels.conv_grad import fixed_order_sum


def _taps_of(w_ref, tap, cols, col_ok):
    """The ``(1, block_n)`` filter values of ``tap`` for channels ``cols``."""
    return cm.gather(w_ref, tap, cols[None, :], col_ok[None, :], 0.0).astype(F32)


def _forward_kernel(*refs, g: ConvGeometry, cfg: BlockConfig, has_bias: bool, has_res: bool,
                    has_bn: bool, relu: bool):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    r_ref = refs.pop(0) if has_res else None
    s_ref, t_ref = (refs.pop(0), refs.pop(0)) if has_bn else (None, None)
    (o_ref,) = refs
    (n, oh, ow), m, m_ok, cols, col_ok = cm.channel_tile(cfg, g)

    def step(tap, acc):
        rows, mask = cm.tap_rows((n, oh, ow), tap, m_ok, col_ok, g)
        a = cm.gather(x_ref, rows[:, None], cols[None, :], mask, 0.0)
        if has_bn:
            a = cm.bn_relu(a, s_ref, t_ref, cols, col_ok, mask)
        return acc + a.astype(F32) * _taps_of(w_ref, tap, cols, col_ok)

    acc = lax.fori_loop(0, g.taps, step, jnp.zeros((cfg.block_m, cfg.block_n), F32))
    acc = cm.epilogue(acc, m, m_ok, cols, col_ok, b_ref, r_ref, relu)
    cm.store_block(o_ref, acc, m_ok, col_ok)


def depthwise_forward(x, w, b, residual, scale, shift, *, g: ConvGeometry, cfg: BlockConfig,
                      relu: bool, interpret: bool):
    """Depthwise forward; arguments as :func:`pallas_kernels.conv.conv_forward`,
    with ``w`` of shape ``(KH, KW, 1, C)``."""
    ops = [x.reshape(g.m_in, g.c), w.reshape(g.taps, g.c)]
    ops += [b] if b is not None else []
    ops += [residual.reshape(g.m_out, g.c)] if residual is not None else []
    ops += [scale, shift] if scale is not None else []
    kernel = functools.partial(_forward_kernel, g=g, cfg=cfg, has_bias=b is not None,
                               has_res=residual is not None, has_bn=scale is not None,
                               relu=relu)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g.m_out, g.c), x.dtype),
        grid=(pl.cdiv(g.m_out, cfg.block_m), pl.cdiv(g.c, cfg.block_n)),
        in_specs=[cm.ANY] * len(ops),
        out_specs=cm.block2d(cfg.block_m, cfg.block_n),
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_depthwise_fwd",
    )(*ops)
    return y.reshape(g.n, g.oh, g.ow, g.c)


def _dgrad_kernel(dy_ref, w_ref, o_ref, *, g: ConvGeometry, cfg: BlockConfig):
    (n, ih, iw), _, r_ok, cols, col_ok = cm.channel_tile(cfg, g, inverse=True)

    def step(tap, acc):
        rows, mask = cm.tap_rows((n, ih, iw), tap, r_ok, col_ok, g, inverse=True)
        d = cm.gather(dy_ref, rows[:, None], cols[None, :], mask, 0.0)
        return acc + d.astype(F32) * _taps_of(w_ref, tap, cols, col_ok)

    acc = lax.fori_loop(0, g.taps, step, jnp.zeros((cfg.block_m, cfg.block_n), F32))
    cm.store_block(o_ref, acc, r_ok, col_ok)


def depthwise_dgrad(dy, w, *, g: ConvGeometry, cfg: BlockConfig, interpret: bool):
    """Input gradient ``(N, H, W, C)`` (in ``dy.dtype``) of the depthwise convolution."""
    dx = pl.pallas_call(
        functools.partial(_dgrad_kernel, g=g, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((g.m_in, g.c), dy.dtype),
        grid=(pl.cdiv(g.m_in, cfg.block_m), pl.cdiv(g.c, cfg.block_n)),
        in_specs=[cm.ANY, cm.ANY],
        out_specs=cm.block2d(cfg.block_m, cfg.block_n),
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_depthwise_dgrad",
    )(dy.reshape(g.m_out, g.c), w.reshape(g.taps, g.c))
    return dx.reshape(g.n, g.h, g.w, g.c)


# Taps one weight-gradient program sums: each keeps a loaded tile live, so a larger window
# is split by rows of taps (a 7x7 filter takes seven programs of seven taps).
MAX_WGRAD_TAPS = 9


def wgrad_rows(g: ConvGeometry) -> int:
    """Filter rows per weight-gradient program: all of them up to
    :data:`MAX_WGRAD_TAPS` taps, else one."""
    return g.kh if g.taps <= MAX_WGRAD_TAPS else 1


def _wgrad_kernel(*refs, g: ConvGeometry, cfg: BlockConfig, has_bn: bool):
    if has_bn:
        x_ref, dy_ref, s_ref, t_ref, o_ref = refs
    else:
        (x_ref, dy_ref, o_ref), s_ref, t_ref = refs, None, None
    bm = cfg.block_m
    cols = cm.arange_block(0, cfg.block_n)
    col_ok = cols < g.c
    per_split = pl.cdiv(pl.cdiv(g.m_out, bm), cfg.split)
    first = pl.program_id(1) * per_split
    rows_here = wgrad_rows(g)
    first_row = pl.program_id(2) * rows_here
    taps = [(r, j) for r in range(rows_here) for j in range(g.kw)]

    def step(q, accs):
        # One read of this block of dy serves every tap; the taps' input tiles overlap
        # (neighbouring pixels), so after the first they come from cache, not memory.
        m = (first + q) * bm + jnp.arange(bm)
        m_ok = m < g.m_out
        n, oh, ow = cm.split_pixels(m, g.oh, g.ow)
        d = cm.gather(dy_ref, m[:, None], cols[None, :], m_ok[:, None] & col_ok[None, :], 0.0)
        d = d.astype(F32)
        out = []
        for (r, j), acc in zip(taps, accs):
            rows, ok = cm.input_rows(n, oh, ow, first_row + r, j, g)
            mask = (ok & m_ok)[:, None] & col_ok[None, :]
            a = cm.gather(x_ref, rows[:, None], cols[None, :], mask, 0.0)
            if has_bn:
                a = cm.bn_relu(a, s_ref, t_ref, cols, col_ok, mask)
            out.append(acc + jnp.sum(a.astype(F32) * d, axis=0))
        return tuple(out)

    zero = jnp.zeros((cfg.block_n,), F32)
    accs = lax.fori_loop(0, per_split, step, (zero,) * len(taps))
    # The per-tap sums as rows of one (power-of-two taps, block_n) tile; padding rows are 0.
    taps_p2 = cm.next_pow2(len(taps))
    tap_ids = jnp.arange(taps_p2)[:, None]
    tile = jnp.zeros((taps_p2, cfg.block_n), F32)
    for t, acc in enumerate(accs):
        tile = jnp.where(tap_ids == t, acc[None, :], tile)
    plt.store(o_ref, tile, mask=col_ok[None, :])


def depthwise_wgrad(x, dy, scale, shift, *, g: ConvGeometry, cfg: BlockConfig,
                    interpret: bool):
    """Kernel gradient ``(KH, KW, 1, C)`` in float32 of the depthwise convolution.

    A program owns ``block_n`` channels, one of ``cfg.split`` ranges of output pixels
    and :func:`wgrad_rows` rows of the filter, and sums each of those taps' products over
    its range: each block of ``dy`` is read once per row group (once for up to 3x3) and
    each tap's input tile after the first comes from cache (a program per tap read
    both once per tap, through L2).
    """
    has_bn = scale is not None
    ops = [x.reshape(g.m_in, g.c), dy.reshape(g.m_out, g.c)]
    ops += [scale, shift] if has_bn else []
    rows = wgrad_rows(g)
    groups, group_taps = g.kh // rows, rows * g.kw
    taps_p2 = cm.next_pow2(group_taps)
    partials = pl.pallas_call(
        functools.partial(_wgrad_kernel, g=g, cfg=cfg, has_bn=has_bn),
        out_shape=jax.ShapeDtypeStruct((cfg.split, groups * taps_p2, g.c), F32),
        grid=(pl.cdiv(g.c, cfg.block_n), cfg.split, groups),
        in_specs=[cm.ANY] * len(ops),
        out_specs=pl.BlockSpec((pl.squeezed, taps_p2, cfg.block_n), lambda j, s, r: (s, r, j)),
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_depthwise_wgrad",
    )(*ops)
    total = fixed_order_sum(partials).reshape(groups, taps_p2, g.c)[:, :group_taps]
    return total.reshape(g.kh, g.kw, 1, g.c)
