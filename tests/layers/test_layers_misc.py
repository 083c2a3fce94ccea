"""Pooling, activation, dropout and reshape layers: analytic output shapes
against traced apply, numerics against float64 numpy references written from
PyTorch's documented semantics, PyTorch itself when installed, policy dtypes.

Tolerance: float32 vs float64 reference, rtol/atol 1e-6 (no long sums)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcnn import layers as L
from jaxcnn.precision import Policy

KEY = jax.random.key(0)
TOL = dict(rtol=1e-6, atol=1e-6)


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def init_out(layer, shape):
    p, s, out = layer.init(KEY, shape)  # parameter-free layers: no PRNG work
    assert p == {} and s == {}
    return out


def traced_out(layer, shape):
    x = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.eval_shape(lambda x: layer.apply({}, {}, x)[0], x).shape


def torch_out_size(n, k, s, lo, hi, d, ceil_mode):
    """PyTorch's pooling output size (pooling_output_shape), with per-side pads."""
    num = n + lo + hi - d * (k - 1) - 1
    out = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (out - 1) * s >= n + lo:
        out -= 1
    return out


def np_pool(x, k, s, pads, d, ceil_mode, mode, count_include_pad=True):
    """Naive pooling: loop over output positions; padding never wins a max and
    counts in an average's divisor only with count_include_pad (up to the pad,
    not the ceil_mode overhang)."""
    n, h, w, c = x.shape
    oh, ow = (torch_out_size(sz, k[i], s[i], *pads[i], d[i], ceil_mode) for i, sz in enumerate((h, w)))
    out = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            h0, w0 = i * s[0] - pads[0][0], j * s[1] - pads[1][0]
            rows = [r for r in range(h0, h0 + d[0] * k[0], d[0]) if 0 <= r < h]
            cols = [q for q in range(w0, w0 + d[1] * k[1], d[1]) if 0 <= q < w]
            win = x[:, rows][:, :, cols].astype(np.float64)
            if mode == "max":
                out[:, i, j] = win.max(axis=(1, 2))
            else:
                if count_include_pad:
                    div = ((min(h0 + k[0], h + pads[0][1]) - h0)
                           * (min(w0 + k[1], w + pads[1][1]) - w0))
                else:
                    div = len(rows) * len(cols)
                out[:, i, j] = win.sum(axis=(1, 2)) / div
    return out


# ---------------------------------------------------------------- pooling

@pytest.mark.parametrize("cfg", [
    dict(k=2, s=None, p=0, d=1, ceil=False),
    dict(k=3, s=2, p=1, d=1, ceil=True),
    dict(k=(3, 2), s=(2, 3), p=((1, 0), (0, 1)), d=(2, 1), ceil=True),
    dict(k=3, s=1, p="SAME", d=1, ceil=False),
])
def test_max_pool_matches_numpy(cfg):
    layer = L.MaxPool2D(cfg["k"], cfg["s"], cfg["p"], cfg["d"], cfg["ceil"])
    x = rand((2, 7, 8, 3))
    c = layer.config
    pads = c["padding"]
    if pads == "SAME":  # XLA SAME for a 3x3 stride-1 window: one on each side
        pads = ((1, 1), (1, 1))
    ref = np_pool(x, c["kernel_size"], c["stride"], pads, c["dilation"], cfg["ceil"], "max")
    y, _ = layer.apply({}, {}, x)
    assert init_out(layer, x.shape) == y.shape == ref.shape
    np.testing.assert_allclose(y, ref, **TOL)


@pytest.mark.parametrize("cfg", [
    dict(k=2, s=None, p=0, ceil=False, cip=True),
    dict(k=3, s=2, p=1, ceil=True, cip=True),
    dict(k=3, s=2, p=1, ceil=True, cip=False),
    dict(k=(2, 3), s=(3, 2), p=(1, 1), ceil=False, cip=False),
])
def test_avg_pool_matches_numpy(cfg):
    layer = L.AvgPool2D(cfg["k"], cfg["s"], cfg["p"], cfg["ceil"], cfg["cip"])
    x = rand((2, 7, 8, 3))
    c = layer.config
    ref = np_pool(x, c["kernel_size"], c["stride"], c["padding"], (1, 1), cfg["ceil"], "avg",
                  cfg["cip"])
    y, _ = layer.apply({}, {}, x)
    assert init_out(layer, x.shape) == y.shape == ref.shape
    np.testing.assert_allclose(y, ref, **TOL)


@settings(max_examples=50, deadline=None)
@given(k=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       s=st.tuples(st.integers(1, 3), st.integers(1, 3)),
       d=st.tuples(st.integers(1, 2), st.integers(1, 2)),
       p=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       ceil=st.booleans(), avg=st.booleans(), hw=st.tuples(st.integers(4, 11), st.integers(4, 11)))
