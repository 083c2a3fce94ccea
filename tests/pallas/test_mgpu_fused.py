"""BatchNorm fused into the Mosaic GPU convolution (``pallas_kernels.mgpu_fused``), on the CPU.

The kernels run in Mosaic GPU interpret mode, the race detector on for at least one
configuration of each fused variant (statistics epilogue, BatchNorm+ReLU prologue, both,
with one warpgroup and with a producer warpgroup).  References are ``jax.lax``
convolutions in float32 of the same 16-bit values, rounded to the 16-bit type where the
unfused chain stores an activation.  Each case compiles its kernels' program with XLA's
optimisations off (``pallas_testlib.fast_run``: an interpreted kernel's program compiles in
about half the time; its results are compared within a tolerance).

Tolerances:

- outputs: each element within half a 16-bit step of the float32 reference plus 1e-4 of
  the largest value (see ``mgpu_testlib``);
- statistics against the kernel's own output: float32 summation-order noise (1e-5 of the
  largest mean/variance, computed in float64 on the host);
- statistics against ``jax.lax``: the bound the per-element output tolerance ``e_i``
  implies, ``|d mean| <= mean(e_i)`` and ``|d var| <= mean((e_i + |d mean|)(|y_i - m_y| +
  |r_i - m_r|))`` (exact identities), plus the same float32 noise;
- gradients of the fused chain against the unfused one: rounding points differ (the
  cotangents are rounded to bfloat16 in different places), so 2e-2 of
  ``max(1, max |reference|)`` for bfloat16, as the Triton kernels' tests.
"""
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import HALF_STEP, S, inspect_kernels, needs_mgpu, races  # noqa: F401
from mgpu_testlib import assert_16bit_close, assert_tma_pipeline, lower_with_grads, normal, ref_conv
from mgpu_testlib import cover, field_values
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_fused as mf
from pallas_testlib import assert_close, fast_run

F32 = jnp.float32
pytestmark = needs_mgpu


def _bound(want, dtype):
    return HALF_STEP[jnp.dtype(dtype)] * np.abs(want) + 1e-4 * np.abs(want).max()


def _assert_stats(mean, var, y, want, dtype, what):
    """``(mean, var)`` of the kernel against its own output ``y`` (tight) and against the
    float32 reference output ``want`` (the bound its element tolerance implies)."""
    mean, var = np.asarray(mean, np.float64), np.asarray(var, np.float64)
    y = np.asarray(y, np.float64).reshape(-1, y.shape[-1])
    want = np.asarray(want, np.float64).reshape(-1, want.shape[-1])
    assert mean.shape == var.shape == (y.shape[1],), f"{what}: shapes {mean.shape} {var.shape}"
    noise_m, noise_v = 1e-5 * np.abs(y).mean(0).max(), 1e-5 * y.var(0).max()
    np.testing.assert_array_less(np.abs(mean - y.mean(0)), noise_m + 1e-30,
                                 err_msg=f"{what}: mean vs its own output")
    np.testing.assert_array_less(np.abs(var - y.var(0)), noise_v + 1e-30,
                                 err_msg=f"{what}: var vs its own output")
    e = _bound(want, dtype)
    dm = e.mean(0)
    dv = ((e + dm) * (np.abs(y - y.mean(0)) + np.abs(want - want.mean(0)))).mean(0)
    np.testing.assert_array_less(np.abs(mean - want.mean(0)), dm + noise_m,
                                 err_msg=f"{what}: mean vs lax")
    np.testing.assert_array_less(np.abs(var - want.var(0)), dv + noise_v,
                                 err_msg=f"{what}: var vs lax")


