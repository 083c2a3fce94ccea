"""The Mosaic GPU (Hopper) pooling kernels of ``pallas_kernels.mgpu_pool``, on the CPU.

The kernels run in Mosaic GPU interpret mode (simulated shared memory, TMA with its
zero fill and store clipping, mbarriers), forward and backward, against the XLA pooling
of ``jaxcnn.functional`` (``impl="xla"``) and its ``jax.vjp`` computed in float32 on the
same 16-bit values, on random inputs and on inputs full of ties (ReLU'd small integers),
with shapes whose sizes are not multiples of the tiles (output-row, column and channel
tails), stride 1 and 2, padding, dilation, ``ceil_mode`` and both average divisors.  The
race detector runs on a max and an average case, forward and backward.  The max pool's
recorded tap index is checked against a numpy first-argmax.  Each case compiles its
kernels' program with XLA's optimisations off (``pallas_testlib.fast_run``: an interpreted
kernel's program compiles in about half the time; its results are compared within a
tolerance, or exactly where nothing rounds).

Tolerances (mgpu_testlib): max-pool outputs are exact (a maximum of 16-bit values);
everything else is within half a step of its 16-bit type of the float32 reference.
A last group lowers the kernels offline for an H100 (no GPU) and checks their modules for
TMA copies.  All of it needs jax >= 0.11; on older jax it skips saying so.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from jaxcnn import _geometry as geo
from jaxcnn import functional as F
from jaxcnn.errors import KernelUnsupported
from mgpu_testlib import (H100, REASON, assert_16bit_close, assert_tma_pipeline,
                          check_auto_needs_a_mosaic_verdict, inspect_kernels, lower_with_grads,
                          needs_mgpu, normal, races)  # noqa: F401 (races: a fixture)
from pallas_kernels import mgpu_pool as mp
from pallas_kernels import mgpu_window as mw
from pallas_testlib import fast_run

BF16, F16 = jnp.bfloat16, jnp.float16


def _ties(shape, dtype, seed=0):
    """ReLU'd small integers: mostly zeros and many equal maxima in each window."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(np.maximum(np.round(rng.standard_normal(shape) * 1.5), 0), dtype)


def _kernel_and_grad(op, kw, races=False):
    """One program: the kernel's output and its input gradient at a cotangent (one
    compilation, XLA's optimisations off (``pallas_testlib.fast_run``), for the forward and
    backward launches and the glue between them)."""
    def run(x, ct):
        y, vjp = jax.vjp(lambda x: getattr(mp, op)(x, **kw, interpret=True, detect_races=races),
                         x)
        return y, vjp(ct)[0]
    return lambda x, ct: fast_run(run, x, ct)


def _check(op, x, kw, races=False):
    """Forward and input gradient (random cotangent) of the kernel against XLA in float32."""
    dtype = x.dtype
    ref_kw = {k: v for k, v in kw.items() if k not in ("config", "backward")}
    y_shape = jax.eval_shape(lambda x: getattr(F, op)(x, **ref_kw, impl="xla"), x).shape
    ct = normal(np.random.default_rng(1), y_shape, dtype)
    y, dx = _kernel_and_grad(op, kw, races)(x, ct)

    @jax.jit
    def reference(x, ct):
        want_y, want_vjp = jax.vjp(lambda x: getattr(F, op)(x, **ref_kw, impl="xla"), x)
        return want_y, want_vjp(ct)[0]
    want_y, want_dx = reference(x.astype(jnp.float32), ct.astype(jnp.float32))
    assert y.dtype == dtype and dx.dtype == dtype
    if op == "max_pool2d":
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y))
    else:
        assert_16bit_close(y, want_y, dtype, f"{op} output")
    assert_16bit_close(dx, want_dx, dtype, f"{op} dx")


MAX_CASES = [  # (and 3x3/2 with every tail, under the race detector below)
    ("2x2/2 float16", (1, 6, 6, 8), dict(kernel_size=2), F16),
    ("3x3/1 pad 1 dilation 2", (1, 8, 7, 8), dict(kernel_size=3, stride=1, padding=1,
                                                   dilation=2), BF16),
]


@needs_mgpu
@pytest.mark.parametrize("name, shape, kw, dtype", MAX_CASES, ids=[c[0] for c in MAX_CASES])
def test_max_pool_with_ties_matches_xla(name, shape, kw, dtype):
    """The gradient of each window goes to its first maximum, as XLA's (and PyTorch's)."""
    _check("max_pool2d", _ties(shape, dtype), kw)


