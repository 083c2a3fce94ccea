"""Conv2D, ConvTranspose2D and Linear: init shapes/params, analytic output
shapes against traced apply, numerics against naive numpy references (float64)
and PyTorch (when installed), validation errors, policy dtypes.

Tolerances: float32 layer vs float64 numpy reference, rtol/atol 1e-5 (sums of
<= 100 terms of O(1) values with "highest" matmul precision)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcnn import layers as L
from jaxcnn.precision import Policy

KEY = jax.random.key(0)
TOL = dict(rtol=1e-5, atol=1e-5)


def init_shapes(layer, input_shape):
    """(params shapes, state shapes, output_shape) without computing anything."""
    box = {}

    def f(k):
        p, s, box["out"] = layer.init(k, input_shape)
        return p, s
    p, s = jax.eval_shape(f, KEY)
    shapes = lambda t: jax.tree_util.tree_map(lambda a: a.shape, t)  # noqa: E731
    return shapes(p), shapes(s), box["out"]


def traced_output_shape(layer, input_shape, **kw):
    p, s = jax.eval_shape(lambda k: layer.init(k, input_shape)[:2], KEY)
    x = jax.ShapeDtypeStruct(input_shape, jnp.float32)
    return jax.eval_shape(lambda p, s, x: layer.apply(p, s, x, **kw)[0], p, s, x).shape


def random_params(layer, input_shape, seed=0):
    """Params of the right shapes from numpy, so that numeric tests need not
    compile the PRNG (slow on a busy 2-core machine); init itself is tested in
    test_layers_initializers.py."""
    rng = np.random.default_rng(seed)
    p = jax.eval_shape(lambda k: layer.init(k, input_shape)[0], KEY)
    return jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype) * 0.5, p)


def assert_shapes_agree(layer, shape):
    """init's analytic output shape equals the traced apply's, or both reject the input."""
    try:
        expected = init_shapes(layer, shape)[2]
    except ValueError as e:
        assert "too small" in str(e)
        with pytest.raises(ValueError):
            traced_output_shape(layer, shape)
        return
    assert expected == traced_output_shape(layer, shape)


def run(layer, x, **kw):
    params = random_params(layer, x.shape)
    y, _ = jax.jit(lambda p, x: layer.apply(p, {}, x, **kw))(params, x)
    return params, np.asarray(y)


def np_conv(x, w, b, stride, pads, dilation, groups):
    x = np.pad(np.asarray(x, np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
    w = np.asarray(w, np.float64)
    (sh, sw), (dh, dw) = stride, dilation
    n, h, wd, c = x.shape
    kh, kw, cg, o = w.shape
    og = o // groups
    oh, ow = (h - dh * (kh - 1) - 1) // sh + 1, (wd - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, oh, ow, o))
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i * dh: i * dh + sh * (oh - 1) + 1: sh, j * dw: j * dw + sw * (ow - 1) + 1: sw]
            for g in range(groups):
                out[..., g * og:(g + 1) * og] += patch[..., g * cg:(g + 1) * cg] @ w[i, j, :, g * og:(g + 1) * og]
    return out if b is None else out + np.asarray(b, np.float64)


def np_conv_transpose(x, w, b, stride, pads, output_padding, dilation, groups):
    """Scatter form of the definition: every input pixel adds x * w into the output."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    (sh, sw), (dh, dw) = stride, dilation
    n, h, wd, c = x.shape
    kh, kw, _, og = w.shape
    cg = c // groups
    full = np.zeros((n, (h - 1) * sh + dh * (kh - 1) + 1 + output_padding[0],
                     (wd - 1) * sw + dw * (kw - 1) + 1 + output_padding[1], og * groups))
    for i in range(kh):
        for j in range(kw):
            for g in range(groups):
                full[:, i * dh: i * dh + sh * (h - 1) + 1: sh, j * dw: j * dw + sw * (wd - 1) + 1: sw,
                     g * og:(g + 1) * og] += x[..., g * cg:(g + 1) * cg] @ w[i, j, g * cg:(g + 1) * cg]
    oh, ow = full.shape[1] - sum(pads[0]), full.shape[2] - sum(pads[1])
    out = full[:, pads[0][0]: pads[0][0] + oh, pads[1][0]: pads[1][0] + ow]
    return out if b is None else out + np.asarray(b, np.float64)


