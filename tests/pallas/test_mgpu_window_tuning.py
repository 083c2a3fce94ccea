"""Tuning the Mosaic GPU window kernels' tiles (``pallas_kernels.mgpu_window``), on the CPU.

The pooling (forward, backward) and depthwise (forward, input and weight gradient) kernels
look their :class:`WindowConfig` up per launch and device kind: their candidate lists
(fitted to the shape, within the device's shared memory, none for calls the kernels
refuse), the cache round trip (a ``tuned.json`` entry for the device kind is what the op
runs with; another device kind's, a malformed one, or none leave the defaults), and the
tuner itself with ``backend="mosaic"`` (a fake clock: nothing is measured; the
candidates are compiled for the CPU in interpret mode, never run).  ``impl="auto"`` still
needs a measured verdict: tuned tiles alone choose nothing.  Mosaic GPU needs jax >= 0.11
(/work/main/.venv312); on older jax the kernels' tests skip saying so, and the candidate
lists are empty.
"""
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels as pk
from jaxcnn import _geometry as geo
from mgpu_testlib import H100, compile_no_candidates, fake_tuning_clock, needs_mgpu, seen_configs
from mgpu_testlib import shipped  # noqa: F401 (a fixture)
from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_depthwise as md
from pallas_kernels import mgpu_pool as mp
from pallas_kernels import mgpu_window as mw
from pallas_testlib import compile_unoptimised

BF16 = jnp.bfloat16
H100_SMEM = 227 * 1024  # what the tuner allows one CTA on sm_90


def pool_calls(op, x_shape, kernel_size, stride=None, padding=0, ceil_mode=False,
               dtype=BF16):
    kernel, stride, dilation, _, run_pads, out_hw = geo.pool_geometry(
        "t", x_shape, kernel_size, stride, padding, 1, ceil_mode)
    return mp.tuning_calls(op, x_shape, dtype, kernel, stride, dilation, run_pads, out_hw)


def depthwise_calls(x_shape, k, stride=1, pad=1, dtype=BF16):
    return md.tuning_calls(x_shape, (k, k, 1, x_shape[3]), dtype, stride=(stride, stride),
                           pads=((pad, pad), (pad, pad)), dilation=(1, 1))


CALLS = {  # every kernel of the tuner, on shapes with tails and several channel tiles
    "max 3x3/2 ceil, 256 channels": pool_calls("max", (4, 28, 27, 256), 3, 2, 1, True),
    "avg 2x2/2, 24 channels": pool_calls("avg", (2, 12, 12, 24), 2),
    "depthwise 3x3/2, 24 channels (narrow)": depthwise_calls((1, 7, 7, 24), 3, 2),
    "depthwise 3x3/1, 96 channels": depthwise_calls((2, 14, 14, 96), 3),
    "depthwise 7x7/2, 384 channels": depthwise_calls((8, 14, 14, 384), 7, 2, 3),
}


@needs_mgpu
@pytest.mark.parametrize("name", list(CALLS))
def test_candidates_are_fitted_distinct_and_fit_shared_memory(name):
    for part, call in CALLS[name].items():
        every = call.candidates()
        assert every and every[0] == call.fit(mw.DEFAULT), f"{call.kernel}: default not first"
        assert len(set(every)) == len(every), f"{call.kernel}: duplicates"
        c, widest = call.x_shape[3], mc.pick_tile_w(call.launch_width())
        for cfg in every:
            assert call.fit(cfg) == cfg  # as the kernel runs it: nothing left to clamp
            # at most the widest row the output has, unless a narrower row copy would not be
            # a multiple of 128 bytes (Mosaic's TMA rule): then the narrowest that is
            assert mw.TILE_M % cfg.tile_w == 0 and cfg.tile_w * cfg.block_c * 2 % 128 == 0
            assert cfg.tile_w <= widest or cfg.tile_w == min(
                t for t in (1, 2, 4, 8) if t * cfg.block_c * 2 % 128 == 0)
            assert cfg.block_c % 8 == 0 and cfg.block_c <= min(c, 256)
            if call.kernel == "mgpu_depthwise_wgrad":
                assert cfg.split >= 1
            else:
                assert cfg.split == 1 and cfg.stages <= call.taps()
        # The device's shared memory leaves out exactly the configs over it.
        fits = call.candidates(H100_SMEM)
        assert fits == [cfg for cfg in every if call.smem_bytes(cfg) <= H100_SMEM]
        assert fits, f"{call.kernel}: nothing fits an H100"
        assert call.candidates(min(call.smem_bytes(cfg) for cfg in every) - 1) == []
    # the grid is searched: slots vary, and every channel tile up to the channels
    fwd = CALLS[name]["fwd"]
    cfgs = fwd.candidates(H100_SMEM)
    assert len({cfg.stages for cfg in cfgs}) > 1
    c = fwd.x_shape[3]
    assert {cfg.block_c for cfg in cfgs} == {min(c, b) for b in (32, 64, 128, 256)}


