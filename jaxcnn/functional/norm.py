"""Normalisation ops: batch (inference and training forms), layer and group norm.

Statistics are computed in float32 (float64 for float64 inputs) whatever the
input dtype, and outputs come back in the input's dtype.  Variances are the
biased (population) ones, the ones used to normalise.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn.functional import _halo
from jaxcnn.functional._channels import channel_broadcast, channel_mean

#: The ways :func:`batch_norm_train` can be differentiated (``grad=``).
BATCH_NORM_GRADS = ("autodiff", "closed_form")


def _acc_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


def _check_channel_vector(op: str, name: str, v, channels: int, x_shape) -> None:
    if v is not None and tuple(jnp.shape(v)) != (channels,):
        raise ValueError(
            f"{op}: {name} must have shape ({channels},) for x shape {tuple(x_shape)}, "
            f"got {tuple(jnp.shape(v))}")


def _affine(y, scale, bias):
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias
    return y


def batch_norm(x, mean, var, scale=None, bias=None, *, eps=1e-5):
    """Batch normalisation with given statistics (inference form), over the last axis.

    ``y = (x - mean) / sqrt(var + eps) * scale + bias``.

    Arguments:
        x: input ``(..., C)``, e.g. NHWC.
        mean, var: per-channel statistics ``(C,)``.
        scale, bias: optional per-channel affine parameters ``(C,)``.
        eps: added to the variance.

    Returns:
        Same shape and dtype as ``x``.
    """
    op = "batch_norm"
    x_shape = tuple(jnp.shape(x))
    if not x_shape:
        raise ValueError(f"{op}: x must have a channel axis, got shape {x_shape}")
    for name, v in (("mean", mean), ("var", var), ("scale", scale), ("bias", bias)):
        _check_channel_vector(op, name, v, x_shape[-1], x_shape)
    acc = _acc_dtype(x)
    centred = x.astype(acc) - channel_broadcast(jnp.asarray(mean, acc), x_shape)
    return _scale_shift(centred, lax.rsqrt(jnp.asarray(var, acc) + eps), scale, bias).astype(x.dtype)


def _scale_shift(centred, factor, scale, bias):
    """``centred * factor * scale + bias`` with per-channel ``factor``, ``scale`` and ``bias``.

    The per-channel vectors are combined first and broadcast with ``channel_broadcast``,
    so their gradients are the fast per-channel reductions (see ``_cpu_lowering``).
    """
    if scale is not None:
        factor = factor * scale
    y = centred * channel_broadcast(factor.astype(centred.dtype), centred.shape)
    return y if bias is None else y + channel_broadcast(bias.astype(centred.dtype), centred.shape)


def default_batch_norm_grad(grad: str):
    """Removed: a scope read while tracing could not reach a cached ``jax.jit`` trace.

    Pass the form instead: ``batch_norm_train(..., grad=)``, or for a model
    ``apply(..., choices=Choices(batch_norm_grad=))`` /
    ``make_train_step(..., batch_norm_grad=)``.
    """
    raise RuntimeError(
        "F.default_batch_norm_grad was removed: a cached jax.jit trace ignored it. Pass the form "
        "as an argument: F.batch_norm_train(..., grad=...), model.apply(..., "
        "choices=jaxcnn.layers.Choices(batch_norm_grad=...)) or make_train_step(..., "
        "batch_norm_grad=...)")


def check_batch_norm_grad(op: str, grad: str) -> str:
    """Returns ``grad`` after checking it is ``"auto"`` or one of :data:`BATCH_NORM_GRADS`."""
    if grad != "auto" and grad not in BATCH_NORM_GRADS:
        raise ValueError(f"{op}: grad must be 'auto' or one of {BATCH_NORM_GRADS}, got {grad!r}")
    return grad


def batch_norm_train(x, scale=None, bias=None, *, eps=1e-5, axis_name=None, grad="auto"):
    """Batch normalisation with the batch's own statistics (training form).

    The statistics are taken per channel over every axis but the last.  With
    ``axis_name`` (inside ``pmap``/``shard_map``/``vmap`` over that axis) they
    are the statistics of the global batch: the per-shard means are averaged
    with ``lax.pmean``, then so are the per-shard variances about the global
    mean (``var_i + (mean_i - mean)**2``).  Two small collectives instead of
    one, to avoid the cancellation of ``E[x**2] - E[x]**2``; every shard must
    hold the same number of elements.

    Two forms, the same function and gradients up to rounding (``grad``):

    * ``"autodiff"``: the mean, then the variance about it (two reads of ``x``),
      all differentiated by JAX.  The variance's cotangent reaches ``x`` through
      the centring, whose gradient is another reduction, so the backward reduces
      twice in sequence before its elementwise pass.
    * ``"closed_form"``: both statistics in one read of ``x`` (:func:`_moments`,
      sums about a per-channel shift), whose VJP is the closed-form, elementwise
      ``dmean / n + 2 dvar (x - mean) / n``.  The rest (normalising, the affine,
      the cross-device combination) is differentiated by JAX as above, so its
      reductions (of ``dy`` and ``dy * (x - mean)``, the parameters' gradients
      among them) all read the same arrays and fuse into one pass on a GPU,
      followed by one elementwise pass.  Collectives stay outside the custom VJP:
      ``pmap``, ``shard_map`` (with or without ``check_vma``) and ``vmap``,
      differentiated inside or out, behave as with autodiff.

    ``"auto"`` is ``"autodiff"``: the closed form has not yet been timed on a
    GPU, and on the 2-core CPU of ``docs/BENCHMARKS.md`` it was no faster.

    Arguments:
        x: input ``(..., C)``, e.g. NHWC.
        scale, bias: optional per-channel affine parameters ``(C,)``.
        eps: added to the variance.
        axis_name: name of a mapped axis to synchronise statistics over, or
            ``None`` for local statistics.
        grad: ``"auto"``, ``"autodiff"`` or ``"closed_form"``.

    Returns:
        ``(y, mean, var)``: ``y`` like ``x``; ``mean`` and ``var`` of shape
        ``(C,)`` in float32 (float64 for float64 inputs), ``var`` biased.
    """
    op = "batch_norm_train"
    x_shape = tuple(jnp.shape(x))
    if len(x_shape) < 2:
        raise ValueError(f"{op}: x must have rank >= 2 (batch..., C), got shape {x_shape}")
    for name, v in (("scale", scale), ("bias", bias)):
        _check_channel_vector(op, name, v, x_shape[-1], x_shape)
    check_batch_norm_grad(op, grad)
    xa = x.astype(_acc_dtype(x))
    if grad == "closed_form":
        mean, var = _moments(xa)
    else:
        mean = channel_mean(xa)
        var = channel_mean(jnp.square(xa - channel_broadcast(mean, x_shape)))
    if axis_name is not None:
        local_mean = mean
        mean = lax.pmean(local_mean, axis_name)
        var = lax.pmean(var + jnp.square(local_mean - mean), axis_name)
    centred = xa - channel_broadcast(mean, x_shape)
    y = _scale_shift(centred, lax.rsqrt(var + eps), scale, bias)
    return y.astype(x.dtype), mean, var


# Rows averaged for the shift of the one-pass moments: enough that one outlying row
# cannot move it far from the mean, few enough to cost nothing next to the full pass.
SHIFT_ROWS = 256


@jax.custom_vjp
def _moments(xa):
    """Per-channel mean and biased variance of ``xa`` ``(..., C)`` from one read of it.

    The sums are taken about a per-channel shift (the mean of the first
    :data:`SHIFT_ROWS` rows), which keeps ``E[d**2] - E[d]**2`` clear of
    cancellation unless those rows sit many standard deviations from the mean.
    The VJP is closed-form and elementwise: ``d mean / dx = 1 / n`` and
    ``d var / dx = 2 (x - mean) / n`` (the mean's own dependence on ``x`` cancels
    because the deviations sum to zero), so no reduction follows the variance's
    cotangent, as one would in autodiff of ``mean((x - mean(x))**2)``.
    """
    return _moments_fwd(xa)[0]


def _moments_fwd(xa):
    shape = xa.shape
    rows = xa.reshape(-1, shape[-1])
    shift = lax.stop_gradient(jnp.mean(rows[:SHIFT_ROWS], axis=0))
    d = xa - channel_broadcast(shift, shape)
    m1 = channel_mean(d)
    var = jnp.maximum(channel_mean(jnp.square(d)) - jnp.square(m1), 0.0)
    mean = shift + m1
    return (mean, var), (xa, mean)


def _moments_bwd(res, cts):
    xa, mean = res
    dmean, dvar = cts
    shape = xa.shape
    n = math.prod(shape[:-1])  # values per channel
    return (channel_broadcast(dmean / n, shape)
            + (xa - channel_broadcast(mean, shape)) * channel_broadcast(2.0 * dvar / n, shape),)


_moments.defvjp(_moments_fwd, _moments_bwd)


def layer_norm(x, scale=None, bias=None, *, axes=-1, eps=1e-5):
    """Layer normalisation over ``axes`` (PyTorch ``LayerNorm`` when they are trailing).

    Arguments:
        x: input of any rank.
        scale, bias: optional affine parameters shaped like the normalised axes,
            ``tuple(x.shape[a] for a in sorted(axes))``.
        axes: int or tuple of ints, the axes to normalise over.
        eps: added to the variance.

    Returns:
        Same shape and dtype as ``x``.
    """
    op = "layer_norm"
    x_shape = tuple(jnp.shape(x))
    axes = (axes,) if isinstance(axes, int) else tuple(axes)
    if not axes or any(not -len(x_shape) <= a < len(x_shape) for a in axes):
        raise ValueError(f"{op}: axes {axes} out of range for x shape {x_shape}")
    axes = tuple(sorted({a % len(x_shape) for a in axes}))
    param_shape = tuple(x_shape[a] for a in axes)
    bshape = tuple(n if i in axes else 1 for i, n in enumerate(x_shape))
    for name, v in (("scale", scale), ("bias", bias)):
        if v is not None and tuple(jnp.shape(v)) != param_shape:
            raise ValueError(
                f"{op}: {name} must have shape {param_shape} for x shape {x_shape} and "
                f"axes {axes}, got {tuple(jnp.shape(v))}")
    xa = x.astype(_acc_dtype(x))
    mean = jnp.mean(xa, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xa - mean), axis=axes, keepdims=True)
    y = (xa - mean) * lax.rsqrt(var + eps)
    y = _affine(y, None if scale is None else scale.reshape(bshape),
                None if bias is None else bias.reshape(bshape))
    return y.astype(x.dtype)


def group_norm(x, num_groups, scale=None, bias=None, *, eps=1e-5, height_axis=None):
    """Group normalisation (PyTorch ``GroupNorm``), channels last.

    Channel ``c`` belongs to group ``c // (C // num_groups)``; each sample's
    group is normalised over its channels and all spatial positions.

    Arguments:
        x: input ``(N, ..., C)``, e.g. NHWC.
        num_groups: number of groups; divides ``C``.
        scale, bias: optional per-channel affine parameters ``(C,)``.
        eps: added to the variance.
        height_axis: the name of a mapped axis over which each image's rows are split
            in equal blocks (as for :func:`jaxcnn.functional.conv2d`): the statistics
            are then the whole image's (``pmean`` over it).

    Returns:
        Same shape and dtype as ``x``.
    """
    op = "group_norm"
    x_shape = tuple(jnp.shape(x))
    if len(x_shape) < 2:
        raise ValueError(f"{op}: x must have rank >= 2 (N, ..., C), got shape {x_shape}")
    c = x_shape[-1]
    if not geo.is_int(num_groups) or num_groups < 1 or c % num_groups:
        raise ValueError(
            f"{op}: num_groups={num_groups!r} must be a positive int dividing the "
            f"{c} channels of x shape {x_shape}")
    for name, v in (("scale", scale), ("bias", bias)):
        _check_channel_vector(op, name, v, c, x_shape)
    xg = x.astype(_acc_dtype(x)).reshape(*x_shape[:-1], num_groups, c // num_groups)
    axes = tuple(range(1, len(x_shape) - 1)) + (len(x_shape),)
    mean, var = _halo.group_moments(xg, axes, height_axis)
    y = ((xg - mean) * lax.rsqrt(var + eps)).reshape(x_shape)
    return _affine(y, scale, bias).astype(x.dtype)
