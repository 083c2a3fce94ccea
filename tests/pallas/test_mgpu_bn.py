"""The Mosaic GPU BatchNorm reductions (pallas_kernels/mgpu_bn.py) in GPU interpret mode, against
numpy float64 of the same (rounded) inputs, and lowered offline for an H100 (sm_90a).

Shapes are tiny but have every tail: rows not a multiple of the 64-row tile (the last CTA's
last tile part zero fill), channels not a multiple of the channel block, several CTAs on
both grid axes (so the in-kernel and the cross-CTA merges both run).  Data sits at an
offset of 50 with standard deviation 3: a plain ``E[x^2] - E[x]^2`` in float32 would lose
the variance's leading digits there.

Each kernel call compiles with XLA's optimisations off (``pallas_testlib.fast_run``: an
interpreted kernel's program compiles in about half the time; the checks are tolerances).

Tolerances (float32 accumulation of exact inputs): means within 2e-6 of the largest |x|,
variances within 1e-4 relative, sums within 1e-5 of the sum of the terms' magnitudes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import (H100, assert_tma_pipeline, inspect_kernels, needs_mgpu, races,  # noqa: F401
                          shipped)
from pallas_kernels import mgpu_bn as mb
from pallas_testlib import fast_run

BF16 = jnp.bfloat16
SMALL = mb.BnConfig(block_c=16, stages=2)  # C=24: two channel blocks; 198 rows: two CTAs


def _data(shape, dtype, seed=0, offset=50.0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray((rng.standard_normal(shape) * 3 + offset).astype(np.float32)).astype(dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64).reshape(-1, shape[-1])


@needs_mgpu
@pytest.mark.parametrize("dtype, c, config", [(BF16, 24, SMALL), (jnp.float32, 20, SMALL),
                                              (BF16, 24, None)])
def test_channel_stats_matches_float64_with_offset(dtype, c, config):
    assert mb.cta_rows(198, c, SMALL).tolist() == [128, 70]
    x, ref = _data((2, 9, 11, c), dtype)
    mean, var = fast_run(lambda x: mb.channel_stats(x, config=config, interpret=True), x)
    assert mean.dtype == var.dtype == jnp.float32 and mean.shape == var.shape == (c,)
    np.testing.assert_allclose(mean, ref.mean(0), rtol=0, atol=2e-6 * np.abs(ref).max())
    np.testing.assert_allclose(var, ref.var(0), rtol=1e-4)


@needs_mgpu
@pytest.mark.parametrize("dtype, relu", [(BF16, "out"), (jnp.float32, "affine"), (BF16, None)])
def test_channel_grad_sums_match_float64(dtype, relu):
    shape = (2, 9, 11, 24)
    x, x64 = _data(shape, dtype)
    dy, dy64 = _data(shape, dtype, seed=1, offset=0.0)
    mean = x64.mean(0).astype(np.float32)
    invstd = (1 / np.sqrt(x64.var(0) + 1e-5)).astype(np.float32)
    a = np.linspace(-1.0, 1.0, 24).astype(np.float32) * invstd
    b = (0.3 - mean * a).astype(np.float32)
    keep = np.ones_like(x64, bool)
    kw = {}
    if relu == "out":
        y = jnp.maximum(x.astype(jnp.float32) * a + b, 0).astype(dtype)
        keep, kw = np.asarray(y.astype(jnp.float32)).reshape(x64.shape) > 0, dict(relu_out=y)
    elif relu == "affine":
        keep, kw = x64 * a + b > 0, dict(relu_affine=(a, b))
    s1, s2 = fast_run(lambda dy, x, mean, invstd, kw: mb.channel_grad_sums(
        dy, x, mean, invstd, config=SMALL, interpret=True, **kw), dy, x, mean, invstd, kw)
    g = np.where(keep, dy64, 0.0)
    xhat = (x64 - mean.astype(np.float64)) * invstd.astype(np.float64)
    for got, terms, what in ((s1, g, "sum dy"), (s2, g * xhat, "sum dy*xhat")):
        atol = 1e-5 * np.abs(terms).sum(0).max()
        np.testing.assert_allclose(got, terms.sum(0), rtol=0, atol=atol, err_msg=what)


@needs_mgpu
def test_no_races(races):
    x, x64 = _data((1, 10, 13, 32), BF16)
    mean, invstd = x64.mean(0).astype(np.float32), np.ones(32, np.float32)
    fast_run(lambda x, mean, invstd: (
        mb.channel_stats(x, config=SMALL, interpret=True, detect_races=races),
        mb.channel_grad_sums(x, x, mean, invstd, relu_out=x, config=SMALL, interpret=True,
                             detect_races=races)), x, mean, invstd)


def test_refuses_what_it_cannot_run():
    with pytest.raises(KernelUnsupported):
        mb.channel_stats(jnp.zeros((4, 4, 4, 12), BF16))  # 24-byte rows
    with pytest.raises(KernelUnsupported):
        mb.channel_stats(jnp.zeros((4, 8), jnp.int32))
    with pytest.raises(ValueError, match="block_c"):
        mb.BnConfig(block_c=24)


@pytest.mark.parametrize("c, dtype", [(24, BF16), (64, BF16), (2048, BF16), (256, jnp.float32)])
def test_candidates_fit_and_are_few(c, dtype):
    for streams, rows in ((1, 0), (3, 4)):
        cands = mb.candidates(c, dtype, streams=streams, table_rows=rows)
        assert 1 <= len(cands) <= 3 and len(set(cands)) == len(cands)
        assert all(mb.smem_bytes(k, c, dtype, streams=streams, table_rows=rows) <= 232448
                   for k in cands)


@needs_mgpu
def test_every_candidate_lowers_for_hopper_with_tma():
    ik = inspect_kernels()
    S = jax.ShapeDtypeStruct
    x, v = S((2, 7, 9, 200), BF16), S((200,), jnp.float32)
    for cfg in mb.candidates(200, BF16):
        reports = ik.inspect_mosaic(lambda x: mb.channel_stats(x, config=cfg), x, kind=H100)
        assert [r.name for r in reports] == ["jaxcnn_mgpu_bn_stats"]
        assert_tma_pipeline(reports, str(cfg))
    for cfg in mb.candidates(200, BF16, streams=3, table_rows=2):
        reports = ik.inspect_mosaic(lambda dy, x, m, i, y: mb.channel_grad_sums(
            dy, x, m, i, relu_out=y, config=cfg), x, x, v, v, x, kind=H100)
        assert [r.name for r in reports] == ["jaxcnn_mgpu_bn_grad_sums"]
        assert_tma_pipeline(reports, str(cfg))
    reports = ik.inspect_mosaic(lambda dy, x, m, i: mb.channel_grad_sums(
        dy, x, m, i, relu_affine=(m, i)), x, x, v, v, kind=H100)
    assert_tma_pipeline(reports, "relu_affine")


# --- batch_norm_train(impl=...): the explicit form with the kernels' reductions ---------------

def _as_if_on_hopper(monkeypatch):
    """``batch_norm_train`` takes the kernels only on a Hopper GPU: here, it is told it is on
    one, and the kernels run in GPU interpret mode (off a GPU, ``mgpu_bn``'s own choice)."""
    from jaxcnn.functional import _dispatch
    from pallas_kernels import mgpu_window as mw
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(mw, "on_hopper", lambda device_kind=None: True)


def _bn_outputs_and_grads(impl, relu, cts, **kw):
    """``(x, scale, bias) -> (outputs, VJP at cts)`` of the explicit form, as one program."""
    from jaxcnn import functional as F

    def run(x, scale, bias):
        out, pull = jax.vjp(lambda *a: F.batch_norm_train(*a, grad="explicit", relu=relu,
                                                          impl=impl, **kw), x, scale, bias)
        return out, pull(cts)
    return lambda *args: fast_run(run, *args)


@needs_mgpu
@pytest.mark.parametrize("dtype, relu", [(BF16, True), (jnp.float32, False)])
def test_batch_norm_train_with_kernels_equals_xla_with_gradients(dtype, relu, monkeypatch):
    """Outputs and gradients (the statistics' cotangents included) equal the XLA form's to
    float32 rounding: 1e-5 of the largest value (16-bit outputs within a step of theirs)."""
    launched = []
    launch = mb._launch
    monkeypatch.setattr(mb, "_launch", lambda *a, **k: launched.append(k["name"]) or launch(*a, **k))
    _as_if_on_hopper(monkeypatch)
    shape = (2, 9, 11, 24)
    x, _ = _data(shape, dtype)
    rng = np.random.default_rng(3)
    scale, bias, dmean, dvar = (jnp.asarray(rng.standard_normal(24), jnp.float32) for _ in range(4))
    cts = (_data(shape, dtype, seed=4, offset=0.0)[0], dmean, dvar)
    got = _bn_outputs_and_grads("pallas", relu, cts)(x, scale, bias)
    assert sorted(set(launched)) == ["jaxcnn_mgpu_bn_grad_sums", "jaxcnn_mgpu_bn_stats"]
    want = _bn_outputs_and_grads("xla", relu, cts)(x, scale, bias)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        # A 16-bit array may round the other way where the statistics differ in their last
        # float32 bit: one step of its type (bfloat16: 2**-7 relative).
        ulp = 2.0 ** -7 * np.abs(np.asarray(b, np.float32)) if a.dtype == BF16 else 0.0
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.all(np.abs(a - b) <= 1e-5 * np.abs(b).max() + ulp), np.abs(a - b).max()


@needs_mgpu
def test_synced_under_shard_map_and_vmap_with_kernels(monkeypatch):
    """SyncBatchNorm (``axis_name``): under ``shard_map`` the kernels reduce each device's
    shard and the collectives stay outside; under ``vmap`` the reductions are XLA's (the
    kernels cannot take part).  Both equal the whole batch's XLA form, gradients included."""
    from jax.sharding import PartitionSpec as P

    from jaxcnn import functional as F
    launched = []
    launch = mb._launch
    monkeypatch.setattr(mb, "_launch", lambda *a, **k: launched.append(k["name"]) or launch(*a, **k))
    _as_if_on_hopper(monkeypatch)
    x, _ = _data((4, 3, 5, 8), jnp.float32)
    g, _ = _data((4, 3, 5, 8), jnp.float32, seed=2, offset=0.0)
    # One device: GPU interpret mode cannot run a kernel on several host devices at once
    # (its shared-memory model then finds a barrier left allocated); the types under
    # check_vma and the collectives around the kernels are the same on one.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda x: jnp.sum(fn(x) * g)))

    def bn(x, impl):
        return F.batch_norm_train(x, axis_name="data", grad="explicit", relu=True, impl=impl)[0]

    sharded = loss(jax.shard_map(lambda x: bn(x, "pallas"), mesh=mesh, in_specs=P("data"),
                                 out_specs=P("data")))
    mapped = loss(lambda x: jax.vmap(lambda x: bn(x, "pallas"), axis_name="data")(
        x.reshape(2, 2, 3, 5, 8)).reshape(x.shape))
    whole = loss(lambda x: F.batch_norm_train(x, grad="explicit", relu=True, impl="xla")[0])
    want = whole(x)
    for fn in (sharded, mapped):
        for a, b in zip(fn(x), want):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())
    assert set(launched) == {"jaxcnn_mgpu_bn_grad_sums", "jaxcnn_mgpu_bn_stats"}


