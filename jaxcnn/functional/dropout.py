"""Inverted dropout and stochastic depth."""
from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp


def dropout(key, x, rate, *, deterministic):
    """Inverted dropout, like PyTorch's ``F.dropout``.

    Each element is zeroed with probability ``rate`` and the survivors are
    scaled by ``1 / (1 - rate)``, so the expectation is unchanged and nothing
    needs rescaling at inference.

    Arguments:
        key: a PRNG key (unused when nothing is dropped).
        x: input of any shape.
        rate: drop probability in ``[0, 1]``; ``1`` zeroes everything.
        deterministic: if true, return ``x`` unchanged (inference).

    Returns:
        An array like ``x``.
    """
    if isinstance(rate, numbers.Real):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"dropout: rate must be in [0, 1], got {rate!r}")
        if deterministic or rate == 0.0:
            return x
        if rate == 1.0:
            return jnp.zeros_like(x)
    elif deterministic:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, jnp.shape(x))
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


STOCHASTIC_DEPTH_MODES = ("row", "batch")


def stochastic_depth(key, x, p, *, mode="row", deterministic):
    """Stochastic depth, like torchvision's ``ops.stochastic_depth``.

    Whole rows (``mode="row"``: each example of the batch, the first axis) or
    the whole input (``mode="batch"``) are zeroed with probability ``p`` and
    the survivors scaled by ``1 / (1 - p)``; a residual block applies it to its
    branch before the sum, so a dropped example passes the block unchanged.

    Arguments:
        key: a PRNG key (unused when nothing is dropped).
        x: input ``(N, ...)``.
        p: drop probability in ``[0, 1]``; ``1`` zeroes everything.
        mode: ``"row"`` (one draw per example) or ``"batch"`` (one draw in all).
        deterministic: if true, return ``x`` unchanged (inference, torch's
            ``training=False``).

    Returns:
        An array like ``x``.
    """
    if mode not in STOCHASTIC_DEPTH_MODES:
        raise ValueError(f"stochastic_depth: mode must be one of {list(STOCHASTIC_DEPTH_MODES)}, "
                         f"got {mode!r}")
    if jnp.ndim(x) < 1:
        raise ValueError(f"stochastic_depth: x must have a batch axis, got shape {jnp.shape(x)}")
    if isinstance(p, numbers.Real):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"stochastic_depth: p must be in [0, 1], got {p!r}")
        if deterministic or p == 0.0:
            return x
        if p == 1.0:
            return jnp.zeros_like(x)
    elif deterministic:
        return x
    shape = (x.shape[0],) + (1,) * (x.ndim - 1) if mode == "row" else (1,) * x.ndim
    keep = jax.random.bernoulli(key, 1.0 - p, shape)
    return jnp.where(keep, x / (1.0 - p), 0).astype(x.dtype)
