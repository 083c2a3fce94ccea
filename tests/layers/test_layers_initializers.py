"""Initialisers: sample statistics against the formulas, and against PyTorch's
own initialisation of the matching layers when torch is installed.

Tolerances: with >= 2**16 samples the sample std of an exact sampler is within
~0.3% of the truth (one sigma), so std checks allow 3%; uniform samplers must
stay within their bound and reach 98% of it."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn.layers import initializers as inits

SHAPE = (256, 256)
FAN_IN, FAN_OUT = 72, 200
# The samplers' statistics do not depend on the PRNG implementation; "rbg"
# compiles several times faster than threefry, which matters on a 2-core
# machine. The PyTorch comparison below uses the default implementation.
KEY = jax.random.key(0, impl="rbg")


def _sample(init, fan_in=FAN_IN, fan_out=FAN_OUT, shape=SHAPE):
    w = np.asarray(init(KEY, shape, jnp.float32, fan_in, fan_out))
    assert w.shape == shape and w.dtype == np.float32
    return w


def _check_uniform(w, bound):
    assert np.abs(w).max() <= bound * (1 + 1e-6)
    assert np.abs(w).max() >= 0.98 * bound
    np.testing.assert_allclose(w.std(), bound / math.sqrt(3), rtol=0.03)
    assert abs(w.mean()) < 0.02 * bound


def _check_normal(w, std):
    np.testing.assert_allclose(w.std(), std, rtol=0.03)
    assert abs(w.mean()) < 0.02 * std
    # Gaussian, not uniform: some samples beyond 3 std (expected ~0.27% of 65536).
    assert (np.abs(w) > 3 * std).mean() > 0.001


@pytest.mark.parametrize("name,kind,scale", [
    ("torch_default", "uniform", 1 / math.sqrt(FAN_IN)),
    ("torch_default_bias", "uniform", 1 / math.sqrt(FAN_IN)),
    ("kaiming_uniform", "uniform", math.sqrt(2) * math.sqrt(3 / FAN_IN)),
    ("he_uniform", "uniform", math.sqrt(6 / FAN_IN)),
    ("kaiming_normal", "normal", math.sqrt(2 / FAN_IN)),
    ("he_normal", "normal", math.sqrt(2 / FAN_IN)),
    ("xavier_uniform", "uniform", math.sqrt(6 / (FAN_IN + FAN_OUT))),
    ("glorot_uniform", "uniform", math.sqrt(6 / (FAN_IN + FAN_OUT))),
    ("xavier_normal", "normal", math.sqrt(2 / (FAN_IN + FAN_OUT))),
    ("glorot_normal", "normal", math.sqrt(2 / (FAN_IN + FAN_OUT))),
    ("lecun_uniform", "uniform", math.sqrt(3 / FAN_IN)),
    ("lecun_normal", "normal", 1 / math.sqrt(FAN_IN)),
])
def test_named_initializers_match_formula(name, kind, scale):
    w = _sample(inits.resolve(name, None))
    (_check_uniform if kind == "uniform" else _check_normal)(w, scale)


def test_factory_options():
    _check_normal(_sample(inits.kaiming_normal(mode="fan_out", nonlinearity="relu")),
                  math.sqrt(2 / FAN_OUT))
    _check_uniform(_sample(inits.kaiming_uniform(a=0.2, nonlinearity="leaky_relu")),
                   math.sqrt(2 / 1.04) * math.sqrt(3 / FAN_IN))
    _check_normal(_sample(inits.kaiming_normal(nonlinearity="tanh")), 5 / 3 / math.sqrt(FAN_IN))
    _check_uniform(_sample(inits.xavier_uniform(gain=2.0)), 2 * math.sqrt(6 / (FAN_IN + FAN_OUT)))
    _check_normal(_sample(inits.xavier_normal(gain=0.5)), 0.5 * math.sqrt(2 / (FAN_IN + FAN_OUT)))


def test_zeros_ones_and_zero_fan_bias():
    np.testing.assert_array_equal(_sample(inits.zeros), 0)
    np.testing.assert_array_equal(_sample(inits.ones), 1)
    np.testing.assert_array_equal(_sample(inits.torch_default_bias(), fan_in=0), 0)


def test_resolve():
    default = inits.lecun_normal()
    assert inits.resolve(None, default) is default
    custom = lambda key, shape, dtype, fan_in, fan_out: jnp.full(shape, 3.0, dtype)  # noqa: E731
    assert inits.resolve(custom, default) is custom
    assert set(inits.names()) >= {"kaiming_normal", "xavier_uniform", "lecun_normal", "zeros"}
    with pytest.raises(ValueError, match="unknown initializer 'kaiming'"):
        inits.resolve("kaiming", default)
    with pytest.raises(TypeError, match="initializer"):
        inits.resolve(3, default)
    with pytest.raises(ValueError, match="mode"):
        inits.kaiming_normal(mode="fan_avg")
    with pytest.raises(ValueError, match="nonlinearity"):
        inits.calculate_gain("swish")


def test_layers_use_their_fans():
    """Conv2D/ConvTranspose2D/Linear pass PyTorch's fans for their weight layouts."""
    key = jax.random.key(1, impl="rbg")
    p, _, _ = L.Conv2D(64, 3, groups=2, w_init="kaiming_normal").init(key, (1, 8, 8, 32))
    _check_normal(np.asarray(p["w"]), math.sqrt(2 / (9 * 16)))  # fan_in = 3*3*32/2
    p, _, _ = L.ConvTranspose2D(96, 3, groups=4, w_init="lecun_uniform").init(key, (1, 4, 4, 64))
    _check_uniform(np.asarray(p["w"]), math.sqrt(3 / (9 * 24)))  # fan_in = 3*3*96/4
    assert p["w"].shape == (3, 3, 64, 24)
    p, _, _ = L.Linear(256, w_init="xavier_normal", b_init="ones").init(key, (2, 300))
    _check_normal(np.asarray(p["w"]), math.sqrt(2 / 556))
    np.testing.assert_array_equal(p["b"], 1)
    p, _, _ = L.Linear(8, b_init="zeros").init(key, (2, 5))
    np.testing.assert_array_equal(p["b"], 0)