def test_auto_takes_the_kernels_only_where_a_verdict_says_so(monkeypatch):
    """Off a GPU: XLA whatever ``impl``.  On a Hopper GPU, ``impl="auto"``: XLA without a
    measurement; each reduction from its kernel where the ``batch_norm`` verdict at this
    shape (and ``relu``) says it won."""
    from jaxcnn.functional import _dispatch
    from pallas_kernels import autotune
    from pallas_kernels import mgpu_window as mw
    x = jnp.zeros((2, 4, 4, 64), BF16)
    for impl in ("auto", "xla", "pallas"):  # the CPU: never (the interpreter cannot run them
        assert _dispatch.batch_norm_kernels(impl, x) == (False, False)  # under remat/shard_map)
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(mw, "on_hopper", lambda device_kind=None: True)
    monkeypatch.setattr(mb, "check_supported", lambda *a: None)  # any jax
    asked = []
    for found in (None, (False, True), (True, True)):
        monkeypatch.setattr(autotune, "verdict", lambda *a, found=found: asked.append(a) or found)
        assert _dispatch.batch_norm_kernels("auto", x, relu=True) == (found or (False, False))
    assert asked[0] == ("batch_norm", (x,), {"backend": "mosaic", "relu": True})
    monkeypatch.setattr(mw, "on_hopper", lambda device_kind=None: False)
    assert _dispatch.batch_norm_kernels("pallas", x) == (False, False)  # not a Hopper GPU


