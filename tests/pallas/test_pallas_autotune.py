"""The autotuner's cache (path, atomic writes, corruption) and its kernel-vs-XLA verdict."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn import functional as F
from pallas_kernels import autotune
from pallas_kernels._common import geometry


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


def test_tune_op_keeps_the_fastest_and_records_the_verdict(cache):
    """A fake clock makes each block_m=32 and the Pallas op faster; every candidate still runs."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 6, 6, 4)), jnp.float32)
    static = dict(kernel_size=2)
    ran = []

    def timer(fn, *args):
        jax.block_until_ready(fn(*args))
        ran.append(1)
        # Candidates come compiled ahead of timing; the final race times jitted functions.
        is_pallas = isinstance(fn, jax.stages.Compiled) or "pallas_call" in str(
            jax.make_jaxpr(fn)(*args))
        fast = sum(c.block_m == 32 for c in autotune._overrides.values())
        return (0.5 if is_pallas else 1.0) / (1 + fast)

    def two_candidates(kernel, g, co):
        return [pk.BlockConfig(64, 16), pk.BlockConfig(32, 16)]

    assert not autotune.tuned_here("avg_pool2d", (x,), static)
    entry = autotune.tune_op("avg_pool2d", (x,), static, timer=timer,
                             candidate_fn=two_candidates)
    assert entry["pallas_faster"] and len(ran) == 2 * 2 + 4
    # What bench_kernels --tune skips when resumed: this call, in any form, and no other.
    assert autotune.tuned_here("avg_pool2d", (x,), dict(kernel_size=(2, 2), stride=2))
    assert not autotune.tuned_here("avg_pool2d", (x,), dict(kernel_size=3))
    saved = autotune.load_cache()[autotune.device_kind()]
    assert {c["block_m"] for c in saved["kernels"].values()} == {32}
    assert len(saved["kernels"]) == 2  # forward and backward kernels
    assert autotune.measured_faster("avg_pool2d", (x,), static)
    # Keyed as jaxcnn.functional looks it up: normalised pairs and explicit padding.
    arrays, canon = autotune.canonical_call("avg_pool2d", (x,), static)
    assert canon["kernel_size"] == (2, 2) and canon["stride"] == (2, 2)
    assert autotune.verdict("avg_pool2d", arrays, canon) == (True, True)
    assert autotune.verdict("avg_pool2d", (x,), static) is None  # the raw form is not a key
    on_gpu = jax.default_backend() == "gpu"  # never on CPU; on a GPU, the verdict
    assert autotune.prefers_pallas("avg_pool2d", (x,), canon) == (on_gpu, on_gpu)
    assert ("pallas_call" in str(jax.make_jaxpr(lambda x: F.avg_pool2d(x, 2))(x))) == on_gpu


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

    autotune.tune_op("avg_pool2d", (x,), dict(kernel_size=2), timer=timer,
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


def test_canonical_call_matches_what_conv2d_asks():
    x, w = jnp.zeros((2, 9, 9, 4), jnp.bfloat16), jnp.zeros((3, 3, 4, 8), jnp.bfloat16)
    arrays, static = autotune.canonical_call("conv2d", (x, w), dict(padding=1, stride=2))
    assert [None if a is None else a.shape for a in arrays] == [x.shape, w.shape, None]
    assert static == dict(stride=(2, 2), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1)


@pytest.mark.parametrize("forward, training", [(True, False), (False, True)])
def test_auto_splits_forward_and_training_choices(monkeypatch, forward, training):
    """Where the kernel wins only alone or only with its backward, auto runs it only there;
    values and gradients equal XLA's either way."""
    monkeypatch.setattr(autotune, "prefers_pallas", lambda *a: (forward, training))
    rng = np.random.default_rng(3)
    x = jnp.asarray(np.maximum(np.round(rng.standard_normal((2, 7, 7, 3)) * 2), 0), jnp.float32)
    kw = dict(kernel_size=3, stride=2, padding=1)

    def pool(x, impl):
        return F.max_pool2d(x, **kw, impl=impl)

    def has_kernel(fn, *a):
        return "pallas_call" in str(jax.make_jaxpr(fn)(*a))

    def loss(impl):
        return lambda x: jnp.sum(pool(x, impl) * jnp.arange(3.0))

    assert has_kernel(lambda x: pool(x, "auto"), x) == forward
    np.testing.assert_array_equal(jax.jit(lambda x: pool(x, "auto"))(x), pool(x, "xla"))
    grad = jax.jit(jax.grad(loss("auto")))(x)
    np.testing.assert_array_equal(grad, jax.grad(loss("xla"))(x))
    assert has_kernel(jax.grad(loss("auto")), x) == training


H100 = "NVIDIA H100 80GB HBM3"


def test_shipped_table_below_the_user_cache(cache, monkeypatch):
    """The shipped H100 measurements answer for ResNet-50's 3x3/2 max-pool (slower alone,
    faster with its backward) until the user's own cache says otherwise."""
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    x = jax.ShapeDtypeStruct((256, 112, 112, 64), jnp.bfloat16)
    arrays, static = autotune.canonical_call("max_pool2d", (x,), dict(
        kernel_size=3, stride=2, padding=1))
    assert autotune.verdict("max_pool2d", arrays, static) == (False, True)
    assert not autotune.tuned_here("max_pool2d", arrays, static)  # shipped, not tuned here
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)
    conv = autotune.canonical_call("conv2d", (jax.ShapeDtypeStruct((256, 56, 56, 64),
                                                                    jnp.bfloat16), w), dict(padding=1))
    assert autotune.verdict("conv2d", *conv) == (False, False)
    key = autotune.op_key("max_pool2d", arrays, static)
    autotune.save_cache({H100: {"kernels": {}, "ops": {key: {"pallas_faster": True}}}})
    assert autotune.verdict("max_pool2d", arrays, static) == (True, True)
    monkeypatch.setattr(autotune, "device_kind", lambda: "some other GPU")
    assert autotune.verdict("max_pool2d", arrays, static) is None