# name, x shape, w shape, stride, pads, config, dtype, race detector
STATS_CASES = [
    # every tail (5 rows, 7 columns: tile 16x4; C_in 24, C_out 40 over block_n 32), with
    # bias, residual and ReLU before the statistics
    ("3x3 tails, bias+residual+relu", (1, 5, 7, 24), (3, 3, 24, 40), (1, 1), ((1, 1), (1, 1)),
     mc.MgpuConfig(block_n=32, block_k=16, stages=2), jnp.bfloat16, True),
    ("1x1, producer warpgroup", (2, 4, 6, 16), (1, 1, 16, 24), (1, 1), ((0, 0), (0, 0)),
     mc.MgpuConfig(block_n=16, stages=2, warp_specialized=True), jnp.bfloat16, True),
    # 3 output columns of 16 channels: the 2-pixel tile rows (input, residual) widen to 4
    # (whole 128-byte TMA copies), one tile a row instead of two, so the statistics mask
    # and count 3 of each row's 4; float16, stride 2, 2 images (statistics over both).
    # (Statistics without a residual or ReLU: the 1x1 case; a column tail: the first.)
    ("float16 3x3 stride 2, 2 images, 3 columns, 16 channels, bias+residual+relu",
     (2, 5, 5, 16), (3, 3, 16, 16), (2, 2), ((1, 1), (1, 1)), None, jnp.float16, False),
]


@pytest.mark.parametrize("case", STATS_CASES, ids=[c[0] for c in STATS_CASES])
def test_epilogue_statistics_match_lax(case, races):
    name, xs, ws, stride, pads, cfg, dtype, detect = case
    rng = np.random.default_rng(10)
    x, w = normal(rng, xs, dtype), normal(rng, ws, dtype)
    b = normal(rng, ws[3:], dtype)
    want = ref_conv(x, w, pads, stride=stride) + b.astype(F32)
    res = None
    if "residual" in name:
        res = normal(rng, want.shape, dtype)
        want = jnp.maximum(want + res.astype(F32), 0.0)
    y, mean, var = fast_run(
        lambda x, w, b, res: mc.conv_forward(x, w, b, res, relu=res is not None, stride=stride,
                                             pads=pads, config=cfg, interpret=True,
                                             detect_races=detect and races, stats=True),
        x, w, b, res)
    assert y.dtype == dtype and mean.dtype == var.dtype == F32
    assert_16bit_close(y, want, dtype, f"{name}: output")
    _assert_stats(mean, var, y, want, dtype, name)


def test_statistics_are_combined_in_a_fixed_order():
    """Chan's combination of per-tile partials gives the float64 mean/variance of the whole,
    and the same bits when run twice (no atomics, no order left to XLA)."""
    rng = np.random.default_rng(11)
    counts = np.array([64, 64, 12, 64, 7], np.float32)
    values = [rng.standard_normal((int(c), 3)) * 3 + 100 for c in counts]  # mean >> std
    partial = np.stack([np.stack([v.sum(0), ((v - v.mean(0)) ** 2).sum(0)]) for v in values])
    mean, var = mc.combine_tile_stats(jnp.asarray(partial, F32), counts)
    whole = np.concatenate(values)
    np.testing.assert_allclose(mean, whole.mean(0), rtol=1e-6)
    np.testing.assert_allclose(var, whole.var(0), rtol=1e-5)
    again = mc.combine_tile_stats(jnp.asarray(partial, F32), counts)
    assert np.array_equal(np.asarray(again[1]), np.asarray(var))
    assert float(mc.fixed_order_sum(jnp.arange(7.0))) == 21.0


# name, x shape, w shape, stride, pads, dilation, config, dtype, race detector
PROLOGUE_CASES = [
    ("3x3 pad 1 tails", (1, 5, 7, 24), (3, 3, 24, 40), (1, 1), ((1, 1), (1, 1)), (1, 1),
     mc.MgpuConfig(block_n=32, block_k=16, stages=2), jnp.bfloat16, True),
    ("3x3 stride 2, asymmetric pad", (1, 7, 9, 8), (3, 3, 8, 16), (2, 2), ((1, 2), (2, 1)),
     (1, 1), None, jnp.bfloat16, False),
    ("dilation 2, pad 2", (1, 6, 6, 8), (3, 3, 8, 8), (1, 1), ((2, 2), (2, 2)), (2, 2), None,
     jnp.bfloat16, False),
    ("float16, producer warpgroup", (1, 4, 9, 16), (3, 3, 16, 16), (1, 1), ((1, 1), (1, 1)),
     (1, 1), mc.MgpuConfig(block_n=16, stages=2, warp_specialized=True), jnp.float16, True),
]