def test_pool_output_shape_matches_apply(k, s, d, p, ceil, avg, hw):
    p = tuple(min(pi, ki // 2) for pi, ki in zip(p, k))
    layer = L.AvgPool2D(k, s, p, ceil) if avg else L.MaxPool2D(k, s, p, d, ceil)
    shape = (1, *hw, 2)
    try:
        out = init_out(layer, shape)
    except ValueError as e:
        assert "too small" in str(e)
        with pytest.raises(ValueError):
            traced_out(layer, shape)
        return
    assert out == traced_out(layer, shape)
    dd = (1, 1) if avg else d
    assert out[1:3] == tuple(torch_out_size(hw[i], k[i], s[i], p[i], p[i], dd[i], ceil)
                             for i in range(2))


def test_pool_validation_and_config():
    with pytest.raises(ValueError, match="MaxPool2D: padding .* at most half"):
        L.MaxPool2D(3, padding=2)
    with pytest.raises(ValueError, match=r"AvgPool2D: expected a rank-4 input .*\(4, 4, 3\)"):
        L.AvgPool2D(2).init(KEY, (4, 4, 3))
    with pytest.raises(ValueError, match=r"MaxPool2D: input shape \(1, 2, 2, 1\) is too small"):
        L.MaxPool2D(3).init(KEY, (1, 2, 2, 1))
    layer = L.MaxPool2D(3, 2, 1)
    assert layer.kind == "max_pool2d"
    assert layer.config == dict(kernel_size=(3, 3), stride=(2, 2), padding=((1, 1), (1, 1)),
                                dilation=(1, 1), ceil_mode=False)
    assert L.AvgPool2D(2).config["count_include_pad"] is True


def np_adaptive(x, oh, ow):
    n, h, w, c = x.shape
    out = np.zeros((n, oh, ow, c))
    for i in range(oh):
        for j in range(ow):
            r0, r1 = (i * h) // oh, -(-((i + 1) * h) // oh)
            c0, c1 = (j * w) // ow, -(-((j + 1) * w) // ow)
            out[:, i, j] = x[:, r0:r1, c0:c1].astype(np.float64).mean(axis=(1, 2))
    return out


@pytest.mark.parametrize("size,expected", [(3, (3, 3)), ((2, 5), (2, 5)), ((None, 4), (7, 4)),
                                           ((7, 8), (7, 8))])
def test_adaptive_avg_pool(size, expected):
    layer = L.AdaptiveAvgPool2D(size)
    x = rand((2, 7, 8, 3))
    y, _ = layer.apply({}, {}, x)
    assert init_out(layer, x.shape) == y.shape == (2, *expected, 3)
    np.testing.assert_allclose(y, np_adaptive(x, *expected), **TOL)
    with pytest.raises(ValueError, match="AdaptiveAvgPool2D: output_size"):
        L.AdaptiveAvgPool2D((0, 2))


def test_global_avg_pool():
    layer = L.GlobalAvgPool2D()
    x = rand((2, 5, 3, 4))
    y, _ = layer.apply({}, {}, x)
    assert init_out(layer, x.shape) == y.shape == (2, 4)
    np.testing.assert_allclose(y, x.astype(np.float64).mean(axis=(1, 2)), **TOL)
    with pytest.raises(ValueError, match=r"GlobalAvgPool2D: expected a rank-4 input .*\(2, 4\)"):
        layer.init(KEY, (2, 4))


# ---------------------------------------------------------------- activations

def _sig(x):
    return 1 / (1 + np.exp(-x))


_ERF = np.vectorize(math.erf)
ACTIVATIONS = [
    (L.Relu(), "relu", lambda x: np.maximum(x, 0)),
    (L.Relu6(), "relu6", lambda x: np.clip(x, 0, 6)),
    (L.LeakyRelu(0.2), "leaky_relu", lambda x: np.where(x >= 0, x, 0.2 * x)),
    (L.Elu(0.5), "elu", lambda x: np.where(x > 0, x, 0.5 * np.expm1(x))),
    (L.Gelu(), "gelu", lambda x: 0.5 * x * (1 + _ERF(x / math.sqrt(2)))),
    (L.Gelu(approximate=True), "gelu",
     lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))),
    (L.Silu(), "silu", lambda x: x * _sig(x)),
    (L.Hardswish(), "hardswish", lambda x: x * np.clip(x + 3, 0, 6) / 6),
    (L.Sigmoid(), "sigmoid", _sig),
    (L.Tanh(), "tanh", np.tanh),
    (L.Softmax(axis=1), "softmax", lambda x: np.exp(x) / np.exp(x).sum(1, keepdims=True)),
    (L.LogSoftmax(), "log_softmax", lambda x: x - np.log(np.exp(x).sum(-1, keepdims=True))),
]


