"""Pallas max/avg pooling against the XLA (jax.lax) implementation in jaxcnn.functional."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn import functional as F
from pallas_testlib import assert_close, fast_compile, fast_run, normal, vjp_all

BF16, F32 = jnp.bfloat16, jnp.float32


def _ties(shape, dtype, seed=0):
    """ReLU'd small integers: mostly zeros and many equal maxima in each window."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.maximum(np.round(rng.standard_normal(shape) * 1.5), 0), dtype)


def _check(op, x, dtype, **kw):
    """Output and input gradient (vjp_all's random cotangent) of the kernel against XLA's;
    returns the kernel's program ``(x, ct) -> (y, dx)``, compiled once (pallas_testlib.fast_compile),
    for other cotangents."""
    ref_kw = {k: v for k, v in kw.items() if k not in ("config", "backward")}
    want_y, want_g = vjp_all(lambda x: getattr(F, op)(x, **ref_kw, impl="xla"), (x,))
    ct = normal(np.random.default_rng(0), want_y.shape).astype(dtype)  # vjp_all's

    def kernel(x, ct):
        y, vjp = jax.vjp(lambda x: getattr(pk, op)(x, **kw), x)
        return y, vjp(ct)[0]
    run = fast_compile(kernel, x, ct)
    got_y, got_dx = run(x, ct)
    assert got_y.dtype == dtype
    assert_close(got_y, want_y, dtype, "output")
    assert_close(got_dx, want_g[0], dtype, "dx")
    return run


@pytest.mark.parametrize("shape, kw, dtype", [
    ((2, 9, 7, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True), F32),
    ((2, 8, 8, 20), dict(kernel_size=2, config=pk.BlockConfig(32, 16)), F32),
    ((1, 9, 10, 4), dict(kernel_size=3, stride=1, padding=1, dilation=2), F32),
    ((1, 9, 7, 6), dict(kernel_size=3, stride=2, padding="SAME"), BF16),
    ((2, 7, 7, 3), dict(kernel_size=3, stride=2, backward="xla"), F32),
])
def test_max_pool_ties_first_max_wins(shape, kw, dtype):
    x = _ties(shape, dtype)
    run = _check("max_pool2d", x, dtype, **kw)
    # With a cotangent of ones, each window's 1 lands on exactly one input (the same
    # program, compiled once, with the case's tiles and backward: for backward="xla" that is
    # XLA's gradient; the kernel's backward picks the first maximum of overlapping tied windows
    # in _check's comparison above, on every case but that one).
    y_shape = jax.eval_shape(lambda x: pk.max_pool2d(x, **kw), x).shape
    y, ones = run(x, jnp.ones(y_shape, dtype))
    assert float(jnp.sum(ones.astype(F32))) == y.size
    assert ones.shape == x.shape


def test_max_pool_integers():
    x = jnp.asarray(np.random.default_rng(3).integers(-5, 5, (2, 9, 8, 6)), jnp.int32)
    kw = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)
    got = fast_run(lambda x: pk.max_pool2d(x, **kw), x)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, F.max_pool2d(x, **kw, impl="xla"))


@pytest.mark.parametrize("shape, kw, dtype", [
    ((2, 9, 7, 5), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                        count_include_pad=False), F32),
    ((2, 9, 7, 5), dict(kernel_size=3, stride=2, padding=1), F32),
    ((1, 8, 10, 20), dict(kernel_size=2, config=pk.BlockConfig(32, 16)), BF16),
    ((1, 7, 6, 4), dict(kernel_size=3, stride=1, padding="SAME", count_include_pad=False,
                        backward="xla"), F32),
])
def test_avg_pool_matches_xla(shape, kw, dtype):
    _check("avg_pool2d", normal(np.random.default_rng(4), shape, dtype), dtype, **kw)


def test_functional_dispatch_runs_the_kernel():
    x = _ties((1, 6, 6, 3), F32)
    for op in (F.max_pool2d, F.avg_pool2d):
        assert "pallas_call" in str(jax.make_jaxpr(lambda x: op(x, 2, impl="pallas"))(x))
        assert "pallas_call" not in str(jax.make_jaxpr(lambda x: op(x, 2, impl="xla"))(x))
        if jax.default_backend() == "cpu":  # on a GPU auto may pick it, where measured faster
            assert "pallas_call" not in str(jax.make_jaxpr(lambda x: op(x, 2, impl="auto"))(x))
    with pytest.raises(ValueError, match="backward"):
        pk.max_pool2d(x, 2, backward="torch")
