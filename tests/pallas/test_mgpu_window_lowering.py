"""Every tile configuration the tuner can choose for the Mosaic GPU window kernels lowers for
an H100 (sm_90a, offline: no GPU, no interpretation) into a kernel that moves its windows
with TMA.

For a few representative shapes (a 3x3 max pool, a 2x2/2 average pool read through the
free phase view with 256 channels, a 3x3 depthwise convolution), every candidate of every
kernel (pooling forward and backward; depthwise forward, input and weight gradient) within
an H100's shared memory (outside the long run, ``tests/sweep.py``, a sample of them,
``mgpu_testlib.cover``: the default tiles, the largest, and each candidate bringing a value
of a tile field none before it had, so every tile row, channel tile, slot count and split;
for the two 24-channel shapes, whose point is the widened rows, the default and the
largest tiles) is lowered by ``scripts/inspect_kernels.py``'s
``window_candidates`` with only what its kernel needs, and each launched kernel's module
must hold TMA loads and stores (``cp.async.bulk.tensor``) and an mbarrier wait.  The
shared memory the tuner counts for a configuration is checked against Mosaic's own count,
which refuses configurations over the limit.  Needs jax >= 0.11; skips otherwise.
"""
import re

import jax
import jax.numpy as jnp
import pytest

from mgpu_testlib import (H100, assert_tma_pipeline, cover, ends, field_values,
                          inspect_kernels, needs_mgpu)
from pallas_kernels import autotune
from pallas_kernels import mgpu_window as mw

BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct
H100_SMEM = 227 * 1024

SHAPES = [  # op, kwargs, abstract operands
    ("max_pool2d", dict(kernel_size=3, stride=1, padding=1), (S((2, 6, 10, 64), BF16),)),
    ("avg_pool2d", dict(kernel_size=2), (S((2, 8, 8, 256), BF16),)),
    ("conv2d", dict(stride=1, padding=1, groups=64),
     (S((2, 6, 10, 64), BF16), S((3, 3, 1, 64), BF16))),
    # 24 channels on 4 output columns: tile rows widened to whole 128-byte TMA copies, filter
    # tables padded (Mosaic refused the 192-byte rows and 864-byte tables these had)
    ("max_pool2d", dict(kernel_size=3, stride=2, padding=1), (S((1, 7, 7, 24), BF16),)),
    ("conv2d", dict(stride=2, padding=1, groups=24),
     (S((1, 7, 7, 24), BF16), S((3, 3, 1, 24), BF16))),
]
KERNELS = {"max_pool2d": ["mgpu_max_pool_bwd", "mgpu_max_pool_fwd"],
           "avg_pool2d": ["mgpu_avg_pool_bwd", "mgpu_avg_pool_fwd"],
           "conv2d": ["mgpu_depthwise_dgrad", "mgpu_depthwise_fwd", "mgpu_depthwise_wgrad"]}


def _launches(ik, op, kw, args):
    """``{kernel: WindowCall}`` of the window kernels the op (and its gradient) looks up."""
    with autotune._recording() as launched:
        jax.eval_shape(ik.mosaic_window_call(op, kw), *args)
    return {kernel: call for kernel, call, _, _ in launched.values()}


@needs_mgpu
@pytest.mark.parametrize("op, kw, args", SHAPES,
                         ids=[f"{s[0]} C={s[2][0].shape[3]}" for s in SHAPES])
