"""Every tile configuration the tuner can choose for the Mosaic GPU dense convolution lowers
for an H100 (sm_90a, offline: no GPU, no interpretation) into a kernel that moves its tiles
with TMA and multiplies with ``wgmma``.

For two representative shapes (a 3x3 stride-1 convolution, 64 -> 64 channels with a
padded 8x8 output; a 1x1 convolution, 64 -> 128, where the channel tiles vary), every
candidate of every dense kernel (the forward plain and in its three fused forms, the input
gradient, the weight gradient) within an H100's shared memory (outside the long run,
``tests/sweep.py``, a sample of them: for the 1x1 shape ``mgpu_testlib.cover``, the
default tiles, the largest, and each candidate bringing a value of a tile field none before
it had, so every channel tile, K chunk, slot count, split and the warp-specialised form;
for the 3x3 shape, whose tile values are all among the 1x1 shape's, the default and the
largest tiles, ``mgpu_testlib.ends``: both take 64-channel K chunks, so 9 taps of two
32-channel chunks are lowered in the long run only, and interpreted in test_mgpu_conv.py's
"3x3 tails") is lowered by
``scripts/inspect_kernels.py``'s ``dense_candidates`` with only its kernel, each distinct
configuration once, and each module must hold TMA loads and stores
(``cp.async.bulk.tensor``), an mbarrier wait and ``wgmma.mma_async`` of the candidate's
channel tile (``setmaxnreg`` exactly where warp-specialised).  Left out for time: a strided
shape (its input gradient is one launch per stride phase; the default tiles of strided
calls are lowered in test_mgpu_conv.py) and channel tiles of 256 (the forward with every
fused option and 256 output channels is lowered for every tile of ``mgpu_conv.SWEEP`` in
test_mgpu_fused.py).  The shared memory the tuner counts for each kernel is checked against
Mosaic's own count, which refuses configurations over the limit.  Two narrow small-channel
calls stand for the classes Mosaic once refused (TMA copies into shared memory of less than a
whole 128 bytes: 16- and 32-channel chunks on 1- and 2-pixel tile rows, 16-channel bias
rows), lowered forward, fused and backward.  Needs jax >= 0.11; skips otherwise.
"""
import re
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

from mgpu_testlib import (H100, assert_tma_pipeline, cover, ends, field_values,
                          inspect_kernels, needs_mgpu)
from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc

BF16 = jnp.bfloat16
F32 = jnp.float32
S = jax.ShapeDtypeStruct
H100_SMEM = 227 * 1024

SHAPES = {  # x, w, stride, pads
    "3x3/1 64->64": ((2, 8, 8, 64), (3, 3, 64, 64), (1, 1), ((1, 1), (1, 1))),
    "1x1 64->128": ((2, 8, 8, 64), (1, 1, 64, 128), (1, 1), ((0, 0), (0, 0))),
}


