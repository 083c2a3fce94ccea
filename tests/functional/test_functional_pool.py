"""Pooling ops against naive loops and PyTorch, values and gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from jaxcnn import functional as F
from numeric import assert_close

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}   # relative to max(|expected|, 1)
GRAD_RTOL = 1e-5
NUMERIC_GRAD_TOL = 2e-2

SETTINGS = settings(max_examples=25, deadline=None)


def torch_out_size(n, lo, hi, k, s, d, ceil_mode):
    """PyTorch's documented pooling output size (pooling_output_shape_pad_lr)."""
    num = n + lo + hi - d * (k - 1) - 1
    out = (num + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= n + lo:
        out -= 1
    return out


def pool_ref(x, kernel, stride, pads, dilation, ceil_mode, mode, count_include_pad=True):
    """Window loops: each output visits its window positions one by one.

    ``mode`` is "max" (positions outside the input are skipped, i.e. -inf) or
    "avg" (PyTorch's divisor: the window clipped to the padded extent, or just
    the in-input positions without count_include_pad).
    """
    x = np.asarray(x, np.float64)
    n, h, w, c = x.shape
    (kh_, kw_), (sh, sw), (dh, dw) = kernel, stride, dilation
    (top, bottom), (left, right) = pads
    oh_ = torch_out_size(h, top, bottom, kh_, sh, dh, ceil_mode)
    ow_ = torch_out_size(w, left, right, kw_, sw, dw, ceil_mode)
    y = np.zeros((n, oh_, ow_, c))
    for oh in range(oh_):
        for ow in range(ow_):
            h0, w0 = oh * sh - top, ow * sw - left
            vals = [x[:, h0 + kh * dh, w0 + kw * dw] for kh in range(kh_) for kw in range(kw_)
                    if 0 <= h0 + kh * dh < h and 0 <= w0 + kw * dw < w]
            if mode == "max":
                # A dilated window can miss the input entirely: all -inf padding.
                y[:, oh, ow] = np.max(vals, axis=0) if vals else -np.inf
            else:
                if count_include_pad:
                    divisor = ((min(h0 + kh_, h + bottom) - h0) * (min(w0 + kw_, w + right) - w0))
                else:
                    divisor = len(vals)
                y[:, oh, ow] = np.sum(vals, axis=0) / divisor
    return y


def max_pool_grad_ref(x, g, kernel, stride, pads, dilation, ceil_mode):
    """Gradient of max pooling: each window sends its cotangent to its FIRST maximum
    in row-major (kh, kw) order."""
    n, h, w, c = x.shape
    (kh_, kw_), (sh, sw), (dh, dw) = kernel, stride, dilation
    (top, _), (left, _) = pads
    gx = np.zeros(x.shape)
    for oh in range(g.shape[1]):
        for ow in range(g.shape[2]):
            for b in range(n):
                for ch in range(c):
                    best = None
                    for kh in range(kh_):
                        for kw in range(kw_):
                            i, j = oh * sh - top + kh * dh, ow * sw - left + kw * dw
                            if 0 <= i < h and 0 <= j < w and (best is None or x[b, i, j, ch] > x[best + (ch,)]):
                                best = (b, i, j)
                    gx[best + (ch,)] += g[b, oh, ow, ch]
    return gx


@st.composite
def pool_cases(draw, with_dilation):
    k = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2))) if with_dilation else (1, 1)
    pads = tuple((draw(st.integers(0, kk // 2)), draw(st.integers(0, kk // 2))) for kk in k)
    kind = draw(st.sampled_from(["explicit", "symmetric"]))
    if kind == "symmetric":
        pads = tuple((lo, lo) for lo, _ in pads)
    k_eff = [(kk - 1) * d + 1 for kk, d in zip(k, dilation)]
    hw = [max(ke - lo - hi, 1) + draw(st.integers(0, 4)) for ke, (lo, hi) in zip(k_eff, pads)]
    return dict(n=draw(st.integers(1, 2)), hw=hw, c=draw(st.integers(1, 3)), k=k, stride=stride,
                dilation=dilation, pads=pads, ceil_mode=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def padding_arg(pads):
    """The user-facing padding argument for ``pads`` (symmetric ones as a pair)."""
    if all(lo == hi for lo, hi in pads):
        return tuple(lo for lo, _ in pads)
    return pads


@SETTINGS
@given(pool_cases(with_dilation=True))
def test_max_pool2d_matches_loops(case):
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((case["n"], *case["hw"], case["c"])).astype(np.float32)
    # One jit per example: the dilated path is many small ops, slow to dispatch eagerly.
    y = jax.jit(lambda x: F.max_pool2d(x, case["k"], stride=case["stride"],
                                       padding=padding_arg(case["pads"]),
                                       dilation=case["dilation"], ceil_mode=case["ceil_mode"]))(x)
    expected = pool_ref(x, case["k"], case["stride"], case["pads"], case["dilation"],
                        case["ceil_mode"], "max")
    np.testing.assert_array_equal(np.asarray(y), expected.astype(np.float32))


@SETTINGS
@given(pool_cases(with_dilation=False), st.booleans())
def test_avg_pool2d_matches_loops(case, count_include_pad):
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal((case["n"], *case["hw"], case["c"])).astype(np.float32)
    y = F.avg_pool2d(x, case["k"], stride=case["stride"], padding=padding_arg(case["pads"]),
                     ceil_mode=case["ceil_mode"], count_include_pad=count_include_pad)
    expected = pool_ref(x, case["k"], case["stride"], case["pads"], (1, 1), case["ceil_mode"],
                        "avg", count_include_pad)
    assert_close(y, expected, RTOL[jnp.float32])


def test_ceil_mode_output_sizes():
    # Output shapes only: each pool is traced (jax.eval_shape), not compiled op by op.
    def shape(pool, x, *args, **kwargs):
        return jax.eval_shape(lambda x: pool(x, *args, **kwargs), x).shape

    # H=5, k=2, s=2: floor gives 2 windows; ceil_mode adds a partial one starting at row 4,
    # inside the input.
    x5 = jax.ShapeDtypeStruct((1, 5, 5, 1), jnp.float32)
    assert shape(F.max_pool2d, x5, 2) == (1, 2, 2, 1)
    assert shape(F.max_pool2d, x5, 2, ceil_mode=True) == (1, 3, 3, 1)
    # H=6, k=3, s=4, pad=1: floor gives 2; rounding up would add a window starting at padded
    # index 8, i.e. input row 7, past the input and the right padding, so PyTorch drops it.
    x6 = jax.ShapeDtypeStruct((1, 6, 6, 1), jnp.float32)
    assert shape(F.avg_pool2d, x6, 3, stride=4, padding=1) == (1, 2, 2, 1)
    assert shape(F.avg_pool2d, x6, 3, stride=4, padding=1, ceil_mode=True) == (1, 2, 2, 1)
    assert shape(F.max_pool2d, x6, 3, stride=4, padding=1, ceil_mode=True) == (1, 2, 2, 1)


def test_avg_pool_ceil_mode_divisor_counts_padding_not_overhang():
    # H=W=4, k=3, s=2, pad=1, ceil_mode: windows start at -1, 1, 3; the last spans rows
    # 3, 4(pad), 5(overhang), so with count_include_pad its divisor per axis is 2, not 3.
    x = jnp.ones((1, 4, 4, 1))
    y = F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=True)
    rows = np.array([2 / 3, 1.0, 1 / 2])   # in-input count / divisor per axis
    np.testing.assert_allclose(np.asarray(y)[0, :, :, 0], np.outer(rows, rows), rtol=1e-6)
    y = F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)
    np.testing.assert_allclose(np.asarray(y), 1.0, rtol=1e-6)


def test_avg_pool_bf16_sums_in_float32():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 8, 3)).astype(np.float32)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = F.avg_pool2d(xb, 4, stride=2, padding=1)
    assert y.dtype == jnp.bfloat16
    expected = pool_ref(np.asarray(xb, np.float32), (4, 4), (2, 2), ((1, 1), (1, 1)), (1, 1), False, "avg")
    assert_close(y, expected, RTOL[jnp.bfloat16])


def test_max_pool_integer_input_pads_with_dtype_minimum():
    # All values negative: zero padding would wrongly win every border window.
    x = -np.arange(1, 17, dtype=np.int32).reshape(1, 4, 4, 1)
    y = F.max_pool2d(x, 3, stride=2, padding=1)
    assert y.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(y)[0, :, :, 0], [[-1, -2], [-5, -6]])