def test_every_candidate_lowers_for_hopper_with_tma(op, kw, args):
    ik = inspect_kernels()
    calls = _launches(ik, op, kw, args)
    assert sorted(calls) == KERNELS[op]
    narrow = args[0].shape[3] == 24
    pick = ends if narrow else cover
    found = ik.window_candidates(op, kw, args, kind=H100, pick=pick)
    for kernel, call in calls.items():
        want = call.candidates(H100_SMEM)
        assert len(want) > 1
        lowered = [cfg for k, cfg, _ in found if k == kernel]
        assert set(lowered) == set(pick(want)), f"{kernel}: candidates not lowered"
        assert want[0] in lowered and want[-1] in lowered, kernel
        if not narrow:
            assert field_values(lowered) == field_values(want), f"{kernel}: a tile value not lowered"
    for kernel, cfg, r in found:
        assert_tma_pipeline([r], str(cfg))
        assert not r.wgmma, f"{r.name} with {cfg}: wgmma in a window kernel"
    # The max pool's forward tiles serve its forward with and without the tap index.
    if op == "max_pool2d":
        names = {r.name for k, _, r in found if k == "mgpu_max_pool_fwd"}
        assert names == {"jaxcnn_mgpu_max_pool_fwd", "jaxcnn_mgpu_max_pool_infer"}


@needs_mgpu
@pytest.mark.parametrize("op", ["max_pool2d", "avg_pool2d", "conv2d"])
def test_shared_memory_count_is_mosaics(op):
    """Past the limit Mosaic refuses a kernel, naming the bytes its scratch needs: the
    tuner's count for that configuration, exactly (the depthwise forward with a bias row),
    for every kernel."""
    from pallas_kernels import mgpu_depthwise as md
    from pallas_kernels import mgpu_pool as mp
    ik = inspect_kernels()
    x = S((1, 6, 10, 256), BF16)
    if op == "conv2d":
        args = (x, S((3, 3, 1, 256), BF16), S((256,), BF16))

        def run(x, w, b):
            return md.conv2d(x, w, b, padding=((1, 1), (1, 1)))
    else:
        args = (x,)

        def run(x):
            return getattr(mp, op)(x, 3, stride=1, padding=1)

    def grads(*a):  # forward and backward: each kernel's scratch checked in turn
        y, vjp = jax.vjp(run, *a)
        return vjp(y)

    with autotune._recording() as launched:
        jax.eval_shape(grads, *args)
    calls = {kernel: call for kernel, call, _, _ in launched.values()}
    assert len(calls) == (3 if op == "conv2d" else 2)
    for kernel, call in calls.items():
        cfg = mw.WindowConfig(block_c=256, stages=16, split=2 if kernel.endswith("wgrad") else 1)
        need = call.smem_bytes(cfg)
        assert need > H100_SMEM
        with autotune.override({call.key: cfg}), pytest.raises(ValueError) as e:
            ik.inspect_mosaic(grads, *args)
        got = re.search(r"smem_bytes=(\d+)", str(e.value))
        assert got and int(got.group(1)) == need, f"{kernel}: {e.value}"


@needs_mgpu
def test_inspect_kernels_reports_each_candidate_per_kernel(capsys, monkeypatch):
    """scripts/inspect_kernels.py --mosaic --candidates: a row per kernel and candidate (two
    candidates a kernel here, for time), each naming its tiles."""
    ik = inspect_kernels()
    every = mw.WindowCall.candidates
    monkeypatch.setattr(mw.WindowCall, "candidates",
                        lambda self, limit=None: every(self, limit)[:2])
    assert ik.main(["--mosaic", "--candidates", "--groups", "pool", "--batch", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()
            if "jaxcnn_mgpu_max_pool" in line]
    # "maxpool 3x3/2" kernel tmaLoad tmaStore mbarrier ldmatrix stmatrix setmaxnreg wgmma cfg
    kernels = sorted((r[2], r[-1]) for r in rows)
    fwd = sorted({r[-1] for r in rows if r[2] == "jaxcnn_mgpu_max_pool_fwd"})
    assert len(fwd) == 2 and all(re.fullmatch(r"w\d+c\d+s\d+", t) for t in fwd)
    assert kernels.count(("jaxcnn_mgpu_max_pool_infer", fwd[0])) == 1
    assert len([k for k in kernels if k[0] == "jaxcnn_mgpu_max_pool_bwd"]) == 2 * 4  # phases
    assert all(r[3:6] == ["yes", "yes", "yes"] for r in rows)