def _bn_relu_ref(x, scale, shift, dtype):
    """The unfused chain's activation: relu(x * scale + shift), stored in ``dtype``."""
    return jnp.maximum(x.astype(F32) * scale + shift, 0.0).astype(dtype).astype(F32)


@pytest.mark.parametrize("case", PROLOGUE_CASES, ids=[c[0] for c in PROLOGUE_CASES])
def test_prologue_matches_the_unfused_chain(case, races):
    """conv(relu(x * scale + shift)) with padding of the activation (zeros after the
    prologue); a shift with relu(shift) > 0 makes padding before it give another answer."""
    name, xs, ws, stride, pads, dil, cfg, dtype, detect = case
    rng = np.random.default_rng(12)
    x, w = normal(rng, xs, dtype), normal(rng, ws, dtype)
    scale = normal(rng, xs[3:], F32)  # negative entries too
    shift = jnp.abs(normal(rng, xs[3:], F32)) + 0.5
    y = fast_run(lambda x, w, scale, shift: mc.conv_forward(
        x, w, stride=stride, pads=pads, dilation=dil, config=cfg, interpret=True,
        detect_races=detect and races, input_scale=scale, input_shift=shift), x, w, scale, shift)
    want = ref_conv(_bn_relu_ref(x, scale, shift, dtype), w, pads, dil, stride)
    assert_16bit_close(y, want, dtype, name)
    padded = jnp.pad(x.astype(F32), ((0, 0), *pads, (0, 0)))
    wrong = ref_conv(_bn_relu_ref(padded, scale, shift, dtype), w, ((0, 0), (0, 0)), dil,
                     stride)
    assert float(jnp.max(jnp.abs(wrong - want))) > 0.5  # the case exercises the padding


def test_prologue_and_statistics_together_without_races(races):
    """The middle convolution of a bottleneck: prologue in, bias + ReLU + statistics out,
    with a producer warpgroup, under the race detector."""
    rng = np.random.default_rng(13)
    x, w = normal(rng, (1, 5, 6, 16), jnp.bfloat16), normal(rng, (3, 3, 16, 24), jnp.bfloat16)
    b = normal(rng, (24,), jnp.bfloat16)
    scale, shift = normal(rng, (16,), F32), normal(rng, (16,), F32)
    cfg = mc.MgpuConfig(block_n=16, stages=2, warp_specialized=True)
    y, mean, var = fast_run(lambda x, w, b, scale, shift: mc.conv_forward(
        x, w, b, relu=True, pads=((1, 1), (1, 1)), input_scale=scale, input_shift=shift,
        stats=True, config=cfg, interpret=True, detect_races=races), x, w, b, scale, shift)
    want = jnp.maximum(ref_conv(_bn_relu_ref(x, scale, shift, jnp.bfloat16), w,
                                ((1, 1), (1, 1))) + b.astype(F32), 0.0)
    assert_16bit_close(y, want, jnp.bfloat16, "output")
    _assert_stats(mean, var, y, want, jnp.bfloat16, "prologue + statistics")


# --- the differentiable op against the unfused chain -----------------------------------

EPS = 1e-5


def _unfused_chain(x, w1, gamma, beta, w2, b2, res, dtype):
    """conv -> BatchNorm (batch statistics) -> ReLU -> conv (+ bias + residual, ReLU), and the
    second convolution's batch statistics: plain jax.lax/jnp, activations stored in
    ``dtype`` where the unfused layers store them."""
    pads = ((1, 1), (1, 1))
    y1 = ref_conv(x, w1, pads).astype(dtype).astype(F32)
    m1, v1 = jnp.mean(y1, (0, 1, 2)), jnp.var(y1, (0, 1, 2))
    z = jnp.maximum((y1 - m1) * lax.rsqrt(v1 + EPS) * gamma + beta, 0.0).astype(dtype)
    y2 = jnp.maximum(ref_conv(z, w2, ((0, 0), (0, 0)), stride=(2, 2)) + b2.astype(F32)
                     + res.astype(F32), 0.0).astype(dtype).astype(F32)
    return y2, jnp.mean(y2, (0, 1, 2)), jnp.var(y2, (0, 1, 2))


