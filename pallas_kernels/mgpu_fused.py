"""BatchNorm fused into the Mosaic GPU (Hopper) convolution: statistics out, scale/shift in.

A ``Conv -> BatchNorm -> ReLU -> Conv`` chain in training reads and writes the
activation several times when each op runs alone: the convolution writes ``y``,
BatchNorm reads it for its statistics and again to normalise, writes the
normalised activation, and the next convolution reads that.  Here:

- the convolution's epilogue also writes BatchNorm's training statistics of
  its output (:func:`conv_bn_stats`: per-tile sums and centred sums of squares,
  combined in a fixed order into the batch mean and biased variance; see
  :func:`pallas_kernels.mgpu_conv.conv_forward`), so no statistics pass reads ``y``;
- the next convolution applies the folded BatchNorm and the ReLU to each input
  tile as it restages it for ``wgmma`` (:func:`bn_relu_conv`), zero padding
  applying to the normalised activation as in ``conv(relu(bn(y)))``, so the
  normalised activation is never written.

Both are one op, :func:`conv2d` (prologue and statistics may be combined: the
middle convolution of a ResNet bottleneck does both), a ``jax.custom_vjp``
whose gradients are the unfused chain's: the statistics' cotangents join the
output's (``dy + dmean / n + 2 dvar (y - mean) / n``, BatchNorm's closed-form
VJP), the convolution gradients are the Mosaic input- and weight-gradient
kernels (or XLA's, ``backward="xla"``), and the prologue's VJP is elementwise
in XLA (the weight gradient reads the re-materialised activation).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import mgpu_conv as mc
from pallas_kernels.fused import fold_batch_norm

F32 = jnp.float32
BACKWARDS = mc.BACKWARDS

__all__ = ["conv2d", "conv_bn_stats", "bn_relu_conv", "fold_batch_norm"]


def conv2d(x, w, b=None, *, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1),
           residual=None, relu=False, input_scale=None, input_shift=None, stats=False,
           backward="mosaic", config=None, interpret=False, detect_races=False):
    """``relu?(conv(x_in, w) + b + residual)`` with ``x_in = relu(x * input_scale +
    input_shift)`` (when given), and with ``stats`` the output's batch statistics.

    Arguments:
        x: ``(N, H, W, C_in)``; w: ``(KH, KW, C_in, C_out)``; bfloat16 or float16.
        b: optional ``(C_out,)``; residual: optional, the output's shape.
        stride, padding, dilation: ``(sh, sw)``, ``((top, bottom), (left, right))``,
            ``(dh, dw)``.
        relu: ReLU on the output (after bias and residual).
        input_scale, input_shift: optional ``(C_in,)`` float32, both or neither: a folded
            BatchNorm (:func:`fold_batch_norm`) and ReLU applied to the input in the
            kernel's prologue; padding is zeros of that activation.
        stats: also return ``(mean, var)``, ``(C_out,)`` float32 each: the per-channel
            mean and biased variance of the output as stored (what
            ``F.batch_norm_train`` computes from it), differentiable.
        backward: ``"mosaic"`` (input/weight-gradient kernels) or ``"xla"``.
        config: an :class:`~pallas_kernels.mgpu_conv.MgpuConfig` or a dict by part; a part
            not given takes its tuned tiles (the forward's keyed by its fused form:
            :func:`pallas_kernels.mgpu_conv.tuning_calls`), else the defaults.
        interpret, detect_races: Mosaic GPU interpret mode and its race detector.

    Returns:
        ``y`` (``(N, OH, OW, C_out)``, ``x``'s dtype), or ``(y, mean, var)`` with ``stats``.

    Raises:
        KernelUnsupported: for a call the kernels cannot run
            (:func:`pallas_kernels.mgpu_conv.check_supported`).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"Mosaic GPU fused conv2d: backward must be one of {BACKWARDS}, got "
                         f"{backward!r}")
    if (input_scale is None) != (input_shift is None):
        raise ValueError("Mosaic GPU fused conv2d: give both input_scale and input_shift, "
                         "or neither")
    pads = tuple(tuple(int(p) for p in pair) for pair in padding)
    dilation = tuple(int(d) for d in dilation)
    stride = tuple(int(v) for v in stride)
    mc.check_supported(x.shape, w.shape, x.dtype, stride=stride, pads=pads)
    cfgs = mc.part_configs("Mosaic GPU fused conv2d", config, mc.tuning_calls(
        x.shape, w.shape, x.dtype, stride=stride, pads=pads, dilation=dilation,
        bias=b is not None, residual=residual is not None, prologue=input_scale is not None,
        stats=stats))
    static = (stride, pads, dilation, bool(relu), bool(stats), backward, cfgs,
              bool(interpret), bool(detect_races))
    return _op(static, x, w, b, residual, input_scale, input_shift)


