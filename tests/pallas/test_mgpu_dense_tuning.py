"""Tuning the Mosaic GPU dense convolution's tiles (``pallas_kernels.mgpu_conv``), on the CPU.

The forward (plain, and the fused forms of ``mgpu_fused``: BatchNorm+ReLU prologue,
statistics epilogue, both), input-gradient and weight-gradient kernels look their
:class:`MgpuConfig` up per launch and device kind (a :class:`DenseCall`): their candidate
lists (fitted to the shape as the kernels clamp them, distinct, within the device's shared
memory by the kernels' own count, none where a kernel does not run), the cache round trip
(a ``tuned.json`` entry for the device kind is what the op runs with, per part; the fused
forward's by its form; another device kind's, a malformed one, or none leave the
defaults; an explicit config wins), and the tuner itself with ``backend="mosaic"`` (a
fake clock: nothing is measured; candidates are compiled for the CPU in interpret mode,
never run).  ``impl="auto"`` and ``conv_bn="auto"`` still need a measured verdict.
Mosaic GPU needs jax >= 0.11 (/work/main/.venv312); on older jax the kernels' tests skip
saying so, and the candidate lists are empty.
"""
import dataclasses
import importlib.util
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from mgpu_testlib import (H100, assert_16bit_close, compile_no_candidates, fake_tuning_clock, needs_mgpu,
                          normal, ref_conv, seen_configs)
from mgpu_testlib import shipped  # noqa: F401 (a fixture)
from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_fused as mf
from pallas_testlib import compile_unoptimised, fast_run

BF16 = jnp.bfloat16
H100_SMEM = 227 * 1024  # what the tuner allows one CTA on sm_90
P1 = ((1, 1), (1, 1))
P0 = ((0, 0), (0, 0))


def calls(x_shape, w_shape, stride=1, pads=P1, dtype=BF16, **kw):
    return mc.tuning_calls(x_shape, w_shape, dtype, stride=(stride, stride), pads=pads,
                           dilation=(1, 1), **kw)


def every_kernel(x_shape, w_shape, stride=1, pads=P1):
    """``{kernel: DenseCall}``: the plain and fused forwards and both gradients."""
    out = {}
    for prologue in (False, True):
        for stats in (False, True):
            found = calls(x_shape, w_shape, stride, pads, prologue=prologue, stats=stats,
                          bias=True, residual=not stats)
            out.update({c.kernel: c for c in found.values()})
    return out


SHAPES = {  # tails, several channel tiles, strides, wide and narrow layers
    "3x3/1 14x14 64->96": ((2, 14, 14, 64), (3, 3, 64, 96), 1, P1),
    "3x3/2 15x15 128->64": ((2, 15, 15, 128), (3, 3, 128, 64), 2, P1),
    "1x1 56x56 64->256": ((256, 56, 56, 64), (1, 1, 64, 256), 1, P0),
    "3x3/1 7x7 512->512": ((256, 7, 7, 512), (3, 3, 512, 512), 1, P1),
}


