"""Normalisation ops: batch (inference and training forms), layer and group norm.

Statistics are computed in float32 (float64 for float64 inputs) whatever the
input dtype, and outputs come back in the input's dtype.  Variances are the
biased (population) ones, the ones used to normalise.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn.functional import _dispatch, _halo
from jaxcnn.functional._channels import channel_broadcast, channel_mean, channel_sum

#: The ways :func:`batch_norm_train` can be differentiated (``grad=``).
BATCH_NORM_GRADS = ("explicit", "autodiff", "closed_form")


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


def check_batch_norm_grad(op: str, grad: str) -> str:
    """Returns ``grad`` after checking it is ``"auto"`` or one of :data:`BATCH_NORM_GRADS`."""
    if grad != "auto" and grad not in BATCH_NORM_GRADS:
        raise ValueError(f"{op}: grad must be 'auto' or one of {BATCH_NORM_GRADS}, got {grad!r}")
    return grad


def resolve_batch_norm_grad(grad: str) -> str:
    """The form ``grad`` names: ``"auto"`` is ``"explicit"`` on the CPU and on a GPU, where
    it was measured faster (``docs/BENCHMARKS.md``: the 2-core CPU; an H200's ResNet-50 step
    in ``scripts/gpu_check.py``), and ``"autodiff"`` on other backends, which no one has
    measured."""
    check_batch_norm_grad("batch_norm_train", grad)
    if grad != "auto":
        return grad
    return "explicit" if jax.default_backend() in ("cpu", "gpu") else "autodiff"


def batch_norm_train(x, scale=None, bias=None, *, eps=1e-5, axis_name=None, grad="auto",
                     relu=False, impl="auto"):
    """Batch normalisation with the batch's own statistics (training form).

    The statistics are taken per channel over every axis but the last.  With
    ``axis_name`` (inside ``pmap``/``shard_map``/``vmap`` over that axis) they
    are the statistics of the global batch: the per-shard means are averaged
    with ``lax.pmean``, then so are the per-shard variances about the global
    mean (``var_i + (mean_i - mean)**2``).  Two small collectives instead of
    one, to avoid the cancellation of ``E[x**2] - E[x]**2``; every shard must
    hold the same number of elements.

    Three forms, the same function and gradients up to rounding (``grad``):

    * ``"explicit"``: the fewest passes over the activation
      (``docs/batch_norm.md``).  Forward: both statistics from one read of ``x``
      (sums about a per-channel shift), then one read and one write for
      ``y = x * a + c`` (``a``, ``c`` per channel).  Backward: one read of ``x`` and
      ``dy`` for the two sums ``Σ dy`` and ``Σ dy·x``, then one more of each and one
      write for ``dx``.  Both passes are custom VJPs on the shard's own data (the
      reductions XLA's or the kernels', ``impl``; under ``vmap`` XLA's); the
      per-channel arithmetic between them (the collectives included) is
      differentiated by JAX, so ``pmap``, ``shard_map`` (with or without
      ``check_vma``) and ``vmap``, differentiated inside or out, behave as with
      autodiff.  Only ``x`` is kept for the backward, in its own dtype.
    * ``"autodiff"``: the mean, then the variance about it (two reads), all by JAX.
    * ``"closed_form"``: the one-pass statistics with their closed-form VJP, the rest by JAX.

    ``"auto"`` is ``"explicit"`` on the CPU and GPUs and ``"autodiff"`` elsewhere
    (:func:`resolve_batch_norm_grad`); the older two forms stay for one release.

    Arguments:
        x: input ``(..., C)``, e.g. NHWC.
        scale, bias: optional per-channel affine parameters ``(C,)``.
        eps: added to the variance.
        axis_name: name of a mapped axis to synchronise statistics over, or
            ``None`` for local statistics.
        grad: ``"auto"``, ``"explicit"``, ``"autodiff"`` or ``"closed_form"``.
        relu: return ``max(y, 0)``: a ReLU that follows the normalisation, folded
            into it by ``"explicit"`` (its backward recomputes the mask from ``x``,
            so neither ``y`` nor a mask is kept or read); the other forms apply it
            after.
        impl: the explicit form's two reductions: ``"xla"``, ``"pallas"`` (the Mosaic
            GPU kernels of :mod:`pallas_kernels.mgpu_bn` on a Hopper GPU, else XLA) or
            ``"auto"`` (the kernels where a measured win is cached:
            :func:`~jaxcnn.functional._dispatch.batch_norm_kernels`; ``docs/batch_norm.md``).

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
    form, impl = resolve_batch_norm_grad(grad), _dispatch.check_impl(op, impl)
    kernels = _dispatch.batch_norm_kernels(impl, x, relu=relu) if form == "explicit" else (False, False)
    acc = _acc_dtype(x)
    if form in ("explicit", "closed_form"):
        mean, var = _moments(x, kernels[0])
    else:
        xa = x.astype(acc)
        mean = channel_mean(xa)
        var = channel_mean(jnp.square(xa - channel_broadcast(mean, x_shape)))
    if axis_name is not None:
        local_mean = mean
        mean = lax.pmean(local_mean, axis_name)
        var = lax.pmean(var + jnp.square(local_mean - mean), axis_name)
    factor = lax.rsqrt(var + eps)
    if form == "explicit":
        a = factor if scale is None else factor * scale.astype(acc)
        c = -mean * a if bias is None else bias.astype(acc) - mean * a
        return _affine_relu(x, *_varying_like(x, a, c), relu, kernels[1]), mean, var
    centred = x.astype(acc) - channel_broadcast(mean, x_shape)
    y = _scale_shift(centred, factor, scale, bias)
    if relu:
        y = jnp.maximum(y, 0)
    return y.astype(x.dtype), mean, var