def test_tune_calls_tunes_each_untuned_call_once(cache):
    """Every pooling call a function makes is found in its canonical form and tuned once."""
    def net(x):
        return F.avg_pool2d(F.max_pool2d(x, 2), 3, stride=1, padding=1) + F.avg_pool2d(
            F.max_pool2d(x, 2), 3, stride=1, padding=1)

    timed = []

    def timer(fn, *args):
        timed.append(1)
        return 1.0

    def one_candidate(kernel, g, co):
        return [pk.BlockConfig(32, 16)]

    x = jax.ShapeDtypeStruct((1, 8, 8, 3), jnp.float32)
    tuned = autotune.tune_calls(net, x, timer=timer, candidate_fn=one_candidate)
    assert sorted(k.split("|")[0] for k in tuned) == ["avg_pool2d", "max_pool2d"]
    y = jax.ShapeDtypeStruct((1, 4, 4, 3), jnp.float32)
    assert all(autotune.verdict(op, *autotune.canonical_call(op, (a,), kw)) is not None
               for op, a, kw in [("max_pool2d", x, dict(kernel_size=2)),
                                 ("avg_pool2d", y, dict(kernel_size=3, stride=1, padding=1))])
    first = len(timed)
    assert autotune.tune_calls(net, x, timer=timer, candidate_fn=one_candidate) == {}
    assert len(timed) == first  # nothing tuned twice
    assert len(autotune.tune_calls(net, x, timer=timer, candidate_fn=one_candidate,
                                   force=True)) == 2


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
    timed = []

    def timer(fn, *args):
        timed.append(dict(autotune._overrides))
        return 1.0

    autotune.tune_op("conv2d", (x, w, None), dict(padding=1), timer=timer,
                     candidate_fn=lambda kernel, g, co: [small, big])
    tuned = [c for overrides in timed[:-4] for c in overrides.values()]  # last 4: the race
    assert small in tuned and big not in tuned
