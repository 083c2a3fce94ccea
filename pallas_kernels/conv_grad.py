"""Input-gradient (dgrad) and weight-gradient (wgrad) kernels of a dense convolution.

dgrad is again an implicit GEMM, now over input pixels:
``dX[M_in, C_in] = sum over taps of dY[rows(tap), C_out] @ W[tap]^T``, where an
input pixel takes its row of ``dY`` from the output pixel whose tap reads it
(none when the stride skips it or the tap falls outside the output).  With a
stride, which taps reach an input pixel depends only on its phase
``(ih % sh, iw % sw)``: the strided kernel gives each program pixels of one
phase and loops over that phase's taps alone (a quarter of them at stride 2),
instead of multiplying masked-off rows for every tap.

wgrad is ``dW[tap] = X_col[M, tap]^T @ dY[M, :]`` with the long reduction
over ``M = N * H_out * W_out``.  It is split into ``cfg.split`` contiguous
ranges, each program writing its own float32 partial sum; the partials are
then added in a fixed order.  No atomics, so the result is bitwise
reproducible for a given config.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels._common import F32, BlockConfig, ConvGeometry

_CONTRACT_ROWS = (((0,), (0,)), ((), ()))


def _dgrad_kernel(dy_ref, w_ref, o_ref, *, g: ConvGeometry, co: int, cfg: BlockConfig,
                  precision):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    r = cm.arange_block(0, bm)
    cols = cm.arange_block(1, bn)  # input channels
    r_ok, col_ok = r < g.m_in, cols < g.c
    n, ih, iw = cm.split_pixels(r, g.h, g.w)
    n_chunks = pl.cdiv(co, bk)

    def step(t, acc):
        tap, kc = cm.divmod_static(t, n_chunks)
        rows, ok = cm.output_rows(n, ih, iw, *cm.divmod_static(tap, g.kw), g)
        ok = ok & r_ok
        k = kc * bk + jnp.arange(bk)  # output channels
        k_ok = k < co
        d = cm.gather(dy_ref, rows[:, None], k[None, :], ok[:, None] & k_ok[None, :], 0.0)
        wt = cm.gather(w_ref, (tap * g.c + cols)[None, :], k[:, None],
                       k_ok[:, None] & col_ok[None, :], 0.0)
        return acc + jnp.dot(d, wt, preferred_element_type=F32, precision=precision)

    acc = lax.fori_loop(0, g.taps * n_chunks, step, jnp.zeros((bm, bn), F32))
    cm.store_block(o_ref, acc, r_ok, col_ok)


def phase_taps(k: int, s: int, d: int, pad: int):
    """Per phase ``p`` of ``s`` (input index ``% s``), the taps along one axis that reach
    inputs of that phase: ``(first, count)`` each, and the step between them.

    Tap ``i`` reaches input ``a * s + p`` when ``p + pad - i * d`` is a multiple of ``s``;
    those ``i`` step by ``s / gcd(s, d)``.
    """
    step = s // math.gcd(s, d)
    firsts, counts = [], []
    for p in range(s):
        taps = [i for i in range(k) if (p + pad - i * d) % s == 0]
        assert taps == list(range(taps[0], k, step)) if taps else True
        firsts.append(taps[0] if taps else 0)
        counts.append(len(taps))
    return firsts, counts, step


def _pick(index, values):
    """``values[index]`` for a traced scalar ``index`` and a short static list."""
    out = jnp.zeros_like(index)
    for v_i, v in enumerate(values):
        out = jnp.where(index == v_i, v, out)
    return out


def _dgrad_strided_kernel(dy_ref, w_ref, o_ref, *, g: ConvGeometry, co: int, cfg: BlockConfig,
                          precision):
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    first_h, count_h, step_h = phase_taps(g.kh, g.sh, g.dh, g.pt)
    first_w, count_w, step_w = phase_taps(g.kw, g.sw, g.dw, g.pl)
    ph, pw = cm.divmod_static(pl.program_id(2), g.sw)
    hp, wp = pl.cdiv(g.h, g.sh), pl.cdiv(g.w, g.sw)  # pixels per phase, at most
    q = cm.arange_block(0, bm)
    n, a, b = cm.split_pixels(q, hp, wp)
    ih, iw = a * g.sh + ph, b * g.sw + pw
    r_ok = (q < g.n * hp * wp) & (ih < g.h) & (iw < g.w)
    cols = cm.arange_block(1, bn)  # input channels
    col_ok = cols < g.c
    n_chunks = pl.cdiv(co, bk)
    taps_w = _pick(pw, count_w)
    i0, j0 = _pick(ph, first_h), _pick(pw, first_w)

    def step(t, acc):
        ki, rest = lax.div(t, taps_w * n_chunks), lax.rem(t, taps_w * n_chunks)
        kj, kc = cm.divmod_static(rest, n_chunks)
        i, j = i0 + ki * step_h, j0 + kj * step_w  # a tap whose offset the stride divides
        rows, ok = cm.output_rows(n, ih, iw, i, j, g)
        ok = ok & r_ok
        k = kc * bk + jnp.arange(bk)  # output channels
        k_ok = k < co
        d = cm.gather(dy_ref, rows[:, None], k[None, :], ok[:, None] & k_ok[None, :], 0.0)
        wt = cm.gather(w_ref, ((i * g.kw + j) * g.c + cols)[None, :], k[:, None],
                       k_ok[:, None] & col_ok[None, :], 0.0)
        return acc + jnp.dot(d, wt, preferred_element_type=F32, precision=precision)

    trips = _pick(ph, count_h) * taps_w * n_chunks  # 0 where no tap reaches the phase
    acc = lax.fori_loop(0, trips, step, jnp.zeros((bm, bn), F32))
    cm.scatter(o_ref, ((n * g.h + ih) * g.w + iw)[:, None], cols[None, :], acc,
               r_ok[:, None] & col_ok[None, :])


def conv_dgrad(dy, w, *, g: ConvGeometry, cfg: BlockConfig, interpret: bool, precision=None):
    """Gradient of the convolution with respect to its input.

    Arguments:
        dy: ``(N, H_out, W_out, C_out)`` output cotangent.
        w: ``(KH, KW, C_in, C_out)``, same dtype as ``dy``.

    Returns:
        ``(N, H, W, C_in)`` in ``dy.dtype``.
    """
    co = w.shape[3]
    ops = (dy.reshape(g.m_out, co), w.reshape(g.taps * g.c, co))
    if g.sh == g.sw == 1:
        kernel = functools.partial(_dgrad_kernel, g=g, co=co, cfg=cfg, precision=precision)
        grid = (pl.cdiv(g.m_in, cfg.block_m), pl.cdiv(g.c, cfg.block_n))
        out_spec = cm.block2d(cfg.block_m, cfg.block_n)
    else:  # a grid axis per phase; each program scatters its rows of one phase
        kernel = functools.partial(_dgrad_strided_kernel, g=g, co=co, cfg=cfg,
                                   precision=precision)
        per_phase = g.n * pl.cdiv(g.h, g.sh) * pl.cdiv(g.w, g.sw)
        grid = (pl.cdiv(per_phase, cfg.block_m), pl.cdiv(g.c, cfg.block_n), g.sh * g.sw)
        out_spec = cm.ANY
    dx = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g.m_in, g.c), dy.dtype),
        grid=grid,
        in_specs=[cm.ANY, cm.ANY],
        out_specs=out_spec,
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_conv_dgrad",
    )(*ops)
    return dx.reshape(g.n, g.h, g.w, g.c)


def _wgrad_kernel(*refs, g: ConvGeometry, co: int, cfg: BlockConfig, has_bn: bool,
                  precision):
    if has_bn:
        x_ref, dy_ref, s_ref, t_ref, o_ref = refs
    else:
        (x_ref, dy_ref, o_ref), s_ref, t_ref = refs, None, None
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tap = pl.program_id(0)
    k = cm.arange_block(1, bk)  # input channels
    cols = cm.arange_block(2, bn)  # output channels
    k_ok, col_ok = k < g.c, cols < co
    per_split = pl.cdiv(pl.cdiv(g.m_out, bm), cfg.split)
    first = pl.program_id(3) * per_split

    def step(q, acc):
        m = (first + q) * bm + jnp.arange(bm)
        m_ok = m < g.m_out
        n, oh, ow = cm.split_pixels(m, g.oh, g.ow)
        rows, a_mask = cm.tap_rows((n, oh, ow), tap, m_ok, k_ok, g)
        a = cm.gather(x_ref, rows[:, None], k[None, :], a_mask, 0.0)
        if has_bn:
            a = cm.bn_relu(a, s_ref, t_ref, k, k_ok, a_mask)
        d = cm.gather(dy_ref, m[:, None], cols[None, :], m_ok[:, None] & col_ok[None, :], 0.0)
        return acc + lax.dot_general(a.astype(d.dtype), d, _CONTRACT_ROWS,
                                     preferred_element_type=F32, precision=precision)

    acc = lax.fori_loop(0, per_split, step, jnp.zeros((bk, bn), F32))
    cm.store_block(o_ref, acc, k_ok, col_ok)


def conv_wgrad(x, dy, scale, shift, *, g: ConvGeometry, cfg: BlockConfig, interpret: bool,
               precision=None):
    """Gradient of the convolution with respect to its kernel.

    Arguments:
        x: ``(N, H, W, C_in)`` forward input.
        dy: ``(N, H_out, W_out, C_out)`` output cotangent.
        scale, shift: ``(C_in,)`` or None: the fused input BatchNorm + ReLU, so
            the gradient is taken against ``relu(x * scale + shift)``.

    Returns:
        ``(KH, KW, C_in, C_out)`` in float32 (the caller casts).
    """
    co = dy.shape[3]
    has_bn = scale is not None
    ops = [x.reshape(g.m_in, g.c), dy.reshape(g.m_out, co)]
    ops += [scale, shift] if has_bn else []
    kernel = functools.partial(_wgrad_kernel, g=g, co=co, cfg=cfg, has_bn=has_bn,
                               precision=precision)
    sq = pl.squeezed
    partials = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.split, g.taps, g.c, co), F32),
        grid=(g.taps, pl.cdiv(g.c, cfg.block_k), pl.cdiv(co, cfg.block_n), cfg.split),
        in_specs=[cm.ANY] * len(ops),
        out_specs=pl.BlockSpec((sq, sq, cfg.block_k, cfg.block_n),
                               lambda t, i, j, s: (s, t, i, j)),
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_conv_wgrad",
    )(*ops)
    return fixed_order_sum(partials).reshape(g.kh, g.kw, g.c, co)


def fixed_order_sum(partials):
    """``partials[0] + partials[1] + ...`` left to right (deterministic rounding)."""
    total = partials[0]
    for s in range(1, partials.shape[0]):
        total = total + partials[s]
    return total
