"""The Mosaic GPU (Hopper) depthwise convolution of ``pallas_kernels.mgpu_depthwise``, on the CPU.

The kernels run in Mosaic GPU interpret mode (simulated shared memory, TMA with its zero
fill and store clipping, mbarriers): forward, input gradient and weight gradient against
``jax.lax.conv_general_dilated`` with ``feature_group_count = C`` (and its ``jax.vjp``)
computed in float32 on the same 16-bit values, on random inputs, with shapes whose sizes
are not multiples of the tiles (output-row, column and channel tails), stride 1 and 2,
symmetric, asymmetric and dilated padding, 3x3 and 7x7 windows.  The race detector runs
on all three kernels.  Each case compiles its kernels' program with XLA's optimisations off
(``pallas_testlib.fast_run``: an interpreted kernel's program compiles in about half the
time, and its results are compared within a tolerance, never bit for bit).

Tolerances (mgpu_testlib): 16-bit results within half a step of their type of the float32
reference; the float32 weight gradient within 1e-4 (summation order only: products of
16-bit values are exact in float32).  A last group lowers the kernels offline for an H100
(no GPU) and checks their modules for TMA copies.  Needs jax >= 0.11; skips otherwise.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import pallas_kernels as pk
from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import (H100, REASON, assert_16bit_close, assert_f32_close,
                          assert_tma_pipeline, lower_with_grads, needs_mgpu, normal,
                          races)  # noqa: F401 (races: a fixture)
from pallas_kernels import conv_op
from pallas_kernels import mgpu_depthwise as md
from pallas_kernels import mgpu_window as mw
from pallas_testlib import fast_run

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
DIMS = ("NHWC", "HWIO", "NHWC")


def _ref(x, w, stride, pads, dilation=(1, 1)):
    return lax.conv_general_dilated(x.astype(F32), w.astype(F32), stride, pads,
                                    rhs_dilation=dilation, dimension_numbers=DIMS,
                                    feature_group_count=x.shape[3],
                                    precision=lax.Precision.HIGHEST)


GRAD_CASES = [
    # 7x9 -> 4x5 outputs (tile_w 4: 4 + 1 columns), channels 16 + 8, 2 shares of the
    # weight-gradient reduction, 2 pipeline slots
    ("3x3/2 pad 1, tails, split 2", (1, 7, 9, 24), (3, 3), (2, 2), ((1, 1), (1, 1)), (1, 1),
     mw.WindowConfig(block_c=16, stages=2, split=2), BF16),
    ("3x3 stride 2x1, dilation 1x2, asymmetric pad", (1, 9, 8, 16), (3, 3), (2, 1),
     ((1, 0), (2, 1)), (1, 2), None, BF16),
    # float16, 2 images (the tile index crosses into the second image), and a shape
    # formerly refused by Mosaic's lowering (a TMA copy must move a multiple of 128 bytes):
    # the 9-row float32 filter table of 16 channels (576 bytes) is padded to 10 rows.
    # (8 channels, whose 8-pixel tile rows a float16 case once ran here, run through all
    # three kernels in the race test.)
    ("3x3/1 pad 1 float16, batch 2, C=16 (filter table padded)", (2, 5, 4, 16), (3, 3),
     (1, 1), ((1, 1), (1, 1)), (1, 1), None, F16),
    # 24 channels, 4 output columns: tile rows of 4 x 24 x 2 = 192 bytes widen to 8 pixels
    # (the columns past the output read zeros, never stored), and the 10-row forward table
    # (bias) and the dgrad phases' 2- and 1-row tables are padded to 4k rows.
    ("3x3/2 pad 1, C=24 narrow (tile rows widened)", (1, 7, 7, 24), (3, 3), (2, 2),
     ((1, 1), (1, 1)), (1, 1), None, BF16),
]


@needs_mgpu
@pytest.mark.parametrize("case", GRAD_CASES, ids=[c[0] for c in GRAD_CASES])
def test_forward_and_gradients_match_lax(case):
    """Output, input, filter and bias gradients of the custom VJP against jax.grad of lax."""
    _, xs, k, stride, pads, dil, cfg, dtype = case
    rng = np.random.default_rng(0)
    x, w = normal(rng, xs, dtype), normal(rng, (*k, 1, xs[3]), dtype)
    b = normal(rng, (xs[3],), dtype)
    y_shape = _ref(x, w, stride, pads, dil).shape
    ct = normal(rng, y_shape, dtype).astype(F32)

    def kernel(x, w, b):
        return md.conv2d(x, w, b, stride=stride, padding=pads, dilation=dil, config=cfg,
                         interpret=True)

    def reference(x, w, b):
        return _ref(x, w, stride, pads, dil) + b.astype(F32)

    def kernel_and_grads(x, w, b, ct):  # one program: forward, three gradient kernels, glue
        y, vjp = jax.vjp(kernel, x, w, b)
        return y, vjp(ct)

    @jax.jit
    def reference_and_grads(x, w, b, ct):
        want_y, want_vjp = jax.vjp(reference, x, w, b)
        return want_y, want_vjp(ct)

    y, got = fast_run(kernel_and_grads, x, w, b, ct.astype(dtype))
    want_y, want = reference_and_grads(*(a.astype(F32) for a in (x, w, b)), ct)
    assert y.dtype == dtype and all(g.dtype == dtype for g in got)
    assert_16bit_close(y, want_y, dtype, "y")
    for name, g, r in zip(("dx", "dw", "db"), got, want):
        assert_16bit_close(g, r, dtype, name)


@needs_mgpu
def test_forward_7x7_with_relu_matches_lax():
    """ConvNeXt's 7x7 (pad 3): 49 taps through 3 slots, bias and ReLU on the accumulator."""
    rng = np.random.default_rng(1)
    x, w = normal(rng, (1, 6, 5, 16), BF16), normal(rng, (7, 7, 1, 16), BF16)
    b = normal(rng, (16,), BF16)
    pads = ((3, 3), (3, 3))
    y = fast_run(lambda x, w, b: md.depthwise_forward(x, w, b, relu=True, pads=pads,
                                                      interpret=True), x, w, b)
    want = jnp.maximum(_ref(x, w, (1, 1), pads) + b.astype(F32), 0.0)
    assert_16bit_close(y, want, BF16, "7x7 relu")


