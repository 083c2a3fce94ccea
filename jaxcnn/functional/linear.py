"""Dense (fully connected) layer op."""
from __future__ import annotations

import jax.numpy as jnp


def linear(x, w, b=None):
    """``x @ w + b`` over the last axis.

    Arguments:
        x: input ``(..., in)``.
        w: weight ``(in, out)`` (the transpose of a PyTorch ``Linear`` weight).
        b: optional bias ``(out,)``.

    Returns:
        ``(..., out)``.

    Raises:
        ValueError: if ``w`` is not 2-D, ``x`` has no feature axis, or the
            feature sizes of ``x``, ``w`` and ``b`` disagree.
    """
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    if len(w_shape) != 2:
        raise ValueError(f"linear: w must have rank 2 (in, out), got shape {w_shape}")
    if len(x_shape) < 1 or x_shape[-1] != w_shape[0]:
        raise ValueError(
            f"linear: x's last axis must match w's input size {w_shape[0]} "
            f"(x shape {x_shape}, w shape {w_shape})")
    if b is not None and tuple(jnp.shape(b)) != (w_shape[1],):
        raise ValueError(
            f"linear: bias must have shape ({w_shape[1]},) to match w shape {w_shape}, "
            f"got {tuple(jnp.shape(b))}")
    y = jnp.matmul(x, w)
    return y if b is None else y + b
