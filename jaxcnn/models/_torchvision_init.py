"""Initialisers the torchvision models use, in the ``(key, shape, dtype,
fan_in, fan_out)`` form of :mod:`jaxcnn.layers.initializers`, so a freshly
built zoo model starts from the same distributions as its torchvision twin."""
from __future__ import annotations

import jax

from jaxcnn.layers import initializers as inits

# ResNet, VGG and MobileNetV2 convolutions: kaiming_normal_(mode="fan_out", nonlinearity="relu").
CONV_FAN_OUT = inits.kaiming_normal(mode="fan_out", nonlinearity="relu")
ZEROS = inits.zeros


def normal(std: float):
    """``N(0, std^2)``, torchvision's classifier init for VGG and MobileNetV2."""
    def init(key, shape, dtype=jax.numpy.float32, fan_in=None, fan_out=None):
        del fan_in, fan_out
        return std * jax.random.normal(key, shape, dtype)
    return init


def uniform(bound: float):
    """``U(-bound, bound)``, EfficientNet's classifier init (``bound = 1/sqrt(out_features)``)."""
    def init(key, shape, dtype=jax.numpy.float32, fan_in=None, fan_out=None):
        del fan_in, fan_out
        return jax.random.uniform(key, shape, dtype, -bound, bound)
    return init


def trunc_normal(std: float, low: float = -2.0, high: float = 2.0):
    """``N(0, std^2)`` cut to ``[low, high]`` (absolute bounds, as
    ``torch.nn.init.trunc_normal_``), ConvNeXt's init of every weight."""
    def init(key, shape, dtype=jax.numpy.float32, fan_in=None, fan_out=None):
        del fan_in, fan_out
        return std * jax.random.truncated_normal(key, low / std, high / std, shape, dtype)
    return init
