"""jaxcnn._host_memory and jaxcnn.cpu: importing jaxcnn changes nothing process-wide; when the
glibc malloc settings apply, and that they keep XLA:CPU's per-run temporary buffer mapped
(minor page faults per run, counted in fresh processes)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxcnn import _host_memory as H


def _cpu_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD",
                                                        "JAXCNN_CPU_MALLOC")}
    env.update(JAX_PLATFORMS="cpu", **extra)
    return env


@pytest.mark.parametrize("env, reason", [
    ({"JAXCNN_CPU_MALLOC": "0"}, "JAXCNN_CPU_MALLOC=0"),
    ({"MALLOC_ARENA_MAX": "2"}, "already tunes malloc"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "already tunes malloc"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "already tunes malloc"),
    ({"LD_PRELOAD": "libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"JAX_PLATFORMS": "cuda"}, "JAX_PLATFORMS=cuda"),
    ({"JAX_PLATFORMS": "tpu,cpu"}, "JAX_PLATFORMS=tpu,cpu"),
    ({"JAX_PLATFORMS": "cpu,cuda"}, "JAX_PLATFORMS=cpu,cuda"),
])
def test_left_alone_when_the_environment_says_so(env, reason):
    called = []
    assert reason in H.skip_reason(env)
    assert not H.configure_malloc(env, mallopt=lambda *a: called.append(a) or 1)
    assert not called


def test_left_alone_once_a_backend_exists():
    import jax
    jax.numpy.zeros(1).block_until_ready()  # this test process has a backend now
    called = []
    assert H.skip_reason({"JAX_PLATFORMS": "cpu"}) in (
        "a JAX backend already exists", "not Linux with glibc")
    assert not H.configure_malloc({"JAX_PLATFORMS": "cpu"},
                                  mallopt=lambda *a: called.append(a) or 1)
    assert not called


def test_applies_every_setting_in_order(monkeypatch):
    monkeypatch.setattr(H, "_glibc", lambda: object())
    monkeypatch.setattr(H, "_backends_initialized", lambda: False)
    monkeypatch.setattr(H, "_accelerator_plugin", lambda: False)
    monkeypatch.setattr(H, "_configured", False)
    called = []
    assert H.skip_reason({}) is None
    assert H.configure_malloc({}, mallopt=lambda p, v: called.append((p, v)) or 1)
    assert called == [(H.M_ARENA_MAX, 1), (H.M_MMAP_MAX, 0), (H.M_TRIM_THRESHOLD, 2 ** 31 - 1)]
    assert H.configured()
    # A setting glibc refuses: reported, the others still tried.
    monkeypatch.setattr(H, "_configured", False)
    called.clear()
    assert not H.configure_malloc({}, mallopt=lambda p, v: called.append(p) or int(p != H.M_MMAP_MAX))
    assert called == [p for p, _ in H.SETTINGS] and not H.configured()
    # An accelerator plugin keeps glibc's defaults unless JAX is told to use the CPU.
    monkeypatch.setattr(H, "_accelerator_plugin", lambda: True)
    assert H.skip_reason({}) == "an accelerator plugin is installed"
    assert H.skip_reason({"JAX_PLATFORMS": "cpu"}) is None


_FAULTS = textwrap.dedent("""
    import ctypes, resource, sys
    # Transparent huge pages off for this process (PR_SET_THP_DISABLE), so that glibc's
    # defaults fault in 4 KiB pages on hosts where THP is "always" too.
    ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)
    {before}
    import jaxcnn
    jaxcnn.cpu.configure()
    from jaxcnn import _host_memory
    import jax, jax.numpy as jnp
    x = jnp.ones((4096, 2048), jnp.float32)
    run = jax.jit(lambda x: jnp.sum(jnp.cumsum(jnp.sin(x), axis=0) * x, axis=0)).lower(x).compile()
    temp = run.memory_analysis().temp_size_in_bytes
    per_run = []
    for _ in range({runs}):
        r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run(x).block_until_ready()
        per_run.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
    # The median run: the heap grows a few times before every block fits, then stays.
    faults = sorted(per_run)[len(per_run) // 2]
    print("RESULT", _host_memory.configured(), _host_memory.skip_reason(), temp, faults)
""")


def _faults(env, before="", runs=40):
    done = subprocess.run([sys.executable, "-c", _FAULTS.format(before=before, runs=runs)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    _, configured, *reason, temp, faults = line.split()
    return configured == "True", " ".join(reason), int(temp), float(faults)


@pytest.mark.skipif(H._glibc() is None, reason="glibc malloc settings: Linux with glibc only")
def test_free_memory_is_given_back_only_under_the_policy(monkeypatch):
    """give_back_free_memory trims the heap (malloc_trim(0)) only where jaxcnn's policy keeps it;
    with glibc's defaults it leaves malloc alone."""
    trims = []

    class Glibc:
        def malloc_trim(self, pad):
            trims.append(pad)
            return 1
    monkeypatch.setattr(H, "_glibc", lambda: Glibc())
    monkeypatch.setattr(H, "_configured", False)
    assert H.give_back_free_memory() is False and trims == []
    monkeypatch.setattr(H, "_configured", True)
    assert H.give_back_free_memory() is True and trims == [0]


def test_temporary_buffer_stays_mapped_between_runs():
    # jax imported first is fine (jaxcnn asks JAX whether a backend exists): the measured run
    # imports it before jaxcnn.  A backend already running is not: that process is
    # test_configure_after_a_backend_exists_does_nothing_and_says_why's.
    on, _, temp, faults_on = _faults(_cpu_env(), before="import jax")
    # glibc's defaults map a block above its largest mmap threshold anew in every run, the
    # first included: 5 runs show it (jaxcnn's settings need ~10 runs before the heap settles).
    off, reason, _, faults_off = _faults(_cpu_env(JAXCNN_CPU_MALLOC="0"), runs=5)
    assert on and not off and reason == "JAXCNN_CPU_MALLOC=0"
    pages = temp / 4096
    assert temp > 32 * 2 ** 20  # above glibc's largest mmap threshold: mapped, unmapped
    assert faults_off > 0.5 * pages  # glibc's defaults: the block is faulted in every run
    assert faults_on < 0.1 * pages  # jaxcnn's: it stays mapped (the median run)


# Spies on every glibc function looked up through ctypes (CDLL.__getattr__/__getitem__, which
# is how _host_memory reaches mallopt), compares os.environ around the imports, then calls
# jaxcnn.cpu.configure() to show the spy sees what an import-time call would have done.
_IMPORT_SPY = textwrap.dedent("""
    import ctypes, json, os
    looked_up = []
    _getattr, _getitem = ctypes.CDLL.__getattr__, ctypes.CDLL.__getitem__
    def _spy_getattr(self, name):
        looked_up.append(name)
        return _getattr(self, name)
    def _spy_getitem(self, name):
        looked_up.append(name)
        return _getitem(self, name)
    ctypes.CDLL.__getattr__, ctypes.CDLL.__getitem__ = _spy_getattr, _spy_getitem
    before = dict(os.environ)
    import jaxcnn, jaxcnn.functional, pallas_kernels
    from jaxcnn import _host_memory
    imported = {"environ_changed": sorted(k for k in set(before) | set(os.environ)
                                          if before.get(k) != os.environ.get(k)),
                "mallopt": "mallopt" in looked_up, "configured": _host_memory.configured(),
                "status": _host_memory.status()}
    done = jaxcnn.cpu.configure()
    configured = {"result": done, "mallopt": "mallopt" in looked_up,
                  "configured": _host_memory.configured(), "status": _host_memory.status(),
                  "xla_flags": os.environ.get("XLA_FLAGS", "")}
    import jax
    jax.numpy.ones(2).sum().block_until_ready()
    late = jaxcnn.cpu.configure()
    print("RESULT", json.dumps({"imported": imported, "configured": configured, "late": late}))
""")


@pytest.mark.skipif(H._glibc() is None, reason="glibc malloc settings: Linux with glibc only")
def test_import_leaves_environ_and_malloc_alone_until_configure():
    import jaxlib
    env = _cpu_env()
    env.pop("XLA_FLAGS", None)
    env.pop("JAXCNN_CPU_XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", _IMPORT_SPY], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    out = json.loads(line.split(" ", 1)[1])
    imported, configured, late = out["imported"], out["configured"], out["late"]
    assert imported == {"environ_changed": [], "mallopt": False, "configured": False,
                        "status": "default"}
    # The explicit call does what the imports did not: mallopt, and XLA_FLAGS where the
    # flag was checked for this jaxlib.
    assert configured["result"]["malloc"] == "jaxcnn" and configured["mallopt"]
    assert configured["configured"] and configured["status"] == "jaxcnn"
    from jaxcnn.functional._cpu_lowering import _FLAG_CHECKED_JAXLIB
    checked = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) in _FLAG_CHECKED_JAXLIB
    assert (configured["result"]["xla_flags"] == "jaxcnn") == checked
    assert ("--xla_cpu_experimental_ynn_fusion_type=individual_dot"
            in configured["xla_flags"]) == checked
    # Once a backend exists: nothing more to do for malloc (already set), and the flag says why.
    assert late == {"malloc": "jaxcnn", "xla_flags": "a JAX backend already exists"}


@pytest.mark.skipif(H._glibc() is None, reason="glibc malloc settings: Linux with glibc only")
def test_configure_after_a_backend_exists_does_nothing_and_says_why():
    code = ("import jax, json, os; jax.numpy.ones(1).sum().block_until_ready(); "
            "import jaxcnn; from jaxcnn import _host_memory; flags = os.environ.get('XLA_FLAGS'); "
            "r = jaxcnn.cpu.configure(); "
            "print('RESULT', json.dumps([r, _host_memory.configured(), _host_memory.status(), "
            "os.environ.get('XLA_FLAGS') == flags]))")
    done = subprocess.run([sys.executable, "-c", code], env=_cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    result, configured, status, flags_kept = json.loads(line.split(" ", 1)[1])
    assert result == {"malloc": "a JAX backend already exists",
                      "xla_flags": "a JAX backend already exists"}
    assert not configured and status == "a JAX backend already exists" and flags_kept
