"""Inverted dropout."""
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