def test_tuned_tiles_are_looked_up_per_launch(shipped, monkeypatch):
    """The tiles the GPU check keeps for a launch (``tuned.json``, the device kind's entry
    under :attr:`BnCall.key`) are the ones the kernel runs with; others take the default."""
    from pallas_kernels import autotune
    monkeypatch.setattr(mb.mc, "unavailable_reason", lambda: None)  # any jax: nothing runs
    seen = []
    monkeypatch.setattr(mb, "_launch", lambda *a, cfg, **k: seen.append(cfg) or jnp.zeros(
        (1, 2, 128), jnp.float32))
    x = jnp.zeros((2, 4, 8, 64), BF16)
    stats = mb.BnCall("mgpu_bn_stats", 64, 64, "bfloat16")
    sums = mb.BnCall("mgpu_bn_grad_sums", 64, 64, "bfloat16", 2, 2)
    shipped(autotune.device_kind(), {stats.key: {"block_c": 32, "stages": 3}})
    mb.channel_stats(x)
    mb.channel_grad_sums(x, x, jnp.zeros(64), jnp.ones(64))
    assert seen == [mb.BnConfig(32, 3), sums.candidates()[0]]


@needs_mgpu
def test_shared_memory_count_is_mosaics(monkeypatch):
    """Past the limit Mosaic refuses a kernel, naming the bytes its scratch needs: the
    model's count (:func:`mb.smem_bytes`), exactly, for both kernels."""
    import re
    ik = inspect_kernels()
    monkeypatch.setattr(mb.mc, "MAX_SMEM", 10 ** 9)  # past the model's own refusal
    S = jax.ShapeDtypeStruct
    x, v = S((2, 7, 9, 256), BF16), S((256,), jnp.float32)
    big = mb.BnConfig(256, 8)
    cases = [(lambda x: mb.channel_stats(x, config=big), (x,), 1, 0),
             (lambda dy, x, m, i: mb.channel_grad_sums(dy, x, m, i, relu_affine=(m, i),
                                                       config=big), (x, x, v, v), 2, 4)]
    for fn, args, streams, rows in cases:
        need = mb.smem_bytes(big, 256, BF16, streams=streams, table_rows=rows)
        assert need > 232448
        with pytest.raises(ValueError) as e:
            ik.inspect_mosaic(fn, *args, kind=H100)
        got = re.search(r"smem_bytes=(\d+)", str(e.value))
        assert got and int(got.group(1)) == need, str(e.value)[:300]


