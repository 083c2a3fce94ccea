"""Element-wise activation layers (and softmax), each wrapping its
``jaxcnn.functional`` op. None has parameters; the output shape is the input
shape. ``Softmax`` computes in float32 under a policy and returns its input's
dtype; the others compute in the policy's compute dtype."""
from __future__ import annotations

from jaxcnn import functional as F
from jaxcnn.layers._common import cast_in, cast_out
from jaxcnn.layers.base import Layer, leaf


def _activation(kind: str, fn, config: dict | None = None) -> Layer:
    def init(key, input_shape):
        del key
        return {}, {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng
        in_dtype = x.dtype
        x, _ = cast_in(policy, kind, x)
        return cast_out(policy, kind, fn(x), in_dtype), state

    return leaf(kind, init, apply, config)


def Relu() -> Layer:
    """``max(x, 0)``; kind ``"relu"``."""
    return _activation("relu", F.relu)


def Relu6() -> Layer:
    """``min(max(x, 0), 6)``; kind ``"relu6"``."""
    return _activation("relu6", F.relu6)


def LeakyRelu(negative_slope: float = 0.01) -> Layer:
    """``x if x >= 0 else negative_slope * x``; kind ``"leaky_relu"``.

    Arguments:
        negative_slope: slope for negative inputs.
    """
    return _activation("leaky_relu", lambda x: F.leaky_relu(x, negative_slope),
                       dict(negative_slope=negative_slope))


def Elu(alpha: float = 1.0) -> Layer:
    """``x if x > 0 else alpha * (exp(x) - 1)``; kind ``"elu"``.

    Arguments:
        alpha: scale of the negative part.
    """
    return _activation("elu", lambda x: F.elu(x, alpha), dict(alpha=alpha))


def Gelu(approximate: bool = False) -> Layer:
    """Gaussian error linear unit; kind ``"gelu"``.

    Arguments:
        approximate: use the tanh approximation (PyTorch's ``approximate="tanh"``).
    """
    return _activation("gelu", lambda x: F.gelu(x, approximate=approximate),
                       dict(approximate=approximate))


def Silu() -> Layer:
    """``x * sigmoid(x)`` (swish); kind ``"silu"``."""
    return _activation("silu", F.silu)


def Hardswish() -> Layer:
    """``x * relu6(x + 3) / 6``; kind ``"hardswish"``."""
    return _activation("hardswish", F.hardswish)


def Hardsigmoid() -> Layer:
    """``relu6(x + 3) / 6``; kind ``"hardsigmoid"``."""
    return _activation("hardsigmoid", F.hardsigmoid)


def Sigmoid() -> Layer:
    """``1 / (1 + exp(-x))``; kind ``"sigmoid"``."""
    return _activation("sigmoid", F.sigmoid)


def Tanh() -> Layer:
    """Hyperbolic tangent; kind ``"tanh"``."""
    return _activation("tanh", F.tanh)


def Softmax(axis: int = -1) -> Layer:
    """Softmax along ``axis``; kind ``"softmax"`` (float32 under a policy).

    Arguments:
        axis: the axis that sums to one.
    """
    return _activation("softmax", lambda x: F.softmax(x, axis=axis), dict(axis=axis))


def LogSoftmax(axis: int = -1) -> Layer:
    """Log of the softmax along ``axis``; kind ``"log_softmax"``.

    Arguments:
        axis: the normalised axis.
    """
    return _activation("log_softmax", lambda x: F.log_softmax(x, axis=axis), dict(axis=axis))
