"""Per-channel reductions and broadcasts over NHWC (``(..., C)``) arrays.

BatchNorm's statistics and backward sums, every bias and scale gradient, and the bias add
of the convolutions go through these functions.  Off the CPU, and where nothing is gained,
they are ``jnp.sum``/``jnp.mean``/``jnp.broadcast_to``.

On the CPU a per-channel sum is a matrix-vector product: the ``(..., W, C)`` array, its
width folded into the channels (``(..., W / g, g * C)``, up to :data:`WIDE_LANES` lanes), is
contracted with ones over every axis but the last (``lax.dot_general``), then summed over
the ``g`` groups.  XLA:CPU runs that as one streaming read (a GEMV), where its own reduction
of the same array over several major axes is many times slower (``docs/BENCHMARKS.md``,
"Training BatchNorm"), and the SPMD partitioner splits a contraction over a sharded
axis into local products and an all-reduce, so a height- or batch-split activation is
reduced where it lies.  Reverse mode through :func:`channel_broadcast` (a broadcast
parameter's gradient) still reduces the folded array XLA's way: code that needs the fast
sum in a backward pass calls :func:`channel_sum` there (BatchNorm's custom VJPs do).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Per-channel reductions over (N, H, W) with few channels are XLA:CPU's slow case: it
# reduces the major axes of an (N*H*W, C) array with C lanes, several times slower than
# once rows are folded into the minor axis (docs/BENCHMARKS.md, "Per-channel reductions").
WIDE_LANES = 1024


def _fold(shape) -> int:
    """How many entries of ``shape``'s second-to-last axis (an image's width) to fold into
    the minor axis, or 0 for XLA's own form (not on a CPU, symbolic dimensions, or nothing
    to gain).

    Only the two minor axes are merged (``(..., W, C) -> (..., W / g, g * C)``), never the
    batch or the height, so an array split along those (data parallelism, spatial
    partitioning) is reshaped where it lies: merging every row into one axis would make XLA's
    partitioner gather a height-split activation around each reduction.
    """
    if jax.default_backend() != "cpu" or len(shape) < 2:
        return 0
    if not all(isinstance(d, int) for d in shape):
        return 0
    c, width = shape[-1], shape[-2]
    if int(np.prod(shape[:-1])) < 2 or c == 0 or 2 * c > WIDE_LANES:
        return 0
    g = max(g for g in range(1, WIDE_LANES // c + 1) if width % g == 0)
    return g if g > 1 else 0


def _folded(shape, g: int):
    """``shape`` with ``g`` entries of its width folded into the channels."""
    return (*shape[:-2], shape[-2] // g, g * shape[-1])


def channel_sum(x):
    """Sum over every axis but the last: ``(..., C) -> (C,)``, in ``x``'s dtype.

    On the CPU the ``(..., W, C)`` array is folded to ``(..., W / g, g * C)`` with up to
    :data:`WIDE_LANES` lanes, contracted with ones over every axis but the last, then
    summed over the ``g`` groups (module docstring).
    """
    shape = tuple(jnp.shape(x))
    g = _fold(shape)
    if not g:
        return jnp.sum(x, axis=tuple(range(len(shape) - 1)))
    c = shape[-1]
    return jnp.sum(_lead_sum(x.reshape(_folded(shape, g))).reshape(g, c), axis=0)


@jax.custom_jvp
def _lead_sum(folded):
    """Sum of ``folded`` over every axis but the last, as a contraction with ones (in
    float32 for 16-bit inputs, returned in their dtype).  Its tangent is ``jnp.sum``'s, so
    reverse mode transposes it to a broadcast: the contraction's own transpose would be an
    outer product, which XLA:CPU computes as a matrix product."""
    lead = tuple(range(folded.ndim - 1))
    acc = jnp.promote_types(folded.dtype, jnp.float32)
    ones = jnp.ones(folded.shape[:-1], folded.dtype)
    total = lax.dot_general(ones, folded, ((lead, lead), ((), ())), preferred_element_type=acc)
    return total.astype(folded.dtype)


@_lead_sum.defjvp
def _lead_sum_jvp(primals, tangents):
    (folded,), (t,) = primals, tangents
    return _lead_sum(folded), jnp.sum(t, axis=tuple(range(folded.ndim - 1)))


def channel_mean(x):
    """Mean over every axis but the last: ``(..., C) -> (C,)`` (:func:`channel_sum`'s form)."""
    shape = tuple(jnp.shape(x))
    if not _fold(shape):
        return jnp.mean(x, axis=tuple(range(len(shape) - 1)))
    return channel_sum(x) / int(np.prod(shape[:-1]))


def channel_broadcast(v, shape):
    """``v`` of shape ``(C,)`` broadcast to ``shape = (..., C)``.

    Written so that its transpose (the gradient of ``v``) is :func:`channel_sum`'s
    fast form: ``x + channel_broadcast(b, x.shape)`` gives ``b`` the folded reduction.
    """
    shape = tuple(shape)
    g = _fold(shape)
    if not g:
        return jnp.broadcast_to(v, shape)
    c = shape[-1]
    row = jnp.broadcast_to(v, (g, c)).reshape(g * c)
    return jnp.broadcast_to(row, _folded(shape, g)).reshape(shape)


def add_bias(y, b):
    """``y + b`` for a per-channel bias ``b`` of shape ``(C,)`` (or ``y`` if ``b`` is None),
    broadcast by :func:`channel_broadcast` so that ``b``'s gradient is the folded sum."""
    return y if b is None else y + channel_broadcast(b, y.shape)