def _fused_chain(x, w1, gamma, beta, w2, b2, res, backward):
    y1, m1, v1 = mf.conv_bn_stats(x, w1, padding=((1, 1), (1, 1)), backward=backward,
                                  interpret=True)
    scale, shift = mf.fold_batch_norm(m1, v1, gamma, beta, eps=EPS)
    y2, m2, v2 = mf.conv2d(y1, w2, b2, stride=(2, 2), residual=res, relu=True,
                           input_scale=scale, input_shift=shift, stats=True,
                           backward=backward, interpret=True)
    return y2.astype(F32), m2, v2


def _out_and_grads(chain, args, cts):
    """``chain``'s outputs and the VJP of ``cts`` at ``args``: one compilation of both."""
    def run(*a):
        out, vjp = jax.vjp(chain, *a)
        return out, vjp(cts)
    return fast_run(run, *args)


@pytest.fixture(scope="module")
def unfused_chain():
    """``(args, cotangents, outputs, gradients)`` of the unfused chain in bfloat16, computed
    once for both backward options."""
    dtype = jnp.bfloat16
    rng = np.random.default_rng(14)
    x, w1 = normal(rng, (1, 4, 6, 16), dtype), normal(rng, (3, 3, 16, 16), dtype)
    gamma, beta = normal(rng, (16,), F32), normal(rng, (16,), F32)
    w2, b2 = normal(rng, (1, 1, 16, 24), dtype), normal(rng, (24,), dtype)
    res = normal(rng, (1, 2, 3, 24), dtype)
    args = (x, w1, gamma, beta, w2, b2, res)
    cts = (normal(rng, (1, 2, 3, 24), F32), normal(rng, (24,), F32), normal(rng, (24,), F32))
    return (args, cts, *_out_and_grads(lambda *a: _unfused_chain(*a, dtype), args, cts))


@pytest.mark.parametrize("backward", ["mosaic", "xla"])
def test_fused_chain_has_the_unfused_chains_values_and_gradients(backward, unfused_chain):
    """conv_bn_stats -> fold -> prologue conv with bias, residual, ReLU and statistics,
    against the same chain unfused: outputs, statistics, and the gradients of a loss of all
    three with respect to the input, both weights, BatchNorm's affine parameters, the bias
    and the residual (through the batch statistics too)."""
    dtype = jnp.bfloat16
    args, cts, want_out, want_grads = unfused_chain
    got_out, got_grads = _out_and_grads(lambda *a: _fused_chain(*a, backward), args, cts)
    for name, g, r in zip(("y", "mean", "var"), got_out, want_out):
        assert_close(g, r, dtype, name)
    names = ("dx", "dw1", "dgamma", "dbeta", "dw2", "db2", "dresidual")
    for name, g, r, a in zip(names, got_grads, want_grads, args):
        assert g.shape == a.shape and g.dtype == a.dtype, f"{name}: {g.shape} {g.dtype}"
        assert_close(g, r, dtype, name)


# --- offline lowering of the fused kernels for sm_90a ----------------------------------

def test_fused_chain_lowers_for_hopper_with_tma_and_wgmma():
    """The fused chain (statistics epilogue; prologue, stride 2 and statistics), forward and
    gradients, with a producer warpgroup, for an abstract H100: each kernel's module holds
    TMA loads and stores, mbarrier waits and bf16 wgmma.  (Every forward tile configuration
    is lowered by the next test.)"""
    xs, ws = (2, 14, 14, 64), (3, 3, 64, 128)
    cfg = mc.MgpuConfig(block_n=64, stages=4, warp_specialized=True)

    def chain(x, w, b, gamma, beta):
        y1, m1, v1 = mf.conv_bn_stats(x, w, b, padding=((1, 1), (1, 1)), config=cfg)
        scale, shift = mf.fold_batch_norm(m1, v1, gamma, beta)
        return mf.conv2d(y1, jnp.swapaxes(w, 2, 3)[..., :64], stride=(2, 2),
                         padding=((1, 1), (1, 1)), input_scale=scale, input_shift=shift,
                         stats=True, config=cfg)

    reports = lower_with_grads(chain, S(xs, jnp.bfloat16), S(ws, jnp.bfloat16),
                               S(ws[3:], jnp.bfloat16), S((128,), F32), S((128,), F32))
    names = [r.name for r in reports]
    assert "jaxcnn_mgpu_conv_fwd_stats" in names, names
    assert "jaxcnn_mgpu_conv_fwd_bnrelu_stats" in names, names
    assert "jaxcnn_mgpu_conv_wgrad" in names and "jaxcnn_mgpu_conv_dgrad" in names
    assert_tma_pipeline(reports)
    for r in reports:
        assert r.wgmma and all(s.endswith(".bf16.bf16") for s in r.wgmma), r.wgmma