@needs_mgpu
def test_unpadded_2x2_stride_2_reads_the_phase_view():
    """2x2/2 without padding on even sizes: the input's phases are a free view (channels
    16 + 8: the tail reads the next phase's channels, which are never stored)."""
    rng = np.random.default_rng(6)
    x, w = normal(rng, (1, 6, 8, 24), BF16), normal(rng, (2, 2, 1, 24), BF16)
    y = md.depthwise_forward(x, w, stride=(2, 2), config=mw.WindowConfig(block_c=16),
                             interpret=True)
    assert_16bit_close(y, _ref(x, w, (2, 2), ((0, 0), (0, 0))), BF16, "2x2/2 phase view")


@needs_mgpu
def test_all_three_kernels_are_race_free(races):
    """Every slot is refilled (9 taps, and 4 output tiles per weight-gradient share, through
    2 slots), so a refill racing with the reads of the slot would be seen."""
    rng = np.random.default_rng(2)
    x, w = normal(rng, (2, 9, 9, 8), BF16), normal(rng, (3, 3, 1, 8), BF16)
    stride, pads = (1, 1), ((1, 1), (1, 1))
    cfg = mw.WindowConfig(block_c=8, tile_w=8, stages=2, split=2)
    kw = dict(stride=stride, pads=pads, config=cfg, interpret=True, detect_races=races)
    dy = normal(rng, _ref(x, w, stride, pads).shape, BF16)

    def kernels(x, w, dy):  # the three kernels in one program, one race-detector run
        return (md.depthwise_forward(x, w, **kw),
                md.depthwise_dgrad(dy, w, x_shape=x.shape, **kw),
                md.depthwise_wgrad(x, dy, kernel_hw=(3, 3), **kw))
    y, dx, dw = fast_run(kernels, x, w, dy)
    assert_16bit_close(y, _ref(x, w, stride, pads), BF16, "forward")
    _, vjp = jax.vjp(lambda x, w: _ref(x, w, stride, pads), x.astype(F32), w.astype(F32))
    want_dx, want_dw = vjp(dy.astype(F32))
    assert_16bit_close(dx, want_dx, BF16, "dgrad")
    assert dw.dtype == F32
    assert_f32_close(dw, want_dw, "wgrad")


@needs_mgpu
def test_xla_backward_option():
    rng = np.random.default_rng(3)
    x, w = normal(rng, (1, 5, 6, 8), BF16), normal(rng, (3, 3, 1, 8), BF16)
    pads = ((1, 1), (1, 1))
    ct = normal(rng, (1, 5, 6, 8), BF16)
    got = jax.vjp(lambda x, w: md.conv2d(x, w, padding=pads, backward="xla", interpret=True),
                  x, w)[1](ct)
    conv = lambda x, w: lax.conv_general_dilated(  # noqa: E731
        x, w, (1, 1), pads, dimension_numbers=DIMS, feature_group_count=8)
    want = jax.vjp(conv, x, w)[1](ct)
    for g, r in zip(got, want):  # exactly XLA's own gradient, in the input's dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32))
    with pytest.raises(ValueError, match="backward must be one of"):
        md.conv2d(x, w, padding=pads, backward="pallas")