@needs_mgpu
def test_over_the_limit_is_where_it_should_be():
    """The max pool's backward stages dy and the tap index: 256-channel tiles in 4 slots
    need 288 KiB (over an H100's 227), in 2 slots 160 KiB."""
    bwd = CALLS["max 3x3/2 ceil, 256 channels"]["bwd"]
    tw = mc.pick_tile_w(bwd.launch_width())
    four = mw.WindowConfig(tile_w=tw, block_c=256, stages=4)
    assert bwd.smem_bytes(four) == (2 * 4 + 1) * 64 * 256 * 2 + 4 * 8 > H100_SMEM
    assert four in bwd.candidates() and four not in bwd.candidates(H100_SMEM)
    assert mw.WindowConfig(tile_w=tw, block_c=256, stages=2) in bwd.candidates(H100_SMEM)
    # The weight gradient's splits: the default's 1, about one CTA per SM (49 taps x 6
    # channel tiles are more than 132 already: 1) and four (4; 16 output tiles to share).
    wgrad = CALLS["depthwise 7x7/2, 384 channels"]["wgrad"]
    assert {cfg.split for cfg in wgrad.candidates()} == {1, 4}


@pytest.mark.parametrize("x_shape, dtype, stride", [
    ((1, 8, 8, 12), BF16, 1),  # channels TMA cannot address
    ((1, 8, 8, 16), jnp.float32, 1),  # not a 16-bit float
    ((1, 12, 12, 16), BF16, 5),  # stride over 4
])
def test_calls_the_kernels_refuse_have_no_candidates(x_shape, dtype, stride):
    """(On jax < 0.11 every call is refused: the tuner imports and finds nothing to time.)"""
    calls = {**pool_calls("max", x_shape, 3, stride, 1, dtype=dtype),
             **depthwise_calls(x_shape, 3, stride, 1, dtype=dtype)}
    for call in calls.values():
        assert call.candidates() == [] and call.candidates(H100_SMEM) == []


def test_a_window_call_names_its_kernel_and_keys_its_geometry():
    (fwd, bwd) = pool_calls("max", (2, 9, 9, 16), 3, 2, 1).values()
    assert fwd.key == ("mgpu_max_pool_fwd|x=[2, 9, 9, 16],k=[3, 3],stride=[2, 2],"
                       "pads=[[1, 1], [1, 1]],dilation=[1, 1]|bfloat16")
    assert bwd.key == fwd.key.replace("_fwd|", "_bwd|")
    assert (fwd.taps(), bwd.taps()) == (9, 4)  # the backward's largest phase: 2 x 2 taps
    with pytest.raises(ValueError, match="kernel must be one of"):
        dataclasses.replace(fwd, kernel="mgpu_conv_fwd")
    cfg = mw.WindowConfig(tile_w=8, block_c=32, stages=2, split=3)
    assert mw.WindowConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


# --- the cache round trip: tuned.json -> the op ---------------------------------------------



@needs_mgpu
def test_pool_takes_tuned_tiles_of_its_device_kind(shipped, monkeypatch):
    x = jnp.zeros((1, 9, 9, 16), BF16)
    fwd, bwd = pool_calls("max", x.shape, 3, 2, 1).values()
    tuned = mw.WindowConfig(tile_w=4, block_c=8, stages=2)
    shipped(H100, {fwd.key: tuned.to_dict()})
    seen = seen_configs(monkeypatch, mp, "_max_pool", 6)
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    pk.max_pool2d(x, 3, stride=2, padding=1, backend="mosaic", interpret=True)
    assert seen.pop() == (tuned, mw.DEFAULT)  # the backward was not tuned: its defaults
    # an explicit config wins; another device kind has no entry
    pk.max_pool2d(x, 3, stride=2, padding=1, backend="mosaic", interpret=True,
                  config=mw.WindowConfig(block_c=16))
    assert seen.pop() == (mw.WindowConfig(block_c=16),) * 2
    monkeypatch.setattr(autotune, "device_kind", lambda: "NVIDIA A100-SXM4-80GB")
    pk.max_pool2d(x, 3, stride=2, padding=1, backend="mosaic", interpret=True)
    assert seen.pop() == (mw.DEFAULT, mw.DEFAULT)
    # tiles by part: the part given, the other its tuned or default tiles
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    mine = mw.WindowConfig(block_c=8, stages=1)
    pk.max_pool2d(x, 3, stride=2, padding=1, backend="mosaic", interpret=True,
                  config={"bwd": mine})
    assert seen.pop() == (tuned, mine)
    assert mp.select_backend(x.shape, BF16, (3, 3), (2, 2), {"bwd": mine}, False,
                             device_kind=H100) == "mosaic"
    with pytest.raises(ValueError, match="unknown config keys"):
        pk.max_pool2d(x, 3, backend="mosaic", interpret=True, config={"dgrad": mine})
    with pytest.raises(ValueError, match="WindowConfig, but this call runs the Triton"):
        pk.max_pool2d(x, 3, backend="triton", interpret=True, config={"fwd": mine})


