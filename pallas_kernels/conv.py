"""Implicit-GEMM forward kernel of a dense (groups=1) convolution.

The convolution is the GEMM ``Y[M, C_out] = X_col[M, KH*KW*C_in] @ W[KH*KW*C_in, C_out]``
with ``M = N * H_out * W_out``, but ``X_col`` (im2col) is never built: each
program owns a ``(block_m, block_n)`` tile of ``Y`` and, for every tap and
every ``block_k`` chunk of input channels, gathers the ``(block_m, block_k)``
input pixels that tap reads (zero where they fall in the padding or past the
channel tail) and multiplies them into a float32 accumulator.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common as cm
from pallas_kernels._common import F32, BlockConfig, ConvGeometry


def _forward_kernel(*refs, g: ConvGeometry, co: int, cfg: BlockConfig, has_bias: bool,
                    has_res: bool, has_bn: bool, relu: bool, precision, k_major: bool):
    refs = list(refs)
    x_ref, w_ref = refs.pop(0), refs.pop(0)
    b_ref = refs.pop(0) if has_bias else None
    r_ref = refs.pop(0) if has_res else None
    s_ref, t_ref = (refs.pop(0), refs.pop(0)) if has_bn else (None, None)
    (o_ref,) = refs
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    m = cm.arange_block(0, bm)
    cols = cm.arange_block(1, bn)
    m_ok, col_ok = m < g.m_out, cols < co
    n, oh, ow = cm.split_pixels(m, g.oh, g.ow)
    n_chunks = pl.cdiv(g.c, bk)

    def step(t, acc):
        tap, kc = cm.divmod_static(t, n_chunks)
        rows, ok = cm.input_rows(n, oh, ow, *cm.divmod_static(tap, g.kw), g)
        ok = ok & m_ok
        k = kc * bk + jnp.arange(bk)
        k_ok = k < g.c
        a_mask = ok[:, None] & k_ok[None, :]
        a = cm.gather(x_ref, rows[:, None], k[None, :], a_mask, 0.0)
        if has_bn:
            a = cm.bn_relu(a, s_ref, t_ref, k, k_ok, a_mask)
        b_mask = k_ok[:, None] & col_ok[None, :]
        if k_major:  # w_ref is (C_out, taps * C_in): contiguous along the reduction
            b = cm.gather(w_ref, cols[None, :], (tap * g.c + k)[:, None], b_mask, 0.0)
        else:
            b = cm.gather(w_ref, (tap * g.c + k)[:, None], cols[None, :], b_mask, 0.0)
        return acc + jnp.dot(a.astype(b.dtype), b, preferred_element_type=F32,
                             precision=precision)

    acc = lax.fori_loop(0, g.taps * n_chunks, step, jnp.zeros((bm, bn), F32))
    acc = cm.epilogue(acc, m, m_ok, cols, col_ok, b_ref, r_ref, relu)
    cm.store_block(o_ref, acc, m_ok, col_ok)


def conv_forward(x, w, b, residual, scale, shift, *, g: ConvGeometry, cfg: BlockConfig,
                 relu: bool, interpret: bool, precision=None):
    """Runs the forward kernel.

    Arguments:
        x: ``(N, H, W, C_in)``.
        w: ``(KH, KW, C_in, C_out)``.
        b: ``(C_out,)`` or None.
        residual: ``(N, H_out, W_out, C_out)`` or None, added before the ReLU.
        scale, shift: ``(C_in,)`` each, or None: the fused BatchNorm-apply +
            ReLU on the input, ``relu(x * scale + shift)``.
        g: the geometry; cfg: the tiles; relu: apply ReLU last.

    Returns:
        ``(N, H_out, W_out, C_out)`` in ``x.dtype``.
    """
    co = w.shape[3]
    # float32 dots run as TF32, whose tensor-core instructions want both operands
    # contiguous along the reduction: the weights go in transposed (a small XLA
    # transpose), or Triton copies them a word at a time. bfloat16 takes either.
    k_major = x.dtype == jnp.float32
    w2 = w.reshape(g.taps * g.c, co)
    ops = [x.reshape(g.m_in, g.c), w2.T if k_major else w2]
    if b is not None:
        ops.append(b)
    if residual is not None:
        ops.append(residual.reshape(g.m_out, co))
    has_bn = scale is not None
    if has_bn:
        ops += [scale, shift]
    kernel = functools.partial(
        _forward_kernel, g=g, co=co, cfg=cfg, has_bias=b is not None,
        has_res=residual is not None, has_bn=has_bn, relu=relu, precision=precision,
        k_major=k_major)
    y = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((g.m_out, co), x.dtype),
        grid=(pl.cdiv(g.m_out, cfg.block_m), pl.cdiv(co, cfg.block_n)),
        in_specs=[cm.ANY] * len(ops),
        out_specs=cm.block2d(cfg.block_m, cfg.block_n),
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name="jaxcnn_conv_fwd",
    )(*ops)
    return y.reshape(g.n, g.oh, g.ow, co)