@needs_mgpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_every_candidate_lowers_for_hopper_with_tma_and_wgmma(name):
    ik = inspect_kernels()
    x_shape, w_shape, stride, pads = SHAPES[name]
    x, w = S(x_shape, BF16), S(w_shape, BF16)
    calls = ik.dense_calls(x, w, stride=stride, pads=pads)
    assert sorted(calls) == sorted(mc.KERNELS)
    # The calls are those the ops look up (and the tuner records): plain and fused.
    ss = S((x_shape[3],), F32)
    with autotune._recording() as launched:
        jax.eval_shape(lambda x, w: mc.conv2d(x, w, stride=stride, padding=pads), x, w)
        from pallas_kernels import mgpu_fused as mf
        for pro in (False, True):
            jax.eval_shape(lambda x, w, s, t, pro=pro: mf.conv2d(
                x, w, stride=stride, padding=pads, input_scale=s if pro else None,
                input_shift=t if pro else None, stats=True), x, w, ss, ss)
            jax.eval_shape(lambda x, w, s, t, pro=pro: mf.conv2d(
                x, w, stride=stride, padding=pads, input_scale=s if pro else None,
                input_shift=t if pro else None), x, w, ss, ss)
    assert {key: call for key, (_, call, _, _) in launched.items()} == {
        c.key: c for c in calls.values()}
    # The 1x1 shape's sample holds every value of every tile field of each kernel; the 3x3
    # shape's every value too (checked here), so the 3x3 shape lowers its default and
    # largest tiles (mgpu_testlib.ends; every candidate in the long run) on its 9 taps.
    pick = cover if name == "1x1 64->128" else ends
    found = ik.dense_candidates((x, w), stride=stride, pads=pads, kind=H100, pick=pick)
    x1, w1, stride1, pads1 = SHAPES["1x1 64->128"]
    calls1 = ik.dense_calls(S(x1, BF16), S(w1, BF16), stride=stride1, pads=pads1)
    for kernel, call in calls.items():
        want = call.candidates(H100_SMEM)
        assert len(want) > 1
        lowered = [cfg for k, cfg, _ in found if k == kernel]
        assert sorted(map(str, lowered)) == sorted(map(str, pick(want))), f"{kernel}: not lowered"
        assert lowered[0] == want[0] and want[-1] in lowered, kernel
        assert field_values(want) <= field_values(calls1[kernel].candidates(H100_SMEM)), kernel
        if pick is cover:
            assert field_values(lowered) == field_values(want), f"{kernel}: a tile value not lowered"
    for kernel, cfg, r in found:
        assert_tma_pipeline([r], str(cfg))
        assert r.wgmma == (f"m64n{cfg.block_n}k16.f32.bf16.bf16",), f"{kernel} {cfg}: {r.wgmma}"
        assert r.setmaxnreg == cfg.warp_specialized, f"{kernel} {cfg}: setmaxnreg"
    if name == "1x1 64->128":  # the grid is there: both channel tiles, chunks, warp layouts
        fwd = calls["mgpu_conv_fwd_bnrelu_stats"].candidates(H100_SMEM)
        assert {c.block_n for c in fwd} == {64, 128} and {c.block_k for c in fwd} == {32, 64}
        assert {c.warp_specialized for c in fwd} == {False, True}


@needs_mgpu
@pytest.mark.parametrize("kernel", ["mgpu_conv_fwd", "mgpu_conv_fwd_bnrelu_stats",
                                    "mgpu_conv_dgrad", "mgpu_conv_wgrad"])
def test_shared_memory_count_is_mosaics(kernel):
    """Past the limit Mosaic refuses a kernel, naming the bytes its scratch needs: the
    tuner's count for that configuration, exactly (the forward with a bias and a residual,
    the fused forward with its prologue and statistics, both gradients).  The forward's own
    check (MAX_SMEM) is lifted so that Mosaic's is reached."""
    ik = inspect_kernels()
    x, w = S((1, 6, 10, 64), BF16), S((3, 3, 64, 256), BF16)
    pads = ((1, 1), (1, 1))
    calls = ik.dense_calls(x, w, stride=(1, 1), pads=pads)
    call = calls[kernel]
    cfg = mc.MgpuConfig(block_n=256, stages=12, split=2)
    need = call.smem_bytes(cfg)
    assert need > H100_SMEM
    args = [x, w, S((64,), F32), S((64,), F32), S((1, 6, 10, 256), BF16)]
    fn = ik.dense_only(call)
    if kernel == "mgpu_conv_fwd":  # with the epilogue's operands
        call = mc.tuning_calls(x.shape, w.shape, BF16, stride=(1, 1), pads=pads,
                               dilation=(1, 1), bias=True, residual=True)["fwd"]
        need = call.smem_bytes(cfg)
        args = [x, w, S((256,), BF16), S((1, 6, 10, 256), BF16)]

        def fn(x, w, b, r):
            return mc.conv2d(x, w, b, padding=pads, residual=r)
    with autotune.override({call.key: cfg}), mock.patch.object(mc, "MAX_SMEM", 1 << 30), \
            pytest.raises(ValueError) as e:
        ik.inspect_mosaic(fn, *args)
    got = re.search(r"smem_bytes=(\d+)", str(e.value))
    assert got and int(got.group(1)) == need, f"{kernel}: {e.value}"


