"""The Mosaic GPU (Hopper) convolution kernels of ``pallas_kernels.mgpu_conv``, on the CPU.

The kernels run in Mosaic GPU *interpret mode* (``plgpu.InterpretGPUParams``),
which simulates shared memory, TMA copies (with their out-of-bounds zero fill
and store clipping), mbarriers and ``wgmma`` on the CPU; the race detector
runs on one case of each kernel.  Every result is checked against
``jax.lax.conv_general_dilated`` (and its ``jax.vjp``) computed in float32
on the same bfloat16/float16 values, on random inputs, with shapes whose
sizes are not multiples of the tiles (output-row, column, input- and
output-channel tails), 1x1/3x3/7x7 windows, symmetric, asymmetric and
dilated padding.  Each case compiles its kernels' program with XLA's
optimisations off (``pallas_testlib.fast_run``: an interpreted kernel's program
compiles in about half the time, and its results are compared within a tolerance).

Tolerances: forward and input-gradient outputs are 16-bit, rounded once after
float32 accumulation, so each element is within half a step of its type
(bfloat16: 2**-8 relative, float16: 2**-11) of the float32 reference, plus
float32 summation-order noise (1e-4 of the largest value).  The weight
gradient is returned in float32: products of 16-bit values are exact in
float32, so only the summation order differs (1e-4 of the largest value).

A second group lowers every kernel offline for CUDA (an abstract H100, no
GPU) and checks that its module holds TMA copies, an mbarrier pipeline and
``wgmma`` (what ``scripts/inspect_kernels.py --mosaic`` reports).

All of it needs jax >= 0.11 (the /work/main/.venv312 environment); on older
jax the kernels are unavailable, these tests skip saying so, and the library
falls back to the Triton kernels (checked here on any jax).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import H100, REASON, S, needs_mgpu, races  # noqa: F401 (a fixture)
from mgpu_testlib import assert_16bit_close as _assert_16bit_close
from mgpu_testlib import assert_f32_close as _assert_f32_close
from mgpu_testlib import assert_tma_pipeline, check_auto_needs_a_mosaic_verdict
from mgpu_testlib import inspect_kernels as _inspect_kernels
from mgpu_testlib import lower_with_grads
from mgpu_testlib import normal as _normal
from mgpu_testlib import ref_conv as _ref_conv
from pallas_kernels import conv_op
from pallas_kernels import mgpu_conv as mc
from pallas_testlib import fast_run


# name, x shape, w shape, pads, dilation, config, dtype[, stride]
FORWARD_CASES = [
    # 3x3, every tail: 5 rows (tile_h 16), 7 columns (tile_w 4: 4 + 3), C_in 24 (block_k
    # 16: 16 + 8), C_out 40 (block_n 32: 32 + 8)
    ("3x3 tails", (1, 5, 7, 24), (3, 3, 24, 40), ((1, 1), (1, 1)), (1, 1),
     mc.MgpuConfig(block_n=32, block_k=16, stages=2), jnp.bfloat16),
    ("7x7 pad 3", (1, 4, 4, 8), (7, 7, 8, 16), ((3, 3), (3, 3)), (1, 1), None, jnp.bfloat16),
    ("asymmetric pad, dilation 2x1", (1, 6, 6, 8), (3, 3, 8, 8), ((2, 0), (0, 1)), (2, 1),
     None, jnp.bfloat16),
    ("float16, 64 channels, 3 stages", (1, 3, 9, 64), (3, 3, 64, 64), ((1, 1), (1, 1)),
     (1, 1), None, jnp.float16),
    # (A 1x1 stride-1 forward and a 3x3 stride-2 forward on odd sizes, phases of different
    # sizes, are checked by test_gradients_match_lax's "1x1" and "3x3 stride 2" cases.)
    ("1x1 stride 2", (2, 6, 7, 16), (1, 1, 16, 16), ((0, 0), (0, 0)), (1, 1), None,
     jnp.bfloat16, (2, 2)),
    ("stride 2x1, dilation 1x2, asymmetric pad", (1, 9, 8, 8), (3, 3, 8, 8), ((1, 0), (2, 1)),
     (1, 2), None, jnp.bfloat16, (2, 1)),
]


@needs_mgpu
@pytest.mark.parametrize("case", FORWARD_CASES, ids=[c[0] for c in FORWARD_CASES])
def test_forward_matches_lax(case):
    name, xs, ws, pads, dil, cfg, dtype, *stride = case
    stride = stride[0] if stride else (1, 1)
    rng = np.random.default_rng(0)
    x, w = _normal(rng, xs, dtype), _normal(rng, ws, dtype)
    y = fast_run(lambda x, w: mc.conv_forward(x, w, stride=stride, pads=pads, dilation=dil,
                                              config=cfg, interpret=True), x, w)
    assert y.dtype == dtype
    _assert_16bit_close(y, _ref_conv(x, w, pads, dil, stride), dtype, name)


@needs_mgpu
@pytest.mark.parametrize("warp_specialized", [False, True], ids=["one warpgroup", "producer wg"])
def test_forward_with_fused_epilogue_has_no_race(races, warp_specialized):
    """Bias, residual and ReLU on the float32 accumulator, tails in every dimension
    (C_out 24 with block_n 16), under the race detector; also with a producer warpgroup
    handing slots back through "consumed" barriers."""
    rng = np.random.default_rng(1)
    x, w = _normal(rng, (1, 5, 7, 8), jnp.bfloat16), _normal(rng, (3, 3, 8, 24), jnp.bfloat16)
    b, res = _normal(rng, (24,), jnp.bfloat16), _normal(rng, (1, 5, 7, 24), jnp.bfloat16)
    pads = ((1, 1), (1, 1))
    cfg = mc.MgpuConfig(block_n=16, stages=2, warp_specialized=warp_specialized)
    y = fast_run(lambda x, w, b, res: mc.conv_forward(x, w, b, res, relu=True, pads=pads,
                                                      config=cfg, interpret=True,
                                                      detect_races=races), x, w, b, res)
    want = jnp.maximum(_ref_conv(x, w, pads) + b.astype(jnp.float32)
                       + res.astype(jnp.float32), 0.0)
    _assert_16bit_close(y, want, jnp.bfloat16, "raced forward with epilogue")


def _loss_grads(fn, x, w, b, res, ct):
    """The four gradients, as one program (forward, gradient kernels and glue)."""
    def loss(x, w, b, res, ct):
        return jnp.sum(fn(x, w, b, res).astype(jnp.float32) * ct)
    return fast_run(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w, b, res, ct)


def _out_and_loss_grads(fn, x, w, b, res, ct):
    """``fn``'s output and :func:`_loss_grads`'s gradients, as one program."""
    def run(x, w, b, res, ct):
        def out(*a):
            y = fn(*a)
            return y.astype(jnp.float32), y
        _, vjp, y = jax.vjp(out, x, w, b, res, has_aux=True)
        return y, vjp(ct)
    return fast_run(run, x, w, b, res, ct)


@needs_mgpu
@pytest.mark.parametrize("xs, ws, stride, pads, cfg", [
    ((2, 2, 8, 24), (3, 3, 24, 16), (1, 1), ((1, 0), (2, 1)), mc.MgpuConfig(split=3, stages=2)),
    ((1, 2, 9, 8), (1, 1, 8, 24), (1, 1), ((0, 0), (0, 0)), None),
    ((1, 3, 17, 8), (3, 3, 8, 16), (2, 2), ((1, 1), (1, 1)), None),
], ids=["3x3 asymmetric pad, split 3", "1x1", "3x3 stride 2 (phase-decomposed dgrad)"])
def test_gradients_match_lax(xs, ws, stride, pads, cfg):
    """The output and the input, weight, bias and residual gradients of the custom VJP
    against lax and jax.grad of lax (one program each)."""
    rng = np.random.default_rng(2)
    x, w = _normal(rng, xs, jnp.bfloat16), _normal(rng, ws, jnp.bfloat16)
    b = _normal(rng, ws[3:], jnp.bfloat16)
    y_shape = _ref_conv(x, w, pads, stride=stride).shape
    res = _normal(rng, y_shape, jnp.bfloat16)
    ct = _normal(rng, y_shape, jnp.bfloat16).astype(jnp.float32)

    def kernel(x, w, b, res):
        return mc.conv2d(x, w, b, stride=stride, padding=pads, residual=res, config=cfg,
                         interpret=True)

    def reference(x, w, b, res):
        return (_ref_conv(x, w, pads, stride=stride) + b.astype(jnp.float32)
                + res.astype(jnp.float32))

    f32 = [a.astype(jnp.float32) for a in (x, w, b, res)]
    y, got = _out_and_loss_grads(kernel, x, w, b, res, ct)
    want_y, want = _out_and_loss_grads(reference, *f32, ct)
    assert y.dtype == jnp.bfloat16
    _assert_16bit_close(y, want_y, jnp.bfloat16, "forward")
    _assert_16bit_close(got[0], want[0], jnp.bfloat16, "dx")
    # dw is computed in float32 and rounded to w's dtype once.
    _assert_16bit_close(got[1], want[1], jnp.bfloat16, "dw")
    _assert_16bit_close(got[2], want[2], jnp.bfloat16, "db")
    _assert_16bit_close(got[3], want[3], jnp.bfloat16, "dresidual")


@needs_mgpu
def test_weight_gradient_kernel_is_float32_exact_and_race_free(races):
    rng = np.random.default_rng(3)
    x, dy = _normal(rng, (2, 3, 5, 8), jnp.bfloat16), _normal(rng, (2, 3, 5, 16), jnp.bfloat16)
    pads = ((1, 1), (1, 1))
    dw = fast_run(lambda x, dy: mc.conv_wgrad(x, dy, kernel_hw=(3, 3), pads=pads,
                                              config=mc.MgpuConfig(split=2), interpret=True,
                                              detect_races=races), x, dy)
    _, vjp = jax.vjp(lambda w: _ref_conv(x, w, pads), jnp.zeros((3, 3, 8, 16), jnp.float32))
    _assert_f32_close(dw, vjp(dy.astype(jnp.float32))[0], "wgrad")


@needs_mgpu
def test_relu_backward_matches_xla_backward_of_the_same_forward():
    """With a ReLU the mask comes from the 16-bit output, so the reference is the same op
    with XLA's convolution gradients (backward="xla")."""
    rng = np.random.default_rng(4)
    x, w = _normal(rng, (1, 2, 8, 16), jnp.bfloat16), _normal(rng, (3, 3, 16, 16), jnp.bfloat16)
    b = _normal(rng, (16,), jnp.bfloat16)
    ct = _normal(rng, (1, 2, 8, 16), jnp.bfloat16).astype(jnp.float32)

    def op(backward):
        return lambda x, w, b, _: mc.conv2d(x, w, b, padding=((1, 1), (1, 1)), relu=True,
                                            backward=backward, interpret=True)
    got = _loss_grads(op("mosaic"), x, w, b, None, ct)
    want = _loss_grads(op("xla"), x, w, b, None, ct)
    for name, g, r in zip(("dx", "dw", "db"), got, want):
        _assert_16bit_close(g, r, jnp.bfloat16, name)


