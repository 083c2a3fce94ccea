"""The autotuner's cache (path, atomic writes, corruption) and its kernel-vs-XLA verdict."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn.functional import tuning
from pallas_kernels import autotune
from pallas_kernels._common import geometry
from pallas_testlib import compile_unoptimised


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "tune.json"
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(path))
    return path


def test_cache_path_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXCNN_AUTOTUNE_CACHE", raising=False)
    assert autotune.cache_path() == os.path.join(
        os.path.expanduser("~"), ".cache", "jaxcnn", "autotune.json")
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "x.json"))
    assert autotune.cache_path() == str(tmp_path / "x.json")


def test_save_is_atomic_and_round_trips(cache):
    data = {"cpu": {"kernels": {"k": {"block_m": 32}}, "ops": {}}}
    autotune.save_cache(data)
    assert autotune.load_cache() == data
    assert os.listdir(cache.parent) == ["tune.json"]  # no temporary file left behind
    assert json.loads(cache.read_text())["version"] == 1


@pytest.mark.parametrize("text", ["{not json", '{"version": 1, "devices": []}', "[1, 2]"])
def test_corrupt_cache_warns_and_is_ignored(cache, text):
    cache.parent.mkdir()
    cache.write_text(text)
    with pytest.warns(UserWarning, match="autotune cache"):
        assert autotune.load_cache() == {}


def test_config_for_uses_cache_then_default(cache):
    g = geometry((1, 8, 8, 4), (3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)), (8, 8))
    key = autotune.kernel_key("dense_fwd", g, 8, jnp.float32)
    default = autotune.config_for("dense_fwd", g, 8, jnp.float32, interpret=True)
    assert default == autotune.default_config("dense_fwd", g, 8, interpret=True)
    chosen = pk.BlockConfig(32, 16, 16, num_warps=8)
    autotune.save_cache({autotune.device_kind(): {"kernels": {key: chosen.to_dict()}}})
    assert autotune.config_for("dense_fwd", g, 8, jnp.float32, interpret=True) == chosen
    with autotune.override({key: pk.BlockConfig(16, 16, 16)}):
        assert autotune.config_for("dense_fwd", g, 8, jnp.float32, True).block_m == 16
    autotune.save_cache({autotune.device_kind(): {"kernels": {key: {"block_m": 24}}}})
    with pytest.warns(UserWarning, match="invalid"):
        assert autotune.config_for("dense_fwd", g, 8, jnp.float32, True) == default


@pytest.mark.skipif(jax.default_backend() == "gpu",
                    reason="reads the interpreter's block slices from the compiled HLO")
def test_candidates_compile_on_threads_and_each_is_timed_as_its_own_config(cache,
                                                                           monkeypatch):
    """Candidates are traced one at a time (the overrides are global) and compiled on
    several threads; each executable timed must be the config it is timed as.  The fake
    clock reads the tile from the executable itself: interpret mode slices
    ``(block_m, 16)`` blocks, so the smallest such shape in its HLO is the block."""
    import re
    import threading
    monkeypatch.setenv("JAXCNN_AUTOTUNE_COMPILE_THREADS", "3")
    threads = set()
    real_compile = jax.stages.Lowered.compile

    def compile_(self, *a, **k):
        threads.add(threading.get_ident())
        return real_compile(self, *a, **k)

    monkeypatch.setattr(jax.stages.Lowered, "compile", compile_)
    x = jnp.zeros((1, 10, 10, 16), jnp.float32)  # 25 output and 100 input pixels
    sizes = (32, 64, 128)
    timed = []

    def timer(fn, *args):
        jax.block_until_ready(fn(*args))
        if not isinstance(fn, jax.stages.Compiled):
            return 1.0  # the race against XLA
        blocks = {int(b) for b in re.findall(r"f32\[(\d+),16\]", fn.as_text())} & set(sizes)
        bm = min(blocks)
        assert bm in {c.block_m for c in autotune._overrides.values()}
        timed.append(bm)
        return 1.0 / bm  # the largest block is the fastest

    tuning.tune_op("avg_pool2d", (x,), dict(kernel_size=2), timer=timer,
                   candidate_fn=lambda kernel, g, co: [pk.BlockConfig(bm, 16) for bm in sizes])
    assert timed == list(sizes) * 2  # the backward kernel's candidates, then the forward's
    assert len(threads) > 1
    saved = autotune.load_cache()[autotune.device_kind()]["kernels"]
    assert {c["block_m"] for c in saved.values()} == {128}


def test_compile_threads_setting(monkeypatch):
    monkeypatch.delenv("JAXCNN_AUTOTUNE_COMPILE_THREADS", raising=False)
    assert 1 <= autotune.compile_threads() <= 8
    monkeypatch.setenv("JAXCNN_AUTOTUNE_COMPILE_THREADS", "2")
    assert autotune.compile_threads() == 2
    for bad in ("0", "many"):
        monkeypatch.setenv("JAXCNN_AUTOTUNE_COMPILE_THREADS", bad)
        with pytest.raises(ValueError, match=f"JAXCNN_AUTOTUNE_COMPILE_THREADS .* got '{bad}'"):
            autotune.compile_threads()


def test_tuner_skips_configs_that_overflow_shared_memory(cache, monkeypatch):
    """On a GPU with little shared memory, configs whose pipelined tiles do not fit are
    never timed (they would fail to launch); the rest still are."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 6, 8)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((3, 3, 8, 16)), jnp.float32)
    small, big = pk.BlockConfig(16, 16, 16, 4, 2), pk.BlockConfig(64, 64, 64, 4, 4)
    est = autotune.shared_memory_estimate
    assert est("dense_fwd", small, jnp.float32) == 2 * (16 * 16 + 16 * 16) * 4
    assert est("dense_wgrad", big, jnp.bfloat16) == 4 * (64 * 64 + 64 * 64) * 2
    assert est("depthwise_fwd", big, jnp.float32) == 0
    monkeypatch.setattr(autotune, "shared_memory_limit", lambda: 16 * 1024)
    compile_unoptimised(monkeypatch)  # compiled, never run (a fake clock): level 0
    timed = []

    def timer(fn, *args):
        timed.append(dict(autotune._overrides))
        return 1.0

    tuning.tune_op("conv2d", (x, w, None), dict(padding=1), timer=timer,
                   candidate_fn=lambda kernel, g, co: [small, big])
    tuned = [c for overrides in timed[:-4] for c in overrides.values()]  # last 4: the race
    assert small in tuned and big not in tuned


def test_kernels_import_nothing_above_them():
    """pallas_kernels sits below jaxcnn.functional (DESIGN.md section 1): no module of it
    imports jaxcnn.functional or jaxcnn.layers, at module level or inside a function."""
    import ast
    import pathlib
    root = pathlib.Path(pk.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) and node.module else [])
            bad += [f"{path.name}: {n}" for n in names
                    if n.startswith(("jaxcnn.functional", "jaxcnn.layers"))]
    assert bad == []
