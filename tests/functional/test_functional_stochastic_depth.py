"""F.stochastic_depth (torchvision's ``ops.stochastic_depth``) and F.layer_norm
over the channel axis of NHWC images (torchvision's ``LayerNorm2d``, ConvNeXt's
norm), against PyTorch with gradients.

stochastic_depth draws its mask from an explicit key, as F.dropout does, so
torch's generator cannot draw the same one: the comparison runs torchvision's
code with ``Tensor.bernoulli_`` made to return the mask our function drew (the
matched mask), then compares values and gradients; the keep rates of both are
checked against the binomial spread.  Tolerances: float32 1e-6, bfloat16 1e-2
(relative to max(|expected|, 1): x/(1-p) here, x * (1/(1-p)) rounded in torch).
LayerNorm: float32 1e-5 (values), 1e-4 (gradients); bfloat16 2e-2.
"""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import functional as F
from numeric import assert_close

SD_RTOL = {jnp.float32: 1e-6, jnp.bfloat16: 1e-2}


def _torchvision_stochastic_depth(torch, x, p, mode, training):
    """torchvision.ops.stochastic_depth, as written there."""
    if not training or p == 0.0:
        return x
    survival_rate = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device)
    noise = noise.bernoulli_(survival_rate)
    if survival_rate > 0.0:
        noise.div_(survival_rate)
    return x * noise


def _mask(y, x):
    """The per-row keep mask behind ``y = x * mask / (1 - p)`` (rows of x are non-zero)."""
    return np.any(np.asarray(y, np.float32) != 0, axis=tuple(range(1, y.ndim)))


@pytest.mark.parametrize("p", [0.2, 0.5])
def test_row_mode_drops_whole_examples(p):
    x = jnp.full((4000, 3, 2, 2), 3.0)
    y = np.asarray(F.stochastic_depth(jax.random.PRNGKey(0), x, p, deterministic=False))
    kept = _mask(y, x)
    assert abs(kept.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / kept.size)
    np.testing.assert_allclose(y[kept], 3.0 / (1 - p), rtol=1e-6)
    np.testing.assert_array_equal(y[~kept], 0.0)


def test_batch_mode_identity_determinism_and_errors():
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 4, 4, 3))
    outs = [np.asarray(F.stochastic_depth(jax.random.PRNGKey(k), x, 0.5, mode="batch",
                                          deterministic=False)) for k in range(20)]
    for y in outs:      # all or nothing
        assert np.array_equal(y, 0 * y) or np.allclose(y, 2 * np.asarray(x), rtol=1e-6)
    assert 0 < sum(np.any(y != 0) for y in outs) < 20
    key = jax.random.PRNGKey(2)
    a = F.stochastic_depth(key, x, 0.3, deterministic=False)
    np.testing.assert_array_equal(a, jax.jit(
        lambda k, x: F.stochastic_depth(k, x, 0.3, deterministic=False))(key, x))
    assert F.stochastic_depth(key, x, 0.3, deterministic=True) is x     # eval: identity
    assert F.stochastic_depth(key, x, 0.0, deterministic=False) is x
    np.testing.assert_array_equal(F.stochastic_depth(key, x, 1.0, deterministic=False), 0.0)
    assert F.stochastic_depth(key, x.astype(jnp.bfloat16), 0.3,
                              deterministic=False).dtype == jnp.bfloat16
    with pytest.raises(ValueError, match=r"stochastic_depth: p must be in \[0, 1\], got 1.5"):
        F.stochastic_depth(key, x, 1.5, deterministic=False)
    with pytest.raises(ValueError, match=r"stochastic_depth: mode must be one of .*'col'"):
        F.stochastic_depth(key, x, 0.5, mode="col", deterministic=False)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("mode, p", [("row", 0.3), ("row", 0.7), ("batch", 0.4)])
def test_matches_torchvision_with_the_same_mask(mode, p, dtype):
    torch = pytest.importorskip("torch")
    tdtype = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[dtype]
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((16, 5, 5, 4)) + 0.1, dtype)
    g = jnp.asarray(rng.standard_normal(x.shape), dtype)
    key = jax.random.PRNGKey(4)
    y, vjp = jax.vjp(lambda v: F.stochastic_depth(key, v, p, mode=mode, deterministic=False), x)
    (grad,) = vjp(g)
    mask = _mask(y, x)
    if mode == "batch":
        assert mask.all() or not mask.any()
        mask = mask[:1]

    def matched_bernoulli(self, survival):
        assert survival == pytest.approx(1 - p)
        return self.copy_(torch.from_numpy(mask.reshape(self.shape)).to(self.dtype))

    xt = torch.tensor(np.asarray(x, np.float32).transpose(0, 3, 1, 2), dtype=tdtype,
                      requires_grad=True)
    with mock.patch.object(torch.Tensor, "bernoulli_", matched_bernoulli):
        yt = _torchvision_stochastic_depth(torch, xt, p, mode, training=True)
    yt.backward(torch.tensor(np.asarray(g, np.float32).transpose(0, 3, 1, 2), dtype=tdtype))
    to_nhwc = lambda t: t.detach().float().numpy().transpose(0, 2, 3, 1)
    assert_close(y, to_nhwc(yt), SD_RTOL[dtype])
    assert_close(grad, to_nhwc(xt.grad), SD_RTOL[dtype])
    # torch's own draws keep rows at the same rate (binomial spread over 4000 rows).
    torch.manual_seed(0)
    kept = _torchvision_stochastic_depth(torch, torch.ones(4000, 1), p, "row", True)[:, 0] != 0
    assert abs(kept.float().mean().item() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / 4000)


@pytest.mark.torch
@pytest.mark.parametrize("dtype, rtol, grad_rtol", [(jnp.float32, 1e-5, 1e-4),
                                                    (jnp.bfloat16, 2e-2, 5e-2)],
                         ids=["f32", "bf16"])
def test_layer_norm_over_channels_matches_torchvision_layernorm2d(dtype, rtol, grad_rtol):
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((3, 4, 5, 8)) * 2 + 3).astype(np.float32)
    s, b = (rng.standard_normal(8) * 0.5 + 1).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    g = rng.standard_normal(x.shape).astype(np.float32)
    xq = np.asarray(jnp.asarray(x, dtype), np.float32)        # what bf16 keeps of x
    y, vjp = jax.vjp(lambda x, s, b: F.layer_norm(x, s, b, axes=-1, eps=1e-6),
                     jnp.asarray(x, dtype), jnp.asarray(s), jnp.asarray(b))
    assert y.dtype == dtype
    grads = vjp(jnp.asarray(g, dtype))
    # LayerNorm2d: NCHW -> NHWC, layer_norm over C, back to NCHW.
    xt = torch.tensor(xq.transpose(0, 3, 1, 2), requires_grad=True)
    st, bt = torch.tensor(s, requires_grad=True), torch.tensor(b, requires_grad=True)
    yt = tf.layer_norm(xt.permute(0, 2, 3, 1), (8,), st, bt, 1e-6).permute(0, 3, 1, 2)
    yt.backward(torch.tensor(np.asarray(jnp.asarray(g, dtype), np.float32).transpose(0, 3, 1, 2)))
    assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), rtol)
    assert_close(grads[0], xt.grad.numpy().transpose(0, 2, 3, 1), grad_rtol)
    assert_close(grads[1], st.grad.numpy(), grad_rtol)
    assert_close(grads[2], bt.grad.numpy(), grad_rtol)
