"""dropout's statistics and determinism; linear against numpy and PyTorch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import functional as F

RTOL = 1e-5


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.8])
def test_dropout_keep_rate_and_scaling(rate):
    x = jnp.full((400, 500), 2.0)
    y = np.asarray(F.dropout(jax.random.PRNGKey(0), x, rate, deterministic=False))
    kept = y != 0
    n = kept.size
    # Kept fraction within 5 binomial standard deviations of 1 - rate.
    assert abs(kept.mean() - (1 - rate)) < 5 * np.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(y[kept], 2.0 / (1 - rate), rtol=1e-6)
    # Independent across positions: rows have binomial-sized spread, not all-or-nothing.
    assert 0 < kept.mean(axis=1).std() < 0.1


def test_dropout_determinism_and_identity():
    x = jax.random.normal(jax.random.PRNGKey(1), (8, 4, 4, 3))
    k1, k2 = jax.random.PRNGKey(2), jax.random.PRNGKey(3)
    a = F.dropout(k1, x, 0.5, deterministic=False)
    np.testing.assert_array_equal(a, F.dropout(k1, x, 0.5, deterministic=False))
    np.testing.assert_array_equal(a, jax.jit(lambda k, x: F.dropout(k, x, 0.5, deterministic=False))(k1, x))
    assert np.any(np.asarray(a != F.dropout(k2, x, 0.5, deterministic=False)))
    assert F.dropout(k1, x, 0.5, deterministic=True) is x
    assert F.dropout(k1, x, 0.0, deterministic=False) is x
    np.testing.assert_array_equal(F.dropout(k1, x, 1.0, deterministic=False), jnp.zeros_like(x))
    assert F.dropout(k1, x.astype(jnp.bfloat16), 0.3, deterministic=False).dtype == jnp.bfloat16


def test_dropout_gradient_uses_same_mask_and_scale():
    x = jnp.ones((1000,))
    key = jax.random.PRNGKey(4)
    g = jax.grad(lambda x: F.dropout(key, x, 0.25, deterministic=False).sum())(x)
    y = F.dropout(key, x, 0.25, deterministic=False)
    np.testing.assert_allclose(g, y, rtol=1e-6)   # d(x*m/(1-p))/dx = m/(1-p) = y at x=1


def test_dropout_bad_rate():
    with pytest.raises(ValueError, match=r"dropout: rate must be in \[0, 1\], got 1.5"):
        F.dropout(jax.random.PRNGKey(0), jnp.ones(3), 1.5, deterministic=False)


def test_linear_matches_numpy_and_bad_shapes():
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 5), (5, 4), (4,)))
    np.testing.assert_allclose(F.linear(x, w, b), x.astype(np.float64) @ w + b, rtol=RTOL, atol=RTOL)
    np.testing.assert_allclose(F.linear(x, w), x.astype(np.float64) @ w, rtol=RTOL, atol=RTOL)
    with pytest.raises(ValueError, match=r"linear: x's last axis must match w's input size 4.*\(2, 5\)"):
        F.linear(np.zeros((2, 5)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match=r"linear: w must have rank 2"):
        F.linear(np.zeros((2, 5)), np.zeros((5,)))
    with pytest.raises(ValueError, match=r"linear: bias must have shape \(3,\)"):
        F.linear(np.zeros((2, 5)), np.zeros((5, 3)), np.zeros(5))


@pytest.mark.torch
def test_linear_matches_torch_with_gradients():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((6, 7), (7, 3), (3,)))
    g = rng.standard_normal((6, 3)).astype(np.float32)
    y, vjp = jax.vjp(F.linear, x, w, b)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w.T.copy(), b))
    yt = torch.nn.functional.linear(xt, wt, bt)
    yt.backward(torch.tensor(g))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=RTOL, atol=RTOL)
    for ours, theirs in zip(vjp(jnp.asarray(g)), (xt.grad, wt.grad.T, bt.grad)):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=RTOL, atol=RTOL)
