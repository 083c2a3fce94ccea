"""How the suite compiles: its XLA:CPU flags and its persistent compilation cache, for the
subprocesses a test starts too.

The suite compiles at LLVM optimisation level 1 (:data:`OPT_FLAG`, tests/conftest.py): LLVM's
optimisation of the generated code is a large share of what the suite's thousands of small
programs cost (compiled, then run once on tiny shapes).  Level 1 keeps the HLO passes, and the
comparisons between two programs measured at levels 1 and 2 agreed (an Adam run on four mpmd
pipeline stages against one device: 7.6e-7 at either); level 0 moved that run 1.8e-4 away
(most likely because its instruction selection forms no fused multiply-adds).  The
interpreted-kernel tests compile their programs at level 0 (pallas_testlib.fast_compile; the
kernel tuners' tests with a fake clock, pallas_testlib.compile_unoptimised): their results are
compared with a reference within a stated tolerance, or exactly where nothing rounds (a
maximum, an index), never bit for bit with arithmetic compiled otherwise.  So does the
gpu_check dry run (:func:`at_level`), which interprets every kernel family and compares within
the GPU's tolerances.  A subprocess that sets its own device count takes the suite's other flags with it
(:func:`with_devices`).

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

# tests/conftest.py's XLA_FLAGS: 8 host devices and this (measured on 2 cores against the
# default level 2: tests/train/test_precision_training.py 57 -> 50 s; level 0 gave 46 s)
_LEVEL = "--xla_backend_optimization_level"
OPT_FLAG = f"{_LEVEL}=1"
CACHE_ENV = "JAXCNN_TEST_COMPILATION_CACHE"  # the directory, or "0": no cache
# The test process stores every program it compiles, however quick: most of the suite's are
# small (a test's own jit of a layer, an eager operation) and compiled again by the other worker
# or under another closure.  Counted with jax.monitoring over tests/layers + tests/models
# (-n 2, jax 0.11.2): at 0 (this), 209 of 1,133 compilations came from the cache, against 2
# when only those over 0.5 s were stored; the 902 entries took 6.7 MB.  The wall time gained
# is small on a quiet machine (72-75 s against 75-77 s, tests/functional/test_functional_norm.py
# included) and larger on a busy one, where compiling is slower.
MIN_COMPILE_TIME_S = 0


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


def fresh_process_env(env=None) -> dict:
    """``env`` (default: this process's environment) for a process that starts as a user's would,
    with one device: XLA_FLAGS holds the suite's optimisation level alone (an example or command
    that sets XLA_FLAGS replaces it), and the suite's compilation cache.  Both change how fast
    XLA:CPU compiles, not what the process does."""
    env = subprocess_env({k: v for k, v in (os.environ if env is None else env).items()
                          if k != "XLA_FLAGS"})
    env["XLA_FLAGS"] = OPT_FLAG
    return env


def with_devices(n: int) -> str:
    """This process's XLA_FLAGS asking for ``n`` host CPU devices instead of the suite's 8, its
    other flags kept (the optimisation level, jaxcnn.cpu.configure's flag)."""
    return _replaced("--xla_force_host_platform_device_count", n)


def at_level(level: int) -> str:
    """This process's XLA_FLAGS with LLVM optimisation level ``level`` instead of the suite's
    (:data:`OPT_FLAG`), its other flags kept."""
    return _replaced(_LEVEL, level)


def _replaced(flag: str, value) -> str:
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(flag)]
    return " ".join(kept + [f"{flag}={value}"])
