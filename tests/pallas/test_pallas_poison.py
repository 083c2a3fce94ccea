"""The interpreter's output poisoning that makes every finiteness check in these tests real.

In interpret mode Pallas starts each output buffer as NaN (float) or the
dtype's minimum (int).  A kernel that skipped an output block or element
would leave those, which the other tests reject.  If a JAX upgrade stops
doing this, this test fails and the others must poison outputs themselves.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt


def _half_writer(o_ref, *, rows):
    i = pl.program_id(0) * 8 + jnp.arange(8)
    plt.store(o_ref, jnp.ones((8, 8), o_ref.dtype), mask=(i < rows // 2)[:, None])


@pytest.mark.parametrize("dtype, poison", [(jnp.float32, np.nan), (jnp.int32, -2**31)])
def test_unwritten_outputs_are_poisoned(dtype, poison):
    out = pl.pallas_call(
        functools.partial(_half_writer, rows=16),
        out_shape=jax.ShapeDtypeStruct((16, 8), dtype), grid=(2,),
        out_specs=pl.BlockSpec((8, 8), lambda i: (i, 0)), interpret=True)()
    out = np.asarray(out)
    assert (out[:8] == 1).all()
    if np.isnan(poison):
        assert np.isnan(out[8:]).all()
    else:
        assert (out[8:] == poison).all()
