"""Activations against float64 numpy formulas and PyTorch, values and gradients incl. kinks."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import functional as F
from numeric import assert_close

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}   # relative to max(|expected|, 1)
GRAD_RTOL = 1e-5

# Random points plus every kink and corner where one-sided derivatives matter.
X = np.concatenate([np.random.default_rng(0).standard_normal(200) * 4,
                    [-6.0, -3.0, -1e-3, 0.0, 1e-3, 3.0, 6.0, 7.5, 40.0, -40.0]]).astype(np.float32)

erf = np.vectorize(math.erf)

REFERENCES = {
    # name: (jax call, numpy float64 formula)
    "relu": (F.relu, lambda x: np.maximum(x, 0)),
    "relu6": (F.relu6, lambda x: np.clip(x, 0, 6)),
    "leaky_relu": (lambda x: F.leaky_relu(x, 0.2), lambda x: np.where(x > 0, x, 0.2 * x)),
    "elu": (lambda x: F.elu(x, 1.5), lambda x: np.where(x > 0, x, 1.5 * np.expm1(np.minimum(x, 0)))),
    "gelu": (F.gelu, lambda x: 0.5 * x * (1 + erf(x / np.sqrt(2)))),
    "gelu_tanh": (lambda x: F.gelu(x, approximate=True),
                  lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))),
    "silu": (F.silu, lambda x: x / (1 + np.exp(-x))),
    "hardswish": (F.hardswish, lambda x: x * np.clip(x + 3, 0, 6) / 6),
    "hardsigmoid": (F.hardsigmoid, lambda x: np.clip(x + 3, 0, 6) / 6),
    "sigmoid": (F.sigmoid, lambda x: 1 / (1 + np.exp(-x))),
    "tanh": (F.tanh, np.tanh),
}


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_values_match_formula(name):
    ours, ref = REFERENCES[name]
    y = ours(jnp.asarray(X))
    assert y.dtype == jnp.float32
    assert_close(y, ref(X.astype(np.float64)), RTOL[jnp.float32])
    xb = jnp.asarray(X, jnp.bfloat16)
    yb = ours(xb)
    assert yb.dtype == jnp.bfloat16
    assert_close(yb, ref(np.asarray(xb, np.float64)), RTOL[jnp.bfloat16])


def grad_at(fn, x):
    return np.asarray(jax.vmap(jax.grad(fn))(jnp.asarray(x, jnp.float32)))


def test_derivatives_at_kinks_follow_pytorch():
    # PyTorch's backward formulas: relu/relu6 use strict inequalities, leaky_relu uses
    # x > 0, hardswish has slope x/3 + 1/2 strictly inside (-3, 3).
    kinks = [-3.0, 0.0, 3.0, 6.0]
    np.testing.assert_array_equal(grad_at(F.relu, kinks), [0, 0, 1, 1])
    np.testing.assert_array_equal(grad_at(F.relu6, kinks), [0, 0, 1, 0])
    np.testing.assert_allclose(grad_at(lambda x: F.leaky_relu(x, 0.2), kinks), [0.2, 0.2, 1, 1])
    np.testing.assert_allclose(grad_at(F.hardswish, kinks), [0.0, 0.5, 1.0, 1.0])
    np.testing.assert_allclose(grad_at(F.hardsigmoid, kinks), [0.0, 1 / 6, 0.0, 0.0])
    np.testing.assert_allclose(grad_at(lambda x: F.elu(x, 1.5), kinks), [1.5 * np.exp(-3), 1.5, 1, 1],
                               rtol=1e-6)


def test_elu_gradient_is_finite_for_large_inputs():
    assert np.all(np.isfinite(grad_at(F.elu, [100.0, 1000.0, -1000.0])))


def test_softmax_and_log_softmax():
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32) * 10
    x64 = x.astype(np.float64)
    for axis in (-1, 1):
        shifted = x64 - x64.max(axis=axis, keepdims=True)
        log_p = shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))
        assert_close(F.log_softmax(x, axis=axis), log_p, RTOL[jnp.float32])
        assert_close(F.softmax(x, axis=axis), np.exp(log_p), RTOL[jnp.float32])


@pytest.mark.torch
def test_values_and_gradients_match_torch():
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    torch_fns = {
        "relu": tf.relu, "relu6": tf.relu6, "leaky_relu": lambda t: tf.leaky_relu(t, 0.2),
        "elu": lambda t: tf.elu(t, 1.5), "gelu": tf.gelu,
        "gelu_tanh": lambda t: tf.gelu(t, approximate="tanh"), "silu": tf.silu,
        "hardswish": tf.hardswish, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
        "hardsigmoid": tf.hardsigmoid,
    }
    for name, tfn in torch_fns.items():
        ours = REFERENCES[name][0]
        xt = torch.tensor(X, requires_grad=True)
        yt = tfn(xt)
        yt.sum().backward()
        assert_close(ours(jnp.asarray(X)), yt.detach().numpy(), RTOL[jnp.float32])
        assert_close(grad_at(ours, X), xt.grad.numpy(), GRAD_RTOL), name
    x = np.random.default_rng(2).standard_normal((3, 7)).astype(np.float32)
    for ours, theirs in ((F.softmax, torch.softmax), (F.log_softmax, torch.log_softmax)):
        xt = torch.tensor(x, requires_grad=True)
        yt = theirs(xt, 0)
        (yt * torch.arange(7.0)).sum().backward()
        y, vjp = jax.vjp(lambda x: ours(x, axis=0), jnp.asarray(x))
        assert_close(y, yt.detach().numpy(), RTOL[jnp.float32])
        assert_close(vjp(jnp.broadcast_to(jnp.arange(7.0), x.shape))[0], xt.grad.numpy(), GRAD_RTOL)


def test_gelu_gradient_inside_a_checked_shard_map():
    """The erf GELU's derivative inside ``shard_map(check_vma=True)`` (ConvNeXt's blocks under
    the explicit spatial split): jax 0.12's derivative of erf fails there; ours is written out
    and equals JAX's elsewhere, second derivative included."""
    from jax.sharding import Mesh, PartitionSpec as P
    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    x = jnp.linspace(-6.0, 6.0, 16).reshape(8, 2)

    def grad_of(f):
        return jax.grad(lambda v: jnp.sum(jnp.sin(f(v))))

    sharded = jax.jit(jax.shard_map(grad_of(F.gelu), mesh=mesh, in_specs=P("d"),
                                    out_specs=P("d"), check_vma=True))
    reference = grad_of(lambda v: jax.nn.gelu(v, approximate=False))
    np.testing.assert_allclose(sharded(x), reference(x), rtol=1e-6, atol=1e-6)
    second = jax.vmap(jax.grad(jax.grad(F.gelu)))(x.ravel())
    second_ref = jax.vmap(jax.grad(jax.grad(lambda v: jax.nn.gelu(v, approximate=False))))(x.ravel())
    np.testing.assert_allclose(second, second_ref, rtol=1e-5, atol=1e-6)
