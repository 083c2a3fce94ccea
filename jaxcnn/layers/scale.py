"""Layers that rescale their input channel by channel: :func:`LayerScale`
(a learned per-channel factor, ConvNeXt's) and :func:`SqueezeExcitation`
(a factor computed from the globally pooled input, torchvision's
``ops.SqueezeExcitation``)."""
from __future__ import annotations

import jax.numpy as jnp

from jaxcnn.layers._common import cast_in, check_min_rank
from jaxcnn.layers.activation import Relu, Sigmoid
from jaxcnn.layers.base import Layer, leaf
from jaxcnn.layers.combinators import gate
from jaxcnn.layers.conv import Conv2D
from jaxcnn.layers.pool import AdaptiveAvgPool2D


def LayerScale(init_value: float = 1e-6) -> Layer:
    """``y = x * scale`` with a learned per-channel ``scale`` (last axis), as
    ConvNeXt's ``layer_scale`` (torchvision keeps it as a ``(C, 1, 1)``
    parameter of the block; :mod:`jaxcnn.interop.torch` maps the two).

    Arguments:
        init_value: initial value of every entry of ``scale``.

    Returns:
        A Layer of kind ``"layer_scale"``: output shape = input shape; params
        ``{"scale": (C,)}`` filled with ``init_value``.
    """
    name = "LayerScale"

    def init(key, input_shape):
        del key
        check_min_rank(name, input_shape, 2)
        return ({"scale": jnp.full((input_shape[-1],), init_value, jnp.float32)}, {},
                tuple(input_shape))

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        x, params = cast_in(policy, "layer_scale", x, params)
        return x * params["scale"], state

    return leaf("layer_scale", init, apply, dict(init_value=init_value))


def SqueezeExcitation(input_channels: int, squeeze_channels: int, *, activation=Relu,
                      scale_activation=Sigmoid, conv_init=None) -> Layer:
    """Squeeze-and-excitation, like torchvision's ``ops.SqueezeExcitation``:
    ``x * scale_activation(fc2(activation(fc1(avgpool(x)))))`` with ``fc1`` and
    ``fc2`` 1x1 convolutions with biases.

    Arguments:
        input_channels: channels of the input (and of ``fc2``'s output).
        squeeze_channels: channels of ``fc1``'s output.
        activation: constructor of the layer after ``fc1`` (e.g. ``layers.Silu``).
        scale_activation: constructor of the layer after ``fc2`` (e.g.
            ``layers.Hardsigmoid``).
        conv_init: weight initialiser of ``fc1`` and ``fc2`` (None: PyTorch's default).

    Returns:
        A :func:`~jaxcnn.layers.gate` of kind ``"gate"`` with children ``avgpool``,
        ``fc1``, ``activation``, ``fc2``, ``scale_activation`` (torchvision's names);
        params ``{"fc1": {"w", "b"}, "fc2": {"w", "b"}}``.
    """
    for what, value in (("input_channels", input_channels), ("squeeze_channels", squeeze_channels)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"SqueezeExcitation: {what} must be a positive int, got {value!r}")
    extra = {} if conv_init is None else {"w_init": conv_init, "b_init": "zeros"}
    body = gate(("avgpool", AdaptiveAvgPool2D(1)),
                ("fc1", Conv2D(squeeze_channels, 1, **extra)), ("activation", activation()),
                ("fc2", Conv2D(input_channels, 1, **extra)),
                ("scale_activation", scale_activation()))

    def init(key, input_shape):
        if len(input_shape) != 4 or input_shape[-1] != input_channels:
            raise ValueError(f"SqueezeExcitation: expected an input (N, H, W, {input_channels}), "
                             f"got shape {tuple(input_shape)}")
        return body.init(key, input_shape)

    return body._replace(init=init)