def rand(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---------------------------------------------------------------- Conv2D

def test_conv2d_params_and_config():
    p, s, out = init_shapes(L.Conv2D(16, (3, 5), stride=2, padding=1, groups=4), (2, 9, 11, 8))
    assert p == {"w": (3, 5, 2, 16), "b": (16,)} and s == {}
    assert out == (2, 5, 5, 16)
    p, _, _ = init_shapes(L.Conv2D(4, 1, use_bias=False), (1, 3, 3, 2))
    assert p == {"w": (1, 1, 2, 4)}
    layer = L.Conv2D(8, 3, padding="same", dilation=2)
    assert layer.kind == "conv2d" and layer.children == ()
    assert layer.config == dict(out_channels=8, kernel_size=(3, 3), stride=(1, 1), padding="SAME",
                                dilation=(2, 2), groups=1, use_bias=True)


@pytest.mark.parametrize("cfg", [
    dict(k=3, stride=1, padding=1, dilation=1, groups=1),
    dict(k=(3, 2), stride=(2, 1), padding=((1, 0), (2, 1)), dilation=(1, 2), groups=2),
    dict(k=1, stride=2, padding=0, dilation=1, groups=6),
    dict(k=3, stride=1, padding="VALID", dilation=2, groups=3),
])
def test_conv2d_matches_numpy(cfg):
    layer = L.Conv2D(6, cfg["k"], stride=cfg["stride"], padding=cfg["padding"],
                     dilation=cfg["dilation"], groups=cfg["groups"])
    x = rand((2, 7, 8, 6))
    params, y = run(layer, x)
    c = layer.config
    pads = ((0, 0), (0, 0)) if c["padding"] == "VALID" else c["padding"]
    ref = np_conv(x, params["w"], params["b"], c["stride"], pads, c["dilation"], c["groups"])
    np.testing.assert_allclose(y, ref, **TOL)


def test_conv2d_same_padding_matches_lax():
    layer = L.Conv2D(5, 4, stride=3, padding="SAME")
    x = rand((1, 10, 7, 2))
    params, y = run(layer, x)
    ref = jax.lax.conv_general_dilated(x, params["w"], (3, 3), "SAME",
                                       dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                       precision="highest") + params["b"]
    assert y.shape == (1, 4, 3, 5)
    np.testing.assert_allclose(y, ref, **TOL)


conv_cfg = st.fixed_dictionaries(dict(
    k=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    stride=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilation=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    padding=st.one_of(st.integers(0, 2), st.sampled_from(["SAME", "VALID"]),
                      st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 2)),
                                st.tuples(st.integers(0, 2), st.integers(0, 2)))),
    groups=st.sampled_from([1, 2]),
    hw=st.tuples(st.integers(6, 12), st.integers(6, 12)),
))


@settings(max_examples=40, deadline=None)
@given(conv_cfg)
def test_conv2d_output_shape_matches_apply(cfg):
    layer = L.Conv2D(4, cfg["k"], stride=cfg["stride"], padding=cfg["padding"],
                     dilation=cfg["dilation"], groups=cfg["groups"])
    assert_shapes_agree(layer, (2, *cfg["hw"], 4))


@settings(max_examples=40, deadline=None)
@given(conv_cfg, st.tuples(st.integers(0, 2), st.integers(0, 2)))
def test_conv_transpose2d_output_shape_matches_apply(cfg, output_padding):
    padding = 1 if isinstance(cfg["padding"], str) else cfg["padding"]
    output_padding = tuple(min(op, max(s, d) - 1) for op, s, d
                           in zip(output_padding, cfg["stride"], cfg["dilation"]))
    layer = L.ConvTranspose2D(4, cfg["k"], stride=cfg["stride"], padding=padding,
                              output_padding=output_padding, dilation=cfg["dilation"],
                              groups=cfg["groups"])
    assert_shapes_agree(layer, (1, 3, 4, 2))


