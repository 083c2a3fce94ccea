"""Every kernel lowers for CUDA (Triton) on this CPU-only machine.

Inside an abstract mesh whose device is an H100, ``jit(f).trace(...).lower(
lowering_platforms=("cuda",))`` runs the Pallas Triton lowering, which is
where GPU-only rules fail (power-of-two blocks, 2-D dots with equal dtypes,
masked loads); PTX-level errors still need a GPU.  Checked to work on jax
0.10.2 and 0.11.2; where the API is missing the tests skip with the reason.
"""
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

import pallas_kernels as pk

_TRITON = "__gpu$xla.gpu.triton"


def _abstract_h100():
    try:
        from jax.sharding import AbstractDevice, AbstractMesh
        device = AbstractDevice(device_kind="NVIDIA H100 80GB HBM3", num_cores=132,
                                platform="gpu")
        return jax.sharding.use_abstract_mesh(
            AbstractMesh((1,), ("x",), abstract_device=device))
    except (ImportError, AttributeError, TypeError) as e:
        pytest.skip(f"abstract-mesh CUDA lowering unavailable in jax {jax.__version__}: {e}")


def _cuda_text(fn, *args):
    with _abstract_h100():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _grad(fn, argnums):
    """The value and gradient of ``sum(fn)``: the value keeps the forward kernel live where
    the gradient does not read its output (an average pool's), which jax 0.12 drops from
    a gradient alone as dead code."""
    return jax.value_and_grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)


S = jax.ShapeDtypeStruct
GPU = dict(interpret=False)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_conv_with_fusions_lowers(dtype):
    def fn(x, w, b, r, s, t):
        return pk.conv2d(x, w, b, stride=2, padding=1, residual=r, relu=True,
                         input_scale=s, input_shift=t, **GPU)
    args = (S((2, 15, 13, 24), dtype), S((3, 3, 24, 40), dtype), S((40,), dtype),
            S((2, 8, 7, 40), dtype), S((24,), jnp.float32), S((24,), jnp.float32))
    text = _cuda_text(_grad(fn, tuple(range(6))), *args)
    assert text.count(_TRITON) == 3  # forward, dgrad, wgrad
    assert "atomic" not in text  # the weight gradient's split needs none


def test_depthwise_conv_lowers():
    def fn(x, w, s, t):
        return pk.conv2d(x, w, padding="SAME", dilation=2, groups=32, input_scale=s,
                         input_shift=t, relu=True, **GPU)
    args = (S((2, 9, 9, 32), jnp.bfloat16), S((5, 5, 1, 32), jnp.bfloat16),
            S((32,), jnp.float32), S((32,), jnp.float32))
    text = _cuda_text(_grad(fn, (0, 1, 2, 3)), *args)
    assert text.count(_TRITON) == 3
    assert "atomic" not in text


@pytest.mark.parametrize("op, kw", [
    ("max_pool2d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    ("avg_pool2d", dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
])
def test_pools_lower(op, kw):
    fn = functools.partial(getattr(pk, op), **kw, **GPU)
    text = _cuda_text(_grad(fn, 0), S((2, 11, 9, 24), jnp.bfloat16))
    assert text.count(_TRITON) == 2


def test_integer_max_pool_lowers():
    fn = functools.partial(pk.max_pool2d, kernel_size=2, **GPU)
    assert _cuda_text(fn, S((1, 8, 8, 16), jnp.int32)).count(_TRITON) == 1


def _bad_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 2


def test_lowering_check_is_live():
    """A block of 24 rows (not a power of two) must be rejected here, not on the GPU.

    Triton compiler params select the Triton lowering (in jax 0.10.2 a
    pallas_call without them goes to Mosaic GPU).
    """
    fn = pl.pallas_call(_bad_kernel, out_shape=S((48, 16), jnp.float32), grid=(2,),
                        in_specs=[pl.BlockSpec((24, 16), lambda i: (i, 0))],
                        out_specs=pl.BlockSpec((24, 16), lambda i: (i, 0)),
                        compiler_params=plt.CompilerParams())
    with pytest.raises(Exception, match="power of 2"):
        _cuda_text(fn, S((48, 16), jnp.float32))
