"""Tuning impl="auto" (jaxcnn.functional.tuning) and the choice it feeds
(jaxcnn.functional._dispatch): call forms, verdicts, the shipped table, the
inference/training split, and that choosing never tunes or imports kernels."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn import functional as F
from jaxcnn.functional import _dispatch, tuning
from pallas_kernels import autotune

H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "tune.json"
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(path))
    return path


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

    assert not tuning.tuned_here("avg_pool2d", (x,), static)
    entry = tuning.tune_op("avg_pool2d", (x,), static, timer=timer,
                           candidate_fn=two_candidates)
    assert entry["pallas_faster"] and len(ran) == 2 * 2 + 4
    # What bench_kernels --tune skips when resumed: this call, in any form, and no other.
    assert tuning.tuned_here("avg_pool2d", (x,), dict(kernel_size=(2, 2), stride=2))
    assert not tuning.tuned_here("avg_pool2d", (x,), dict(kernel_size=3))
    saved = autotune.load_cache()[autotune.device_kind()]
    assert {c["block_m"] for c in saved["kernels"].values()} == {32}
    assert len(saved["kernels"]) == 2  # forward and backward kernels
    # Keyed as jaxcnn.functional looks it up: normalised pairs and explicit padding.
    arrays, canon = tuning.canonical_call("avg_pool2d", (x,), static)
    assert canon["kernel_size"] == (2, 2) and canon["stride"] == (2, 2)
    assert autotune.verdict("avg_pool2d", arrays, canon) == (True, True)
    assert autotune.verdict("avg_pool2d", (x,), static) is None  # the raw form is not a key
    on_gpu = jax.default_backend() == "gpu"  # never on CPU; on a GPU, the verdict
    assert ("pallas_call" in str(jax.make_jaxpr(lambda x: F.avg_pool2d(x, 2))(x))) == on_gpu


def test_canonical_call_matches_what_conv2d_asks():
    x, w = jnp.zeros((2, 9, 9, 4), jnp.bfloat16), jnp.zeros((3, 3, 4, 8), jnp.bfloat16)
    arrays, static = tuning.canonical_call("conv2d", (x, w), dict(padding=1, stride=2))
    assert [None if a is None else a.shape for a in arrays] == [x.shape, w.shape, None]
    assert static == dict(stride=(2, 2), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1)


@pytest.mark.parametrize("forward, training", [(True, False), (False, True)])
def test_auto_splits_forward_and_training_choices(monkeypatch, forward, training):
    """Where the kernel wins only alone or only with its backward, auto runs it only there;
    values and gradients equal XLA's either way."""
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(autotune, "verdict", lambda *a: (forward, training))
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


def test_shipped_table_below_the_user_cache(cache, monkeypatch):
    """The shipped H100 measurements answer for ResNet-50's 3x3/2 max-pool (slower alone,
    faster with its backward) until the user's own cache says otherwise."""
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    x = jax.ShapeDtypeStruct((256, 112, 112, 64), jnp.bfloat16)
    arrays, static = tuning.canonical_call("max_pool2d", (x,), dict(
        kernel_size=3, stride=2, padding=1))
    assert autotune.verdict("max_pool2d", arrays, static) == (False, True)
    assert not tuning.tuned_here("max_pool2d", arrays, static)  # shipped, not tuned here
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)
    conv = tuning.canonical_call("conv2d", (jax.ShapeDtypeStruct((256, 56, 56, 64),
                                                                    jnp.bfloat16), w), dict(padding=1))
    assert autotune.verdict("conv2d", *conv) == (False, False)
    key = autotune.op_key("max_pool2d", arrays, static)
    autotune.save_cache({H100: {"kernels": {}, "ops": {key: {
        "fwd_faster": True, "grad_faster": True}}}})
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
    tuned = tuning.tune_calls(net, x, timer=timer, candidate_fn=one_candidate)
    assert sorted(k.split("|")[0] for k in tuned) == ["avg_pool2d", "max_pool2d"]
    y = jax.ShapeDtypeStruct((1, 4, 4, 3), jnp.float32)
    assert all(autotune.verdict(op, *tuning.canonical_call(op, (a,), kw)) is not None
               for op, a, kw in [("max_pool2d", x, dict(kernel_size=2)),
                                 ("avg_pool2d", y, dict(kernel_size=3, stride=1, padding=1))])
    first = len(timed)
    assert tuning.tune_calls(net, x, timer=timer, candidate_fn=one_candidate) == {}
    assert len(timed) == first  # nothing tuned twice
    assert len(tuning.tune_calls(net, x, timer=timer, candidate_fn=one_candidate,
                                   force=True)) == 2


def test_auto_never_tunes_inside_a_trace(cache, monkeypatch):
    """A GPU call never measured runs XLA; choosing only looks up, even where the
    retired JAXCNN_AUTOTUNE=1 is still set (it used to time kernels in the user's trace)."""
    monkeypatch.setenv("JAXCNN_AUTOTUNE", "1")
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")

    def no_tuning(*a, **k):
        raise AssertionError("tuned inside a trace")

    monkeypatch.setattr(autotune, "tune_op", no_tuning)
    monkeypatch.setattr(autotune, "time_call", no_tuning)
    x = jnp.ones((1, 6, 6, 4), jnp.float32)
    w = jnp.ones((3, 3, 4, 4), jnp.float32)
    y = jax.jit(lambda x: F.max_pool2d(F.conv2d(x, w, padding=1), 2))(x)
    assert y.shape == (1, 3, 3, 4)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda x: F.avg_pool2d(x, 2))(x))


def test_ops_on_the_cpu_never_import_pallas_kernels():
    """impl="auto"/"xla" on a CPU choose XLA or a CPU rewrite without importing the kernels;
    impl="pallas" imports them."""
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from jaxcnn import functional as F, layers\n"
        "x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))\n"
        "f = lambda x: jnp.sum(F.avg_pool2d(F.max_pool2d(F.conv2d(x, w, padding=1), 2), 2))\n"
        "jax.grad(f)(x); F.conv2d(x, w, impl='xla')\n"
        "assert 'pallas_kernels' not in sys.modules, 'imported by auto'\n"
        "F.max_pool2d(x, 2, impl='pallas')\n"
        "assert 'pallas_kernels' in sys.modules\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXCNN_CPU_MALLOC": "0"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
