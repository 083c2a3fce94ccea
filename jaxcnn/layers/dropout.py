"""Dropout layer."""
from __future__ import annotations

from jaxcnn import functional as F
from jaxcnn.layers._common import cast_in
from jaxcnn.layers.base import Layer, leaf


def Dropout(rate: float) -> Layer:
    """Inverted dropout, like ``torch.nn.Dropout``: with ``train=True`` each
    element is zeroed with probability ``rate`` and the rest scaled by
    ``1 / (1 - rate)``; with ``train=False`` it is the identity.

    Arguments:
        rate: drop probability in ``[0, 1]``.

    Returns:
        A Layer of kind ``"dropout"``; output shape = input shape, no params.
        Its ``apply`` needs ``rng`` (a PRNG key) when ``train=True``.
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"Dropout: rate must be in [0, 1], got {rate}")

    def init(key, input_shape):
        del key
        return {}, {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params
        x, _ = cast_in(policy, "dropout", x)
        if not train:
            return x, state
        if rng is None:
            raise ValueError("Dropout: apply(..., train=True) needs an rng key (pass rng=...)")
        return F.dropout(rng, x, rate, deterministic=False), state

    return leaf("dropout", init, apply, dict(rate=rate))
