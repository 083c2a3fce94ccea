"""Weight initialisers, PyTorch's defaults among them.

Every initialiser is a function ::

    init(key, shape, dtype, fan_in, fan_out) -> jax.Array

The layer, not the initialiser, computes ``fan_in`` and ``fan_out``, exactly as
PyTorch does for the layer's own weight layout (PyTorch reads them off its
weight tensor; ours are stored in another layout, e.g. HWIO instead of OIHW, so
reading them off ``shape`` would be wrong for transposed convolutions):

=================  ===========================  ===========================
layer              fan_in                       fan_out
=================  ===========================  ===========================
Conv2D             KH*KW*C_in/groups            KH*KW*C_out
ConvTranspose2D    KH*KW*C_out/groups           KH*KW*C_in
Linear             in_features                  out_features
=================  ===========================  ===========================

The factories (``kaiming_normal(...)``, ``xavier_uniform(...)``...) return
such functions; :func:`resolve` turns a name string into one, so layers
accept ``w_init="kaiming_normal"`` as well as a callable.
"""
from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

Initializer = Callable[..., jax.Array]


def calculate_gain(nonlinearity: str, param: float | None = None) -> float:
    """The recommended gain for ``nonlinearity``, as ``torch.nn.init.calculate_gain``.

    Arguments:
        nonlinearity: ``"linear"``, ``"conv2d"``, ``"conv_transpose2d"``,
            ``"sigmoid"``, ``"tanh"``, ``"relu"``, ``"leaky_relu"`` or ``"selu"``.
        param: negative slope for ``"leaky_relu"`` (default 0.01).

    Returns:
        The gain, a Python float.
    """
    if nonlinearity in ("linear", "conv2d", "conv_transpose2d", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3.0
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        slope = 0.01 if param is None else float(param)
        return math.sqrt(2.0 / (1.0 + slope ** 2))
    if nonlinearity == "selu":
        return 0.75
    raise ValueError(f"calculate_gain: unsupported nonlinearity {nonlinearity!r}")


def _fan(mode: str, fan_in: int, fan_out: int) -> int:
    if mode == "fan_in":
        return fan_in
    if mode == "fan_out":
        return fan_out
    raise ValueError(f"initializer mode must be 'fan_in' or 'fan_out', got {mode!r}")


def _uniform(key, shape, dtype, bound: float) -> jax.Array:
    return jax.random.uniform(key, shape, dtype, minval=-bound, maxval=bound)


def _normal(key, shape, dtype, std: float) -> jax.Array:
    return std * jax.random.normal(key, shape, dtype)


def zeros(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None) -> jax.Array:
    """All zeros. Arguments as in the module docstring (key and fans unused)."""
    del key, fan_in, fan_out
    return jnp.zeros(shape, dtype)


def ones(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None) -> jax.Array:
    """All ones. Arguments as in the module docstring (key and fans unused)."""
    del key, fan_in, fan_out
    return jnp.ones(shape, dtype)


def kaiming_uniform(a: float = 0.0, mode: str = "fan_in",
                    nonlinearity: str = "leaky_relu") -> Initializer:
    """He/Kaiming uniform, as ``torch.nn.init.kaiming_uniform_``.

    Samples ``U(-b, b)`` with ``b = gain * sqrt(3 / fan)``.

    Arguments:
        a: negative slope used in the gain when ``nonlinearity="leaky_relu"``.
        mode: ``"fan_in"`` (preserve forward variance) or ``"fan_out"``.
        nonlinearity: name passed to :func:`calculate_gain`.
    """
    gain = calculate_gain(nonlinearity, a)
    _fan(mode, 0, 0)  # fail at construction on a bad mode

    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _uniform(key, shape, dtype, gain * math.sqrt(3.0 / _fan(mode, fan_in, fan_out)))
    return init


def kaiming_normal(a: float = 0.0, mode: str = "fan_in",
                   nonlinearity: str = "leaky_relu") -> Initializer:
    """He/Kaiming normal, as ``torch.nn.init.kaiming_normal_``: ``N(0, (gain/sqrt(fan))^2)``.

    Arguments:
        a: negative slope used in the gain when ``nonlinearity="leaky_relu"``.
        mode: ``"fan_in"`` or ``"fan_out"``.
        nonlinearity: name passed to :func:`calculate_gain`.
    """
    gain = calculate_gain(nonlinearity, a)
    _fan(mode, 0, 0)

    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _normal(key, shape, dtype, gain / math.sqrt(_fan(mode, fan_in, fan_out)))
    return init


def xavier_uniform(gain: float = 1.0) -> Initializer:
    """Glorot/Xavier uniform: ``U(-b, b)``, ``b = gain * sqrt(6 / (fan_in + fan_out))``.

    Arguments:
        gain: scaling factor.
    """
    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _uniform(key, shape, dtype, gain * math.sqrt(6.0 / (fan_in + fan_out)))
    return init


def xavier_normal(gain: float = 1.0) -> Initializer:
    """Glorot/Xavier normal: ``N(0, std^2)``, ``std = gain * sqrt(2 / (fan_in + fan_out))``.

    Arguments:
        gain: scaling factor.
    """
    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _normal(key, shape, dtype, gain * math.sqrt(2.0 / (fan_in + fan_out)))
    return init


def lecun_uniform() -> Initializer:
    """LeCun uniform: ``U(-b, b)``, ``b = sqrt(3 / fan_in)`` (variance ``1/fan_in``)."""
    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _uniform(key, shape, dtype, math.sqrt(3.0 / fan_in))
    return init


def lecun_normal() -> Initializer:
    """LeCun normal: ``N(0, 1/fan_in)`` (plain, not truncated)."""
    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        return _normal(key, shape, dtype, 1.0 / math.sqrt(fan_in))
    return init


def torch_default_weight() -> Initializer:
    """PyTorch's default Conv/Linear weight init: ``kaiming_uniform(a=sqrt(5))``,
    which is ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``."""
    return kaiming_uniform(a=math.sqrt(5.0), mode="fan_in", nonlinearity="leaky_relu")


def torch_default_bias() -> Initializer:
    """PyTorch's default Conv/Linear bias init: ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``
    (zeros when ``fan_in`` is 0, as PyTorch)."""
    def init(key, shape, dtype=jnp.float32, fan_in=None, fan_out=None):
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        return _uniform(key, shape, dtype, bound)
    return init


_BY_NAME: dict[str, Callable[[], Initializer]] = {
    "torch_default": torch_default_weight,
    "torch_default_bias": torch_default_bias,
    "kaiming_uniform": kaiming_uniform,
    "kaiming_normal": kaiming_normal,
    "he_uniform": lambda: kaiming_uniform(nonlinearity="relu"),
    "he_normal": lambda: kaiming_normal(nonlinearity="relu"),
    "xavier_uniform": xavier_uniform,
    "xavier_normal": xavier_normal,
    "glorot_uniform": xavier_uniform,
    "glorot_normal": xavier_normal,
    "lecun_uniform": lecun_uniform,
    "lecun_normal": lecun_normal,
    "zeros": lambda: zeros,
    "ones": lambda: ones,
}


def names() -> list[str]:
    """The names :func:`resolve` accepts."""
    return sorted(_BY_NAME)


def resolve(init: Initializer | str | None, default: Initializer) -> Initializer:
    """Turn a layer's ``w_init``/``b_init`` argument into an initialiser.

    Arguments:
        init: ``None`` (use ``default``), a name from :func:`names` (the
            factory's defaults; ``"kaiming_*"`` use ``nonlinearity="leaky_relu"``
            with ``a=0`` like PyTorch, which equals ``"he_*"``), or a callable
            ``(key, shape, dtype, fan_in, fan_out) -> array``.
        default: what ``None`` means.
    """
    if init is None:
        return default
    if isinstance(init, str):
        try:
            return _BY_NAME[init]()
        except KeyError:
            raise ValueError(f"unknown initializer {init!r}; expected a callable or one of "
                             f"{names()}") from None
    if not callable(init):
        raise TypeError(f"initializer must be a callable, a name or None, got {init!r}")
    return init