@needs_mgpu
def test_max_pool_3x3_2_with_tails_is_race_free_and_records_the_first_maximum(races,
                                                                             monkeypatch):
    """7x9 -> 4x5 outputs (ceil_mode overhang): tile_w 4 (4 + 1 columns), channels 16 + 8,
    9 taps through 2 slots; the backward's 4 phases with 4, 2, 2 and 1 taps.

    The custom VJP's own forward (with the recorded tap index) and backward run once, in one
    jitted program under the race detector, with the static arguments ``max_pool2d`` passes
    them (its VJP wiring is checked through ``jax.vjp`` by the tests above)."""
    x = _ties((1, 7, 9, 24), BF16, seed=2)
    cfg = mw.WindowConfig(block_c=16, stages=2)
    kw = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, config=cfg)
    with monkeypatch.context() as m:  # the static arguments of the public call
        seen = []
        m.setattr(mp, "_max_pool", lambda static, x: seen.append(static) or x)
        mp.max_pool2d(x, **kw, interpret=True, detect_races=races)
    (static,) = seen
    kernel, stride, dilation, _, run_pads, out_hw = geo.pool_geometry(
        "t", x.shape, 3, 2, 1, 1, True)
    assert static == (kernel, stride, dilation, run_pads, out_hw, "mosaic", (cfg, cfg), True,
                      True)
    ct = normal(np.random.default_rng(1), (1, *out_hw, 24), BF16)

    def fwd_and_bwd(x, ct):
        y, saved = mp._max_pool_fwd(static, x)
        return y, saved[1], mp._max_pool_bwd(static, saved, ct)[0]
    y, idx, dx = fast_run(fwd_and_bwd, x, ct)
    want_y, want_vjp = jax.vjp(lambda x: F.max_pool2d(x, 3, stride=2, padding=1, ceil_mode=True,
                                                      impl="xla"), x.astype(jnp.float32))
    (want_dx,) = want_vjp(ct.astype(jnp.float32))
    assert y.dtype == BF16 and dx.dtype == BF16
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want_y))
    assert_16bit_close(dx, want_dx, BF16, "max_pool2d dx")
    assert idx.dtype == jnp.int16
    # numpy: the taps of every window (row-major), -inf outside the input; first argmax.
    xp = np.pad(np.asarray(x, np.float32), ((0, 0), *run_pads, (0, 0)), constant_values=-np.inf)
    taps = np.stack([xp[:, i:i + 2 * out_hw[0]:2, j:j + 2 * out_hw[1]:2]
                     for i in range(3) for j in range(3)])
    np.testing.assert_array_equal(np.asarray(idx), np.argmax(taps, axis=0))


AVG_CASES = [
    ("3x3/2 pad 1 ceil, pad not counted", (1, 7, 9, 16), dict(
        kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False,
        config=mw.WindowConfig(block_c=8, stages=2)), BF16),
    ("3x3/2 pad 1 ceil, pad counted", (1, 7, 9, 16), dict(
        kernel_size=3, stride=2, padding=1, ceil_mode=True), BF16),
    ("2x2/2 float16, odd sizes", (2, 7, 5, 8), dict(kernel_size=2), F16),
    # even sizes: the phases are a free view; channels 16 + 8 (the tail reads the next
    # phase's channels, never stored)
    ("2x2/2 phase view, channel tail", (1, 6, 8, 24), dict(
        kernel_size=2, config=mw.WindowConfig(block_c=16)), BF16),
]


@needs_mgpu
@pytest.mark.parametrize("name, shape, kw, dtype", AVG_CASES, ids=[c[0] for c in AVG_CASES])
def test_avg_pool_matches_xla(name, shape, kw, dtype):
    _check("avg_pool2d", normal(np.random.default_rng(3), shape, dtype), kw)


def test_unpadded_strided_phases_are_a_free_view():
    x = jnp.zeros((2, 6, 8, 24), BF16)
    jaxpr = str(jax.make_jaxpr(lambda x: mw.phases(x, ((0, 0), (0, 0)), (2, 2), 0))(x))
    assert "transpose" not in jaxpr and "pad" not in jaxpr
    assert mw.phases(x, ((0, 0), (0, 0)), (2, 2), 0).shape == (2, 3, 2, 4, 48)
    assert mw.phases(x, ((1, 0), (0, 0)), (2, 2), 0).shape == (8, 4, 4, 24)  # padded: a copy