@needs_mgpu
@pytest.mark.parametrize("xs, ws, stride, pads", [
    ((1, 6, 7, 16), (1, 1, 16, 8), (2, 2), ((0, 0), (0, 0))),
    ((1, 8, 6, 8), (3, 3, 8, 8), (2, 1), ((1, 0), (2, 1))),
], ids=["1x1/2 (a phase no tap reaches)", "3x3 stride 2x1, asymmetric pad"])
def test_strided_input_gradient_matches_lax(xs, ws, stride, pads):
    rng = np.random.default_rng(7)
    w = _normal(rng, ws, jnp.bfloat16)
    y_shape = _ref_conv(jnp.zeros(xs), w, pads, stride=stride).shape
    dy = _normal(rng, y_shape, jnp.bfloat16)
    _, vjp = jax.vjp(lambda x: _ref_conv(x, w, pads, stride=stride), jnp.zeros(xs, jnp.float32))
    dx = fast_run(lambda dy, w: mc.conv_dgrad(dy, w, x_hw=xs[1:3], stride=stride, pads=pads,
                                              interpret=True), dy, w)
    _assert_16bit_close(dx, vjp(dy.astype(jnp.float32))[0], jnp.bfloat16, "strided dgrad")


@needs_mgpu
def test_input_gradient_falls_back_to_xla_where_it_would_need_negative_padding():
    """A 1x1 convolution padded by 1 has a correlation with padding -1 as its input
    gradient: XLA computes that part; the values still match lax."""
    rng = np.random.default_rng(5)
    x, w = _normal(rng, (1, 1, 7, 8), jnp.bfloat16), _normal(rng, (1, 1, 8, 16), jnp.bfloat16)
    pads = ((1, 1), (1, 1))
    with pytest.raises(KernelUnsupported, match="negative padding"):
        mc.conv_dgrad(jnp.zeros((1, 3, 9, 16), jnp.bfloat16), w, x_hw=(1, 7), pads=pads,
                      interpret=True)
    ct = _normal(rng, (1, 3, 9, 16), jnp.bfloat16).astype(jnp.float32)
    def loss(x, w):
        return jnp.sum(mc.conv2d(x, w, padding=pads, interpret=True).astype(jnp.float32) * ct)
    got = fast_run(jax.grad(loss, argnums=(0, 1)), x, w)
    want = jax.grad(lambda x, w: jnp.sum(_ref_conv(x, w, pads) * ct), argnums=(0, 1))(
        x.astype(jnp.float32), w.astype(jnp.float32))
    _assert_16bit_close(got[0], want[0], jnp.bfloat16, "dx")
    _assert_16bit_close(got[1], want[1], jnp.bfloat16, "dw")


