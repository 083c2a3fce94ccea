"""Element-wise activations and softmax, matching PyTorch's values and gradients.

Where PyTorch's derivative at a kink differs from what a naive JAX formula
gives (``relu6`` at 6, where ``jnp.minimum`` would split it in halves,
``leaky_relu`` at 0, ``hardswish`` and ``hardsigmoid`` at -3 and 3), the functions
are written with ``jnp.where`` so that the chosen branch gives PyTorch's one-sided derivative.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax


def relu(x):
    """``max(x, 0)``; derivative 0 at 0.

    Arguments:
        x: any array.
    """
    return jax.nn.relu(x)


def relu6(x):
    """``min(max(x, 0), 6)``; derivative 0 at 0 and at 6, as PyTorch.

    Arguments:
        x: any array.
    """
    return jnp.where(x <= 0, jnp.zeros_like(x), jnp.where(x >= 6, jnp.full_like(x, 6), x))


def leaky_relu(x, negative_slope=0.01):
    """``x`` if ``x > 0`` else ``negative_slope * x``; derivative ``negative_slope`` at 0.

    Arguments:
        x: any array.
        negative_slope: slope for ``x <= 0``.
    """
    return jnp.where(x > 0, x, negative_slope * x)


def elu(x, alpha=1.0):
    """``x`` if ``x > 0`` else ``alpha * (exp(x) - 1)``.

    Arguments:
        x: any array.
        alpha: scale of the negative part.
    """
    # The inner where keeps expm1 of large positive x (unused) from overflowing
    # into a NaN gradient.
    return jnp.where(x > 0, x, alpha * jnp.expm1(jnp.where(x > 0, jnp.zeros_like(x), x)))


def gelu(x, approximate=False):
    """Gaussian error linear unit: ``x * Phi(x)``.

    Arguments:
        x: any array.
        approximate: use PyTorch's ``approximate="tanh"`` formula
            ``0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x**3)))`` instead of erf.
    """
    if approximate:
        return jax.nn.gelu(x, approximate=True)
    return _gelu_erf(x)


@jax.custom_jvp
def _gelu_erf(x):
    """The erf GELU with its derivative ``Phi(x) + x phi(x)`` written out (in float32 for
    16-bit ``x``): jax 0.12's own derivative of erf fails inside ``shard_map(check_vma=True)``
    (its polynomial's coefficients do not vary with ``x``), where ConvNeXt's split blocks run."""
    return jax.nn.gelu(x, approximate=False)


@_gelu_erf.defjvp
def _gelu_erf_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    cdf = 0.5 * (1.0 + lax.erf(xf * (1.0 / math.sqrt(2.0))))
    pdf = jnp.exp(-0.5 * xf * xf) * (1.0 / math.sqrt(2.0 * math.pi))
    return _gelu_erf(x), t * (cdf + xf * pdf).astype(x.dtype)


def silu(x):
    """``x * sigmoid(x)`` (a.k.a. swish).

    Arguments:
        x: any array.
    """
    return jax.nn.silu(x)


def hardswish(x):
    """``x * relu6(x + 3) / 6``; derivative 0 at -3 and 1 at 3, as PyTorch.

    Arguments:
        x: any array.
    """
    return jnp.where(x <= -3, jnp.zeros_like(x), jnp.where(x < 3, x * (x + 3) / 6, x))


def hardsigmoid(x):
    """``relu6(x + 3) / 6``; derivative ``1/6`` strictly inside ``(-3, 3)`` and 0 at
    -3 and 3, as PyTorch's ``F.hardsigmoid``.

    Arguments:
        x: any array.
    """
    return jnp.where(x <= -3, jnp.zeros_like(x),
                     jnp.where(x >= 3, jnp.ones_like(x), (x + 3) / 6))


def sigmoid(x):
    """``1 / (1 + exp(-x))``.

    Arguments:
        x: any array.
    """
    return jax.nn.sigmoid(x)


def tanh(x):
    """Hyperbolic tangent.

    Arguments:
        x: any array.
    """
    return jnp.tanh(x)


def softmax(x, axis=-1):
    """Softmax along ``axis``.

    Arguments:
        x: any array.
        axis: the axis that sums to one.
    """
    return jax.nn.softmax(x, axis=axis)


def log_softmax(x, axis=-1):
    """Log of the softmax along ``axis``, computed stably.

    Arguments:
        x: any array.
        axis: the axis to normalise over.
    """
    return jax.nn.log_softmax(x, axis=axis)