def conv_bn_stats(x, w, b=None, **kwargs):
    """``(y, mean, var)``: :func:`conv2d` with ``stats=True`` (its keywords)."""
    return conv2d(x, w, b, stats=True, **kwargs)


def bn_relu_conv(x, w, b=None, *, scale, shift, **kwargs):
    """``conv(relu(x * scale + shift), w) + b``: :func:`conv2d` with the input prologue."""
    return conv2d(x, w, b, input_scale=scale, input_shift=shift, **kwargs)


def _forward(static, x, w, b, residual, scale, shift):
    stride, pads, dilation, relu, stats, _, (cfg, _, _), interpret, races = static
    return mc.conv_forward(x, w, b, residual, relu=relu, stride=stride, pads=pads,
                           dilation=dilation, config=cfg, interpret=interpret,
                           detect_races=races, input_scale=scale, input_shift=shift,
                           stats=stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _op(static, x, w, b, residual, scale, shift):
    return _forward(static, x, w, b, residual, scale, shift)


def _op_fwd(static, x, w, b, residual, scale, shift):
    out = _forward(static, x, w, b, residual, scale, shift)
    relu, stats = static[3], static[4]
    y = out[0] if stats else out
    keep_y = y if (relu or stats) else None
    mean = out[1] if stats else None
    return out, (x, w, b, residual, scale, shift, keep_y, mean)


def _op_bwd(static, saved, ct):
    stride, pads, dilation, relu, stats, backward, (_, cfg_d, cfg_w), interpret, races = static
    x, w, b, residual, scale, shift, y, mean = saved
    if stats:
        dy, dmean, dvar = ct
        n = y.shape[0] * y.shape[1] * y.shape[2]
        # BatchNorm's statistics' VJP, closed form: d mean/dy = 1/n, d var/dy = 2(y - mean)/n.
        g = (dy.astype(F32) + dmean / n
             + (2.0 / n) * dvar * (y.astype(F32) - mean))
    else:
        g = ct.astype(F32)
    if relu:
        g = jnp.where(y > 0, g, 0.0)
    db = None if b is None else jnp.sum(g, axis=(0, 1, 2)).astype(b.dtype)
    dres = None if residual is None else g.astype(residual.dtype)
    x_in = x if scale is None else _bn_relu(x, scale, shift).astype(x.dtype)
    dx, dw = mc.input_and_weight_grads(x_in, w, g.astype(x.dtype), stride=stride, pads=pads,
                                       dilation=dilation, backward=backward,
                                       configs=(cfg_d, cfg_w), interpret=interpret,
                                       detect_races=races)
    if scale is None:
        return dx, dw, db, dres, None, None
    # Through relu(x * scale + shift), elementwise (XLA fuses it with its reductions).
    dpre = jnp.where(_bn_relu(x, scale, shift) > 0, dx.astype(F32), 0.0)
    dscale = jnp.sum(dpre * x.astype(F32), axis=(0, 1, 2)).astype(scale.dtype)
    dshift = jnp.sum(dpre, axis=(0, 1, 2)).astype(shift.dtype)
    return (dpre * scale.astype(F32)).astype(x.dtype), dw, db, dres, dscale, dshift


def _bn_relu(x, scale, shift):
    return jnp.maximum(x.astype(F32) * scale.astype(F32) + shift.astype(F32), 0.0)


_op.defvjp(_op_fwd, _op_bwd)
