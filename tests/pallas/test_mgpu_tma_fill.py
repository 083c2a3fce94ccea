"""The Mosaic GPU kernels ask for TMA's zero fill explicitly, and get it in the lowered kernel.

The kernels' bottom/right padding, channel tails and tile rows past the output are reads
outside the global array that must come back as zeros.  jax makes no promise about the
default out-of-bounds mode of ``plgpu.copy_gmem_to_smem`` (ZEROS on 0.11 and 0.12), so
every copy passes ``oob_mode=OOBFillMode.ZEROS`` (``mgpu_conv.tma_load``).  Checked on the
traced kernels (each copy's ``oob_mode`` parameter: explicit, never the default ``None``)
and on the lowered ones: every load is the tensor TMA, whose out-of-bounds elements are
zeros, never the non-tensor bulk copy Mosaic may use for a contiguous window under the other
modes, which is bounded by the end of the whole array only.  Needs jax >= 0.11.
"""
import jax
import jax.numpy as jnp
import pytest
from jax.extend import core as jex

from mgpu_testlib import assert_tma_pipeline, inspect_kernels, needs_mgpu
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_depthwise as md
from pallas_kernels import mgpu_fused as mf
from pallas_kernels import mgpu_pool as mp

S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
X = S((2, 9, 10, 64), BF16)
SS = S((64,), jnp.float32)
PAD = ((1, 1), (1, 1))
# One call per kernel family, forward and gradients: the padded, strided dense convolution
# with its bias and residual epilogue; the BatchNorm-fused one (prologue and statistics);
# max and average pooling; the depthwise convolution.
FAMILIES = {
    "dense": (lambda x, w, b, r: mc.conv2d(x, w, b, stride=(2, 2), padding=PAD, residual=r),
              (X, S((3, 3, 64, 32), BF16), S((32,), BF16), S((2, 5, 5, 32), BF16))),
    "fused": (lambda x, w, s, t: mf.conv2d(x, w, padding=PAD, input_scale=s, input_shift=t,
                                           stats=True),
              (X, S((3, 3, 64, 32), BF16), SS, SS)),
    "max_pool": (lambda x: mp.max_pool2d(x, 3, stride=2, padding=1), (X,)),
    "avg_pool": (lambda x: mp.avg_pool2d(x, 3, stride=1, padding=1), (X,)),
    "depthwise": (lambda x, w: md.conv2d(x, w, padding=PAD), (X, S((3, 3, 1, 64), BF16))),
}


def _with_grads(fn):
    """``fn``'s output and its VJP at that output: every forward and gradient kernel live."""
    def run(*args):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(y)
    return run


def _oob_modes(jaxpr, found):
    """Appends the ``oob_mode`` of every ``copy_gmem_to_smem`` in ``jaxpr`` and the jaxprs
    nested in its equations (kernel bodies, scopes, loops, branches) to ``found``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "copy_gmem_to_smem":
            found.append(eqn.params["oob_mode"])
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex.ClosedJaxpr):
                    _oob_modes(sub.jaxpr, found)
                elif isinstance(sub, jex.Jaxpr):
                    _oob_modes(sub, found)
    return found


@needs_mgpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_tma_load_asks_for_zero_fill(family):
    from jax.experimental.pallas import mosaic_gpu as plgpu
    fn, args = FAMILIES[family]
    modes = _oob_modes(jax.make_jaxpr(_with_grads(fn))(*args).jaxpr, [])
    assert modes, f"{family}: no TMA load traced"
    assert set(modes) == {plgpu.OOBFillMode.ZEROS}, f"{family}: out-of-bounds modes {set(modes)}"


@needs_mgpu
def test_zero_fill_keeps_contiguous_windows_on_the_tensor_tma(monkeypatch):
    """A 64-channel average pool reads each tile row as one contiguous window: lowered with
    the zero fill, by the tensor TMA; with ``OOBFillMode.UNDEFINED`` instead, by the bulk
    copy, which the report tells apart (the check in ``assert_tma_pipeline`` is live)."""
    ik = inspect_kernels()
    fn, args = FAMILIES["avg_pool"]
    assert_tma_pipeline(ik.inspect_mosaic(fn, *args), "zero fill")

    def undefined_fill(plgpu, src, dst, barrier):
        plgpu.copy_gmem_to_smem(src, dst, barrier, oob_mode=plgpu.OOBFillMode.UNDEFINED)

    monkeypatch.setattr(mc, "tma_load", undefined_fill)
    (r,) = ik.inspect_mosaic(fn, *args)
    assert r.bulk_load and not r.tma_load, r
