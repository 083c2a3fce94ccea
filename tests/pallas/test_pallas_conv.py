"""Dense and depthwise Pallas convolutions against jax.lax: forward, input and weight gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_kernels as pk
from jaxcnn import functional as F
from jaxcnn import layers as L
from pallas_testlib import assert_close, fast_run, normal, vjp_all

BF16, F32 = jnp.bfloat16, jnp.float32
_DIMS = ("NHWC", "HWIO", "NHWC")


def _lax_conv(x, w, b, residual=None, *, stride, padding, dilation, groups=1, relu=False):
    """The reference, in float32 whatever the input dtype."""
    if not isinstance(padding, str):
        padding = ((padding, padding),) * 2 if isinstance(padding, int) else padding
    y = lax.conv_general_dilated(
        x.astype(F32), w.astype(F32), window_strides=(stride,) * 2 if isinstance(stride, int)
        else stride, padding=padding, rhs_dilation=(dilation,) * 2
        if isinstance(dilation, int) else dilation, dimension_numbers=_DIMS,
        feature_group_count=groups)
    if b is not None:
        y = y + b.astype(F32)
    if residual is not None:
        y = y + residual.astype(F32)
    return jnp.maximum(y, 0) if relu else y


def _check(x_shape, k, c_out, dtype, *, stride=1, padding=0, dilation=1, groups=1,
           config=None, backward="pallas", bias=True, seed=0):
    rng = np.random.default_rng(seed)
    x = normal(rng, x_shape, dtype)
    w = normal(rng, (k, k, x_shape[3] // groups, c_out), dtype)
    b = normal(rng, (c_out,), dtype) if bias else None
    conv = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)

    def kernel(x, w, b):
        return pk.conv2d(x, w, b, **conv, config=config, backward=backward)

    def reference(x, w, b):
        return _lax_conv(x, w, b, **conv)

    got_y, got_g = fast_run(lambda *a: vjp_all(kernel, a), x, w, b)
    want_y, want_g = jax.jit(lambda *a: vjp_all(reference, a))(
        x.astype(F32), w.astype(F32), None if b is None else b.astype(F32))
    assert got_y.dtype == dtype
    assert_close(got_y, want_y, dtype, "output")
    for name, got, want in zip(("dx", "dw", "db"), got_g, want_g):
        if want is not None:
            assert got.dtype == dtype
            assert_close(got, want, dtype, name)


@pytest.mark.parametrize("x_shape, k, c_out, stride, padding, dilation, dtype, config", [
    ((2, 9, 7, 5), 1, 6, 1, 0, 1, F32, None),
    ((2, 9, 7, 5), 3, 6, 1, 1, 1, F32, None),
    ((1, 10, 9, 6), 3, 8, 2, "SAME", 1, F32, None),
    ((2, 11, 8, 4), 3, 5, 1, 0, 2, F32, None),
    ((1, 12, 11, 3), 7, 16, 2, 3, 1, F32, None),
    ((1, 9, 9, 8), 5, 12, 2, 2, 1, BF16, None),
    # Tails everywhere: 3 pixel blocks, 2 channel chunks (20 = 16 + 4), 2 output
    # channel blocks (24 = 16 + 8), wgrad split 3.
    ((2, 13, 11, 20), 3, 24, 2, 1, 1, BF16, pk.BlockConfig(32, 16, 16, split=3)),
    ((1, 8, 9, 6), 3, 7, (1, 2), ((1, 0), (0, 2)), (2, 1), F32, pk.BlockConfig(32, 16, 16)),
    # Strided input gradients by phase: 1x1/2 (three of four phases get no tap, so their
    # pixels are written as zeros), stride 3 with dilation 2 (taps of a phase step by 3),
    # stride 2 with dilation 2 (every tap lands on one row phase), odd sizes, 2 pixel blocks.
    ((2, 7, 9, 8), 1, 8, 2, 0, 1, F32, pk.BlockConfig(32, 16, 16)),
    ((1, 11, 10, 4), 3, 6, 3, 2, 2, F32, pk.BlockConfig(16, 16, 16)),
    ((2, 9, 8, 6), 3, 5, 2, 1, 2, BF16, pk.BlockConfig(32, 16, 16)),
])
def test_dense_matches_lax(x_shape, k, c_out, stride, padding, dilation, dtype, config):
    _check(x_shape, k, c_out, dtype, stride=stride, padding=padding, dilation=dilation,
           config=config)


def test_dense_xla_backward():
    _check((2, 9, 7, 5), 3, 6, F32, stride=2, padding=1, backward="xla", bias=False)


@pytest.mark.parametrize("x_shape, k, stride, padding, dilation, dtype, config", [
    ((2, 9, 7, 8), 3, 1, 1, 1, F32, None),
    ((1, 11, 10, 20), 3, 2, "SAME", 1, BF16, pk.BlockConfig(32, 16, 16, split=3)),
    ((1, 10, 9, 8), 5, 1, 4, 2, F32, None),
    # 49 taps (a 64-row partial tile), 2 channel tiles (20 = 16 + 4), wgrad split 2.
    ((1, 9, 8, 20), 7, 1, 3, 1, F32, pk.BlockConfig(32, 16, 16, split=2)),
])
def test_depthwise_matches_lax(x_shape, k, stride, padding, dilation, dtype, config):
    c = x_shape[3]
    _check(x_shape, k, c, dtype, stride=stride, padding=padding, dilation=dilation, groups=c,
           config=config)


@pytest.mark.parametrize("groups", [1, 6])
def test_epilogue_bias_residual_relu(groups):
    rng = np.random.default_rng(1)
    x, w = normal(rng, (2, 9, 7, 6)), normal(rng, (3, 3, 6 // groups, 6))
    b, res = normal(rng, (6,)), normal(rng, (2, 5, 4, 6))
    conv = dict(stride=2, padding=1, groups=groups, relu=True)
    got_y, got_g = fast_run(lambda *a: vjp_all(
        lambda x, w, b, r: pk.conv2d(x, w, b, residual=r, **conv), a), x, w, b, res)
    want_y, want_g = vjp_all(
        lambda x, w, b, r: _lax_conv(x, w, b, r, dilation=1, **conv), (x, w, b, res))
    assert (np.asarray(want_y) == 0).mean() > 0.2  # the ReLU really clips
    assert_close(got_y, want_y, F32, "output")
    for name, got, want in zip(("dx", "dw", "db", "dresidual"), got_g, want_g):
        assert_close(got, want, F32, name)


def test_functional_dispatch_runs_the_kernel():
    rng = np.random.default_rng(2)
    x, w = normal(rng, (1, 6, 5, 3)), normal(rng, (3, 3, 3, 4))
    kw = dict(stride=2, padding="SAME")
    assert "pallas_call" in str(jax.make_jaxpr(lambda x, w: F.conv2d(x, w, **kw, impl="pallas"))(x, w))
    # auto never picks a kernel on CPU (on a GPU it may, where measured faster)
    for impl in ("auto", "xla") if jax.default_backend() == "cpu" else ("xla",):
        assert "pallas_call" not in str(jax.make_jaxpr(
            lambda x, w: F.conv2d(x, w, **kw, impl=impl))(x, w))
    # A layer's choice reaches the op through apply's choices (no scope a cached trace
    # could miss); "xla" there rules out the kernels, as the op's "xla" does.
    conv = L.Conv2D(4, 3, **kw, use_bias=False)
    params = {"w": w}

    def layer_jaxpr(impl):
        return str(jax.make_jaxpr(lambda x: conv.apply(params, {}, x, choices=L.Choices(
            impl=impl))[0])(x))

    assert "pallas_call" in layer_jaxpr("pallas")
    assert "pallas_call" not in layer_jaxpr("xla")
    with pytest.raises(ValueError, match="impl must be one of"):
        L.Choices(impl="cudnn")
    assert_close(fast_run(lambda x, w: F.conv2d(x, w, **kw, impl="pallas"), x, w),
                 F.conv2d(x, w, **kw, impl="xla"), F32, "impl=pallas")


def test_weight_gradient_split_is_a_fixed_order_sum():
    """Different splits give the same weight gradient up to float32 rounding."""
    rng = np.random.default_rng(4)
    x, w = normal(rng, (2, 9, 8, 4)), normal(rng, (3, 3, 4, 8))
    grads = []
    for split in (1, 4):
        cfg = pk.BlockConfig(32, 16, 16, split=split)
        grads.append(fast_run(jax.grad(lambda w: jnp.sum(
            pk.conv2d(x, w, padding=1, config=cfg) ** 2)), w))
    assert_close(grads[1], grads[0], F32, "split 4 vs 1")


def test_rejects_bad_arguments():
    x, w = jnp.zeros((1, 5, 5, 4)), jnp.zeros((3, 3, 2, 4))
    with pytest.raises(NotImplementedError, match="groups=2"):
        pk.conv2d(x, w, groups=2)
    with pytest.raises(ValueError, match="dtype"):
        pk.conv2d(x, jnp.zeros((3, 3, 4, 4), BF16))
    with pytest.raises(ValueError, match="backward"):
        pk.conv2d(x, jnp.zeros((3, 3, 4, 4)), backward="cudnn")
    with pytest.raises(ValueError, match="residual"):
        pk.conv2d(x, jnp.zeros((3, 3, 4, 4)), residual=jnp.zeros((1, 5, 5, 4)))
    with pytest.raises(ValueError, match="power of two"):
        pk.BlockConfig(block_m=24)