@needs_mgpu
def test_avg_pool_stride_1_same_padding_is_race_free(races):
    kw = dict(kernel_size=3, stride=1, padding="SAME", count_include_pad=False)
    _check("avg_pool2d", normal(np.random.default_rng(4), (1, 5, 6, 8), BF16), kw, races=races)


@needs_mgpu
@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d"])
def test_xla_backward_option_is_xlas_own_gradient(op):
    """backward="xla": the kernel's forward, then exactly the gradient of the XLA op (in
    the input's dtype, as XLA computes it)."""
    x = _ties((1, 6, 6, 8), BF16) if op == "max_pool2d" else normal(
        np.random.default_rng(5), (1, 6, 6, 8), BF16)
    kw = dict(kernel_size=3, stride=2, padding=1)
    y, vjp = jax.vjp(lambda x: getattr(mp, op)(x, **kw, backward="xla", interpret=True), x)
    ct = normal(np.random.default_rng(6), y.shape, BF16)
    want_y, want_vjp = jax.vjp(lambda x: getattr(F, op)(x, **kw, impl="xla"), x)
    assert_16bit_close(y, want_y.astype(jnp.float32), BF16, "output")
    np.testing.assert_array_equal(np.asarray(vjp(ct)[0], np.float32),
                                  np.asarray(want_vjp(ct)[0], np.float32))
    with pytest.raises(ValueError, match="backward must be one of"):
        getattr(mp, op)(x, 2, backward="pallas")


@needs_mgpu
@pytest.mark.parametrize("shape, dtype, kw, match", [
    ((1, 8, 8, 3), BF16, {}, "C=3 is not a multiple of 8"),
    ((1, 8, 8, 8), jnp.float32, {}, "dtype float32 unsupported"),
    ((1, 12, 12, 8), BF16, {"stride": 5}, "stride"),
])
def test_unsupported_calls_raise_one_clear_line(shape, dtype, kw, match):
    for op in (mp.max_pool2d, mp.avg_pool2d):
        with pytest.raises(KernelUnsupported, match=match) as e:
            op(jnp.zeros(shape, dtype), 2, interpret=True, **kw)
        assert "\n" not in str(e.value)


# --- dispatch from pallas_kernels.max_pool2d / avg_pool2d ----------------------------------

def _jaxpr(fn, x):
    return str(jax.make_jaxpr(fn)(x))


@needs_mgpu
def test_pallas_pool_backend_mosaic_runs_the_mosaic_kernels():
    x = _ties((1, 6, 6, 8), BF16)
    y = pk.max_pool2d(x, 3, stride=2, padding=1, backend="mosaic", interpret=True)
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(F.max_pool2d(x, 3, stride=2, padding=1, impl="xla"),
                                             np.float32))
    for op, name in ((pk.max_pool2d, "max"), (pk.avg_pool2d, "avg")):
        grad = _jaxpr(jax.grad(lambda x: jnp.sum(op(x, 2, backend="mosaic", interpret=True)
                                                 .astype(jnp.float32))), x)
        assert f"jaxcnn_mgpu_{name}_pool_fwd" in grad and f"jaxcnn_mgpu_{name}_pool_bwd" in grad
        # backward="xla" keeps the Mosaic forward and takes XLA's gradient
        grad = _jaxpr(jax.grad(lambda x: jnp.sum(op(x, 2, backend="mosaic", backward="xla",
                                                    interpret=True).astype(jnp.float32))), x)
        assert f"jaxcnn_mgpu_{name}_pool_bwd" not in grad


def test_interpret_mode_and_other_gpus_keep_the_triton_kernels():
    x = jnp.zeros((1, 6, 6, 8), BF16)
    for op in (pk.max_pool2d, pk.avg_pool2d):
        jaxpr = _jaxpr(lambda x: op(x, 2, interpret=True), x)  # backend=None
        assert "pallas_call" in jaxpr and "jaxcnn_mgpu" not in jaxpr
        with pytest.raises(ValueError, match="WindowConfig, but this call runs the Triton"):
            op(x, 2, backend="triton", config=mw.WindowConfig(), interpret=True)
        with pytest.raises(ValueError, match="backend must be one of"):
            op(x, 2, backend="cuda")


