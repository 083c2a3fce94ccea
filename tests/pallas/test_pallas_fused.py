"""BatchNorm-apply + ReLU fused into the convolution's input load, against unfused jax.lax."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_kernels as pk
from pallas_testlib import assert_close, fast_run, normal, vjp_all

F32 = jnp.float32
_DIMS = ("NHWC", "HWIO", "NHWC")


def _lax_conv(x, w, *, stride=1, padding=1, groups=1):
    pads = padding if isinstance(padding, str) else ((padding, padding),) * 2
    return lax.conv_general_dilated(x, w, (stride, stride), pads, dimension_numbers=_DIMS,
                                    feature_group_count=groups)


@pytest.mark.parametrize("groups, dtype", [(1, F32), (6, jnp.bfloat16)])
def test_inference_form_pads_after_bn_relu(groups, dtype):
    rng = np.random.default_rng(0)
    x, w = normal(rng, (2, 9, 7, 6), dtype), normal(rng, (3, 3, 6 // groups, 6), dtype)
    scale = normal(rng, (6,))
    shift = jnp.abs(normal(rng, (6,))) + 0.5  # relu(shift) > 0: wrong padding would show

    def fused(x, w, scale, shift):
        return pk.bn_relu_conv2d(x, w, scale=scale, shift=shift, padding=1, groups=groups)

    def unfused(x, w, scale, shift):
        a = jnp.maximum(x.astype(F32) * scale + shift, 0).astype(x.dtype).astype(F32)
        return _lax_conv(a, w.astype(F32), groups=groups)

    got_y, got_g = fast_run(lambda *a: vjp_all(fused, a), x, w, scale, shift)
    want_y, want_g = vjp_all(unfused, (x, w, scale, shift))
    assert_close(got_y, want_y, dtype, "output")
    for name, got, want in zip(("dx", "dw", "dscale", "dshift"), got_g, want_g):
        assert_close(got, want, dtype, name)
    # Padding before the BN+ReLU (pads become relu(shift)) really gives another answer.
    xp = jnp.pad(x.astype(F32), ((0, 0), (1, 1), (1, 1), (0, 0)))
    wrong = _lax_conv(jnp.maximum(xp * scale + shift, 0), w.astype(F32), padding=0, groups=groups)
    assert float(jnp.max(jnp.abs(wrong - want_y))) > 0.5


def test_training_form_with_batch_stats_and_residual():
    """conv(relu(bn_train(x))) + residual, ReLU: grads reach x through the batch mean/var."""
    rng = np.random.default_rng(1)
    x, w = normal(rng, (2, 8, 7, 5)), normal(rng, (3, 3, 5, 8))
    gamma, beta = normal(rng, (5,)), normal(rng, (5,))
    res = normal(rng, (2, 4, 4, 8))

    def fused(x, w, gamma, beta, res):
        mean, var = jnp.mean(x, (0, 1, 2)), jnp.var(x, (0, 1, 2))
        return pk.bn_relu_conv2d_train(x, w, mean=mean, var=var, gamma=gamma, beta=beta,
                                       stride=2, padding="SAME", residual=res, relu=True)

    def unfused(x, w, gamma, beta, res):
        mean, var = jnp.mean(x, (0, 1, 2)), jnp.var(x, (0, 1, 2))
        a = jnp.maximum((x - mean) * lax.rsqrt(var + 1e-5) * gamma + beta, 0)
        return jnp.maximum(_lax_conv(a, w, stride=2, padding="SAME") + res, 0)

    got_y, got_g = fast_run(lambda *a: vjp_all(fused, a), x, w, gamma, beta, res)
    want_y, want_g = vjp_all(unfused, (x, w, gamma, beta, res))
    assert_close(got_y, want_y, F32, "output")
    for name, got, want in zip(("dx", "dw", "dgamma", "dbeta", "dres"), got_g, want_g):
        assert_close(got, want, F32, name)


def test_fold_batch_norm():
    mean, var = jnp.array([1.0, -2.0]), jnp.array([4.0, 0.25])
    scale, shift = pk.fold_batch_norm(mean, var, jnp.array([2.0, 1.0]), jnp.array([0.5, 0.0]),
                                      eps=0.0)
    np.testing.assert_allclose(scale, [1.0, 2.0])
    np.testing.assert_allclose(shift, [-0.5, 4.0])
