"""The Mosaic GPU BatchNorm reductions (pallas_kernels/mgpu_bn.py) in GPU interpret mode, against
numpy float64 of the same (rounded) inputs, and lowered offline for an H100 (sm_90a).

Shapes are tiny but have every tail: rows not a multiple of the 64-row tile (the last CTA's
last tile part zero fill), channels not a multiple of the channel block, several CTAs on
both grid axes (so the in-kernel and the cross-CTA merges both run).  Data sits at an
offset of 50 with standard deviation 3: a plain ``E[x^2] - E[x]^2`` in float32 would lose
the variance's leading digits there.

Tolerances (float32 accumulation of exact inputs): means within 2e-6 of the largest |x|,
variances within 1e-4 relative, sums within 1e-5 of the sum of the terms' magnitudes.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import H100, assert_tma_pipeline, inspect_kernels, needs_mgpu, races  # noqa: F401
from pallas_kernels import mgpu_bn as mb

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
    mean, var = mb.channel_stats(x, config=config, interpret=True)
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
    s1, s2 = mb.channel_grad_sums(dy, x, mean, invstd, config=SMALL, interpret=True, **kw)
    g = np.where(keep, dy64, 0.0)
    xhat = (x64 - mean.astype(np.float64)) * invstd.astype(np.float64)
    for got, terms, what in ((s1, g, "sum dy"), (s2, g * xhat, "sum dy*xhat")):
        atol = 1e-5 * np.abs(terms).sum(0).max()
        np.testing.assert_allclose(got, terms.sum(0), rtol=0, atol=atol, err_msg=what)


@needs_mgpu
def test_no_races(races):
    x, x64 = _data((1, 10, 13, 32), BF16)
    mean, invstd = x64.mean(0).astype(np.float32), np.ones(32, np.float32)
    mb.channel_stats(x, config=SMALL, interpret=True, detect_races=races)
    mb.channel_grad_sums(x, x, mean, invstd, relu_out=x, config=SMALL, interpret=True,
                         detect_races=races)


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