@needs_mgpu
@pytest.mark.parametrize("xs, ws, dtype, kw, match", [
    ((1, 8, 8, 12), (3, 3, 1, 12), BF16, {}, "C=12 is not a multiple of 8"),
    ((1, 8, 8, 8), (3, 3, 1, 8), F32, {}, "dtype float32 unsupported"),
    ((1, 12, 12, 8), (3, 3, 1, 8), BF16, {"stride": (5, 5)}, "stride"),
    ((1, 8, 8, 8), (3, 3, 2, 8), BF16, {}, "not depthwise"),
])
def test_unsupported_calls_raise_one_clear_line(xs, ws, dtype, kw, match):
    with pytest.raises(KernelUnsupported, match=match) as e:
        md.conv2d(jnp.zeros(xs, dtype), jnp.zeros(ws, dtype), interpret=True, **kw)
    assert "\n" not in str(e.value)


# --- dispatch from pallas_kernels.conv2d ---------------------------------------------------

@needs_mgpu
def test_pallas_conv2d_backend_mosaic_runs_the_depthwise_kernels():
    rng = np.random.default_rng(4)
    x, w = normal(rng, (1, 5, 6, 16), BF16), normal(rng, (3, 3, 1, 16), BF16)
    b = normal(rng, (16,), BF16)
    y = fast_run(lambda x, w, b: pk.conv2d(x, w, b, padding=1, groups=16, relu=True,
                                           backend="mosaic", interpret=True), x, w, b)
    want = jnp.maximum(_ref(x, w, (1, 1), ((1, 1), (1, 1))) + b.astype(F32), 0.0)
    assert_16bit_close(y, want, BF16, "pk.conv2d depthwise mosaic")
    grad = str(jax.make_jaxpr(jax.grad(
        lambda x, w: jnp.sum(pk.conv2d(x, w, stride=2, padding=1, groups=16, backend="mosaic",
                                       interpret=True).astype(F32)), argnums=(0, 1)))(x, w))
    for name in ("fwd", "dgrad", "wgrad"):
        assert f"jaxcnn_mgpu_depthwise_{name}" in grad
    with pytest.raises(KernelUnsupported, match="without a residual") as e:
        pk.conv2d(x, w, padding=1, groups=16, residual=y, backend="mosaic", interpret=True)
    assert "\n" not in str(e.value)


@needs_mgpu
def test_float16_through_pallas_conv2d_runs_on_mosaic_only():
    """float16 convolutions (depthwise and dense) run on the Mosaic kernels; the Triton
    kernels refuse them in one line."""
    rng = np.random.default_rng(5)
    x = normal(rng, (1, 4, 5, 8), F16)
    for w, groups in ((normal(rng, (3, 3, 1, 8), F16), 8), (normal(rng, (3, 3, 8, 16), F16), 1)):
        y = fast_run(lambda x, w, g=groups: pk.conv2d(x, w, padding=1, groups=g,
                                                      backend="mosaic", interpret=True), x, w)
        assert y.dtype == F16
        ref = lax.conv_general_dilated(x.astype(F32), w.astype(F32), (1, 1), ((1, 1), (1, 1)),
                                       dimension_numbers=DIMS, feature_group_count=groups,
                                       precision=lax.Precision.HIGHEST)
        assert_16bit_close(y, ref, F16, f"float16 groups={groups}")
        with pytest.raises(ValueError, match="float16 runs on the Mosaic GPU kernels only"):
            pk.conv2d(x, w, padding=1, groups=groups, interpret=True)  # backend=None: Triton


@pytest.mark.parametrize("change, want", [
    ({}, "mosaic"),
    ({"dtype": F16}, "mosaic"),
    ({"has_residual": True}, "triton"),
    ({"device_kind": "NVIDIA A100-SXM4-80GB"}, "triton"),
    ({"interpret": True}, "triton"),
    ({"dtype": F32}, "triton"),
    ({"x_shape": (8, 28, 28, 12), "w_shape": (3, 3, 1, 12)}, "triton"),
    ({"stride": (5, 5)}, "triton"),
    ({"has_input_bn": True}, "triton"),
    ({"config": pk.BlockConfig()}, "triton"),
    ({"config": {"fwd": mw.WindowConfig(block_c=32)}}, "mosaic"),
])
def test_select_backend_takes_depthwise_calls_on_hopper(change, want):
    if want == "mosaic" and REASON is not None:
        want = "triton"  # jax < 0.11: the library falls back
    args = dict(dtype=BF16, kind="depthwise", stride=(1, 1), x_shape=(8, 28, 28, 96),
                w_shape=(3, 3, 1, 96), pads=((1, 1), (1, 1)), has_input_bn=False,
                precision=None, config=None, interpret=False, device_kind=H100)
    args.update(change)
    assert conv_op.select_backend(**args) == want