@needs_mgpu
def test_pallas_conv2d_backend_mosaic_runs_the_mosaic_kernels():
    rng = np.random.default_rng(6)
    x, w = _normal(rng, (1, 4, 4, 8), jnp.bfloat16), _normal(rng, (3, 3, 8, 16), jnp.bfloat16)
    y = fast_run(lambda x, w: pk.conv2d(x, w, padding=1, backend="mosaic", interpret=True), x, w)
    _assert_16bit_close(y, _ref_conv(x, w, ((1, 1), (1, 1))), jnp.bfloat16, "pk.conv2d mosaic")
    jaxpr = str(jax.make_jaxpr(lambda x, w: pk.conv2d(x, w, padding=1, backend="mosaic",
                                                      interpret=True))(x, w))
    assert "jaxcnn_mgpu_conv_fwd" in jaxpr


# --- what the kernels refuse, and the choice of backend (any jax) -----------------------

@needs_mgpu
@pytest.mark.parametrize("xs, ws, kw, match", [
    ((1, 8, 8, 3), (3, 3, 3, 16), {}, "C_in=3 is not a multiple of 8"),
    ((1, 8, 8, 16), (3, 3, 16, 12), {}, "C_out=12"),
    ((1, 8, 8, 16), (3, 3, 16, 16), {"stride": (5, 5)}, "stride"),
    ((1, 8, 8, 16), (3, 3, 16, 16), {"dtype": jnp.float32}, "float32"),
])
def test_unsupported_calls_raise_one_clear_line(xs, ws, kw, match):
    dtype = kw.pop("dtype", jnp.bfloat16)
    with pytest.raises(KernelUnsupported, match=match) as e:
        mc.check_supported(xs, ws, dtype, **kw)
    assert "\n" not in str(e.value)


