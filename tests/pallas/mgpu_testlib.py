"""Helpers shared by the tests of the Mosaic GPU window kernels (pooling, depthwise).

They run in Mosaic GPU interpret mode on the CPU and need jax >= 0.11 (/work/main/.venv312,
CI's Python 3.12 environment); on older jax ``needs_mgpu`` skips them saying why.

Tolerances: a 16-bit result is rounded once from its float32 accumulation, so each element
is within half a step of its type (bfloat16: 2**-8 relative, float16: 2**-11) of the float32
reference, plus summation-order noise (1e-4 of the largest reference value).  Float32
results (the depthwise weight gradient before its cast) differ from the reference only by
summation order: 1e-4 of the largest value.
"""
import importlib.util
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mgpu_conv

REASON = mgpu_conv.unavailable_reason()
needs_mgpu = pytest.mark.skipif(REASON is not None, reason=f"Mosaic GPU: {REASON}")
HALF_STEP = {jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float16): 2.0 ** -11}
H100 = "NVIDIA H100 80GB HBM3"


def normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def assert_16bit_close(got, want, dtype, what):
    """Finite everywhere (interpret mode leaves unwritten outputs NaN) and within half a
    step of ``dtype`` of the float32 reference, plus 1e-4 of its largest value."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.sum(~np.isfinite(got))} non-finite elements"
    tol = HALF_STEP[jnp.dtype(dtype)] * np.abs(want) + 1e-4 * np.abs(want).max()
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{what}: {bad.sum()} elements off, worst "
                           f"{np.abs(got - want).max():.3g} (max |ref| {np.abs(want).max():.3g})")


def assert_f32_close(got, want, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= 1e-4, f"{what}: relative error {err:.3g}"


@pytest.fixture
def races():
    """Runs a case under the race detector and fails it if a race was found."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()
    yield True
    found = ipc.get_races().races_found
    ipc.reset_gpu_interpret_mode_state()
    assert not found, "the interpreter's race detector found a data race"


def inspect_kernels():
    """scripts/inspect_kernels.py as a module (its offline Mosaic lowering report)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "inspect_kernels.py")
    spec = importlib.util.spec_from_file_location("inspect_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("inspect_kernels", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return sys.modules["inspect_kernels"]
