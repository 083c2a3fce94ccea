"""BatchNorm-apply + ReLU fused into the convolution's input load.

``conv(relu(batch_norm(x)))`` normally reads ``x``, writes the normalised
activation, and reads it again in the convolution.  Here the convolution
kernels apply ``relu(x * scale + shift)`` (per input channel) to each tile
as they load it, so the activation is read once and never written.  Padding
is applied after the BatchNorm and ReLU: padded positions are zeros of the
normalised activation, exactly as in the unfused ``conv2d(relu(bn(x)))``.

Two forms: :func:`bn_relu_conv2d` takes the folded inference ``scale`` and
``shift``; :func:`bn_relu_conv2d_train` takes the batch mean and variance
(and optional affine parameters) and folds them itself, so gradients flow
to all of them (and to ``x`` through the mean/var if the caller computed
them from ``x``).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_kernels.conv_op import conv2d


def fold_batch_norm(mean, var, gamma=None, beta=None, *, eps=1e-5):
    """Per-channel ``(scale, shift)`` with ``bn(x) = x * scale + shift``.

    Arguments:
        mean, var: ``(C,)`` statistics (running ones for inference, the batch's
            biased variance for training).
        gamma, beta: optional ``(C,)`` affine weight and bias.
        eps: added to the variance.

    Returns:
        ``(scale, shift)``, each ``(C,)`` in float32.
    """
    scale = lax.rsqrt(jnp.asarray(var, jnp.float32) + eps)
    if gamma is not None:
        scale = scale * jnp.asarray(gamma, jnp.float32)
    shift = -jnp.asarray(mean, jnp.float32) * scale
    if beta is not None:
        shift = shift + jnp.asarray(beta, jnp.float32)
    return scale, shift


def bn_relu_conv2d(x, w, b=None, *, scale, shift, **conv_kwargs):
    """``conv2d(relu(x * scale + shift), w, b, ...)`` reading ``x`` once (inference form).

    Arguments:
        x: ``(N, H, W, C_in)``.
        w: ``(KH, KW, C_in // groups, C_out)``.
        b: optional ``(C_out,)``.
        scale, shift: ``(C_in,)`` folded BatchNorm (see :func:`fold_batch_norm`).
        **conv_kwargs: any keyword of :func:`pallas_kernels.conv2d` (stride,
            padding, dilation, groups, residual, relu, backward, config, ...).

    Returns:
        ``(N, H_out, W_out, C_out)`` in ``x.dtype``.
    """
    return conv2d(x, w, b, input_scale=scale, input_shift=shift, **conv_kwargs)


def bn_relu_conv2d_train(x, w, b=None, *, mean, var, gamma=None, beta=None, eps=1e-5,
                         **conv_kwargs):
    """``conv2d(relu(batch_norm(x, mean, var, gamma, beta)), w, b, ...)``, training form.

    Arguments:
        x: ``(N, H, W, C_in)``.
        w, b: as in :func:`bn_relu_conv2d`.
        mean, var: ``(C_in,)`` batch statistics (biased variance), e.g. from
            :func:`jaxcnn.functional.batch_norm_train`; differentiable.
        gamma, beta: optional ``(C_in,)`` affine parameters.
        eps: added to the variance.
        **conv_kwargs: as in :func:`bn_relu_conv2d`.

    Returns:
        ``(N, H_out, W_out, C_out)`` in ``x.dtype``.
    """
    scale, shift = fold_batch_norm(mean, var, gamma, beta, eps=eps)
    return conv2d(x, w, b, input_scale=scale, input_shift=shift, **conv_kwargs)
