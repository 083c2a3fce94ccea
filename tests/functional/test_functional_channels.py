"""Per-channel reductions and broadcasts (jaxcnn.functional._channels): values and
gradients against numpy, the CPU's folded form and who uses it."""
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings, strategies as st

from jaxcnn import functional as F
from jaxcnn.functional import _channels as ch


@jax.jit(static_argnames="shape")
def _channel_ops(x, v, g, *, shape):
    """The channel sum and mean of ``x``, the broadcast of ``v`` to ``shape``, the broadcast's
    VJP of ``g`` and the sum's VJP of ``v``: one compiled program per example instead of a
    compile for each eager op (their gradients' too)."""
    _, broadcast_vjp = jax.vjp(lambda v: ch.channel_broadcast(v, shape), v)
    _, sum_vjp = jax.vjp(ch.channel_sum, x)
    return (ch.channel_sum(x), ch.channel_mean(x), ch.channel_broadcast(v, shape),
            broadcast_vjp(g)[0], sum_vjp(v)[0])


@settings(max_examples=12, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3).map(tuple),
       c=st.sampled_from([1, 3, 64, 600, 1500]), seed=st.integers(0, 2**31 - 1))
def test_channel_sum_mean_broadcast_against_numpy(shape, c, seed):
    rng = np.random.default_rng(seed)
    shape = shape + (c,)
    x = rng.standard_normal(shape).astype(np.float32)
    v = rng.standard_normal(c).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    total, mean, broadcast, broadcast_grad, sum_grad = _channel_ops(x, v, g, shape=shape)
    axes = tuple(range(len(shape) - 1))
    scale = np.abs(x).sum(axes) + 1.0  # a sum's rounding error grows with the sum of |terms|
    np.testing.assert_allclose(total, x.astype(np.float64).sum(axes),
                               rtol=0, atol=float(np.max(scale)) * 1e-6)
    np.testing.assert_allclose(mean, x.astype(np.float64).mean(axes),
                               rtol=0, atol=float(np.max(scale)) * 1e-6 / max(1, x.size // c))
    np.testing.assert_array_equal(broadcast, np.broadcast_to(v, shape))
    # the gradient of the broadcast is the channel sum; of the sum, the broadcast
    np.testing.assert_allclose(broadcast_grad, g.astype(np.float64).sum(axes),
                               rtol=0, atol=float(np.max(np.abs(g).sum(axes) + 1)) * 1e-6)
    np.testing.assert_array_equal(sum_grad, np.broadcast_to(v, shape))


def test_channel_fold_choice():
    assert ch._fold((128, 32, 32, 64)) == 16           # 1024 lanes
    assert ch._fold((7, 64)) == 7                        # the largest divisor that fits
    assert ch._fold((13 * 17, 100)) == 0                 # no divisor of 221 in 2..10: XLA's form
    assert ch._fold((4, 4, 600)) == 0                    # wide enough already
    assert ch._fold((64,)) == 0
    assert ch._fold((8, 14, 14, 256)) == 2               # a divisor of the width (not of the rows)
    assert ch._fold((8, 16, 7, 128)) == 7


def test_channel_fold_keeps_batch_and_height_axes():
    """The fold merges the width into the channels only: an activation split over the batch or
    the height (spatial partitioning) is reshaped where it lies, without an all-gather."""
    x = jnp.ones((4, 8, 12, 16))
    g = ch._fold(x.shape)
    hlo = jax.jit(ch.channel_sum).lower(x).as_text()
    assert f"tensor<4x8x{12 // g}x{g * 16}xf32>" in hlo
    # The CPU's fast sum is a contraction with ones (XLA:CPU's matrix-vector product); its
    # reverse mode is a plain broadcast, not the contraction's transpose (an outer product).
    assert "dot_general" in hlo
    grad = jax.jit(jax.grad(lambda x: jnp.sum(ch.channel_sum(x) * jnp.arange(16.0))))
    assert "dot_general" not in grad.lower(x).as_text()


def test_bias_and_batchnorm_gradients_use_the_folded_reduction():
    """The bias gradient reduces the folded view; BatchNorm's explicit form sums it as a
    contraction with ones (forward: x and the centred squares; backward: dy and dy * x)."""
    x = jnp.ones((8, 6, 6, 16))
    g = ch._fold(x.shape)
    view = f"tensor<8x6x{6 // g}x{g * 16}xf32>"  # (N, H, W / g, g * C), reduced but for its lanes

    def reduced_views(f, *args):
        hlo = jax.jit(f).lower(*args).as_text()
        return [line for line in hlo.splitlines()
                if ("reduce" in line and f"({view}" in line)
                or ("dot_general" in line and f", {view})" in line)]

    bias_grad = jax.grad(lambda b: jnp.sum(jnp.sin(F.conv2d(x, jnp.ones((1, 1, 16, 16)), b))))
    assert reduced_views(bias_grad, jnp.ones(16))
    bn_grad = jax.grad(lambda s, b: jnp.sum(jnp.sin(F.batch_norm_train(x * s, s, b)[0])), argnums=(0, 1))
    assert len(reduced_views(bn_grad, jnp.ones(16), jnp.ones(16))) >= 4  # mean, var, d scale, d bias