def test_a_window_config_on_the_triton_path_is_one_clear_error():
    x, w = jnp.zeros((1, 8, 8, 16), BF16), jnp.zeros((3, 3, 1, 16), BF16)
    with pytest.raises(ValueError, match="WindowConfig, but this call runs the Triton"):
        pk.conv2d(x, w, padding=1, groups=16, backend="triton", config=mw.WindowConfig())


# --- offline lowering for sm_90a (no GPU) -------------------------------------------------

@needs_mgpu
@pytest.mark.parametrize("stride, phases", [((1, 1), 1), ((2, 2), 4)], ids=["3x3/1", "3x3/2"])
def test_depthwise_kernels_lower_for_hopper_with_tma(stride, phases):
    reports = lower_with_grads(
        lambda x, w, b: md.conv2d(x, w, b, stride=stride, padding=((1, 1), (1, 1)), relu=True),
        jax.ShapeDtypeStruct((8, 56, 56, 96), BF16), jax.ShapeDtypeStruct((3, 3, 1, 96), BF16),
        jax.ShapeDtypeStruct((96,), BF16))
    assert sorted(r.name for r in reports) == (["jaxcnn_mgpu_depthwise_dgrad"] * phases
                                               + ["jaxcnn_mgpu_depthwise_fwd",
                                                  "jaxcnn_mgpu_depthwise_wgrad"])
    assert_tma_pipeline(reports)


@needs_mgpu
@pytest.mark.parametrize("c, stride, bias", [(16, 1, False), (24, 2, True)],
                         ids=["C=16 3x3/1 no bias", "C=24 3x3/2 bias"])
def test_small_channel_counts_lower_for_hopper(c, stride, bias):
    """Every TMA copy into shared memory moves a multiple of 128 bytes, or Mosaic refuses to
    lower the kernel.  C=16 at 3x3/1: the forward's and input gradient's 9-row float32
    filter tables (576 bytes).  C=24 at 3x3/2 on 14x14: 4-pixel tile rows (192 bytes) in the
    input gradient's phases and the weight gradient, and 10-, 2- and 1-row tables."""
    args = [jax.ShapeDtypeStruct((2, 14, 14, c), BF16), jax.ShapeDtypeStruct((3, 3, 1, c), BF16)]
    if bias:
        args.append(jax.ShapeDtypeStruct((c,), BF16))
    reports = lower_with_grads(
        lambda *a: md.conv2d(*a, stride=(stride, stride), padding=((1, 1), (1, 1))), *args)
    phases = stride * stride
    assert sorted(r.name for r in reports) == (["jaxcnn_mgpu_depthwise_dgrad"] * phases
                                               + ["jaxcnn_mgpu_depthwise_fwd",
                                                  "jaxcnn_mgpu_depthwise_wgrad"])
    assert_tma_pipeline(reports)


def test_tile_rows_and_filter_tables_are_whole_copies():
    """The tiles the kernels pick: each tile row copy and filter table a multiple of 128
    bytes, widened or padded no more than needed."""
    for c in (8, 16, 24, 32, 40, 64):
        bc = mw.block_c(c, mw.DEFAULT)
        for width in (1, 3, 4, 7, 14, 56):
            tw = mw.tile_w(width, bc, mw.DEFAULT)
            assert tw * bc * 2 % 128 == 0 and mw.TILE_M % tw == 0, (c, width, tw)
            narrowest = next(t for t in (1, 2, 4, 8) if t * bc * 2 % 128 == 0)
            assert tw == max(narrowest, min(64, 1 << (width.bit_length() - 1))), (c, width)
        for rows in (1, 2, 4, 9, 10, 25, 49, 50):
            padded = mw.table_rows(rows, bc)
            assert padded * bc * 4 % 128 == 0 and rows <= padded < rows + 4, (c, rows)
    assert mw.table_rows(9, 16) == 10 and mw.tile_w(4, 24, mw.DEFAULT) == 8