def test_same_padding_has_xla_meaning():
    x = np.random.default_rng(1).standard_normal((1, 5, 7, 2)).astype(np.float32)
    # XLA SAME: ceil(5/2)=3 rows need (3-1)*2+3-5 = 2 pad rows (1, 1); 7 cols: 4 outs, 3 pads (1, 2).
    y = F.max_pool2d(x, 3, stride=2, padding="SAME")
    expected = jax.lax.reduce_window(x, -np.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    np.testing.assert_array_equal(y, expected)
    assert_close(y, pool_ref(x, (3, 3), (2, 2), ((1, 1), (1, 2)), (1, 1), False, "max"), 0)
    y = F.avg_pool2d(x, 3, stride=2, padding="VALID")
    assert_close(y, pool_ref(x, (3, 3), (2, 2), ((0, 0), (0, 0)), (1, 1), False, "avg"), RTOL[jnp.float32])


TIE_CASES = [
    # (kernel, stride, padding, dilation, ceil_mode)
    ((2, 2), (2, 2), 0, 1, False),
    ((3, 3), (1, 1), 1, 1, False),      # overlapping windows accumulate
    ((3, 2), (2, 1), (1, 1), (1, 2), True),
]


@pytest.mark.parametrize("kernel,stride,padding,dilation,ceil_mode", TIE_CASES)
def test_max_pool_gradient_goes_to_first_max_on_ties(kernel, stride, padding, dilation, ceil_mode):
    rng = np.random.default_rng(5)
    # relu of small integers: mostly zeros and repeated values, so most windows tie.
    x = np.maximum(rng.integers(-3, 3, size=(2, 7, 6, 2)), 0).astype(np.float32)
    fn = lambda x: F.max_pool2d(x, kernel, stride=stride, padding=padding, dilation=dilation,
                                ceil_mode=ceil_mode)
    g = rng.standard_normal(jax.eval_shape(fn, x).shape).astype(np.float32)
    y, dx = jit_value_and_pullback(fn)(x, g)
    ph, pw = (padding, padding) if isinstance(padding, int) else padding
    d = (dilation, dilation) if isinstance(dilation, int) else dilation
    expected = max_pool_grad_ref(x, g, kernel, stride, ((ph, ph), (pw, pw)), d, ceil_mode)
    assert_close(dx, expected, RTOL[jnp.float32])


def test_pool_gradients_numerically():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((1, 6, 5, 2)), jnp.float32)
    # Each function jitted: its evaluations (x and x +- eps v) and its vjp run compiled
    # programs, not an eager op at a time; the derivative checked is the same.
    check_grads(jax.jit(lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, ceil_mode=True,
                                               count_include_pad=False)),
                (x,), order=1, modes=("rev",), atol=NUMERIC_GRAD_TOL, rtol=NUMERIC_GRAD_TOL, eps=1e-2)
    # Distinct, well separated values keep finite differences away from max switches.
    xm = jnp.asarray(np.random.default_rng(7).permutation(60).reshape(1, 6, 5, 2), jnp.float32)
    check_grads(jax.jit(lambda x: F.max_pool2d(x, 2, stride=1, padding=1)), (xm,), order=1,
                modes=("rev",), atol=NUMERIC_GRAD_TOL, rtol=NUMERIC_GRAD_TOL, eps=1e-2)