@pytest.mark.torch
def test_calculate_gain_matches_torch():
    torch = pytest.importorskip("torch")
    for nl, param in [("linear", None), ("sigmoid", None), ("tanh", None), ("relu", None),
                      ("leaky_relu", None), ("leaky_relu", 0.2), ("selu", None)]:
        assert inits.calculate_gain(nl, param) == pytest.approx(
            torch.nn.init.calculate_gain(nl, param), rel=1e-12)


@pytest.mark.torch
@pytest.mark.parametrize("case", ["conv", "conv_groups", "conv_transpose", "linear"])
def test_default_init_matches_torch(case):
    """Same bounds as torch's default init; sample std agrees within 5%."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    if case == "conv":
        tm, layer, shape = torch.nn.Conv2d(48, 64, 3), L.Conv2D(64, 3), (1, 8, 8, 48)
    elif case == "conv_groups":
        tm, layer, shape = (torch.nn.Conv2d(48, 64, 5, groups=4), L.Conv2D(64, 5, groups=4),
                            (1, 8, 8, 48))
    elif case == "conv_transpose":
        tm, layer, shape = (torch.nn.ConvTranspose2d(64, 96, 3, groups=2),
                            L.ConvTranspose2D(96, 3, groups=2), (1, 4, 4, 64))
    else:
        tm, layer, shape = torch.nn.Linear(300, 200), L.Linear(200), (2, 300)
    params, _, _ = layer.init(jax.random.key(2), shape)
    for ours, theirs in [(params["w"], tm.weight), (params["b"], tm.bias)]:
        ours, theirs = np.asarray(ours), theirs.detach().numpy()
        assert ours.size == theirs.size
        fan_in = {"conv": 9 * 48, "conv_groups": 25 * 12, "conv_transpose": 9 * 48,
                  "linear": 300}[case]
        bound = 1 / math.sqrt(fan_in)
        assert np.abs(ours).max() <= bound * (1 + 1e-6)
        assert np.abs(theirs).max() <= bound * (1 + 1e-6)
        if ours.size > 5000:
            np.testing.assert_allclose(ours.std(), theirs.std(), rtol=0.05)