@pytest.mark.parametrize("layer,kind,ref", ACTIVATIONS,
                         ids=[f"{kind}{i}" for i, (_, kind, _) in enumerate(ACTIVATIONS)])
def test_activation_matches_numpy(layer, kind, ref):
    x = 4 * rand((2, 3, 5))
    y, state = layer.apply({}, {}, x)
    assert layer.kind == kind and state == {} and init_out(layer, x.shape) == x.shape
    np.testing.assert_allclose(y, ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_activation_config_and_policy():
    assert L.LeakyRelu(0.3).config == {"negative_slope": 0.3}
    assert L.Softmax(axis=0).config == {"axis": 0}
    policy = Policy(compute_dtype=jnp.bfloat16)
    x = rand((2, 6))
    assert L.Relu().apply({}, {}, x, policy=policy)[0].dtype == jnp.bfloat16
    assert L.Relu().apply({}, {}, x)[0].dtype == jnp.float32
    # softmax computes in float32 and hands back its input's dtype
    assert L.Softmax().apply({}, {}, x, policy=policy)[0].dtype == jnp.float32
    xb = x.astype(jnp.bfloat16)
    y, _ = L.Softmax().apply({}, {}, xb, policy=policy)
    y32, _ = L.Softmax().apply({}, {}, xb.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=2 ** -8, atol=1e-7)


# ---------------------------------------------------------------- dropout, reshape

def test_dropout():
    layer = L.Dropout(0.3)
    x = np.ones((64, 64), np.float32)
    assert init_out(layer, x.shape) == x.shape and layer.config == {"rate": 0.3}
    y, state = layer.apply({}, {}, x)  # eval: identity, no rng needed
    np.testing.assert_array_equal(y, x)
    assert state == {}
    with pytest.raises(ValueError, match="Dropout: .*rng"):
        layer.apply({}, {}, x, train=True)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    y1, _ = layer.apply({}, {}, x, train=True, rng=k1)
    y1 = np.asarray(y1)
    # 4096 Bernoulli(0.3) draws: std of the fraction ~0.007, allow 4 sigma.
    assert abs((y1 == 0).mean() - 0.3) < 0.03
    np.testing.assert_allclose(y1[y1 != 0], 1 / 0.7, rtol=1e-6)
    np.testing.assert_array_equal(layer.apply({}, {}, x, train=True, rng=k1)[0], y1)
    assert (np.asarray(layer.apply({}, {}, x, train=True, rng=k2)[0]) != y1).any()
    y, _ = layer.apply({}, {}, x, policy=Policy(compute_dtype=jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="Dropout: rate"):
        L.Dropout(1.5)


def test_flatten_and_identity():
    x = rand((2, 3, 4, 5))
    y, _ = L.Flatten().apply({}, {}, x)
    assert init_out(L.Flatten(), x.shape) == y.shape == (2, 60)
    np.testing.assert_array_equal(y[1], x[1].ravel())  # row-major over (H, W, C)
    np.testing.assert_array_equal(y.reshape(2, 3, 4, 5)[:, 2, 1], x[:, 2, 1])
    assert L.Flatten().kind == "flatten"
    y, _ = L.Identity().apply({}, {}, x, train=True, policy=Policy(compute_dtype=jnp.bfloat16))
    assert y is x and init_out(L.Identity(), x.shape) == x.shape


# ---------------------------------------------------------------- PyTorch

@pytest.mark.torch
def test_pools_match_torch():
    torch = pytest.importorskip("torch")
    x = rand((2, 9, 7, 3))
    xt = torch.from_numpy(x).permute(0, 3, 1, 2)
    cases = [
        (L.MaxPool2D(3, 2, 1, 2, True), torch.nn.MaxPool2d(3, 2, 1, 2, ceil_mode=True)),
        (L.AvgPool2D(3, 2, 1, True, False), torch.nn.AvgPool2d(3, 2, 1, True, False)),
        (L.AvgPool2D((2, 3), 2, (1, 1), True, True), torch.nn.AvgPool2d((2, 3), 2, (1, 1), True, True)),
        (L.AdaptiveAvgPool2D((4, 5)), torch.nn.AdaptiveAvgPool2d((4, 5))),
    ]
    for ours, theirs in cases:
        y, _ = ours.apply({}, {}, x)
        ref = theirs(xt).permute(0, 2, 3, 1).numpy()
        assert init_out(ours, x.shape) == ref.shape
        np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