@needs_mgpu
def test_depthwise_takes_tuned_tiles_per_part_and_skips_a_malformed_entry(shipped,
                                                                         monkeypatch):
    x, w = jnp.zeros((1, 8, 8, 16), BF16), jnp.zeros((3, 3, 1, 16), BF16)
    calls = depthwise_calls(x.shape, 3)
    tuned = {"dgrad": mw.WindowConfig(tile_w=8, block_c=8, stages=4),
             "wgrad": mw.WindowConfig(block_c=16, split=2)}
    shipped(H100, {**{calls[p].key: c.to_dict() for p, c in tuned.items()},
                   calls["fwd"].key: {"block_c": 12}})  # not a multiple of 8
    seen = seen_configs(monkeypatch, md, "_conv", 5)
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    with pytest.warns(UserWarning, match="mgpu_depthwise_fwd.* is invalid"):
        pk.conv2d(x, w, padding=1, groups=16, backend="mosaic", interpret=True)
    assert seen.pop() == (mw.DEFAULT, tuned["dgrad"], tuned["wgrad"])
    # the user's cache over the shipped table
    mine = mw.WindowConfig(block_c=8, stages=2, split=4)
    autotune.save_cache({H100: {"kernels": {calls["wgrad"].key: mine.to_dict()}, "ops": {}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the malformed forward entry again
        md.conv2d(x, w, padding=((1, 1), (1, 1)), config={"fwd": mw.WindowConfig(stages=1)},
                  interpret=True)
    assert seen.pop() == (mw.WindowConfig(stages=1), tuned["dgrad"], mine)


@pytest.mark.parametrize("op", ["max_pool2d", "conv2d"])
def test_auto_needs_a_verdict_not_tuned_tiles(shipped, monkeypatch, op):
    """impl="auto" takes the Mosaic kernels only where a race against XLA was measured:
    tiles in tuned.json for the call's kernels choose nothing."""
    from jaxcnn.functional import _dispatch
    x = jnp.zeros((1, 8, 8, 16), BF16)
    if op == "conv2d":
        arrays = (x, jnp.zeros((3, 3, 1, 16), BF16), None)
        static = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=16)
        calls = depthwise_calls(x.shape, 3)
    else:
        arrays = (x,)
        static = dict(kernel_size=(3, 3), stride=(2, 2), padding=((1, 1), (1, 1)))
        calls = pool_calls("max", x.shape, 3, 2, 1)
    shipped(H100, {c.key: mw.WindowConfig(block_c=8).to_dict() for c in calls.values()})
    monkeypatch.setattr(autotune, "device_kind", lambda: H100)
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    assert _dispatch.choose(op, "auto", arrays, static) is None


# --- the tuner with backend="mosaic" ---------------------------------------------------------

@needs_mgpu
def test_tune_op_times_the_window_candidates_and_the_op_then_runs_the_fastest(tmp_path,
                                                                               monkeypatch):
    """tune_op records both pooling kernels' launches, times two candidates of each (a fake
    clock: the more slots, the faster; the kernel beats XLA) and stores the fastest under
    the device kind with the backend="mosaic" verdict; the op then runs those tiles."""
    x = jnp.zeros((1, 5, 5, 8), BF16)
    static = dict(kernel_size=(2, 2), stride=(1, 1), padding=((0, 0), (0, 0)),
                  dilation=(1, 1), ceil_mode=False, backward="pallas", backend="mosaic")
    timer, timed = fake_tuning_clock(monkeypatch, tmp_path)
    compile_unoptimised(monkeypatch)  # compiled, never run (a fake clock): level 0

    def two(kernel, call, co):
        assert co is None and call.kernel == kernel
        return [mw.WindowConfig(tile_w=2, block_c=8, stages=1), call.candidates()[0]]

    entry = autotune.tune_op("max_pool2d", (x,), static, xla=lambda x: x, timer=timer,
                             candidate_fn=two)
    assert [c.stages for c in timed] == [1, 3, 1, 3]  # two candidates of each kernel
    calls = pool_calls("max", x.shape, 2, 1)
    fastest = tuple(calls[p].candidates()[0] for p in ("fwd", "bwd"))  # the defaults, fitted
    saved = autotune.load_cache()[autotune.device_kind()]
    assert [saved["kernels"][calls[p].key] for p in ("fwd", "bwd")] == [
        c.to_dict() for c in fastest]
    assert saved["ops"][autotune.op_key("max_pool2d", (x,), static)] == entry
    assert entry["pallas_faster"]
    seen = seen_configs(monkeypatch, mp, "_max_pool", 6)
    pk.max_pool2d(x, 2, stride=1, backend="mosaic", interpret=True)
    assert seen.pop() == fastest


def test_tuner_imports_and_refuses_without_mosaic(monkeypatch):
    """With jax < 0.11 (mocked where the kernels exist) a window launch has nothing to time,
    and select_backend keeps the Triton kernels: the tuner still imports and runs them."""
    monkeypatch.setattr(mc, "_jax_version", lambda: (0, 10))
    call = pool_calls("avg", (1, 8, 8, 16), 2)["fwd"]
    assert autotune.candidates(call.kernel, call, None) == []
    assert mp.select_backend((1, 8, 8, 16), BF16, (2, 2), (2, 2), None, False,
                             device_kind=H100) == "triton"


@needs_mgpu
def test_bench_mgpu_window_tunes_then_times_with_the_tuned_tiles(tmp_path, monkeypatch,
                                                                capsys):
    """scripts/bench_mgpu_window.py --tune: each shape's kernels are tuned (a fake clock, one
    candidate a kernel: single-slot tiles, not the defaults; for time, the candidates are not
    compiled) before it is timed, the rows
    name the tiles it ran with, and a resumed run tunes nothing already tuned unless
    --retune.  The timings are faked too (nothing timed for time: the Mosaic forward's
    result with the tuned tiles is compared with XLA's); the real timings of the three
    backends are test_bench_scripts.py's test_bench_mgpu_window_runs_in_interpret_mode."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_mgpu_window.py")
    spec = importlib.util.spec_from_file_location("bench_mgpu_window", path)
    bw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bw)
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    real, tuned = autotune.tune_op, []
    def fake_tune(op, arrays, static, **kw):  # one candidate a kernel: single-slot tiles
        tuned.append(op)
        return real(op, arrays, static, **kw, timer=lambda fn, *a: 1.0,
                    candidate_fn=lambda k, call, co: [
                        dataclasses.replace(call.candidates()[0], stages=1)])

    monkeypatch.setattr(autotune, "tune_op", fake_tune)
    compile_no_candidates(monkeypatch)  # the fake clock times nothing
    monkeypatch.setattr(bw.bc, "time_fn", lambda fn, args, repeats, grad: 1.0)
    out = tmp_path / "w.json"
    argv = ["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1", "--no-grad",
            "--tune", "--json", str(out)]
    assert bw.main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    assert tuned == ["max_pool2d", "conv2d"] and [r["op"] for r in rows] == tuned
    parts = {"max_pool2d": ["fwd", "bwd"], "conv2d": ["fwd", "dgrad", "wgrad"]}
    for row in rows:
        assert "error" not in row and row["max_rel_err"] <= 2.0 ** -8
        assert list(row["tiles"]) == parts[row["op"]]
        assert {t["stages"] for t in row["tiles"].values()} == {1}  # the tuned tiles ran
    assert "fwd w" in capsys.readouterr().out
    # A resumed run tunes nothing already tuned, unless told to.
    _, _, op, hwc, kw, w_shape, _ = next(s for s in bw.SHAPES if s[0] == "mnist")
    args = bw._args(op, (1, *hwc), w_shape, BF16)
    assert not bw.tune(op, args, kw) and len(tuned) == 2
    assert bw.tune(op, args, kw, retune=True) and tuned[2:] == ["max_pool2d"]