# Rows averaged for the shift of the one-pass moments: enough that one outlying row
# cannot move it far from the mean, few enough to cost nothing next to the full pass.
SHIFT_ROWS = 256


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _moments(x, kernel=False):
    """Per-channel mean and biased variance of ``x`` ``(..., C)`` from one read of it, in
    float32 (float64 for float64 ``x``) whatever ``x``'s dtype.

    With ``kernel`` the Mosaic GPU kernel takes them (``mgpu_bn.channel_stats``: Welford's
    running sums per element position, merged by Chan's formula); otherwise:

    The sums are taken about a per-channel shift (the mean of the first
    :data:`SHIFT_ROWS` rows), which keeps ``E[d**2] - E[d]**2`` clear of
    cancellation unless those rows sit many standard deviations from the mean.
    The VJP is closed-form and elementwise: ``d mean / dx = 1 / n`` and
    ``d var / dx = 2 (x - mean) / n`` (the mean's own dependence on ``x`` cancels
    because the deviations sum to zero), so no reduction follows the variance's
    cotangent, as one would in autodiff of ``mean((x - mean(x))**2)``.  Only ``x``
    is kept for it, in its own dtype.
    """
    return _moments_fwd(x, kernel)[0]


def _moments_fwd(x, kernel=False):
    mean, var = _kernel_or_xla(_kernel_moments, _xla_moments)(x) if kernel else _xla_moments(x)
    return (mean, var), (x, mean)


def _xla_moments(x):
    shape, acc = x.shape, _acc_dtype(x)
    rows = x.reshape(-1, shape[-1])
    shift = lax.stop_gradient(jnp.mean(rows[:SHIFT_ROWS].astype(acc), axis=0))
    xa = x.astype(acc)
    m1 = channel_mean(xa) - shift  # the mean of d = x - shift, without storing d
    var = jnp.maximum(channel_mean(jnp.square(xa - channel_broadcast(shift, shape)))
                      - jnp.square(m1), 0.0)
    return shift + m1, var


def _moments_bwd(_, res, cts):
    x, mean = res
    dmean, dvar = cts
    shape = x.shape
    n = math.prod(shape[:-1])  # values per channel
    dx = (channel_broadcast(dmean / n, shape)
          + (x.astype(mean.dtype) - channel_broadcast(mean, shape))
          * channel_broadcast(2.0 * dvar / n, shape))
    return (dx.astype(x.dtype),)


_moments.defvjp(_moments_fwd, _moments_bwd)


def _varying(v) -> frozenset:
    """The mapped axes ``v`` varies over inside ``shard_map(check_vma=True)`` (else none)."""
    axis_type = getattr(jax.typeof(v), "manual_axis_type", None)
    return frozenset(getattr(axis_type, "varying", ()) or ())


