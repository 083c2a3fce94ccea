"""Helpers shared by the Pallas kernel tests (CPU, interpret mode).

Interpret-mode programs are slow to compile, so each case compiles one
function (forward and VJP together) at XLA's lowest optimisation level.
In interpret mode Pallas fills every output buffer with NaN (the dtype's
minimum for integers) before the kernel runs; ``test_pallas_poison.py``
checks that, so the finiteness checks below catch any unwritten element.
"""
import jax
import jax.numpy as jnp
import numpy as np

# Largest error allowed, relative to max(1, max |reference|). float32 kernels
# accumulate in a different order than XLA; bfloat16 results are rounded to
# 8 significant bits (relative step 2**-8) after float32 accumulation.
TOLERANCE = {jnp.dtype(jnp.float32): 2e-5, jnp.dtype(jnp.bfloat16): 2e-2}


LEVEL_0 = {"xla_backend_optimization_level": 0}  # XLA's compiler options: optimisations off


def fast_compile(fn, *args):
    """``jax.jit(fn)`` compiled for ``args`` with XLA optimisations off (interpret mode compiles
    slowly); for results compared with a reference within a tolerance, never bit for bit with a
    program compiled otherwise (level 0 forms no fused multiply-adds, for one)."""
    return jax.jit(fn).trace(*args).lower().compile(LEVEL_0)


def fast_run(fn, *args):
    """``fast_compile(fn, *args)(*args)``."""
    return fast_compile(fn, *args)(*args)


def compile_unoptimised(monkeypatch) -> None:
    """Every ``jax.stages.Lowered.compile`` from now on (the test's) compiles with XLA's
    optimisations off, whatever options it is given: for a tuner test whose fake clock reads
    no value the candidates compute (the tuner still lowers and compiles each one)."""
    compile_lowered = jax.stages.Lowered.compile

    def compile_at_level_0(self, compiler_options=None, **kw):
        options = {**(compiler_options or {}), **LEVEL_0}
        return compile_lowered(self, options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_at_level_0)


def assert_close(got, want, dtype, what):
    """Finite everywhere (nothing left unwritten) and within the dtype's tolerance."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: {np.sum(~np.isfinite(got))} non-finite elements"
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale
    assert err <= TOLERANCE[jnp.dtype(dtype)], f"{what}: relative error {err:.3g} ({dtype})"


def normal(rng, shape, dtype=jnp.float32):
    """Standard-normal test data from numpy (jax.random compiles slowly per shape on CPU), in
    float32 rounded to ``dtype`` on the host: ml_dtypes rounds to nearest even, as XLA's
    convert does (the same bits), without an eager conversion compiled per shape."""
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(dtype)))


def vjp_all(fn, args, seed=0):
    """``(y, grads)`` of ``fn`` at ``args`` with a fixed random cotangent (float args only)."""
    y, vjp = jax.vjp(fn, *args)
    ct = normal(np.random.default_rng(seed), y.shape, y.dtype)
    return y, vjp(ct)
