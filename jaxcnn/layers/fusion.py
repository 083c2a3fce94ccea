"""``Conv -> BatchNorm [-> ReLU] -> Conv`` chains run as fused convolutions (training).

:func:`serial` and :func:`residual` (the main branch) hand their children to
:func:`apply_chain` when ``choices.conv_bn`` may fuse (:func:`active`).  Walking the
children in order, a ``conv2d`` followed by a ``batch_norm`` runs as one convolution
that also returns its output's batch mean and variance (the kernel's epilogue), from
which the BatchNorm's folded scale/shift and its running statistics are computed
(exactly as :func:`jaxcnn.layers.BatchNorm` does, SyncBatchNorm's collectives
included); the normalisation is not applied yet.  A ``relu`` after it is noted too.
When the next child is a ``conv2d`` it gets the pending BatchNorm + ReLU as its input
prologue (and the statistics of its own output if a BatchNorm follows); anything else
gets the activation materialised first, as the unfused chain computes it.  So a ResNet
bottleneck reads each activation once per convolution, with no BatchNorm statistics or
apply pass of its own, except where a block ends (the residual add).

Whether a convolution runs fused is :func:`jaxcnn.functional.conv_bn.use_fusion`'s
lookup (16-bit dense convolutions the Mosaic GPU kernels support, under a policy that
computes convolutions in bfloat16/float16); where it says no, the children run as
they would unfused.  Values and gradients are the unfused chain's up to rounding
(``tests/layers/test_conv_bn_fusion.py``).  In inference BatchNorm uses its running
statistics and nothing is fused.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn.functional import _dispatch
from jaxcnn.functional import conv_bn as fcb
from jaxcnn.layers._common import cast_in
from jaxcnn.layers.base import choices_or_default
from jaxcnn.layers.norm import running_stats, values_per_channel

F32 = jnp.float32


class _Pending(NamedTuple):
    """A BatchNorm (+ ReLU) not yet applied to a convolution's output ``y``."""
    y: jax.Array
    scale: jax.Array  # (C,) float32: gamma / sqrt(var + eps)
    shift: jax.Array  # (C,) float32: beta - mean * scale
    relu: bool


def has_chain(children) -> bool:
    """Whether ``children`` (``(name, Layer)`` pairs) hold a ``Conv -> BatchNorm`` chain, the
    only place a fusion can start: combinators check it once, when they are built."""
    return any(a.kind == "conv2d" and b.kind == "batch_norm"
               for (_, a), (_, b) in zip(children, children[1:]))


def active(choices, train: bool) -> bool:
    """Whether a combinator with a chain (:func:`has_chain`) should walk its children through
    :func:`apply_chain`: in training, with ``conv_bn="mosaic"``, or with ``"auto"`` on a GPU
    whose autotune cache holds a measured win of a fused call (none: the walk is skipped)."""
    fusion = choices_or_default(choices).conv_bn
    if not train or fusion == "off":
        return False
    if fusion == "mosaic":
        return True
    if _dispatch._platform() != "gpu":
        return False
    from jaxcnn.functional.conv_bn import TUNED_OP
    from pallas_kernels import autotune
    return autotune.any_win(TUNED_OP)


def apply_chain(children, rngs, params, state, x, *, train, policy, choices, new_state,
                apply_child):
    """Applies ``children`` (``(name, Layer)`` pairs) in order like a serial combinator,
    fusing ``Conv -> BatchNorm [-> ReLU]`` chains; ``apply_child`` runs one child unfused
    (the combinators' own).  Returns the output; BatchNorm states go into ``new_state``."""
    choices = choices_or_default(choices)
    pending = None
    i, n = 0, len(children)
    while i < n:
        name, layer = children[i]
        if layer.kind == "conv2d":
            if pending is not None and not pending.relu:  # no prologue without the ReLU
                x, pending = _materialise(pending), None
            bn = children[i + 1] if i + 1 < n and children[i + 1][1].kind == "batch_norm" \
                else None
            fused = _fused_conv(name, layer, bn, params, state, x, pending, policy, choices,
                                new_state)
            if fused is not None:
                x, pending = fused
                i += 2 if bn is not None else 1
                if pending is not None and i < n and children[i][1].kind == "relu":
                    pending, i = pending._replace(relu=True), i + 1
                continue
        if pending is not None:
            x, pending = _materialise(pending), None
        x = apply_child(name, layer, rngs[i], params, state, x, train, policy, choices,
                        new_state)
        i += 1
    return x if pending is None else _materialise(pending)


def _fused_conv(name, layer, bn, params, state, x, pending, policy, choices, new_state):
    """``(output, None)`` or ``(None, pending BatchNorm)`` of the fused convolution, or None
    where it does not run fused."""
    cfg = layer.config
    src = x if pending is None else pending.y
    xc, p = cast_in(policy, "conv2d", src, params.get(name, {}))
    kw = dict(stride=cfg["stride"], padding=cfg["padding"], dilation=cfg["dilation"])
    prologue, stats = pending is not None, bn is not None
    if not fcb.use_fusion(choices.conv_bn, xc, p["w"], groups=cfg["groups"], prologue=prologue,
                          stats=stats, **kw):
        return None
    out = fcb.conv2d_bn(xc, p["w"], p.get("b"), **kw, stats=stats,
                        input_scale=pending.scale if prologue else None,
                        input_shift=pending.shift if prologue else None)
    if not stats:
        return out, None
    y, mean, var = out
    bn_name, bn_layer = bn
    scale, shift, bn_state = _batch_norm(bn_layer, params.get(bn_name, {}), state[bn_name],
                                         y.shape, mean, var, choices)
    new_state[bn_name] = bn_state
    return None, _Pending(y, scale, shift, relu=False)


def _batch_norm(layer, params, state, y_shape, mean, var, choices):
    """Folded ``(scale, shift)`` and the new state of BatchNorm ``layer`` given the batch
    statistics of its input (local ones: synced over the axis here, as the layer does)."""
    cfg = layer.config
    axis = cfg["axis_name"] if cfg["axis_name"] is not None else choices.axis_name
    n = values_per_channel("BatchNorm", y_shape, axis)
    if axis is not None:  # F.batch_norm_train's combination of per-device statistics
        local_mean = mean
        mean = lax.pmean(local_mean, axis)
        var = lax.pmean(var + jnp.square(local_mean - mean), axis)
    scale = lax.rsqrt(var + cfg["eps"]) * params["scale"].astype(F32)
    shift = params["bias"].astype(F32) - mean * scale
    return scale, shift, running_stats(state, mean, var, n, cfg["momentum"])


def _materialise(p: _Pending):
    """The BatchNorm (+ ReLU) output the unfused layers would have produced."""
    a = p.y.astype(F32) * p.scale + p.shift
    if p.relu:
        a = jnp.maximum(a, 0.0)
    return a.astype(p.y.dtype)
