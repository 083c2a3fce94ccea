"""Fully connected layer :func:`Linear`."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcnn import functional as F
from jaxcnn.layers import initializers as inits
from jaxcnn.layers._common import cast_in, check_min_rank
from jaxcnn.layers.base import Layer, leaf, where


def Linear(out_features: int, *, use_bias: bool = True, w_init=None, b_init=None) -> Layer:
    """Affine map over the last axis, ``y = x @ w + b``, like ``torch.nn.Linear``.

    Arguments:
        out_features: size of the output's last axis.
        use_bias: whether to add a bias ``b`` of shape ``(out_features,)``.
        w_init, b_init: initialiser or name (see :mod:`jaxcnn.layers.initializers`);
            default PyTorch's (``U(±1/sqrt(in_features))`` for both).

    Returns:
        A Layer of kind ``"linear"``: input ``(N, ..., in_features)``, output
        ``(N, ..., out_features)``; params ``{"w": (in_features, out_features),
        "b": (out_features,)}``.
    """
    name = "Linear"
    if out_features < 1:
        raise ValueError(f"{name}: out_features must be >= 1, got {out_features}")
    w_init = inits.resolve(w_init, inits.torch_default_weight())
    b_init = inits.resolve(b_init, inits.torch_default_bias())

    def init(key, input_shape):
        check_min_rank(where(name), input_shape, 2)
        in_features = input_shape[-1]
        if in_features < 1:
            raise ValueError(f"{where(name)}: input shape {tuple(input_shape)} has no features")
        k_w, k_b = jax.random.split(key)
        params = {"w": w_init(k_w, (in_features, out_features), jnp.float32,
                              in_features, out_features)}
        if use_bias:
            params["b"] = b_init(k_b, (out_features,), jnp.float32, in_features, out_features)
        return params, {}, tuple(input_shape[:-1]) + (out_features,)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        w_shape = tuple(params["w"].shape)
        if tuple(x.shape[-1:]) != w_shape[:1]:  # the path, which F.linear's own check cannot name
            raise ValueError(f"{where(name)}: input shape {tuple(x.shape)} does not end in the "
                             f"{w_shape[0]} features its weight takes (w shape {w_shape}); was "
                             "the model initialised for another input size?")
        x, params = cast_in(policy, "linear", x, params)
        return F.linear(x, params["w"], params.get("b")), state

    return leaf("linear", init, apply, dict(out_features=out_features, use_bias=use_bias))