def test_every_tuner_config_of_the_fused_forward_lowers_or_is_refused_by_its_smem():
    """Each forward tile configuration of ``mgpu_conv.SWEEP`` (channel tiles up to 256, the
    grid ``bench_mgpu.py --sweep`` timed before the tuner took over; of those that fit, outside
    the long run (``tests/sweep.py``), a sample, ``mgpu_testlib.cover``: the first, the
    largest (256-channel tiles) and each bringing a channel tile, K chunk, slot count or
    warp specialisation none before it had), on the fused kernel
    with every option (prologue, bias, residual, ReLU, statistics): where :func:`smem_bytes`
    says it fits, it lowers for an abstract H100 with TMA loads and stores, mbarriers,
    ``wgmma`` of its ``block_n`` and ``setmaxnreg`` exactly when warp-specialised; where it does not, the kernel refuses it
    in one line, and Mosaic's own check agrees (its count is the estimate's)."""
    ik = inspect_kernels()
    xs, ws = (2, 14, 14, 128), (3, 3, 128, 256)
    args = (S(xs, jnp.bfloat16), S(ws, jnp.bfloat16), S((256,), jnp.bfloat16),
            S((2, 14, 14, 256), jnp.bfloat16), S((128,), F32), S((128,), F32))
    def need(cfg):
        return mc.smem_bytes(cfg, 128, 256, jnp.bfloat16, bias=True, prologue=True, stats=True,
                             residual_dtype=jnp.bfloat16)
    refused = [cfg for cfg in mc.SWEEP if need(cfg) > mc.MAX_SMEM]
    assert len(refused) == 2  # block_n 256, block_k 64, 4 stages: over 227 KiB
    fitted, fits = 0, [cfg for cfg in mc.SWEEP if cfg not in refused]
    picked = cover(fits)
    assert field_values(picked) == field_values(fits) and fits[-1].block_n == 256
    for cfg in refused + picked:
        def fwd(x, w, b, res, scale, shift, cfg=cfg):
            return mc.conv_forward(x, w, b, res, relu=True, pads=((1, 1), (1, 1)),
                                   input_scale=scale, input_shift=shift, stats=True,
                                   config=cfg)
        if cfg in refused:
            with pytest.raises(KernelUnsupported, match=f"needs {need(cfg)} bytes of shared"):
                ik.inspect_mosaic(fwd, *args)
            with pytest.raises(ValueError, match=f"smem_bytes={need(cfg)} > "):
                # Mosaic's own count, past our check: the estimate is what Mosaic sums.
                with mock.patch.object(mc, "MAX_SMEM", 1 << 30):
                    ik.inspect_mosaic(fwd, *args)
            continue
        fitted += 1
        (r,) = ik.inspect_mosaic(fwd, *args)
        assert r.name == "jaxcnn_mgpu_conv_fwd_bnrelu_stats"
        assert_tma_pipeline([r], str(cfg))
        assert r.wgmma == (f"m64n{cfg.block_n}k16.f32.bf16.bf16",), f"{cfg}: {r.wgmma}"
        assert r.setmaxnreg == cfg.warp_specialized, f"{cfg}: setmaxnreg {r.setmaxnreg}"
    assert fitted == len(picked)
