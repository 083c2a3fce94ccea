"""Normalisation layers: :func:`BatchNorm`, :func:`LayerNorm`, :func:`GroupNorm`.

All three normalise in float32 under a precision policy (their kinds are in
``jaxcnn.precision.DEFAULT_FP32_KINDS``) and return the dtype their input came
in with; BatchNorm's running statistics are float32 state.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcnn import functional as F
from jaxcnn.layers._common import (cast_in, cast_out, check_min_rank, layer_impl, prod,
                                   whole_images_only)
from jaxcnn.layers.base import Layer, choices_or_default, leaf


_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _affine_params(channels: int):
    return {"scale": jnp.ones((channels,), jnp.float32),
            "bias": jnp.zeros((channels,), jnp.float32)}


def values_per_channel(name: str, x_shape, axis):
    """How many values per channel a training BatchNorm over ``x_shape`` normalises (the
    global batch's, over mapped ``axis``); fewer than 2 locally is a one-line error."""
    n = prod(x_shape[:-1])
    if axis is not None:
        return n * jax.lax.psum(1, axis)
    if n < 2:
        raise ValueError(f"{name}: expected more than 1 value per channel when training, "
                         f"got input shape {tuple(x_shape)}")
    return n


def running_stats(state, mean, var, n, momentum):
    """BatchNorm's new state after a training batch with statistics ``mean`` and biased
    ``var`` over ``n`` values per channel: PyTorch's update (``count += 1``; running
    ``(1 - m) * running + m * batch``, the variance unbiased by ``n / (n - 1)``, ``m`` the
    momentum or ``1 / count``)."""
    count = state["count"] + 1
    m = momentum if momentum is not None else 1.0 / count.astype(jnp.float32)
    unbiased = var.astype(jnp.float32) * (n / (n - 1))
    return {
        "mean": ((1 - m) * state["mean"] + m * mean.astype(jnp.float32)).astype(
            state["mean"].dtype),
        "var": ((1 - m) * state["var"] + m * unbiased).astype(state["var"].dtype),
        "count": count,
    }


def _batch_norm_apply(name, momentum, eps, axis_name, *, relu: bool):
    """BatchNorm's ``apply``; with ``relu`` also the ReLU that follows it, folded into the
    training form (``F.batch_norm_train(relu=True)``)."""
    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del rng
        in_dtype = x.dtype
        if not train:
            stats = (state["mean"], state["var"])
            x, (params, (mean, var)) = cast_in(policy, "batch_norm", x, (params, stats))
            y = F.batch_norm(x, mean, var, params["scale"], params["bias"], eps=eps)
            y = F.relu(y) if relu else y
            return cast_out(policy, "batch_norm", y, in_dtype), state
        choices = choices_or_default(choices)
        axis = axis_name if axis_name is not None else choices.axis_name
        if choices.height_axis is not None and choices.height_axis not in (
                axis if isinstance(axis, tuple) else (axis,)):
            whole_images_only(name, choices, f"takes its statistics over axis_name={axis!r} only")
        n = values_per_channel(name, x.shape, axis)
        cx, params = cast_in(policy, "batch_norm", x, params)
        if cx.dtype == jnp.float32 and x.dtype in _HALF:
            cx = x  # it computes in float32 whatever it is given: no float32 copy of x
        y, mean, var = F.batch_norm_train(cx, params["scale"], params["bias"], eps=eps,
                                          axis_name=axis, grad=choices.batch_norm_grad,
                                          relu=relu, impl=layer_impl(choices))
        new_state = running_stats(state, mean, var, n, momentum)
        return cast_out(policy, "batch_norm", y, in_dtype), new_state
    return apply


def with_relu(layer: Layer):
    """The ``apply`` of BatchNorm ``layer`` followed by a ReLU, the two as one (in training the
    ReLU's mask is recomputed inside BatchNorm's backward: no extra pass, nothing kept).
    The combinators call it for a ``batch_norm`` child followed by a ``relu`` one."""
    cfg = layer.config
    return _batch_norm_apply("BatchNorm", cfg["momentum"], cfg["eps"], cfg["axis_name"],
                             relu=True)


def BatchNorm(*, momentum: float | None = 0.1, eps: float = 1e-5, axis_name=None) -> Layer:
    """Batch normalisation over the last (channel) axis, like ``torch.nn.BatchNorm2d``.

    With ``train=True`` the batch statistics normalise ``x`` and update the
    running ones exactly as PyTorch does: ``count += 1`` and
    ``running = (1 - m) * running + m * batch`` where ``m = momentum`` (or
    ``1 / count``, a cumulative average, when ``momentum`` is None) and the
    variance folded in is the unbiased one, ``var * n / (n - 1)`` with ``n``
    the number of values per channel in the (global) batch. With
    ``train=False`` the running statistics normalise and the state is unchanged.

    Arguments:
        momentum: weight of the new batch in the running statistics, or None.
        eps: added to the variance before the square root.
        axis_name: name of a mapped axis (``pmap``/``shard_map``) over which the
            batch statistics are averaged, so that devices agree (SyncBatchNorm);
            None takes ``apply``'s ``choices.axis_name``, if any.

    ``apply``'s ``choices.batch_norm_grad`` picks the backward form (``F.batch_norm_train``'s
    ``grad``), and ``choices.impl`` where its explicit form's reductions run (its ``impl``).
    A 16-bit input under a policy that computes BatchNorm in float32 goes in as it is: the
    op computes in float32 and returns the input's dtype, as the cast would.

    Returns:
        A Layer of kind ``"batch_norm"``: input ``(N, ..., C)``, output of the same
        shape; params ``{"scale": (C,), "bias": (C,)}`` (ones, zeros); state
        ``{"mean": (C,), "var": (C,)}`` float32 (zeros, ones) and ``"count"``, an
        int32 scalar (``num_batches_tracked``).
    """
    name = "BatchNorm"
    if momentum is not None and not 0.0 <= momentum <= 1.0:
        raise ValueError(f"{name}: momentum must be in [0, 1] or None, got {momentum}")
    if eps <= 0:
        raise ValueError(f"{name}: eps must be > 0, got {eps}")

    def init(key, input_shape):
        del key
        check_min_rank(name, input_shape, 2)
        c = input_shape[-1]
        state = {"mean": jnp.zeros((c,), jnp.float32), "var": jnp.ones((c,), jnp.float32),
                 "count": jnp.zeros((), jnp.int32)}
        return _affine_params(c), state, tuple(input_shape)

    apply = _batch_norm_apply(name, momentum, eps, axis_name, relu=False)
    return leaf("batch_norm", init, apply, dict(momentum=momentum, eps=eps, axis_name=axis_name))


def LayerNorm(*, axes=-1, eps: float = 1e-5) -> Layer:
    """Layer normalisation over trailing axes, like ``torch.nn.LayerNorm``.

    Arguments:
        axes: an axis or a tuple of axes, which must be the trailing ones (as
            PyTorch's ``normalized_shape``); ``-1`` normalises each position's
            channels, ``(-3, -2, -1)`` a whole NHWC image.
        eps: added to the variance before the square root.

    Returns:
        A Layer of kind ``"layer_norm"``: output shape = input shape; params
        ``{"scale", "bias"}`` shaped like the normalised axes (ones, zeros).
    """
    name = "LayerNorm"
    axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
    if not axes_t or not all(isinstance(a, int) for a in axes_t):
        raise ValueError(f"{name}: axes must be an int or a non-empty tuple of ints, got {axes!r}")
    if eps <= 0:
        raise ValueError(f"{name}: eps must be > 0, got {eps}")

    def init(key, input_shape):
        del key
        rank = len(input_shape)
        check_min_rank(name, input_shape, len(axes_t) + 1)
        trailing = list(range(rank - len(axes_t), rank))
        if (not all(-rank <= a < rank for a in axes_t)
                or sorted(a % rank for a in axes_t) != trailing):
            raise ValueError(f"{name}: axes {axes!r} must be the trailing axes of the input "
                             f"(excluding the batch axis), input shape {tuple(input_shape)}")
        norm_shape = tuple(input_shape[rank - len(axes_t):])
        params = {"scale": jnp.ones(norm_shape, jnp.float32),
                  "bias": jnp.zeros(norm_shape, jnp.float32)}
        return params, {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        in_dtype = x.dtype
        if x.ndim - len(axes_t) < 2:  # it normalises over rows too
            whole_images_only(name, choices, f"normalises over axes {axes!r}, the rows among them")
        x, params = cast_in(policy, "layer_norm", x, params)
        axes_pos = tuple(range(x.ndim - len(axes_t), x.ndim))
        y = F.layer_norm(x, params["scale"], params["bias"], axes=axes_pos, eps=eps)
        return cast_out(policy, "layer_norm", y, in_dtype), state

    return leaf("layer_norm", init, apply, dict(axes=axes_t, eps=eps))


def GroupNorm(num_groups: int, *, eps: float = 1e-5) -> Layer:
    """Group normalisation, like ``torch.nn.GroupNorm``: channels are split into
    ``num_groups`` groups, each normalised over its channels and all spatial positions.

    Arguments:
        num_groups: number of groups; must divide the channel count.
        eps: added to the variance before the square root.

    Returns:
        A Layer of kind ``"group_norm"``: input ``(N, ..., C)``, output of the same
        shape; params ``{"scale": (C,), "bias": (C,)}`` (ones, zeros).
    """
    name = "GroupNorm"
    if num_groups < 1:
        raise ValueError(f"{name}: num_groups must be >= 1, got {num_groups}")
    if eps <= 0:
        raise ValueError(f"{name}: eps must be > 0, got {eps}")

    def init(key, input_shape):
        del key
        check_min_rank(name, input_shape, 2)
        if input_shape[-1] % num_groups:
            raise ValueError(f"{name}: num_groups={num_groups} must divide the channels of "
                             f"input shape {tuple(input_shape)}")
        return _affine_params(input_shape[-1]), {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        in_dtype = x.dtype
        x, params = cast_in(policy, "group_norm", x, params)
        y = F.group_norm(x, num_groups, params["scale"], params["bias"], eps=eps,
                         height_axis=choices_or_default(choices).height_axis)
        return cast_out(policy, "group_norm", y, in_dtype), state

    return leaf("group_norm", init, apply, dict(num_groups=num_groups, eps=eps))
