"""Dropout and stochastic depth layers."""
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


def StochasticDepth(p: float, mode: str = "row") -> Layer:
    """Stochastic depth, like torchvision's ``ops.StochasticDepth``: with
    ``train=True`` each example (``mode="row"``) or the whole batch
    (``mode="batch"``) is zeroed with probability ``p`` and the rest scaled by
    ``1 / (1 - p)``; with ``train=False`` it is the identity.  Put it at the end
    of a residual block's main branch.

    Arguments:
        p: drop probability in ``[0, 1]``.
        mode: ``"row"`` or ``"batch"``.

    Returns:
        A Layer of kind ``"stochastic_depth"``; output shape = input shape, no
        params.  Its ``apply`` needs ``rng`` (a PRNG key) when ``train=True`` and
        ``p > 0``.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"StochasticDepth: p must be in [0, 1], got {p}")
    if mode not in F.STOCHASTIC_DEPTH_MODES:
        raise ValueError(f"StochasticDepth: mode must be one of "
                         f"{list(F.STOCHASTIC_DEPTH_MODES)}, got {mode!r}")

    def init(key, input_shape):
        del key
        if len(input_shape) < 1:
            raise ValueError(f"StochasticDepth: input shape {tuple(input_shape)} has no batch axis")
        return {}, {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params
        x, _ = cast_in(policy, "stochastic_depth", x)
        if not train or p == 0.0:
            return x, state
        if rng is None:
            raise ValueError("StochasticDepth: apply(..., train=True) needs an rng key "
                             "(pass rng=...)")
        return F.stochastic_depth(rng, x, p, mode=mode, deterministic=False), state

    return leaf("stochastic_depth", init, apply, dict(p=p, mode=mode))