def adaptive_ref(x, out_hw):
    n, h, w, c = x.shape
    oh_, ow_ = out_hw
    y = np.zeros((n, oh_, ow_, c))
    for i in range(oh_):
        for j in range(ow_):
            h0, h1 = (i * h) // oh_, -(-((i + 1) * h) // oh_)
            w0, w1 = (j * w) // ow_, -(-((j + 1) * w) // ow_)
            y[:, i, j] = np.asarray(x, np.float64)[:, h0:h1, w0:w1].mean(axis=(1, 2))
    return y


@settings(max_examples=15, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 7), st.integers(1, 7), st.integers(0, 99))
def test_adaptive_avg_pool2d_matches_loops(h, w, oh, ow, seed):
    x = np.random.default_rng(seed).standard_normal((2, h, w, 3)).astype(np.float32)
    assert_close(F.adaptive_avg_pool2d(x, (oh, ow)), adaptive_ref(x, (oh, ow)), RTOL[jnp.float32])


def test_adaptive_and_global_pool_shapes_and_values():
    x = np.random.default_rng(8).standard_normal((2, 6, 4, 3)).astype(np.float32)
    assert_close(F.adaptive_avg_pool2d(x, 2), adaptive_ref(x, (2, 2)), RTOL[jnp.float32])
    assert_close(F.adaptive_avg_pool2d(x, (None, 3)), adaptive_ref(x, (6, 3)), RTOL[jnp.float32])
    assert_close(F.global_avg_pool2d(x), x.astype(np.float64).mean(axis=(1, 2)), RTOL[jnp.float32])
    assert F.global_avg_pool2d(x, keepdims=True).shape == (2, 1, 1, 3)
    gx = jax.grad(lambda x: jnp.sum(F.adaptive_avg_pool2d(x, (4, 3)) ** 2))(jnp.asarray(x))
    assert gx.shape == x.shape and np.all(np.isfinite(gx))


