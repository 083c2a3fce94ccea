"""Layers: ``(init, apply)`` pairs over NHWC arrays, and combinators of them.

Every constructor returns a :class:`Layer`::

    init(key, input_shape) -> (params, state, output_shape)
    apply(params, state, x, *, train=False, rng=None, policy=None, choices=None) -> (y, new_state)

``choices`` (a :class:`Choices`) picks kernels, BatchNorm's backward and sync axis.

Example::

    net = serial(Conv2D(8, 3, padding=1), BatchNorm(), Relu(), GlobalAvgPool2D(), Linear(10))
    params, state, out_shape = net.init(jax.random.key(0), (2, 32, 32, 3))
    logits, state = net.apply(params, state, x, train=True)
"""
from jaxcnn.layers import initializers
from jaxcnn.layers.activation import (Elu, Gelu, Hardsigmoid, Hardswish, LeakyRelu, LogSoftmax,
                                      Relu, Relu6, Sigmoid, Silu, Softmax, Tanh)
from jaxcnn.layers.base import (Choices, Layer, LayerRecord, leaf, name_scope, record_layers,
                                split_rng)
from jaxcnn.layers.combinators import gate, parallel, residual, serial, whole_model
from jaxcnn.layers.conv import Conv2D, ConvTranspose2D
from jaxcnn.layers.dropout import Dropout, StochasticDepth
from jaxcnn.layers.linear import Linear
from jaxcnn.layers.norm import BatchNorm, GroupNorm, LayerNorm
from jaxcnn.layers.pool import AdaptiveAvgPool2D, AvgPool2D, GlobalAvgPool2D, MaxPool2D
from jaxcnn.layers.reshape import Flatten, Identity
from jaxcnn.layers.scale import LayerScale, SqueezeExcitation

__all__ = [
    "Choices", "Layer", "LayerRecord", "leaf", "name_scope", "record_layers", "split_rng",
    "initializers",
    "Conv2D", "ConvTranspose2D", "Linear",
    "BatchNorm", "LayerNorm", "GroupNorm",
    "MaxPool2D", "AvgPool2D", "AdaptiveAvgPool2D", "GlobalAvgPool2D",
    "Relu", "Relu6", "LeakyRelu", "Elu", "Gelu", "Silu", "Hardswish", "Sigmoid", "Tanh",
    "Softmax", "LogSoftmax",
    "Dropout", "Flatten", "Identity",
    "serial", "residual", "parallel", "whole_model",
    "Hardsigmoid", "StochasticDepth", "LayerScale", "SqueezeExcitation", "gate",
]