@needs_mgpu
def test_inspect_kernels_reports_each_dense_candidate_per_kernel(capsys, monkeypatch):
    """scripts/inspect_kernels.py --mosaic --candidates: a row per dense kernel and candidate
    (two candidates a kernel here, for time), each naming its tiles."""
    ik = inspect_kernels()
    every = mc.DenseCall.candidates
    monkeypatch.setattr(mc.DenseCall, "candidates",
                        lambda self, limit=None: every(self, limit)[:2])
    assert ik.main(["--mosaic", "--candidates", "--groups", "mnist", "--batch", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if "jaxcnn_mgpu_conv" in line]
    # "mnist conv2" kernel tmaLoad tmaStore mbarrier ldmatrix stmatrix setmaxnreg wgmma cfg
    kernels = sorted({r[2] for r in rows})
    assert kernels == sorted(f"jaxcnn_{k}" for k in mc.KERNELS)
    assert len(rows) == 2 * len(mc.KERNELS)
    assert all(re.fullmatch(r"w\d+n\d+k\d+s\d+(ws)?(/\d+)?", r[-1]) for r in rows)
    assert all(r[3:6] == ["yes", "yes", "yes"] and r[-2].startswith("m64n") for r in rows)


# Formerly refused by Mosaic's lowering: every TMA copy into shared memory must move a
# multiple of 128 bytes.  x, w, stride, pads, epilogue (bias, residual).
NARROW = {
    # 2 output columns, 8 channels (16-channel chunks and tiles): 64-byte input rows in
    # the forward, input-gradient phases (3 columns) and weight gradient's dy rows, and a
    # 64-byte bias row; the tile rows widen to 4 pixels, the bias slot to 32 entries.
    "C=8 K=8 3x3/2 on 4x4, bias": ((1, 4, 4, 8), (3, 3, 8, 8), (2, 2), ((1, 1), (1, 1)),
                                    (True, False)),
    # 1 output column, 32 channels: 64-byte input, residual and dy rows widen to 2 pixels.
    "C=32 K=32 3x3/1 on 1x1, residual": ((1, 1, 1, 32), (3, 3, 32, 32), (1, 1),
                                         ((1, 1), (1, 1)), (False, True)),
}


@needs_mgpu
@pytest.mark.parametrize("name", list(NARROW))
def test_small_channel_narrow_calls_lower_for_hopper(name):
    """The forward (with its epilogue operands), the input gradient (one launch per stride
    phase) and the weight gradient of each formerly refused class lower with TMA and
    wgmma; so does the fused forward (BatchNorm+ReLU prologue and statistics) of the same
    call."""
    from mgpu_testlib import lower_with_grads
    from pallas_kernels import mgpu_fused as mf
    x_shape, w_shape, stride, pads, (bias, residual) = NARROW[name]
    x, w = S(x_shape, BF16), S(w_shape, BF16)
    y = jax.eval_shape(lambda x, w: mc.conv2d(x, w, stride=stride, padding=pads), x, w)
    b, r = S(w_shape[3:], BF16) if bias else None, S(y.shape, BF16) if residual else None
    reports = lower_with_grads(
        lambda x, w, *e: mc.conv2d(x, w, e[0] if bias else None, stride=stride, padding=pads,
                                   residual=e[-1] if residual else None, relu=True),
        x, w, *[a for a in (b, r) if a is not None])
    phases = stride[0] * stride[1]
    assert sorted(r.name for r in reports) == (["jaxcnn_mgpu_conv_dgrad"] * phases
                                               + ["jaxcnn_mgpu_conv_fwd",
                                                  "jaxcnn_mgpu_conv_wgrad"])
    ss = S((x_shape[3],), F32)
    reports += inspect_kernels().inspect_mosaic(
        lambda x, w, s, t: mf.conv2d(x, w, stride=stride, padding=pads, input_scale=s,
                                     input_shift=t, stats=True), x, w, ss, ss)
    assert reports[-1].name == "jaxcnn_mgpu_conv_fwd_bnrelu_stats"
    assert_tma_pipeline(reports)
    assert all(r.wgmma for r in reports)