def test_the_gpu_check_times_each_candidate_with_its_own_tiles(tmp_path, monkeypatch):
    """``scripts/_gpu_check_stages.py``'s tile race runs each candidate's own tiles, so each
    timing is of the tiles it is stored under (tiles looked up while tracing under an
    override timed the first traced candidate again: jax reuses the trace), and the fastest
    is stored where the kernels look their tiles up."""
    import importlib.util
    import os
    import sys
    from types import SimpleNamespace

    from pallas_kernels import autotune
    scripts = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
    sys.path.insert(0, scripts)
    try:
        spec = importlib.util.spec_from_file_location("_gpu_check_stages",
                                                      os.path.join(scripts, "_gpu_check_stages.py"))
        stages = sys.modules["_gpu_check_stages"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(stages)
    finally:
        sys.path.remove(scripts)
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(mb.mc, "unavailable_reason", lambda: None)  # any jax: nothing runs
    traced = []
    monkeypatch.setattr(mb, "_launch", lambda *a, cfg, **k: traced.append(cfg) or jnp.zeros(
        (1, 2, 128), jnp.float32))
    call = mb.BnCall("mgpu_bn_stats", 64, 64, "bfloat16")
    candidates = call.candidates(stages.mc.MAX_SMEM)[:3]
    assert len(candidates) >= 2
    times = iter([3.0, 1.0, 2.0])

    def timer(fn, *args):
        jax.block_until_ready(fn(*args))
        return next(times)
    ctx = SimpleNamespace(timer=timer, max_candidates=3)
    kernel = stages._batch_norm_fns()["stats"][0]
    seconds, best = stages._fastest_tiles(ctx, call, kernel, (jnp.zeros((2, 4, 8, 64), BF16),))
    assert traced == candidates and (seconds, best) == (1.0, candidates[1])
    assert autotune.mosaic_config(call, mb.BnConfig) == candidates[1]
    traced.clear()  # and the library, which looks them up, runs the stored ones
    jax.jit(lambda x: mb.channel_stats(x))(jnp.zeros((2, 4, 8, 64), BF16))
    assert traced == [candidates[1]]
