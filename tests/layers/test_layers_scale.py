"""SqueezeExcitation (and the gate combinator under it), LayerScale,
StochasticDepth and Hardsigmoid layers: torchvision's SqueezeExcitation
written in PyTorch with the same weights (values and gradients), NumPy
references, errors, policies, and the layer-tree rebuild that export uses.

Tolerance: float32, max |ours - torch| <= 1e-5 * max(|torch|, 1) (values),
1e-4 (gradients: sums over the pooled positions)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn.export import fold_batch_norm
from jaxcnn.layers._tree import leaves, rewrite
from jaxcnn.precision import Policy
from numeric import assert_close

KEY = jax.random.PRNGKey(0)


def _variables(layer, shape, seed=0):
    rng = np.random.default_rng(seed)
    p = jax.eval_shape(lambda k: layer.init(k, shape)[0], KEY)
    return jax.tree_util.tree_map(lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype), p)


@pytest.mark.torch
@pytest.mark.parametrize("act, scale_act, t_act, t_scale", [
    ("Relu", "Hardsigmoid", "ReLU", "Hardsigmoid"),      # MobileNetV3's
    ("Silu", "Sigmoid", "SiLU", "Sigmoid"),              # EfficientNet's
])
def test_squeeze_excitation_matches_torchvision(act, scale_act, t_act, t_scale):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    shape = (2, 5, 6, 16)
    se = L.SqueezeExcitation(16, 8, activation=getattr(L, act),
                             scale_activation=getattr(L, scale_act))
    params = _variables(se, shape)
    assert set(params) == {"fc1", "fc2"} and params["fc1"]["w"].shape == (1, 1, 16, 8)
    rng = np.random.default_rng(1)
    x = (2 * rng.standard_normal(shape)).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    y, vjp = jax.vjp(lambda p, x: se.apply(p, {}, x)[0], params, jnp.asarray(x))
    dp, dx = vjp(jnp.asarray(g))

    # torchvision.ops.SqueezeExcitation: avgpool, fc1, activation, fc2, scale_activation.
    fc1, fc2 = nn.Conv2d(16, 8, 1), nn.Conv2d(8, 16, 1)
    with torch.no_grad():
        for conv, name in ((fc1, "fc1"), (fc2, "fc2")):
            conv.weight.copy_(torch.from_numpy(np.asarray(params[name]["w"]).transpose(3, 2, 0, 1)))
            conv.bias.copy_(torch.from_numpy(np.asarray(params[name]["b"])))
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    pooled = nn.AdaptiveAvgPool2d(1)(xt)
    yt = getattr(nn, t_scale)()(fc2(getattr(nn, t_act)()(fc1(pooled)))) * xt
    yt.backward(torch.from_numpy(g.transpose(0, 3, 1, 2)))
    nhwc = lambda t: t.detach().numpy().transpose(0, 2, 3, 1)
    assert_close(y, nhwc(yt), 1e-5)
    assert_close(dx, nhwc(xt.grad), 1e-4)
    assert_close(dp["fc1"]["w"], fc1.weight.grad.numpy().transpose(2, 3, 1, 0), 1e-4)
    assert_close(dp["fc2"]["b"], fc2.bias.grad.numpy(), 1e-4)


def test_gate_multiplies_by_its_body_and_checks_shapes():
    x = np.random.default_rng(2).standard_normal((2, 3, 3, 4)).astype(np.float32)
    g = L.gate(("pool", L.AdaptiveAvgPool2D(1)), ("sig", L.Sigmoid()))
    y, _ = g.apply({}, {}, x)
    expected = x * (1 / (1 + np.exp(-x.astype(np.float64).mean(axis=(1, 2), keepdims=True))))
    np.testing.assert_allclose(y, expected, rtol=1e-6, atol=1e-6)
    assert g.init(KEY, (2, 3, 3, 4))[2] == (2, 3, 3, 4)
    with pytest.raises(ValueError, match=r"gate at .*body output \(2, 3, 3, 2\) does not "
                                         r"broadcast to the input shape \(2, 3, 3, 4\)"):
        L.gate(L.Conv2D(2, 1)).init(KEY, (2, 3, 3, 4))
    with pytest.raises(ValueError, match="gate: needs at least one layer"):
        L.gate()
    with pytest.raises(ValueError, match=r"SqueezeExcitation: expected an input \(N, H, W, 8\), "
                                         r"got shape \(2, 3, 3, 4\)"):
        L.SqueezeExcitation(8, 2).init(KEY, (2, 3, 3, 4))
    with pytest.raises(ValueError, match="SqueezeExcitation: squeeze_channels must be a positive"):
        L.SqueezeExcitation(8, 0)


def test_gate_under_a_bf16_policy_and_in_the_tree_rebuild():
    model = L.serial(("conv", L.Conv2D(8, 3, padding=1)), ("bn", L.BatchNorm()),
                     ("se", L.SqueezeExcitation(8, 4)), ("pool", L.GlobalAvgPool2D()))
    params = _variables(model, (2, 6, 6, 3))
    state = {"bn": {"mean": jnp.full(8, 0.1), "var": jnp.full(8, 1.5),
                    "count": jnp.zeros((), jnp.int32)}}
    x = np.random.default_rng(3).standard_normal((2, 6, 6, 3)).astype(np.float32)
    same, p2, s2 = rewrite(model, params, state)        # rebuilt from kind and children
    assert [p for p, _ in leaves(same)] == [p for p, _ in leaves(model)]
    folded, pf, sf = fold_batch_norm(model, params, state)
    assert "bn" not in pf

    @jax.jit
    def run(x):
        return (model.apply(params, state, x)[0],
                model.apply(params, state, x, policy=Policy.parse("bf16"))[0],
                same.apply(p2, s2, x)[0], folded.apply(pf, sf, x)[0])

    y, yb, y_same, y_folded = run(x)
    assert yb.dtype == jnp.bfloat16
    assert_close(yb, y, 5e-2)
    np.testing.assert_array_equal(y_same, y)
    np.testing.assert_allclose(y_folded, y, rtol=1e-5, atol=1e-5)


def test_layer_scale_stochastic_depth_and_hardsigmoid_layers():
    x = np.random.default_rng(4).standard_normal((8, 2, 2, 3)).astype(np.float32)
    ls = L.LayerScale(0.25)
    params, state, out = ls.init(KEY, x.shape)
    assert out == x.shape and state == {}
    np.testing.assert_array_equal(params["scale"], [0.25] * 3)
    params = {"scale": jnp.asarray([1.0, -2.0, 0.5])}
    np.testing.assert_array_equal(ls.apply(params, {}, x)[0], x * np.float32([1.0, -2.0, 0.5]))

    sd = L.StochasticDepth(0.5)
    assert sd.init(KEY, x.shape) == ({}, {}, x.shape)
    np.testing.assert_array_equal(sd.apply({}, {}, x)[0], x)                      # eval
    y = np.asarray(sd.apply({}, {}, x, train=True, rng=jax.random.PRNGKey(1))[0])
    rows = [np.array_equal(r, 0 * r) or np.allclose(r, 2 * xr) for r, xr in zip(y, x)]
    assert all(rows)
    np.testing.assert_array_equal(L.StochasticDepth(0.0).apply({}, {}, x, train=True)[0], x)
    with pytest.raises(ValueError, match="StochasticDepth: apply.*needs an rng key"):
        sd.apply({}, {}, x, train=True)
    with pytest.raises(ValueError, match=r"StochasticDepth: p must be in \[0, 1\]"):
        L.StochasticDepth(-0.1)
    with pytest.raises(ValueError, match="StochasticDepth: mode must be one of"):
        L.StochasticDepth(0.1, mode="rows")

    hs = L.Hardsigmoid()
    np.testing.assert_allclose(hs.apply({}, {}, x)[0], np.clip(x + 3, 0, 6) / 6, rtol=1e-6)
    assert hs.kind == "hardsigmoid"
