"""The suite's persistent XLA compilation cache, for the subprocesses a test starts.

tests/conftest.py makes one cache directory per test run, names it in
``JAXCNN_TEST_COMPILATION_CACHE`` (the xdist workers inherit it) and points this process's JAX
at it.  A subprocess (a ``jaxcnn-train`` run, a multi-process worker) starts a JAX of its own
that does not use it unless its environment says so: :func:`subprocess_env` adds JAX's own
variables for it.  A run that finds its programs there skips their compilation (most of a
short trainer run's time); the cache is keyed on the program, the XLA flags and JAX's
settings and holds the executables a fresh compilation makes, so the run computes the same
bits.  Tests that time or interrupt a compilation leave it out.
"""
import os

CACHE_ENV = "JAXCNN_TEST_COMPILATION_CACHE"  # the directory, or "0": no cache
# the test process stores the programs that took longer than this to compile
MIN_COMPILE_TIME_S = 0.5


def directory():
    """The run's cache directory, or None when the suite runs without one."""
    path = os.environ.get(CACHE_ENV)
    return path if path and path != "0" else None


def jax_cache_vars(path) -> dict:
    """JAX's environment variables that make a fresh process use the cache at ``path`` for every
    program: it compiles each eager operation of its initialisation again (seconds for a
    ResNet) unless an earlier process left them there."""
    return dict(JAX_COMPILATION_CACHE_DIR=str(path), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def subprocess_env(env=None) -> dict:
    """``env`` (default: this process's environment), with the suite's compilation cache."""
    env = dict(os.environ if env is None else env)
    path = directory()
    if path:
        env.update(jax_cache_vars(path))
    return env