def test_a_mosaic_config_on_the_triton_path_is_one_clear_error():
    x, w = jnp.zeros((1, 8, 8, 16), jnp.bfloat16), jnp.zeros((3, 3, 16, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="MgpuConfig, but this call runs the Triton"):
        pk.conv2d(x, w, padding=1, backend="triton", config=mc.MgpuConfig())


def test_old_jax_is_unsupported_and_the_library_falls_back(monkeypatch):
    monkeypatch.setattr(mc, "_jax_version", lambda: (0, 10))
    with pytest.raises(KernelUnsupported, match=r"jax .* < 0\.11"):
        mc.check_supported((1, 8, 8, 16), (3, 3, 16, 16), jnp.bfloat16)
    assert conv_op.select_backend(jnp.bfloat16, "dense", (1, 1), (1, 8, 8, 16), (3, 3, 16, 16),
                                  ((1, 1), (1, 1)), False, None, None, False,
                                  device_kind=H100) == "triton"


@pytest.mark.parametrize("change, want", [
    ({}, "mosaic"),
    ({"device_kind": "NVIDIA A100-SXM4-80GB"}, "triton"),
    ({"interpret": True}, "triton"),
    ({"dtype": jnp.float32}, "triton"),
    ({"x_shape": (1, 8, 8, 3), "w_shape": (3, 3, 3, 16)}, "triton"),
    ({"stride": (2, 2)}, "mosaic"),
    ({"stride": (5, 5)}, "triton"),
    ({"has_input_bn": True}, "triton"),
    ({"kind": "depthwise"}, "triton"),
    ({"config": pk.BlockConfig(block_m=64, block_n=64, block_k=16)}, "triton"),
])
def test_select_backend_is_a_lookup_by_device_kind_and_shape(change, want):
    if want == "mosaic" and REASON is not None:
        want = "triton"  # jax < 0.11: the library falls back
    args = dict(dtype=jnp.bfloat16, kind="dense", stride=(1, 1), x_shape=(1, 8, 8, 16),
                w_shape=(3, 3, 16, 16), pads=((1, 1), (1, 1)), has_input_bn=False,
                precision=None, config=None, interpret=False, device_kind=H100)
    args.update(change)
    assert conv_op.select_backend(**args) == want
    assert mc.is_hopper("NVIDIA H200") and not mc.is_hopper("NVIDIA L4")
    assert mc.is_hopper("some GPU", "9.0") and not mc.is_hopper("NVIDIA A100", "8.0")


def test_auto_needs_a_measurement_of_the_mosaic_kernel(monkeypatch):
    """impl="auto" on a GPU takes a conv kernel only where a verdict says so, and a verdict
    measured on the Triton kernel pins backend="triton": the Mosaic kernel is chosen only
    by an entry keyed with backend="mosaic"."""
    x, w = jnp.zeros((1, 8, 8, 16), jnp.bfloat16), jnp.zeros((3, 3, 16, 16), jnp.bfloat16)
    static = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1)
    check_auto_needs_a_mosaic_verdict(monkeypatch, "conv2d", (x, w, None), static)


