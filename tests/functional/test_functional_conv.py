"""conv2d and conv_transpose2d against naive loops, PyTorch and numerical gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from jaxcnn import functional as F
from numeric import assert_close, jaxpr_eqns

# Relative-to-max error bounds. fp32 against a float64 loop (the conftest
# sets jax_default_matmul_precision=highest); bf16 keeps 8 mantissa bits.
RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
GRAD_RTOL = 1e-5          # jax vs torch autograd, both fp32
NUMERIC_GRAD_TOL = 2e-2   # check_grads' finite differences in fp32

SETTINGS = settings(max_examples=20, deadline=None)


def same_pads(n, k_eff, s):
    """XLA's SAME padding, written out from its definition."""
    out = -(-n // s)
    total = max((out - 1) * s + k_eff - n, 0)
    return total // 2, total - total // 2


def conv2d_ref(x, w, b, stride, pads, dilation, groups):
    """Textbook direct convolution: explicit zero padding, loops over oh, ow, kh, kw, groups."""
    x = np.pad(np.asarray(x, np.float64), ((0, 0), pads[0], pads[1], (0, 0)))
    w = np.asarray(w, np.float64)
    n, h, wd, c = x.shape
    kh_, kw_, ci, co = w.shape
    (sh, sw), (dh, dw) = stride, dilation
    oh_ = (h - dh * (kh_ - 1) - 1) // sh + 1
    ow_ = (wd - dw * (kw_ - 1) - 1) // sw + 1
    cog = co // groups
    y = np.zeros((n, oh_, ow_, co))
    for oh in range(oh_):
        for ow in range(ow_):
            for kh in range(kh_):
                for kw in range(kw_):
                    for g in range(groups):
                        patch = x[:, oh * sh + kh * dh, ow * sw + kw * dw, g * ci:(g + 1) * ci]
                        y[:, oh, ow, g * cog:(g + 1) * cog] += patch @ w[kh, kw, :, g * cog:(g + 1) * cog]
    return y if b is None else y + np.asarray(b, np.float64)


def conv_transpose2d_ref(x, w, b, stride, pads, output_padding, dilation, groups):
    """Scatter form: each input pixel adds w times itself at stride spacing, then crop."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    n, h, wd, c = x.shape
    kh_, kw_, _, cog = w.shape
    (sh, sw), (dh, dw), (oph, opw) = stride, dilation, output_padding
    cig = c // groups
    full = np.zeros((n, (h - 1) * sh + dh * (kh_ - 1) + 1 + oph,
                     (wd - 1) * sw + dw * (kw_ - 1) + 1 + opw, cog * groups))
    for ih in range(h):
        for iw in range(wd):
            for kh in range(kh_):
                for kw in range(kw_):
                    for g in range(groups):
                        full[:, ih * sh + kh * dh, iw * sw + kw * dw, g * cog:(g + 1) * cog] += (
                            x[:, ih, iw, g * cig:(g + 1) * cig] @ w[kh, kw, g * cig:(g + 1) * cig])
    (top, bottom), (left, right) = pads
    y = full[:, top:full.shape[1] - bottom, left:full.shape[2] - right]
    return y if b is None else y + np.asarray(b, np.float64)


def rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


@st.composite
def conv_cases(draw):
    groups = draw(st.sampled_from([1, 2, 3]))
    ci, co = draw(st.integers(1, 3)) * groups, draw(st.integers(1, 3)) * groups
    k = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    kind = draw(st.sampled_from(["int", "pair", "explicit", "SAME", "VALID"]))
    padding = {
        "int": draw(st.integers(0, 2)),
        "pair": (draw(st.integers(0, 2)), draw(st.integers(0, 2))),
        "explicit": tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(2)),
        "SAME": "SAME", "VALID": "VALID",
    }[kind]
    k_eff = [(kk - 1) * d + 1 for kk, d in zip(k, dilation)]
    hw = [ke + draw(st.integers(0, 4)) for ke in k_eff]
    return dict(n=draw(st.integers(1, 2)), hw=hw, ci=ci, co=co, k=k, stride=stride,
                dilation=dilation, padding=padding, groups=groups,
                bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def resolve_pads(padding, hw, k, stride, dilation):
    k_eff = [(kk - 1) * d + 1 for kk, d in zip(k, dilation)]
    if padding == "SAME":
        return tuple(same_pads(n, ke, s) for n, ke, s in zip(hw, k_eff, stride))
    if padding == "VALID":
        return ((0, 0), (0, 0))
    if isinstance(padding, int):
        return ((padding, padding),) * 2
    if isinstance(padding[0], int):
        return tuple((p, p) for p in padding)
    return padding


@SETTINGS
@given(conv_cases())
def test_conv2d_matches_naive_loops(case):
    rng = np.random.default_rng(case["seed"])
    x = rand(rng, case["n"], *case["hw"], case["ci"])
    w = rand(rng, *case["k"], case["ci"] // case["groups"], case["co"])
    b = rand(rng, case["co"]) if case["bias"] else None
    y = F.conv2d(x, w, b, stride=case["stride"], padding=case["padding"],
                 dilation=case["dilation"], groups=case["groups"])
    pads = resolve_pads(case["padding"], case["hw"], case["k"], case["stride"], case["dilation"])
    expected = conv2d_ref(x, w, b, case["stride"], pads, case["dilation"], case["groups"])
    assert_close(y, expected, RTOL[jnp.float32])


@SETTINGS
@given(conv_cases(), st.data())
def test_conv_transpose2d_matches_scatter_loops(case, data):
    stride, dilation = case["stride"], case["dilation"]
    output_padding = tuple(data.draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
    k_eff = [(kk - 1) * d + 1 for kk, d in zip(case["k"], dilation)]
    # Crops must leave at least one output row/column.
    pads = tuple((data.draw(st.integers(0, 2)), data.draw(st.integers(0, 2))) for _ in range(2))
    hw = [max(n // 2, 1) for n in case["hw"]]
    full = [(n - 1) * s + ke + o for n, s, ke, o in zip(hw, stride, k_eff, output_padding)]
    pads = tuple((min(lo, f // 2), min(hi, (f - 1) // 2)) for (lo, hi), f in zip(pads, full))
    rng = np.random.default_rng(case["seed"])
    x = rand(rng, case["n"], *hw, case["ci"])
    w = rand(rng, *case["k"], case["ci"], case["co"] // case["groups"])
    b = rand(rng, case["co"]) if case["bias"] else None
    y = F.conv_transpose2d(x, w, b, stride=stride, padding=pads, output_padding=output_padding,
                           dilation=dilation, groups=case["groups"])
    expected = conv_transpose2d_ref(x, w, b, stride, pads, output_padding, dilation, case["groups"])
    assert_close(y, expected, RTOL[jnp.float32])


def test_conv2d_bf16_close_to_fp32_reference():
    rng = np.random.default_rng(0)
    x, w, b = rand(rng, 2, 6, 6, 4), rand(rng, 3, 3, 4, 5), rand(rng, 5)
    y = F.conv2d(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16),
                 jnp.asarray(b, jnp.bfloat16), padding=1)
    assert y.dtype == jnp.bfloat16
    assert_close(y, conv2d_ref(x, w, b, (1, 1), ((1, 1), (1, 1)), (1, 1), 1), RTOL[jnp.bfloat16])


def test_conv_transpose2d_is_the_input_gradient_of_conv2d():
    """<conv2d(x, w), g> = <x, conv_transpose2d(g, w')> with w' the in/out-swapped kernel."""
    rng = np.random.default_rng(1)
    groups, stride, pad, dil = 2, (2, 3), (1, 2), (2, 1)
    x, w = rand(rng, 2, 9, 10, 4), rand(rng, 3, 3, 2, 6)
    y, vjp = jax.vjp(lambda x: F.conv2d(x, w, stride=stride, padding=pad, dilation=dil,
                                        groups=groups), x)
    g = rand(rng, *y.shape)
    # (KH, KW, C_in // g, C_out) -> (KH, KW, C_out, C_in // g): the transposed kernel.
    wt = w.transpose(0, 1, 3, 2)
    out_pad = tuple(n - ((o - 1) * s - 2 * p + (k - 1) * d + 1)
                    for n, o, s, p, k, d in zip(x.shape[1:3], y.shape[1:3], stride, pad, (3, 3), dil))
    xt = F.conv_transpose2d(g, wt, stride=stride, padding=pad, output_padding=out_pad,
                            dilation=dil, groups=groups)
    assert_close(xt, vjp(g)[0], RTOL[jnp.float32])


@pytest.mark.parametrize("op", ["conv2d", "conv_transpose2d"])
def test_conv_gradients_numerically(op):
    rng = np.random.default_rng(2)
    x = jnp.asarray(rand(rng, 1, 5, 5, 4))
    if op == "conv2d":
        w, b = jnp.asarray(rand(rng, 3, 2, 2, 4)), jnp.asarray(rand(rng, 4))
        fn = lambda x, w, b: F.conv2d(x, w, b, stride=2, padding=((1, 0), (2, 1)), groups=2)
    else:
        w, b = jnp.asarray(rand(rng, 3, 2, 4, 3)), jnp.asarray(rand(rng, 6))
        fn = lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2, padding=1, output_padding=1,
                                                dilation=(1, 2), groups=2)
    # jitted, as in a model: its evaluations (x and x +- eps v) and its vjp run compiled
    # programs, not an eager op at a time; the derivative checked is the same.
    check_grads(jax.jit(fn), (x, w, b), order=1, modes=("rev",), atol=NUMERIC_GRAD_TOL,
                rtol=NUMERIC_GRAD_TOL, eps=1e-2)


def test_impl_switch():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 4, 2)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(3, 3, 2, 2)), jnp.float32)
    ref = F.conv2d(x, w, impl="xla")
    assert_close(F.conv2d(x, w, impl="auto"), ref, RTOL[jnp.float32])
    assert_close(F.conv2d(x, w, impl="pallas"), ref, RTOL[jnp.float32])  # interpret mode on CPU
    with pytest.raises(ValueError, match=r"conv2d: impl must be one of"):
        F.conv2d(x, w, impl="cudnn")


def test_works_under_jit():
    x, w = jnp.ones((1, 6, 6, 2)), jnp.ones((2, 2, 2, 3))
    f = jax.jit(lambda x, w: F.conv_transpose2d(F.conv2d(x, w, stride=2), w.transpose(0, 1, 3, 2),
                                                stride=2))
    assert f(x, w).shape == (1, 6, 6, 2)


X4 = np.zeros((2, 5, 5, 4), np.float32)
ERRORS = [
    (lambda: F.conv2d(np.zeros((5, 5, 4)), np.zeros((3, 3, 4, 2))), r"conv2d: x must have rank 4.*\(5, 5, 4\)"),
    (lambda: F.conv2d(X4, np.zeros((3, 4, 2))), r"conv2d: w must have rank 4.*\(3, 4, 2\)"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 3, 2))), r"conv2d: channel mismatch.*\(2, 5, 5, 4\).*\(3, 3, 3, 2\)"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 2, 3)), groups=2), r"conv2d: groups=2 must divide.*output channels 3"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 1, 3)), groups=3), r"conv2d: groups=3 must divide.*input channels 4"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), groups=0), r"conv2d: groups must be a positive int"),
    (lambda: F.conv2d(X4, np.zeros((6, 3, 4, 2))), r"conv2d: kernel \(6, 3\).*larger than the padded input \(5, 5\)"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), dilation=3), r"conv2d: kernel \(7, 7\).*padded input \(5, 5\)"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), stride=0), r"conv2d: stride must be >= 1"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), stride=(1, 2, 3)), r"conv2d: stride must be an int or a pair"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), padding=-1), r"conv2d: padding must be >= 0"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), padding="full"), r"conv2d: padding must be an int"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), padding=((1, -1), (0, 0))), r"conv2d: padding must be non-negative"),
    (lambda: F.conv2d(X4, np.zeros((3, 3, 4, 2)), np.zeros(3)), r"conv2d: bias must have shape \(2,\)"),
    (lambda: F.conv_transpose2d(X4, np.zeros((3, 3, 2, 2))), r"conv_transpose2d: channel mismatch.*\(3, 3, 2, 2\)"),
    (lambda: F.conv_transpose2d(X4, np.zeros((3, 3, 4, 2)), groups=3), r"conv_transpose2d: groups=3 must divide"),
    (lambda: F.conv_transpose2d(X4, np.zeros((3, 3, 4, 2)), stride=2, output_padding=2),
     r"conv_transpose2d: output_padding \(2, 2\) must be smaller"),
    (lambda: F.conv_transpose2d(X4, np.zeros((1, 1, 4, 2)), padding=3), r"conv_transpose2d: output size .* is empty"),
    (lambda: F.conv_transpose2d(X4, np.zeros((3, 3, 4, 2)), padding="SAME"), r"conv_transpose2d: padding must be"),
    (lambda: F.conv_transpose2d(X4[0], np.zeros((3, 3, 4, 2))), r"conv_transpose2d: x must have rank 4"),
]


@pytest.mark.parametrize("call,match", ERRORS)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_images_as_nchw_or_uint8_are_named_as_such():
    with pytest.raises(ValueError, match=r"x has 5 channels .*; jaxcnn takes NHWC images and x "
                                         r"looks like NCHW \(N, C, H, W\): x.transpose\(0, 2, 3, 1\)"):
        F.conv2d(np.zeros((2, 3, 5, 5), np.float32), np.zeros((3, 3, 3, 2), np.float32))
    with pytest.raises(ValueError, match=r"expects 3 \* groups=1 = 3 \(x shape \(2, 5, 5, 4\), "
                                         r"w shape \(3, 3, 3, 2\)\)$"):  # not NCHW: no hint
        F.conv2d(X4, np.zeros((3, 3, 3, 2), np.float32))
    with pytest.raises(TypeError, match=r"conv2d: x is uint8, w float32: convert images to "
                                        r"floating point first"):
        F.conv2d(X4.astype(np.uint8), np.zeros((3, 3, 4, 2), np.float32))


def test_errors_fire_at_trace_time():
    with pytest.raises(ValueError, match="conv2d: channel mismatch"):
        jax.eval_shape(lambda x: F.conv2d(x, jnp.zeros((3, 3, 3, 2))), jax.ShapeDtypeStruct(X4.shape, jnp.float32))


# ---------------------------------------------------------------- PyTorch reference

def _torch():
    return pytest.importorskip("torch")


TORCH_CONV_CASES = [
    # (x shape NHWC, kernel, stride, padding, dilation, groups)
    ((2, 7, 8, 4), (3, 3), 1, 1, 1, 1),
    ((2, 7, 8, 4), (3, 2), (2, 1), (1, 0), (1, 2), 2),
    ((1, 9, 9, 6), (3, 3), 2, ((0, 1), (1, 0)), 1, 3),      # asymmetric, via torch F.pad
    ((1, 9, 9, 6), (3, 3), 1, "SAME", 2, 6),                # depthwise, dilated SAME
    ((2, 8, 7, 3), (2, 3), 3, "VALID", 1, 1),
    ((1, 6, 6, 4), (5, 5), 2, "SAME", 1, 1),                # odd total pad: extra at bottom/right
    # Pads wider than the window less one, more on the top/left: the input gradient's
    # transposed convolution would have a negative low pad (openxla/xla#48713).
    ((2, 7, 6, 2), (2, 2), 1, ((2, 0), (2, 1)), 1, 1),
    ((2, 7, 6, 4), (2, 3), (2, 1), ((3, 0), (0, 4)), (1, 2), 2),
]


@pytest.mark.torch
@pytest.mark.parametrize("x_shape,k,stride,padding,dilation,groups", TORCH_CONV_CASES)
def test_conv2d_matches_torch_with_gradients(x_shape, k, stride, padding, dilation, groups):
    torch = _torch()
    rng = np.random.default_rng(3)
    c_in, c_out = x_shape[3], 2 * groups
    x, w, b = rand(rng, *x_shape), rand(rng, *k, c_in // groups, c_out), rand(rng, c_out)
    y, vjp = jax.vjp(lambda x, w, b: F.conv2d(x, w, b, stride=stride, padding=padding,
                                              dilation=dilation, groups=groups), x, w, b)
    g = rand(rng, *y.shape)
    gx, gw, gb = vjp(jnp.asarray(g))

    s2 = (stride, stride) if isinstance(stride, int) else stride
    d2 = (dilation, dilation) if isinstance(dilation, int) else dilation
    pads = resolve_pads(padding, x_shape[1:3], k, s2, d2)
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    wt = torch.tensor(w.transpose(3, 2, 0, 1), requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    xp = torch.nn.functional.pad(xt, (pads[1][0], pads[1][1], pads[0][0], pads[0][1]))
    yt = torch.nn.functional.conv2d(xp, wt, bt, stride=s2, dilation=d2, groups=groups)
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])
    assert_close(gx, xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)
    assert_close(gw, wt.grad.numpy().transpose(2, 3, 1, 0), GRAD_RTOL)
    assert_close(gb, bt.grad.numpy(), GRAD_RTOL)


TORCH_CONVT_CASES = [
    # (x shape NHWC, kernel, stride, padding, output_padding, dilation, groups)
    ((2, 4, 5, 4), (3, 3), 2, 1, 1, 1, 1),
    ((1, 5, 4, 4), (3, 2), (2, 3), (0, 1), (1, 2), 1, 2),
    ((2, 3, 3, 6), (2, 3), 3, 2, (0, 1), (2, 1), 3),
    ((1, 4, 4, 4), (4, 4), 2, 1, 0, 1, 4),                  # depthwise upsampling
    ((1, 3, 3, 2), (3, 3), 1, 0, 1, 2, 1),                  # output_padding < dilation
    ((2, 4, 5, 2), (1, 1), 3, 1, 2, 1, 1),                  # crop wider than the window
    ((2, 5, 4, 2), (2, 2), 1, 2, 0, 1, 1),
]


@pytest.mark.torch
@pytest.mark.parametrize("x_shape,k,stride,padding,output_padding,dilation,groups", TORCH_CONVT_CASES)
def test_conv_transpose2d_matches_torch_with_gradients(x_shape, k, stride, padding, output_padding,
                                                      dilation, groups):
    torch = _torch()
    rng = np.random.default_rng(4)
    c_in, c_out = x_shape[3], 2 * groups
    x, w, b = rand(rng, *x_shape), rand(rng, *k, c_in, c_out // groups), rand(rng, c_out)
    kw = dict(stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
              groups=groups)
    y, vjp = jax.vjp(lambda x, w, b: F.conv_transpose2d(x, w, b, **kw), x, w, b)
    g = rand(rng, *y.shape)
    gx, gw, gb = vjp(jnp.asarray(g))

    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    wt = torch.tensor(w.transpose(2, 3, 0, 1), requires_grad=True)
    bt = torch.tensor(b, requires_grad=True)
    yt = torch.nn.functional.conv_transpose2d(xt, wt, bt, **kw)
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])
    assert_close(gx, xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)
    assert_close(gw, wt.grad.numpy().transpose(2, 3, 0, 1), GRAD_RTOL)
    assert_close(gb, bt.grad.numpy(), GRAD_RTOL)


def _negative_low_pads(jaxpr) -> list:
    """The pads of every convolution in `jaxpr` (sub-jaxprs included) with a negative low pad."""
    return [eqn.params["padding"] for eqn in jaxpr_eqns(jaxpr)
            if eqn.primitive.name == "conv_general_dilated"
            and any(lo < 0 for lo, _ in eqn.params["padding"])]


@pytest.mark.parametrize("op", ["conv2d", "conv_transpose2d"])
def test_no_convolution_with_a_negative_low_pad_forward_or_backward(op):
    """XLA:CPU reads outside the input of a convolution with a negative low pad and a positive
    high one (openxla/xla#48713): garbage, at times NaN, in conv2d's input gradient when a pad
    is wider than the window less one, and in conv_transpose2d's output when it crops more than
    that.  Neither op nor its gradient may emit one; the torch cases above check the values."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rand(rng, 2, 7, 6, 2))
    if op == "conv2d":
        w = jnp.asarray(rand(rng, 2, 3, 2, 3))
        fn = lambda x, w: F.conv2d(x, w, padding=((2, 0), (3, 1)), dilation=(1, 1))
    else:
        w = jnp.asarray(rand(rng, 2, 2, 2, 3))
        fn = lambda x, w: F.conv_transpose2d(x, w, padding=((2, 0), (3, 1)))
    loss = lambda x, w: jnp.sum(fn(x, w) ** 2)
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(x, w).jaxpr
    assert "conv_general_dilated" in str(jaxpr)
    assert _negative_low_pads(jaxpr) == []
    # The same value as the explicitly padded (or cropped) VALID convolution.
    if op == "conv2d":
        want = F.conv2d(jnp.pad(x, ((0, 0), (2, 0), (3, 1), (0, 0))), w)
    else:
        want = F.conv_transpose2d(x, w)[:, 2:, 3:-1]
    assert_close(fn(x, w), want, RTOL[jnp.float32])