@needs_mgpu
@pytest.mark.parametrize("name", list(SHAPES))
def test_candidates_are_fitted_distinct_and_fit_shared_memory(name):
    x_shape, w_shape, stride, pads = SHAPES[name]
    kernels = every_kernel(x_shape, w_shape, stride, pads)
    assert sorted(kernels) == sorted(mc.KERNELS)
    for kernel, call in kernels.items():
        every = call.candidates()
        assert every and every[0] == call.fit(mc.DEFAULT), f"{kernel}: default not first"
        assert len(set(every)) == len(every), f"{kernel}: duplicates"
        c_red, c_out = call.channels()
        widest = mc.pick_tile_w(call.launch_width())
        for cfg in every:
            assert call.fit(cfg) == cfg  # as the kernel runs it: nothing left to clamp
            assert cfg.tile_w <= widest and mc.TILE_M % cfg.tile_w == 0
            assert mc.MgpuConfig.from_dict(cfg.to_dict()) == cfg  # valid, round-trips
            assert cfg.block_n <= max(16, 2 * c_out) and cfg.stages in (2, 3, 4)
            if call.part == "wgrad":
                assert cfg.split >= 1 and not cfg.warp_specialized
                assert cfg.block_k == mc.DEFAULT.block_k  # unused: 64 input channels a CTA
            else:
                assert cfg.split == 1 and cfg.block_k <= max(16, 2 * c_red)
            assert call.smem_bytes(cfg) <= mc.MAX_SMEM
        # The device's shared memory leaves out exactly the configs over it.
        fits = call.candidates(H100_SMEM)
        assert fits == [cfg for cfg in every if call.smem_bytes(cfg) <= H100_SMEM]
        assert call.candidates(min(call.smem_bytes(cfg) for cfg in every) - 1) == []
    # The grid is searched: slots, channel tiles, chunks, both warp layouts, two tile rows.
    fwd = kernels["mgpu_conv_fwd"].candidates(H100_SMEM)
    assert {cfg.stages for cfg in fwd} == {2, 3, 4}
    assert {cfg.warp_specialized for cfg in fwd} == {False, True}
    c, co = x_shape[3], w_shape[3]
    assert {cfg.block_n for cfg in fwd} == {mc._block_n(co, mc.MgpuConfig(block_n=b))
                                            for b in (64, 128, 256)}
    widest = mc.pick_tile_w(kernels["mgpu_conv_fwd"].out_hw()[1])
    assert {cfg.tile_w for cfg in fwd} == ({widest, widest // 2} if widest >= 16 else {widest})
    assert {cfg.block_k for cfg in fwd} == {32, 64}


@needs_mgpu
def test_fused_forms_and_epilogue_count_their_shared_memory():
    """The prologue's scale/shift slots, the statistics' rows and reduction scratch, the bias
    row and the residual tile are counted per form: the largest tiles fit the plain forward
    but not the fused one with a residual, so the fused form has fewer candidates."""
    x_shape, w_shape = (2, 14, 14, 128), (3, 3, 128, 256)
    plain = calls(x_shape, w_shape)["fwd"]
    fused = calls(x_shape, w_shape, prologue=True, stats=True, bias=True, residual=True)["fwd"]
    assert fused.kernel == "mgpu_conv_fwd_bnrelu_stats"
    big = mc.MgpuConfig(tile_w=8, block_n=256, block_k=64, stages=4)
    assert fused.smem_bytes(big) == mc.smem_bytes(big, 128, 256, BF16, bias=True,
                                                  residual_dtype=BF16, prologue=True,
                                                  stats=True)
    assert plain.smem_bytes(big) == mc.smem_bytes(big, 128, 256, BF16)
    assert plain.smem_bytes(big) <= H100_SMEM < fused.smem_bytes(big)
    assert big in plain.candidates(H100_SMEM) and big not in fused.candidates(H100_SMEM)
    # The weight gradient: both operands' slots twice (unswizzled, swizzled), float32 tile.
    wgrad = calls(x_shape, w_shape)["wgrad"]
    cfg = mc.MgpuConfig(tile_w=8, block_n=128, stages=4)
    assert wgrad.smem_bytes(cfg) == 2 * 4 * 64 * (64 + 128) * 2 + 64 * 128 * 4 + 4 * 8
    # Splits: the default's 1, about one and four CTAs per SM (9 taps x 2 x 2 channel tiles
    # of 64 x 128: 4 and 16), clamped to the 2 x 2 x 2 = 8 output tiles there are.
    assert {c.split for c in wgrad.candidates()} == {1, 4, 8}


def test_a_dense_call_names_its_kernel_and_keys_its_geometry():
    fwd, dgrad, wgrad = calls((2, 9, 9, 16), (3, 3, 16, 32), 2, bias=True).values()
    assert fwd.key == ("mgpu_conv_fwd|x=[2, 9, 9, 16],w=[3, 3, 16, 32],stride=[2, 2],"
                       "pads=[[1, 1], [1, 1]],dilation=[1, 1],epilogue=bias|bfloat16")
    assert dgrad.key == ("mgpu_conv_dgrad|x=[2, 9, 9, 16],w=[3, 3, 16, 32],stride=[2, 2],"
                         "pads=[[1, 1], [1, 1]],dilation=[1, 1]|bfloat16")
    assert wgrad.key == dgrad.key.replace("_dgrad|", "_wgrad|")
    assert (fwd.part, dgrad.part, wgrad.part) == ("fwd", "dgrad", "wgrad")
    assert dgrad.channels() == (32, 16) and dgrad.launch_width() == 5  # a stride phase's
    bnrelu = calls((2, 9, 9, 16), (3, 3, 16, 32), prologue=True)["fwd"]
    assert bnrelu.kernel == "mgpu_conv_fwd_bnrelu" and bnrelu.part == "fwd"
    with pytest.raises(ValueError, match="kernel must be one of"):
        dataclasses.replace(fwd, kernel="mgpu_depthwise_fwd")
    cfg = mc.MgpuConfig(tile_w=8, block_n=32, block_k=16, stages=2, split=3,
                        warp_specialized=True)
    assert mc.MgpuConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("entry, match", [
    ({"block_k": 48}, "block_k must be 16, 32 or 64"),
    ({"block_n": 24}, "block_n must be a multiple of 16"),
    ({"stages": 1}, "stages must be >= 2"),
    ({"tile_w": 3}, "tile_w must divide 64"),
    ({"split": 0}, "split must be >= 1"),
    ({"stages": "3"}, "stages must be an int"),
    ({"warp_specialized": 1}, "warp_specialized must be a bool"),
    ({"block_m": 64}, "unexpected keyword"),
])
def test_malformed_entries_are_refused(entry, match):
    with pytest.raises((TypeError, ValueError), match=match):
        mc.MgpuConfig.from_dict(entry)


@pytest.mark.parametrize("x_shape, w_shape, dtype, stride", [
    ((1, 8, 8, 12), (3, 3, 12, 16), BF16, 1),  # channels TMA cannot address
    ((1, 8, 8, 16), (3, 3, 16, 16), jnp.float32, 1),  # not a 16-bit float
    ((1, 12, 12, 16), (3, 3, 16, 16), BF16, 5),  # stride over 4
])
def test_calls_the_kernels_refuse_have_no_candidates(x_shape, w_shape, dtype, stride):
    """(On jax < 0.11 every call is refused: the tuner imports and finds nothing to time.)"""
    for call in calls(x_shape, w_shape, stride, dtype=dtype, prologue=True).values():
        assert call.candidates() == [] and call.candidates(H100_SMEM) == []


@needs_mgpu
def test_an_input_gradient_without_a_kernel_has_no_candidates():
    """Where the input gradient runs in XLA (strided and dilated; padded past the window)
    only the forward and the weight gradient have tiles to time."""
    strided_dilated = mc.tuning_calls((1, 12, 12, 16), (3, 3, 16, 16), BF16, stride=(2, 2),
                                      pads=P1, dilation=(2, 2))
    over_padded = calls((1, 8, 8, 16), (1, 1, 16, 16), pads=P1)
    for found in (strided_dilated, over_padded):
        assert found["dgrad"].candidates() == []
        assert found["fwd"].candidates() and found["wgrad"].candidates()


# --- the cache round trip: tuned.json -> the op ---------------------------------------------



TUNED = {"fwd": mc.MgpuConfig(tile_w=4, block_n=16, block_k=16, stages=2),
         "dgrad": mc.MgpuConfig(block_n=32, block_k=32, stages=4, warp_specialized=True),
         "wgrad": mc.MgpuConfig(tile_w=8, block_n=16, stages=2, split=2)}


@needs_mgpu
def test_conv_takes_tuned_tiles_per_part_of_its_device_kind(shipped, monkeypatch):
    x, w = jnp.zeros((1, 8, 8, 16), BF16), jnp.zeros((3, 3, 16, 32), BF16)
    found = calls(x.shape, w.shape)
    shipped(H100, {found[p].key: c.to_dict() for p, c in TUNED.items()})
    seen = seen_configs(monkeypatch, mc, "_conv", 4)
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    pk.conv2d(x, w, padding=1, backend="mosaic", interpret=True)
    assert seen.pop() == (TUNED["fwd"], TUNED["dgrad"], TUNED["wgrad"])
    # an explicit config wins; by part, the others keep their tuned tiles
    mine = mc.MgpuConfig(block_n=64, stages=4)
    pk.conv2d(x, w, padding=1, backend="mosaic", interpret=True, config=mine)
    assert seen.pop() == (mine,) * 3
    mc.conv2d(x, w, padding=P1, interpret=True, config={"wgrad": mine})
    assert seen.pop() == (TUNED["fwd"], TUNED["dgrad"], mine)
    with pytest.raises(ValueError, match="unknown config keys"):
        mc.conv2d(x, w, padding=P1, interpret=True, config={"bwd": mine})
    # a bias is another launch (its shared memory): not the tiles tuned without one
    mc.conv2d(x, w, jnp.zeros((32,), BF16), padding=P1, interpret=True)
    assert seen.pop() == (mc.DEFAULT, TUNED["dgrad"], TUNED["wgrad"])
    # another device kind has no entry
    monkeypatch.setattr(autotune, "device_kind", lambda: "NVIDIA A100-SXM4-80GB")
    pk.conv2d(x, w, padding=1, backend="mosaic", interpret=True)
    assert seen.pop() == (mc.DEFAULT,) * 3


@needs_mgpu
def test_fused_conv_takes_the_tiles_of_its_form_and_skips_a_malformed_entry(shipped,
                                                                            monkeypatch):
    """The fused forward's tiles are keyed by its form (prologue, statistics); its gradients
    are the plain op's kernels and take their tiles.  A malformed entry warns naming its
    key and leaves the defaults; the user's cache wins over the shipped table."""
    x, w = jnp.zeros((1, 8, 8, 16), BF16), jnp.zeros((3, 3, 16, 32), BF16)
    ss = jnp.ones((16,), jnp.float32)
    both = calls(x.shape, w.shape, prologue=True, stats=True)
    stats_only = calls(x.shape, w.shape, stats=True)["fwd"]
    fused_fwd = mc.MgpuConfig(tile_w=2, block_n=16, block_k=16, stages=3)
    shipped(H100, {both["fwd"].key: fused_fwd.to_dict(),
                   both["dgrad"].key: TUNED["dgrad"].to_dict(),
                   calls(x.shape, w.shape)["fwd"].key: TUNED["fwd"].to_dict(),
                   stats_only.key: {"block_k": 48}})
    seen = seen_configs(monkeypatch, mf, "_op", 6)
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    mf.conv2d(x, w, padding=P1, input_scale=ss, input_shift=ss, stats=True, interpret=True)
    assert seen.pop() == (fused_fwd, TUNED["dgrad"], mc.DEFAULT)
    with pytest.warns(UserWarning, match="mgpu_conv_fwd_stats.* is invalid.*block_k"):
        mf.conv2d(x, w, padding=P1, stats=True, interpret=True)
    assert seen.pop() == (mc.DEFAULT, TUNED["dgrad"], mc.DEFAULT)
    mine = mc.MgpuConfig(block_n=32, stages=2, split=4)
    autotune.save_cache({H100: {"kernels": {both["wgrad"].key: mine.to_dict()}, "ops": {}}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mf.conv2d(x, w, padding=P1, input_scale=ss, input_shift=ss, stats=True,
                  interpret=True)
    assert seen.pop() == (fused_fwd, TUNED["dgrad"], mine)


@needs_mgpu
def test_the_op_runs_its_tuned_tiles(shipped, monkeypatch):
    """Tuned forward tiles (a 2-pixel tile row: 32 rows of TMA copies, 32-channel chunks of
    128 bytes a row, 16-channel tiles) really run, in GPU interpret mode, tiny: the result
    is the convolution's (bfloat16: half a step plus float32 noise), and the kernel saw
    those tiles."""
    rng = np.random.default_rng(0)
    x, w = normal(rng, (1, 5, 6, 32), BF16), normal(rng, (3, 3, 32, 32), BF16)
    fwd = calls(x.shape, w.shape)["fwd"]
    tuned = mc.MgpuConfig(tile_w=2, block_n=16, block_k=32, stages=2)
    assert fwd.fit(tuned) == tuned  # (16-channel chunks would widen the row to 4 pixels)
    shipped(H100, {fwd.key: tuned.to_dict()})
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    used = []
    real = mc._implicit_gemm
    monkeypatch.setattr(mc, "_implicit_gemm", lambda *a, **k: used.append(a[5]) or real(*a, **k))
    # one program (its glue not dispatched op by op), compiled at level 0: a tolerance check
    y = fast_run(lambda x, w: mc.conv2d(x, w, padding=P1, interpret=True), x, w)
    assert used == [tuned]
    assert_16bit_close(y, ref_conv(x, w, P1), BF16, "tuned tiles")


@pytest.mark.parametrize("fused", [False, True])
def test_auto_needs_a_verdict_not_tuned_tiles(shipped, monkeypatch, fused):
    """impl="auto" (and conv_bn="auto") take the Mosaic kernels only where a race against
    XLA was measured: tiles in tuned.json for the call's kernels choose nothing."""
    from jaxcnn.functional import _dispatch
    from jaxcnn.functional import conv_bn as fcb
    x, w = jnp.zeros((1, 8, 8, 16), BF16), jnp.zeros((3, 3, 16, 32), BF16)
    found = every_kernel(x.shape, w.shape)
    shipped(H100, {c.key: mc.MgpuConfig(block_n=16).to_dict() for c in found.values()})
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    if fused:
        assert not fcb.use_fusion("auto", x, w, stride=1, padding=1, dilation=1, groups=1,
                                  prologue=True, stats=True)
    else:
        static = dict(stride=(1, 1), padding=P1, dilation=(1, 1), groups=1)
        assert _dispatch.choose("conv2d", "auto", (x, w, None), static) is None


# --- the tuner with backend="mosaic" ---------------------------------------------------------

@needs_mgpu
def test_tune_op_times_the_dense_candidates_and_the_op_then_runs_the_fastest(tmp_path,
                                                                              monkeypatch):
    """tune_op records the three dense kernels' launches, times two candidates of each (a
    fake clock: the more slots, the faster; the kernel beats XLA), the gradient kernels by
    a gradient that needs them (the weight gradient's too), and stores the fastest under
    the device kind with the backend="mosaic" verdict; the op then runs those tiles."""
    x, w = jnp.zeros((1, 4, 4, 16), BF16), jnp.zeros((3, 3, 16, 16), BF16)
    static = dict(stride=(1, 1), padding=P1, dilation=(1, 1), groups=1, backward="pallas",
                  backend="mosaic")
    timer, timed = fake_tuning_clock(monkeypatch, tmp_path)
    # The candidates are compiled (the timer is handed each one's jax.stages.Compiled) but
    # never run (the clock is fake): XLA's optimisations off, about half the compile time.
    compile_unoptimised(monkeypatch)

    def two(kernel, call, co):
        assert co is None and call.kernel == kernel
        return [dataclasses.replace(call.candidates()[0], stages=2), call.candidates()[0]]

    benched = []
    real_loss_grad = autotune._loss_grad

    def loss_grad(fn, args):  # the first two gradient benches traced once more, as text
        if len(benched) < 2:
            benched.append(str(jax.make_jaxpr(real_loss_grad(fn, args))(*args)))
        return real_loss_grad(fn, args)

    monkeypatch.setattr(autotune, "_loss_grad", loss_grad)
    entry = autotune.tune_op("conv2d", (x, w, None), static, xla=lambda x, w, b: x,
                             timer=timer, candidate_fn=two)
    assert [c.stages for c in timed] == [2, 3] * 3  # two candidates of each kernel
    assert len(benched) == 2 and all("jaxcnn_mgpu_conv_wgrad" in text for text in benched)  # dgrad, wgrad
    found = calls(x.shape, w.shape)
    fastest = tuple(found[p].candidates()[0] for p in mc.PARTS)  # the defaults, fitted
    saved = autotune.load_cache()[autotune.device_kind()]
    assert [saved["kernels"][found[p].key] for p in mc.PARTS] == [c.to_dict() for c in fastest]
    assert saved["ops"][autotune.op_key("conv2d", (x, w, None), static)] == entry
    assert entry["pallas_faster"]
    seen = seen_configs(monkeypatch, mc, "_conv", 4)
    pk.conv2d(x, w, padding=1, backend="mosaic", interpret=True)
    assert seen.pop() == fastest


def test_tuner_imports_and_refuses_without_mosaic(monkeypatch):
    """With jax < 0.11 (mocked where the kernels exist) a dense launch has nothing to time:
    the tuner still imports and finds no candidates."""
    monkeypatch.setattr(mc, "_jax_version", lambda: (0, 10))
    for call in every_kernel((1, 8, 8, 16), (3, 3, 16, 16)).values():
        assert autotune.candidates(call.kernel, call, None) == []


def _script(name):
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_mgpu
def test_bench_mgpu_tunes_then_times_with_the_tuned_tiles(tmp_path, monkeypatch, capsys):
    """scripts/bench_mgpu.py --tune (and its old name --sweep): each shape's kernels are tuned
    (a fake clock, one candidate a kernel: two-slot tiles, not the defaults; for time, the
    candidates are not compiled) before it is
    timed, the rows name the tiles each part ran with, and a resumed run tunes nothing
    already tuned unless --retune.  --fused --tune tunes the fused op's kernels the same
    way (through autotune.tune_kernels), its forward keyed by its form.  (On a CPU the
    script tunes no tiles, interpret mode being no measurement: told here that it may.)
    Nothing is timed for time: the Mosaic forward's result with the tuned tiles is compared
    with XLA's; the real timings of the three backends are test_bench_scripts.py's
    test_bench_mgpu_runs_in_interpret_mode."""
    bm = _script("bench_mgpu")
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    real_op, real_kernels, tuned = autotune.tune_op, autotune.tune_kernels, []

    def one(kernel, call, co):  # two-slot tiles
        return [dataclasses.replace(call.candidates()[0], stages=2)]

    def fake_tune(op, arrays, static, **kw):
        tuned.append(op)
        kw.pop("candidate_fn", None)
        return real_op(op, arrays, static, **kw, timer=lambda fn, *a: 1.0, candidate_fn=one)

    def fake_kernels(run, arrays, **kw):
        tuned.append("fused")
        return real_kernels(run, arrays, timer=lambda fn, *a: 1.0, candidate_fn=one)

    monkeypatch.setattr(autotune, "tune_op", fake_tune)
    compile_no_candidates(monkeypatch)  # the fake clock times nothing
    monkeypatch.setattr(bm.bc, "time_fn", lambda fn, args, repeats, grad: 1.0)
    assert not bm.tiles_tunable()  # the CPU: tiles are tuned on a GPU only, unless told
    monkeypatch.setattr(bm, "tiles_tunable", lambda: True)
    monkeypatch.setattr(bm, "SHAPES", [("mnist", "tiny", (4, 4, 16), dict(padding=1),
                                        (3, 3, 16, 16), 1)])
    out = tmp_path / "m.json"
    argv = ["--force", "--groups", "mnist", "--repeats", "1", "--no-grad", "--json", str(out)]
    assert bm.main(argv + ["--sweep"]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert tuned == ["conv2d"] and "error" not in row and row["max_rel_err"] <= 2.0 ** -8
    assert list(row["tiles"]) == list(mc.PARTS)
    assert {t["stages"] for t in row["tiles"].values()} == {2}  # the tuned tiles ran
    assert "fwd w4n16k16s2 dgrad w4n16k16s2 wgrad w4n16k64s2" in capsys.readouterr().out
    x, w = jnp.zeros((1, 4, 4, 16), BF16), jnp.zeros((3, 3, 16, 16), BF16)
    assert not bm.tune(x, w, dict(padding=1)) and tuned == ["conv2d"]  # resumed: cached
    assert bm.tune(x, w, dict(padding=1), retune=True) and tuned == ["conv2d"] * 2
    # --fused --tune: each form's kernels tuned, then timed with those tiles (nothing timed
    # for time: the forms' results are compared).
    monkeypatch.setattr(autotune, "tune_kernels", fake_kernels)
    monkeypatch.setattr(bm, "_time_fused", lambda *a: 1.0)
    assert bm.main(argv + ["--fused", "--tune"]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert tuned[2:] == ["fused", "fused"] and [r["form"] for r in rows] == list(bm.FUSED_FORMS)
    for r in rows:
        assert "error" not in r and {t["stages"] for t in r["tiles"].values()} == {2}
    saved = autotune.load_cache()[autotune.device_kind()]["kernels"]
    for prologue in (False, True):
        assert calls(x.shape, w.shape, prologue=prologue, stats=True)["fwd"].key in saved


@needs_mgpu
def test_narrow_small_channel_candidates_make_whole_tma_copies():
    """At small channel counts and output widths 1 to 8, every candidate of every dense
    kernel (the forward with bias and residual, fused, both gradients) has tile rows whose
    TMA copies into shared memory (input or dy, residual) and a bias slot that are each a
    whole number of 128 bytes (Mosaic refuses others: lowered in
    test_mgpu_dense_lowering.py), its tile row widened past the launch's no further than
    that needs."""
    for c, co, k, stride in [(8, 8, 3, 2), (16, 64, 1, 1), (24, 16, 7, 1), (32, 8, 3, 2),
                             (64, 64, 3, 1)]:
        for ow in (1, 2, 3, 5, 8):
            h = (ow - 1) * stride + 1  # padded by k // 2 on each side
            pads = ((k // 2,) * 2,) * 2
            for kernel, call in every_kernel((1, h, h, c), (k, k, c, co), stride,
                                             pads).items():
                widest = mc.pick_tile_w(call.launch_width())
                for cfg in call.candidates():
                    tw, bn = cfg.tile_w, cfg.block_n
                    rows = {"wgrad": [64, bn], "dgrad": [cfg.block_k]}.get(
                        call.part, [cfg.block_k] + [bn] * call.residual)
                    what = f"C={c} K={co} {k}x{k}/{stride} ow={ow} {kernel} {cfg}"
                    assert all(tw * r * 2 % mc.COPY_BYTES == 0 for r in rows), what
                    if tw > widest:  # widened: the narrowest whole row
                        assert any((tw // 2) * r * 2 % mc.COPY_BYTES for r in rows), what
                    if call.bias and call.part == "fwd":
                        assert mc.bias_rows(bn) * 4 % mc.COPY_BYTES == 0, what
                        assert bn <= mc.bias_rows(bn) < bn + 32, what
