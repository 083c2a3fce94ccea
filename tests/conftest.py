"""Test setup shared by the whole suite.

Eight host CPU devices are requested before JAX is imported anywhere, so the
multi-device tests can build meshes on a CPU-only machine, and XLA:CPU compiles
at LLVM optimisation level 1 (tests/xla_cache.py says why).
"""
import collections
import gc
import os
import re
import shutil
import signal
import tempfile

import pytest

# A run started with SIGINT ignored (under nohup, or as a background job of a non-interactive
# shell) passes that on to every process it starts, and the Ctrl-C tests' children would never
# see the SIGINT they are sent: this process (the controller and each xdist worker) takes
# Python's own handler, as a run started from a terminal has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

import xla_cache  # the suite's flags and cache (no JAX inside)

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {xla_cache.OPT_FLAG}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxcnn's glibc malloc settings keep each process's peak heap; the suite's workers run
# many shapes, so they keep glibc's defaults.  tests/test_host_memory.py checks the
# settings in fresh processes.
os.environ.setdefault("JAXCNN_CPU_MALLOC", "0")

# The suite runs as the command-line tools do: jaxcnn.cpu.configure() before JAX starts, so a
# test that compares an in-process run with a `jaxcnn-train` subprocess (which configures
# itself) compares the same XLA:CPU lowering.  It also sets XLA_FLAGS for the subprocesses.
import jaxcnn.cpu  # noqa: E402

jaxcnn.cpu.configure()

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# One persistent XLA compilation cache for the whole run, shared by the xdist workers: many
# tests build the same programs afresh (a new make_train_step closure, the same model), which
# JAX's in-memory caches cannot see but the persistent cache (keyed on the program) can.  The
# controller creates it and removes it at the end; a subprocess uses it when the test passes
# it on (tests/xla_cache.py: subprocess_env).  JAXCNN_TEST_COMPILATION_CACHE=0 turns it off.
import sweep  # noqa: E402

_CACHE_ENV = xla_cache.CACHE_ENV


def pytest_configure(config):
    config._jaxcnn_xla_flags = os.environ.get(_XLA_FLAGS)
    if _CACHE_ENV not in os.environ:  # the controller, or a run without xdist
        config._jaxcnn_compilation_cache = os.environ[_CACHE_ENV] = tempfile.mkdtemp(
            prefix="jaxcnn-test-xla-cache-")
    if os.environ[_CACHE_ENV] == "0":  # JAXCNN_TEST_COMPILATION_CACHE=0: compile everything
        return
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", xla_cache.MIN_COMPILE_TIME_S)


def pytest_unconfigure(config):
    path = getattr(config, "_jaxcnn_compilation_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


# XLA_FLAGS reaches every subprocess a test starts (trainer runs compared bit for bit with an
# in-process reference): a test that calls a command-line tool's main in process, which sets
# its own flags as a tool must, has to put them back (monkeypatch.setenv does).
_XLA_FLAGS = "XLA_FLAGS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    result = yield  # the test's fixtures (monkeypatch included) are torn down by now
    before, after = item.config._jaxcnn_xla_flags, os.environ.get(_XLA_FLAGS)
    if after != before:
        if before is None:
            os.environ.pop(_XLA_FLAGS, None)
        else:
            os.environ[_XLA_FLAGS] = before
        raise AssertionError(f"{item.nodeid} left XLA_FLAGS changed: {before!r} -> {after!r} "
                             "(restored; later tests' subprocesses would inherit it)")
    return result


# Python's cyclic garbage collector: each full collection walks every live object, and a worker
# holds hundreds of thousands (JAX's caches of traced and lowered programs, the imported
# modules).  After collection, what the imports and test modules made is frozen (never walked
# again), and a young collection waits for 10,000 new objects instead of 700 (Python 3.11's and
# 3.12's default; tracing makes and drops many).  Measured over tests/train + tests/layers (-n 2,
# jax 0.11.2), the collector's time per worker: 26-28 s as Python sets it, 17-19 s frozen, 4-6 s
# frozen with this threshold.
@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, *gc.get_threshold()[1:])


# The order the tests are handed out in.  xdist (--dist loadgroup) gives its workers the
# xdist_group groups first, largest first, then the other tests in collection order, and a worker
# that has run out of tests waits for the other to finish its last one: the GPU check's dry run
# (one test of about 90 s) comes first among the others, and tests/functional (JAX's and
# PyTorch's small ops, a few seconds a test at most) last, so the run ends on short tests.
# Within a directory the order stays the collection's.
_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_FIRST = ("test_gpu_check.py",)
_LAST = ("functional",)


def _schedule_rank(item) -> int:
    top = os.path.relpath(str(item.path), _TESTS_DIR).split(os.sep)[0]
    return 0 if top in _FIRST else 2 if top in _LAST else 1


def pytest_collection_modifyitems(config, items):
    items.sort(key=_schedule_rank)  # stable: each directory keeps its order
    _halve_examples(items)


# Property tests (hypothesis) run half their max_examples, at least 10, in the normal suite:
# most of them compile a program per example.  JAXCNN_TEST_ALL_EXAMPLES=1 runs them all
# (the scheduled long run sets it together with -m slow; tests/sweep.py reads it too).
def _halve_examples(items):
    if sweep.all_examples():
        return
    import hypothesis
    seen = set()
    for item in items:
        test = getattr(item, "obj", None)
        current = getattr(test, "_hypothesis_internal_use_settings", None)  # read when it runs
        if current is None or id(test) in seen or current.max_examples <= 10:
            continue
        seen.add(id(test))
        test._hypothesis_internal_use_settings = hypothesis.settings(
            current, max_examples=max(10, current.max_examples // 2))


def _skip_reason(report) -> str:
    """A skipped test's reason, grouped: a missing import names the module."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ").strip().splitlines()[0] if reason.strip() else "no reason given"
    missing = re.search(r"could not import '([^']+)'|No module named '([^']+)'", reason)
    if missing:
        return f"{missing.group(1) or missing.group(2)} absent"
    return reason if len(reason) <= 100 else reason[:97] + "..."


def pytest_terminal_summary(terminalreporter):
    """One line naming why tests were skipped, with counts (-rs lists them one by one)."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if getattr(r, "skipped", False)]
    if skipped:
        counts = collections.Counter(_skip_reason(r) for r in skipped)
        terminalreporter.write_line(f"skipped {len(skipped)}: " + "; ".join(
            f"{reason} ({n})" for reason, n in counts.most_common()))


@pytest.fixture(scope="session")
def mnist_run(tmp_path_factory):
    """A short ``configs/mnist_cnn.yaml`` run (60 steps, a checkpoint at the end, its params and
    preprocessing.json) that the export and predict tests read; they must not write into it
    (copy it first).  Their modules are one xdist group, ``mnist_run`` (pyproject's ``--dist
    loadgroup``), so one worker trains it once for all of them."""
    from jaxcnn.train.cli import train_main
    path = str(tmp_path_factory.mktemp("mnist_run"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert train_main([os.path.join(root, "configs", "mnist_cnn.yaml"), "train.steps=60",
                       "train.eval_every=null", "logging.progress=none", "--workdir", path]) == 0
    return path