# --- offline lowering for sm_90a (no GPU) -------------------------------------------------

LOWERED = [  # x shape, w shape, pads, config[, stride]: default tiles, the CPU cases' tails
    ((2, 14, 14, 64), (3, 3, 64, 128), ((1, 1), (1, 1)), None),
    ((1, 5, 7, 24), (3, 3, 24, 40), ((1, 1), (1, 1)), mc.MgpuConfig(block_n=32, block_k=16,
                                                                   stages=2, split=2)),
    ((2, 7, 7, 256), (1, 1, 256, 64), ((0, 0), (0, 0)), None),
    ((1, 16, 16, 16), (7, 7, 16, 64), ((3, 3), (3, 3)), mc.MgpuConfig(
        stages=4, warp_specialized=True)),
    ((2, 28, 28, 128), (3, 3, 128, 128), ((1, 1), (1, 1)), None, (2, 2)),
]


@needs_mgpu
@pytest.mark.parametrize("case", LOWERED, ids=["3x3", "3x3 tails", "1x1", "7x7", "3x3/2"])
def test_kernels_lower_for_hopper_with_tma_and_wgmma(case):
    xs, ws, pads, cfg, *stride = case
    stride = stride[0] if stride else (1, 1)
    reports = lower_with_grads(  # the fused epilogue (bias, ReLU) lowers too
        lambda x, w, b: mc.conv2d(x, w, b, stride=stride, padding=pads, relu=True, config=cfg),
        S(xs, jnp.bfloat16), S(ws, jnp.bfloat16), S(ws[3:], jnp.bfloat16))
    names = sorted(r.name for r in reports)
    want = ["jaxcnn_mgpu_conv_fwd", "jaxcnn_mgpu_conv_wgrad"]
    if pads[0][0] <= ws[0] - 1 and pads[1][0] <= ws[1] - 1:
        want.append("jaxcnn_mgpu_conv_dgrad")
    assert set(names) == set(want)  # (a strided input gradient is one launch per phase)
    if stride != (1, 1):
        assert names.count("jaxcnn_mgpu_conv_dgrad") == stride[0] * stride[1]
    assert_tma_pipeline(reports)
    for r in reports:
        assert r.wgmma and all(s.startswith("m64n") and s.endswith(".bf16.bf16")
                               for s in r.wgmma), f"{r.name}: wgmma {r.wgmma}"
        # Warp specialisation rebalances registers (the weight gradient has no such variant).
        ws = cfg is not None and cfg.warp_specialized and r.name != "jaxcnn_mgpu_conv_wgrad"
        assert r.setmaxnreg == ws, f"{r.name}: setmaxnreg {r.setmaxnreg}"