def test_conv2d_validation():
    with pytest.raises(ValueError, match=r"Conv2D: expected a rank-4 input .*\(8, 8, 3\)"):
        init_shapes(L.Conv2D(4, 3), (8, 8, 3))
    with pytest.raises(ValueError, match=r"Conv2D: groups=2 .*\(1, 8, 8, 3\)"):
        init_shapes(L.Conv2D(4, 3, groups=2), (1, 8, 8, 3))
    with pytest.raises(ValueError, match="Conv2D: groups=3 .*out_channels=4"):
        init_shapes(L.Conv2D(4, 3, groups=3), (1, 8, 8, 3))
    with pytest.raises(ValueError, match=r"Conv2D: input shape \(1, 2, 8, 3\) is too small"):
        init_shapes(L.Conv2D(4, 3), (1, 2, 8, 3))
    with pytest.raises(ValueError, match="Conv2D: kernel_size"):
        L.Conv2D(4, (3, 3, 3))
    with pytest.raises(ValueError, match="Conv2D: stride must be >= 1"):
        L.Conv2D(4, 3, stride=0)
    with pytest.raises(ValueError, match="Conv2D: padding string"):
        L.Conv2D(4, 3, padding="full")
    with pytest.raises(ValueError, match="unknown initializer"):
        L.Conv2D(4, 3, w_init="he")


# ---------------------------------------------------------------- ConvTranspose2D

def test_conv_transpose2d_params():
    p, s, out = init_shapes(L.ConvTranspose2D(6, 3, stride=2, padding=1, output_padding=1,
                                              groups=2), (2, 5, 4, 4))
    assert p == {"w": (3, 3, 4, 3), "b": (6,)} and s == {}
    assert out == (2, 10, 8, 6)


@pytest.mark.parametrize("cfg", [
    dict(k=3, stride=2, padding=1, output_padding=1, dilation=1, groups=1),
    dict(k=(2, 3), stride=(1, 3), padding=((0, 1), (2, 0)), output_padding=(0, 2),
         dilation=(2, 1), groups=2),
    dict(k=4, stride=2, padding=0, output_padding=0, dilation=1, groups=4),
])
def test_conv_transpose2d_matches_numpy(cfg):
    layer = L.ConvTranspose2D(4, cfg["k"], stride=cfg["stride"], padding=cfg["padding"],
                              output_padding=cfg["output_padding"], dilation=cfg["dilation"],
                              groups=cfg["groups"])
    x = rand((2, 4, 5, 4))
    params, y = run(layer, x)
    c = layer.config
    ref = np_conv_transpose(x, params["w"], params["b"], c["stride"], c["padding"],
                            c["output_padding"], c["dilation"], c["groups"])
    assert y.shape == ref.shape
    np.testing.assert_allclose(y, ref, **TOL)


def test_conv_transpose2d_validation():
    with pytest.raises(ValueError, match="ConvTranspose2D: output_padding"):
        L.ConvTranspose2D(4, 3, stride=2, output_padding=2)
    with pytest.raises(ValueError, match="ConvTranspose2D: padding must be numeric"):
        L.ConvTranspose2D(4, 3, padding="SAME")
    with pytest.raises(ValueError, match=r"ConvTranspose2D: groups=3 .*\(1, 4, 4, 4\)"):
        init_shapes(L.ConvTranspose2D(6, 3, groups=3), (1, 4, 4, 4))
    with pytest.raises(ValueError, match="ConvTranspose2D: expected a rank-4"):
        init_shapes(L.ConvTranspose2D(6, 3), (4, 4, 4))


# ---------------------------------------------------------------- Linear

def test_linear():
    layer = L.Linear(5)
    p, s, out = init_shapes(layer, (3, 2, 7))
    assert p == {"w": (7, 5), "b": (5,)} and s == {} and out == (3, 2, 5)
    assert traced_output_shape(layer, (3, 2, 7)) == (3, 2, 5)
    x = rand((3, 7))
    params, y = run(layer, x)
    np.testing.assert_allclose(y, x.astype(np.float64) @ np.asarray(params["w"], np.float64)
                               + np.asarray(params["b"]), **TOL)
    assert init_shapes(L.Linear(5, use_bias=False), (3, 7))[0] == {"w": (7, 5)}
    assert layer.kind == "linear" and layer.config == dict(out_features=5, use_bias=True)
    with pytest.raises(ValueError, match=r"Linear: expected an input of rank >= 2, got shape \(7,\)"):
        init_shapes(layer, (7,))
    with pytest.raises(ValueError, match="Linear: out_features"):
        L.Linear(0)