@needs_mgpu
def test_backend_mosaic_refuses_what_it_cannot_run_in_one_line():
    with pytest.raises(KernelUnsupported, match="C=3 is not a multiple of 8") as e:
        pk.max_pool2d(jnp.zeros((1, 6, 6, 3), BF16), 2, backend="mosaic", interpret=True)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="config must be a WindowConfig"):
        pk.avg_pool2d(jnp.zeros((1, 6, 6, 8), BF16), 2, backend="mosaic",
                      config=pk.BlockConfig(), interpret=True)


@pytest.mark.parametrize("change, want", [
    ({}, "mosaic"),
    ({"dtype": F16}, "mosaic"),
    ({"device_kind": "NVIDIA A100-SXM4-80GB"}, "triton"),
    ({"interpret": True}, "triton"),
    ({"dtype": jnp.float32}, "triton"),
    ({"x_shape": (8, 56, 56, 3)}, "triton"),
    ({"stride": (5, 5)}, "triton"),
    ({"config": pk.BlockConfig()}, "triton"),
    ({"config": mw.WindowConfig(block_c=32)}, "mosaic"),
])
def test_select_backend_is_a_lookup_by_device_kind_and_shape(change, want):
    if want == "mosaic" and REASON is not None:
        want = "triton"  # jax < 0.11: the library falls back
    args = dict(x_shape=(8, 56, 56, 64), dtype=BF16, kernel=(3, 3), stride=(2, 2), config=None,
                interpret=False, device_kind=H100)
    args.update(change)
    assert mp.select_backend(**args) == want


@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d"])
def test_auto_needs_a_measurement_of_the_mosaic_kernel(monkeypatch, op):
    """impl="auto" on a GPU takes a pooling kernel only where a verdict says so, and a
    verdict measured on the Triton kernel pins backend="triton"."""
    x = jnp.zeros((1, 8, 8, 16), BF16)
    static = dict(kernel_size=(3, 3), stride=(2, 2), padding=((1, 1), (1, 1)))
    check_auto_needs_a_mosaic_verdict(monkeypatch, op, (x,), static)


# --- offline lowering for sm_90a (no GPU) -------------------------------------------------

@needs_mgpu
@pytest.mark.parametrize("op, kw", [
    ("max_pool2d", dict(kernel_size=3, stride=2, padding=1)),
    ("avg_pool2d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True,
                        count_include_pad=False)),
    ("avg_pool2d", dict(kernel_size=2)),
], ids=["max 3x3/2", "avg 3x3/2", "avg 2x2/2 (phase view)"])
def test_pool_kernels_lower_for_hopper_with_tma(op, kw):
    reports = lower_with_grads(lambda x: getattr(mp, op)(x, **kw),
                               jax.ShapeDtypeStruct((8, 56, 56, 64), BF16))
    name = op.replace("_pool2d", "")
    # the backward is one launch per stride phase of the input (2 x 2)
    assert sorted(r.name for r in reports) == (
        [f"jaxcnn_mgpu_{name}_pool_bwd"] * 4 + [f"jaxcnn_mgpu_{name}_pool_fwd"])
    assert_tma_pipeline(reports)
    assert not any(r.wgmma for r in reports), "wgmma in a pooling kernel"


@needs_mgpu
@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d"])
def test_narrow_small_channel_pools_lower_for_hopper(op):
    """24 channels at 3x3/2 on 14x14 (7 output columns): 4-pixel tile rows would be 192-byte
    TMA copies, which Mosaic refuses (a multiple of 128 bytes only); they widen to 8."""
    reports = lower_with_grads(lambda x: getattr(mp, op)(x, 3, stride=2, padding=1),
                               jax.ShapeDtypeStruct((2, 14, 14, 24), BF16))
    name = op.replace("_pool2d", "")
    assert sorted(r.name for r in reports) == (
        [f"jaxcnn_mgpu_{name}_pool_bwd"] * 4 + [f"jaxcnn_mgpu_{name}_pool_fwd"])
    assert_tma_pipeline(reports)


@needs_mgpu
def test_inspect_kernels_reports_the_pool_kernels(capsys):
    """scripts/inspect_kernels.py --mosaic lists the window kernels of the pool shapes."""
    assert inspect_kernels().main(["--mosaic", "--groups", "pool", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "jaxcnn_mgpu_max_pool" in line]
    # "maxpool 3x3/2" kernel tmaLoad tmaStore mbarrier ...
    assert [r[2] for r in rows] == ["jaxcnn_mgpu_max_pool_fwd"] + ["jaxcnn_mgpu_max_pool_bwd"] * 4
    assert all(r[3:6] == ["yes", "yes", "yes"] for r in rows), out  # TMA load, store, mbarrier