@needs_mgpu
def test_residual_epilogue_lowers_for_hopper():
    ik = _inspect_kernels()

    def fwd(x, w, b, r):
        return mc.conv_forward(x, w, b, r, relu=True, pads=((1, 1), (1, 1)))
    (r,) = ik.inspect_mosaic(fwd, S((2, 14, 14, 64), jnp.bfloat16),
                             S((3, 3, 64, 40), jnp.bfloat16), S((40,), jnp.bfloat16),
                             S((2, 14, 14, 40), jnp.bfloat16))
    assert r.name == "jaxcnn_mgpu_conv_fwd" and r.tma_load and r.tma_store and r.wgmma


@needs_mgpu
def test_cached_tiles_are_looked_up_per_part(tmp_path, monkeypatch):
    """autotune.store_kernels writes a part's tiles into the user's cache for this device kind
    (under its DenseCall key); conv2d then traces with them (a pure lookup), and the other
    parts keep the defaults."""
    from pallas_kernels import autotune
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    x, w = jnp.zeros((1, 8, 8, 16), jnp.bfloat16), jnp.zeros((3, 3, 16, 32), jnp.bfloat16)
    pads, cfg = ((1, 1), (1, 1)), mc.MgpuConfig(block_n=32, block_k=16, stages=4)
    calls = mc.tuning_calls(x.shape, w.shape, x.dtype, stride=(1, 1), pads=pads,
                            dilation=(1, 1))
    assert mc.tuned_config(calls["fwd"]) is None
    autotune.store_kernels({calls["fwd"].key: cfg})
    assert mc.tuned_config(calls["fwd"]) == cfg
    assert mc.tuned_config(calls["wgrad"]) is None
    seen = []
    monkeypatch.setattr(mc, "_conv", lambda static, *a: seen.append(static[4]))
    mc.conv2d(x, w, padding=pads, interpret=True)
    assert seen == [(cfg, mc.DEFAULT, mc.DEFAULT)]
    assert autotune.device_kind() in autotune.load_cache()


@needs_mgpu
def test_narrow_small_channel_conv_matches_lax():
    """A formerly refused call (Mosaic lowers only TMA copies of whole 128-byte multiples):
    8 -> 16 channels, 3x3/2 on 4x4, so 2 output columns, with bias and residual.  Its tile
    rows widen to 4 pixels in the forward (16-channel input and residual rows), the input
    gradient's phases (3 columns) and the weight gradient (dy rows); the bias slot pads to
    32 entries.  The widened columns are never stored, so the forward, its input, weight,
    bias and residual gradients match jax.lax's in float32 (16-bit outputs: half a step
    plus 1e-4 of the largest value; the weight gradient is rounded to bfloat16 once)."""
    rng = np.random.default_rng(8)
    x, w = _normal(rng, (1, 4, 4, 8), jnp.bfloat16), _normal(rng, (3, 3, 8, 16), jnp.bfloat16)
    b = _normal(rng, (16,), jnp.bfloat16)
    pads, stride = ((1, 1), (1, 1)), (2, 2)
    res = _normal(rng, (1, 2, 2, 16), jnp.bfloat16)
    ct = _normal(rng, (1, 2, 2, 16), jnp.bfloat16).astype(jnp.float32)
    calls = mc.tuning_calls(x.shape, w.shape, x.dtype, stride=stride, pads=pads,
                            dilation=(1, 1), bias=True, residual=True)
    assert [calls[p].fit(mc.DEFAULT).tile_w for p in mc.PARTS] == [4, 4, 4]  # from 2

    def kernel(x, w, b, res):
        return mc.conv2d(x, w, b, stride=stride, padding=pads, residual=res, interpret=True)

    def reference(x, w, b, res):
        return (_ref_conv(x, w, pads, stride=stride) + b.astype(jnp.float32)
                + res.astype(jnp.float32))

    f32 = [a.astype(jnp.float32) for a in (x, w, b, res)]
    y, got = _out_and_loss_grads(kernel, x, w, b, res, ct)
    want_y, want = _out_and_loss_grads(reference, *f32, ct)
    _assert_16bit_close(y, want_y, jnp.bfloat16, "forward")
    for name, g, r in zip(("dx", "dw", "db", "dresidual"), got, want):
        _assert_16bit_close(g, r, jnp.bfloat16, name)