# ---------------------------------------------------------------- policy

@pytest.mark.parametrize("layer,shape", [
    (L.Conv2D(4, 3, padding=1), (1, 5, 5, 3)),
    (L.ConvTranspose2D(4, 3, stride=2), (1, 3, 3, 3)),
    (L.Linear(4), (2, 3)),
])
def test_bf16_policy(layer, shape):
    x = rand(shape)
    policy = Policy(compute_dtype=jnp.bfloat16)
    params, y32 = run(layer, x)
    y, _ = jax.jit(lambda p, x: layer.apply(p, {}, x, policy=policy))(params, x)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=0.05, atol=0.1)


# ---------------------------------------------------------------- PyTorch

@pytest.mark.torch
def test_conv_layers_match_torch():
    torch = pytest.importorskip("torch")
    x = rand((2, 6, 7, 4))
    xt = torch.from_numpy(x).permute(0, 3, 1, 2)
    conv = L.Conv2D(6, 3, stride=2, padding=(1, 2), dilation=(1, 2), groups=2)
    params, y = run(conv, x)
    ref = torch.nn.functional.conv2d(
        xt, torch.from_numpy(np.asarray(params["w"]).transpose(3, 2, 0, 1).copy()),
        torch.from_numpy(np.asarray(params["b"])), stride=2, padding=(1, 2), dilation=(1, 2),
        groups=2)
    np.testing.assert_allclose(y, ref.permute(0, 2, 3, 1).numpy(), **TOL)

    tconv = L.ConvTranspose2D(6, 3, stride=2, padding=1, output_padding=1, groups=2)
    params, y = run(tconv, x)
    ref = torch.nn.functional.conv_transpose2d(
        xt, torch.from_numpy(np.asarray(params["w"]).transpose(2, 3, 0, 1).copy()),
        torch.from_numpy(np.asarray(params["b"])), stride=2, padding=1, output_padding=1,
        groups=2)
    np.testing.assert_allclose(y, ref.permute(0, 2, 3, 1).numpy(), **TOL)


def test_linear_errors_name_its_path_in_the_model():
    """The input-shape error of a Linear inside a model named no layer ('linear: x's last axis
    must match w's input size ...'); now its path, as the combinators name theirs."""
    model = L.serial(L.Flatten(), ("classifier", L.serial(L.Linear(4), L.Relu(), L.Linear(2))))
    params, state, _ = model.init(jax.random.PRNGKey(0), (2, 3, 3, 1))
    x = rand((2, 4, 4, 1))  # another input size than at init: 16 features, not 9
    for apply in (model.apply, jax.jit(model.apply)):
        with pytest.raises(ValueError) as info:
            apply(params, state, x)
        assert str(info.value) == (
            "Linear at 'classifier.0': input shape (2, 16) does not end in the 9 features its "
            "weight takes (w shape (9, 4)); was the model initialised for another input size?")
    with pytest.raises(ValueError, match=r"^Linear at 'classifier.0': expected an input of rank >= 2, "
                                         r"got shape \(2,\)"):
        L.serial(("classifier", L.serial(L.Linear(4)))).init(jax.random.PRNGKey(0), (2,))
    # a Linear on its own has no path
    with pytest.raises(ValueError, match=r"^Linear: input shape \(2, 5\) does not end in the 9 features"):
        L.Linear(4).apply(params["classifier"]["0"], {}, rand((2, 5)))
    # the other layers' apply errors get the path as a note, as their init errors do
    conv = L.serial(("body", L.serial(L.Conv2D(4, 3))))
    params, state, _ = conv.init(jax.random.PRNGKey(0), (1, 5, 5, 3))
    with pytest.raises(ValueError, match="channel mismatch") as info:
        conv.apply(params, state, rand((1, 5, 5, 2)))
    assert [n for n in info.value.__notes__ if n.startswith("while applying")] == [
        "while applying layer 'body.0' to input shape (1, 5, 5, 2)"]