def _varying_like(x, *vs):
    """``vs`` made to vary over every mapped axis ``x`` varies over (inside
    ``shard_map(check_vma=True)``), so that a custom VJP taking both may return
    their cotangents as per-device partial sums, whose transpose JAX then sums; a no-op
    elsewhere."""
    varying = _varying(x)
    if not varying:
        return vs
    return tuple(v if not (varying - _varying(v)) else
                 lax.pcast(v, tuple(sorted(varying - _varying(v))), to="varying") for v in vs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _affine_relu(x, a, c, relu, kernel=False):
    """``x * a + c`` per channel, then ``max(., 0)`` with ``relu``: one read of ``x`` and one
    write of the result, in ``x``'s dtype (computed in ``a``'s).  The VJP reads ``x`` and
    the output's cotangent twice: once for the two per-channel sums (the cotangents of
    ``a`` and ``c``, with the ReLU's mask recomputed from ``x``: :func:`affine_relu_sums`,
    the Mosaic GPU kernel's with ``kernel``), once for ``dx``."""
    return _affine_relu_fwd(x, a, c, relu, kernel)[0]


def _affine_relu_fwd(x, a, c, relu, kernel=False):
    z = x.astype(a.dtype) * channel_broadcast(a, x.shape) + channel_broadcast(c, x.shape)
    y = jnp.maximum(z, 0) if relu else z
    return y.astype(x.dtype), (x, a, c)


def _affine_relu_bwd(relu, kernel, res, dy):
    x, a, c = res
    g = _masked(dy, x, a, c, relu)
    da, dc = affine_relu_sums(dy, x, a, c, relu=relu, kernel=kernel)
    return (g * channel_broadcast(a, x.shape)).astype(x.dtype), da, dc


_affine_relu.defvjp(_affine_relu_fwd, _affine_relu_bwd)


def _masked(dy, x, a, c, relu):
    """``dy`` in ``a``'s dtype, zero where ``relu`` and ``x * a + c <= 0``."""
    g = dy.astype(a.dtype)
    if not relu:
        return g
    z = x.astype(a.dtype) * channel_broadcast(a, x.shape) + channel_broadcast(c, x.shape)
    return jnp.where(z > 0, g, jnp.zeros_like(g))


def affine_relu_sums(dy, x, a, c, *, relu, kernel):
    """``(Σ g·x, Σ g)`` per channel (the cotangents of ``a`` and ``c`` in the explicit
    form's backward), ``g = dy`` masked by ``x * a + c > 0`` with ``relu``: XLA's
    (:func:`channel_sum`) or, with ``kernel``, the Mosaic GPU kernel's
    (``mgpu_bn.channel_grad_sums`` about a zero mean with unit scale, which is
    ``Σ g·x``).  One read of ``dy`` and ``x`` either way."""
    xla = functools.partial(_xla_sums, relu=relu)
    if not kernel:
        return xla(dy, x, a, c)
    return _kernel_or_xla(functools.partial(_kernel_sums, relu=relu), xla)(dy, x, a, c)


def _xla_sums(dy, x, a, c, *, relu):
    g = _masked(dy, x, a, c, relu)
    return channel_sum(g * x.astype(a.dtype)), channel_sum(g)


def _kernel_sums(dy, x, a, c, *, relu):
    mgpu_bn, interpret = _mosaic_bn()
    zero = jnp.zeros_like(a)
    dc, da = mgpu_bn.channel_grad_sums(dy, x, zero, zero + 1, interpret=interpret,
                                       relu_affine=(a, c) if relu else None)
    # A kernel's outputs vary over no mapped axis (shard_map(check_vma=True)): cast them.
    return _varying_like(x, da.astype(a.dtype), dc.astype(a.dtype))


def _kernel_or_xla(kernel, xla):
    """``kernel`` (a function of arrays), except under ``vmap``, where the Mosaic GPU kernels
    cannot take part (a kernel would see one example): there ``xla``, the same function in
    XLA, vmapped over the batched arguments."""
    run = jax.custom_batching.custom_vmap(kernel)

    @run.def_vmap
    def _rule(axis_size, in_batched, *args):
        out = jax.vmap(xla, in_axes=[0 if b else None for b in in_batched],
                       axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)
    return run


def _kernel_moments(x):
    """``(mean, var)`` of ``x`` by ``mgpu_bn.channel_stats``."""
    mgpu_bn, interpret = _mosaic_bn()
    return _varying_like(x, *mgpu_bn.channel_stats(x, interpret=interpret))


def _mosaic_bn():
    """:mod:`pallas_kernels.mgpu_bn` (imported only where a kernel runs) and whether it runs
    in GPU interpret mode (off a GPU)."""
    from pallas_kernels import mgpu_bn
    return mgpu_bn, jax.default_backend() != "gpu"


def moments(x, *, kernel: bool = False):
    """The explicit form's statistics pass, ``(mean, biased var)`` of ``x`` ``(..., C)``:
    XLA's shifted one-pass sums, or with ``kernel`` the Mosaic GPU kernel's (what the GPU
    check races against each other)."""
    return _moments(x, kernel)


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