def test_impl_switch():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 4, 1)), jnp.float32)
    for op in (F.max_pool2d, F.avg_pool2d):
        np.testing.assert_array_equal(op(x, 2, impl="xla"), op(x, 2))
        assert_close(op(x, 2, impl="pallas"), op(x, 2, impl="xla"), RTOL[jnp.float32])
        with pytest.raises(ValueError, match=rf"{op.__name__}: impl must be one of"):
            op(x, 2, impl="triton")


X = np.zeros((2, 5, 5, 3), np.float32)
ERRORS = [
    (lambda: F.max_pool2d(X[0], 2), r"max_pool2d: x must have rank 4.*\(5, 5, 3\)"),
    (lambda: F.avg_pool2d(X[0], 2), r"avg_pool2d: x must have rank 4"),
    (lambda: F.max_pool2d(X, 6), r"max_pool2d: window \(6, 6\).*larger than the padded input \(5, 5\).*\(2, 5, 5, 3\)"),
    (lambda: F.max_pool2d(X, 3, dilation=3), r"max_pool2d: window \(7, 7\)"),
    (lambda: F.avg_pool2d(X, (2, 7)), r"avg_pool2d: window \(2, 7\)"),
    (lambda: F.max_pool2d(X, 2, padding=2), r"max_pool2d: padding .* at most half the kernel size"),
    (lambda: F.avg_pool2d(X, 3, padding=((0, 2), (0, 0))), r"avg_pool2d: padding .* at most half"),
    (lambda: F.max_pool2d(X, 2, stride=0), r"max_pool2d: stride must be >= 1"),
    (lambda: F.max_pool2d(X, 0), r"max_pool2d: kernel_size must be >= 1"),
    (lambda: F.avg_pool2d(X, 2, padding="reflect"), r"avg_pool2d: padding must be"),
    (lambda: F.adaptive_avg_pool2d(X, 0), r"adaptive_avg_pool2d: output_size must be >= 1"),
    (lambda: F.adaptive_avg_pool2d(X[0], 2), r"adaptive_avg_pool2d: x must have rank 4"),
    (lambda: F.global_avg_pool2d(X[0]), r"global_avg_pool2d: x must have rank 4"),
]


@pytest.mark.parametrize("call,match", ERRORS)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------- PyTorch reference

def jit_value_and_pullback(fn):
    """fn's value and its vjp of a cotangent as one compiled program (not an eager op at a time)."""
    return jax.jit(lambda x, g: (lambda y, vjp: (y, vjp(g)[0]))(*jax.vjp(fn, x)))


TORCH_POOL_CASES = [
    # (x shape NHWC, kernel, stride, padding, dilation, ceil_mode)
    ((2, 7, 7, 3), 3, 2, 1, 1, True),
    ((2, 7, 7, 3), 3, 2, 1, 1, False),
    ((1, 6, 9, 2), (2, 3), (2, 2), (1, 1), (1, 1), True),
    ((1, 8, 8, 2), 2, 3, 1, 1, True),
    ((1, 9, 6, 2), 3, (3, 2), (1, 0), (2, 1), True),        # max only: dilation
    ((2, 5, 5, 2), 4, 3, 2, 1, True),
    ((1, 11, 10, 2), 3, 3, 0, 1, True),
]


