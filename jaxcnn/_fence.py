"""One way to make XLA:CPU store a value, and compute it no earlier than another.

XLA:CPU drops ``lax.optimization_barrier`` (and so ``jax.checkpoint``'s guard against
merging a recomputation with the forward), fuses elementwise producers into every
consumer, and schedules each computation as early as its inputs allow.  A conditional is
none of that: it is never fused through, never merged with another computation, and runs
only once its predicate exists.  :func:`stored` is such a conditional whose two branches
give the same values.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _never(first):
    """A predicate read from ``first`` that no finite float and no non-negative integer
    makes true (``isnan`` of an integer would be a constant XLA folds away)."""
    return jnp.isnan(first) if jnp.issubdtype(first.dtype, jnp.inexact) else first < 0


def _plus_zero(tree):
    return jax.tree_util.tree_map(lambda v: v + jnp.zeros((), v.dtype), tree)


def stored(x, *, after, other=None):
    """``x`` (a pytree), stored, once ``after`` exists.

    Arguments:
        x: what to store.
        after: an array or pytree of arrays (floats, or integers that are never negative):
            the predicate reads the first element of each, so the copy is made only once
            they exist; read from ``x`` itself it only stores ``x``.
        other: the branch never taken, ``x -> x'``, which must not be the identity in
            XLA's eyes (else it removes the conditional): ``x + 0.0`` by default (which only
            turns -0.0 into 0.0); a linear function (``2 * x``) where the result must be
            linear in ``x``, as a tangent is.

    Costs one copy of ``x``.
    """
    firsts = [a[(0,) * a.ndim] for a in jax.tree_util.tree_leaves(after)]
    pred = functools.reduce(jnp.logical_or, [_never(f) for f in firsts])
    return jax.lax.cond(pred, other or _plus_zero, lambda v: v, x)