@pytest.mark.torch
@pytest.mark.parametrize("x_shape,kernel,stride,padding,dilation,ceil_mode", TORCH_POOL_CASES)
def test_max_pool2d_matches_torch_with_ties(x_shape, kernel, stride, padding, dilation, ceil_mode):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    x = np.maximum(rng.integers(-2, 3, size=x_shape), 0).astype(np.float32)   # many ties
    fn = lambda x: F.max_pool2d(x, kernel, stride=stride, padding=padding, dilation=dilation,
                                ceil_mode=ceil_mode)
    g = rng.standard_normal(jax.eval_shape(fn, x).shape).astype(np.float32)
    y, dx = jit_value_and_pullback(fn)(x, g)
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    yt = torch.nn.functional.max_pool2d(xt, kernel, stride, padding, dilation, ceil_mode=ceil_mode)
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy().transpose(0, 2, 3, 1))
    assert_close(dx, xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)


@pytest.mark.torch
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("x_shape,kernel,stride,padding,dilation,ceil_mode",
                         [c for c in TORCH_POOL_CASES if c[4] == 1])
def test_avg_pool2d_matches_torch(x_shape, kernel, stride, padding, dilation, ceil_mode,
                                  count_include_pad):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(10)
    x = rng.standard_normal(x_shape).astype(np.float32)
    fn = lambda x: F.avg_pool2d(x, kernel, stride=stride, padding=padding, ceil_mode=ceil_mode,
                                count_include_pad=count_include_pad)
    g = rng.standard_normal(jax.eval_shape(fn, x).shape).astype(np.float32)
    y, dx = jit_value_and_pullback(fn)(x, g)
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    yt = torch.nn.functional.avg_pool2d(xt, kernel, stride, padding, ceil_mode=ceil_mode,
                                        count_include_pad=count_include_pad)
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])
    assert_close(dx, xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)


@pytest.mark.torch
@pytest.mark.parametrize("hw,out", [((7, 7), (1, 1)), ((7, 7), (3, 3)), ((10, 6), (4, 5)),
                                    ((5, 5), (7, 7)), ((8, 8), (2, 4))])
def test_adaptive_avg_pool2d_matches_torch(hw, out):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, *hw, 3)).astype(np.float32)
    y, vjp = jax.vjp(lambda x: F.adaptive_avg_pool2d(x, out), x)
    g = rng.standard_normal(y.shape).astype(np.float32)
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    yt = torch.nn.functional.adaptive_avg_pool2d(xt, out)
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])
    assert_close(vjp(jnp.asarray(g))[0], xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)


# ---------------------------------------------------------------- adaptive max pooling


def adaptive_max_ref(x, out_hw, g=None):
    """Loops over PyTorch's adaptive bins: the max of each bin and, given a cotangent
    ``g``, the gradient, sent to each bin's first maximum in row-major order."""
    x = np.asarray(x, np.float64)
    n, h, w, c = x.shape
    oh_, ow_ = out_hw
    y = np.zeros((n, oh_, ow_, c))
    gx = np.zeros(x.shape)
    for i in range(oh_):
        for j in range(ow_):
            h0, h1 = (i * h) // oh_, -(-((i + 1) * h) // oh_)
            w0, w1 = (j * w) // ow_, -(-((j + 1) * w) // ow_)
            for b in range(n):
                for ch in range(c):
                    window = x[b, h0:h1, w0:w1, ch]
                    first = np.argmax(window)                  # row-major, first of equals
                    y[b, i, j, ch] = window.flat[first]
                    if g is not None:
                        r, s = divmod(first, w1 - w0)
                        gx[b, h0 + r, w0 + s, ch] += g[b, i, j, ch]
    return y, gx


# (H, W, OH, OW): overlapping bins, uneven bins, outputs larger than the input, equal
# bins on both axes (the strided max-pool path) and on one axis only.
ADAPTIVE_MAX_CASES = [(7, 7, 3, 3), (10, 6, 4, 5), (5, 5, 7, 7), (8, 8, 2, 4), (9, 4, 2, 4),
                      (6, 5, 1, 1), (3, 8, 3, 3)]


@pytest.mark.parametrize("h,w,oh,ow", ADAPTIVE_MAX_CASES[:4])
def test_adaptive_max_pool2d_matches_loops_with_ties(h, w, oh, ow):
    rng = np.random.default_rng(h * 100 + w * 10 + oh + ow)
    x = rng.integers(-2, 3, size=(2, h, w, 3)).astype(np.float32)   # many ties
    fn = lambda x: F.adaptive_max_pool2d(x, (oh, ow))
    g = rng.standard_normal(jax.eval_shape(fn, x).shape).astype(np.float32)
    y, dx = jit_value_and_pullback(fn)(x, g)
    y_ref, gx_ref = adaptive_max_ref(x, (oh, ow), g)
    np.testing.assert_array_equal(np.asarray(y), y_ref)               # a max is exact
    assert_close(dx, gx_ref, GRAD_RTOL)


def test_adaptive_max_pool2d_sizes_dtypes_and_jit():
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 6, 5, 3)).astype(np.float32)
    assert F.adaptive_max_pool2d(x, 2).shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(F.adaptive_max_pool2d(x, (None, 3)),
                                  adaptive_max_ref(x, (6, 3))[0])
    np.testing.assert_array_equal(jax.jit(F.adaptive_max_pool2d, static_argnums=1)(x, (4, 3)),
                                  adaptive_max_ref(x, (4, 3))[0])
    xi = rng.integers(-100, 100, size=(1, 7, 5, 2)).astype(np.int32)   # integers: exact
    yi = F.adaptive_max_pool2d(xi, (3, 2))
    assert yi.dtype == jnp.int32
    np.testing.assert_array_equal(yi, adaptive_max_ref(xi, (3, 2))[0])
    xb = jnp.asarray(x, jnp.bfloat16)                                  # bfloat16: exact too
    yb = F.adaptive_max_pool2d(xb, (4, 3))
    assert yb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(yb, np.float32),
                                  adaptive_max_ref(np.asarray(xb, np.float32), (4, 3))[0])
    xn = x.copy()
    xn[0, 0, 0, 0] = np.nan                                           # NaN propagates
    yn = np.asarray(F.adaptive_max_pool2d(xn, (4, 3)))
    assert np.isnan(yn[0, 0, 0, 0]) and np.isfinite(np.delete(yn.ravel(), 0)).all()


@pytest.mark.parametrize("call,match", [
    (lambda: F.adaptive_max_pool2d(X, 0), r"adaptive_max_pool2d: output_size must be >= 1"),
    (lambda: F.adaptive_max_pool2d(X, (2, 2, 2)), r"adaptive_max_pool2d: output_size must be"),
    (lambda: F.adaptive_max_pool2d(X[0], 2), r"adaptive_max_pool2d: x must have rank 4"),
])
def test_adaptive_max_pool2d_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.torch
@pytest.mark.parametrize("h,w,oh,ow,ties", [(*c, True) for c in ADAPTIVE_MAX_CASES]
                         + [(*c, False) for c in ADAPTIVE_MAX_CASES[:3]])
def test_adaptive_max_pool2d_matches_torch(h, w, oh, ow, ties):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(13)
    if ties:
        x = np.maximum(rng.integers(-2, 3, size=(2, h, w, 3)), 0).astype(np.float32)
    else:
        x = rng.standard_normal((2, h, w, 3)).astype(np.float32)
    fn = lambda x: F.adaptive_max_pool2d(x, (oh, ow))
    g = rng.standard_normal(jax.eval_shape(fn, x).shape).astype(np.float32)
    y, dx = jit_value_and_pullback(fn)(x, g)
    xt = torch.tensor(x.transpose(0, 3, 1, 2), requires_grad=True)
    yt = torch.nn.functional.adaptive_max_pool2d(xt, (oh, ow))
    yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
    np.testing.assert_array_equal(np.asarray(y), yt.detach().numpy().transpose(0, 2, 3, 1))
    assert_close(dx, xt.grad.numpy().transpose(0, 2, 3, 1), GRAD_RTOL)
