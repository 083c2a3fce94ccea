"""Helpers shared by the Mosaic GPU (Hopper) kernel tests, which run in GPU interpret mode.

Tolerances: a 16-bit result rounded once after float32 accumulation is within half a
step of its type (bfloat16: 2**-8 relative, float16: 2**-11) of the float32 reference,
plus float32 summation-order noise (1e-4 of the largest value).
"""
import importlib.util
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc

REASON = mc.unavailable_reason()
needs_mgpu = pytest.mark.skipif(REASON is not None, reason=f"Mosaic GPU: {REASON}")
DIMS = ("NHWC", "HWIO", "NHWC")
HALF_STEP = {jnp.dtype(jnp.bfloat16): 2.0 ** -8, jnp.dtype(jnp.float16): 2.0 ** -11}
H100 = "NVIDIA H100 80GB HBM3"
S = jax.ShapeDtypeStruct


def ref_conv(x, w, pads, dilation=(1, 1), stride=(1, 1)):
    """``jax.lax`` convolution in float32 (HIGHEST precision) of the given values."""
    return lax.conv_general_dilated(x.astype(jnp.float32), w.astype(jnp.float32), stride,
                                    pads, rhs_dilation=dilation, dimension_numbers=DIMS,
                                    precision=lax.Precision.HIGHEST)


def normal(rng, shape, dtype):
    """Standard-normal values in float32 rounded to ``dtype`` on the host: ml_dtypes rounds to
    nearest even, as XLA's convert does (the same bits), without an eager conversion
    compiled per shape."""
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32).astype(jnp.dtype(dtype)))


def assert_16bit_close(got, want, dtype, what):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite elements"
    tol = HALF_STEP[jnp.dtype(dtype)] * np.abs(want) + 1e-4 * np.abs(want).max()
    bad = np.abs(got - want) > tol
    assert not bad.any(), (f"{what}: {bad.sum()} elements off, worst "
                           f"{np.abs(got - want).max():.3g} (max |ref| {np.abs(want).max():.3g})")


def assert_f32_close(got, want, what, rtol=1e-4):
    """Within ``rtol`` of the largest reference value (float32 summation-order noise)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite elements"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


@pytest.fixture
def races():
    """Runs a case under the race detector and fails it if a race was found."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
    ipc.reset_gpu_interpret_mode_state()
    yield True
    found = ipc.get_races().races_found
    ipc.reset_gpu_interpret_mode_state()
    assert not found, "the interpreter's race detector found a data race"


def inspect_kernels():
    """``scripts/inspect_kernels.py`` as a module (its offline-lowering reports)."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "inspect_kernels.py")
    spec = importlib.util.spec_from_file_location("inspect_kernels", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("inspect_kernels", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return sys.modules["inspect_kernels"]


def lower_with_grads(fn, *args) -> list:
    """The ``MosaicReport`` of every Mosaic kernel ``fn`` and its gradient launch, lowered
    offline for an abstract H100 (``scripts/inspect_kernels.py``): ``fn``'s output and its
    VJP at that output, so the forward is lowered as well as the backward."""
    def fwd_and_grads(*a):
        y, vjp = jax.vjp(fn, *a)
        return y, vjp(y)
    return inspect_kernels().inspect_mosaic(fwd_and_grads, *args)


def assert_tma_pipeline(reports, what: str = "") -> None:
    """Each lowered kernel moves its tiles with TMA (``cp.async.bulk.tensor`` loads and
    stores), loads nothing with the non-tensor bulk copy (which has no zero fill past a
    row: the kernels' padding is the tensor TMA's) and waits on mbarriers."""
    assert reports, f"{what}: no Mosaic kernel lowered"
    for r in reports:
        where = f"{r.name}{what and f' ({what})'}"
        assert r.tma_load, f"{where}: no TMA load (cp.async.bulk.tensor)"
        assert not r.bulk_load, f"{where}: a non-tensor bulk load (cp.async.bulk, no zero fill)"
        assert r.tma_store, f"{where}: no TMA store"
        assert r.mbarrier, f"{where}: no mbarrier wait"


def check_auto_needs_a_mosaic_verdict(monkeypatch, op, arrays, static) -> None:
    """``impl="auto"`` on a GPU (mocked) takes a kernel for ``op(*arrays, **static)`` only
    where a verdict says so, and a verdict measured on the Triton kernel pins
    ``backend="triton"``: the Mosaic kernels are chosen only by an entry keyed with
    ``backend="mosaic"``."""
    from jaxcnn.functional import _dispatch
    from pallas_kernels import autotune
    chosen = []
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(_dispatch, "_kernel", lambda op, st: chosen.append(st) or "kernel")
    for measured in ("triton", "mosaic"):
        def verdict(op, arrays, st, measured=measured):
            return (True, True) if st.get("backend", "triton") == measured else None
        monkeypatch.setattr(autotune, "verdict", verdict)
        chosen.clear()
        assert _dispatch.choose(op, "auto", arrays, static) == "kernel"
        assert chosen[-1]["backend"] == measured
    monkeypatch.setattr(autotune, "verdict", lambda *a: None)
    assert _dispatch.choose(op, "auto", arrays, static) is None


# --- the tuners' cache round trip: tuned.json -> the op ---------------------------------------

@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """An empty user cache and a temporary ``tuned.json``; ``write(kind, {key: entry})``
    fills the latter for a device kind."""
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "user.json"))
    path = tmp_path / "tuned.json"
    monkeypatch.setattr(autotune, "SHIPPED", str(path))

    def write(kind, kernels):
        path.write_text(json.dumps({"version": 1, "devices": {
            kind: {"kernels": kernels, "ops": {}}}}))
        autotune._memo.clear()  # the merged entries are memoised per (cache, device kind)
    yield write
    autotune._memo.clear()


def seen_configs(monkeypatch, module, fn_name, slot):
    """The ``static[slot]`` (the tiles) of every call of ``module.fn_name`` from now on; the
    call itself does nothing."""
    seen = []
    monkeypatch.setattr(module, fn_name, lambda static, *a: seen.append(static[slot]))
    return seen


def fake_tuning_clock(monkeypatch, tmp_path):
    """A user cache in ``tmp_path`` and ``(timer, timed)`` for ``autotune.tune_op(timer=...)``:
    the race of the op against XLA reads 1 s, 2 s (the kernel wins), then the same for their
    gradients; a compiled candidate takes ``1 / stages`` s (more slots, faster), and its
    config (the kernel being tuned, the last override) is appended to ``timed``."""
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setenv("JAXCNN_AUTOTUNE_COMPILE_THREADS", "1")
    timed, race = [], iter([1.0, 2.0, 1.0, 2.0])

    def timer(fn, *args):
        if not isinstance(fn, jax.stages.Compiled):
            return next(race)
        cfg = list(autotune._overrides.values())[-1]
        timed.append(cfg)
        return 1.0 / cfg.stages

    return timer, timed



def compile_no_candidates(monkeypatch) -> None:
    """The tuner compiles no candidate (each config paired with no program): for a fake clock
    that times nothing.  That tune_op compiles and times real candidates is the
    ``test_tune_op_times_*`` tests' point."""
    monkeypatch.setattr(autotune, "_compile_candidates",
                        lambda kernel, key, cfgs, *a: [(cfg, None) for cfg in cfgs])

# --- which tile candidates the default suite lowers --------------------------------------------

def cover(candidates) -> list:
    """A representative sample of a kernel's tile candidates (dataclass configs, the
    default's first), in their order: every one with ``JAXCNN_TEST_ALL_EXAMPLES=1`` (the long
    run, ``tests/sweep.py``); else the first (the default tiles, which the GPU check's and
    ``tuned.json``'s untuned launches run), the last (the largest tiles: most pipeline slots,
    the widest channel tile, warp specialisation where the grid has it), then, in order, each
    candidate that brings a value of some field (tile row, channel tiles, slots, split, warp
    specialisation) that none before it had: every value of every tile field is lowered at
    least once, so every branch the tiles select (swizzle widths, pipeline depths, the
    warp-specialised producer, the split reduction) is compiled."""
    candidates = list(candidates)
    picked = ends(candidates)
    if len(picked) == len(candidates):
        return picked
    seen = field_values(picked)
    for c in candidates[1:-1]:
        values = field_values([c])
        if not values <= seen:
            picked.insert(-1, c)
            seen |= values
    return picked


def ends(candidates) -> list:
    """The default (first) and the largest (last) tiles; every candidate in the long run."""
    from sweep import all_examples
    candidates = list(candidates)
    return candidates if all_examples() or len(candidates) <= 2 else [candidates[0], candidates[-1]]


def field_values(configs) -> set:
    """``{(field, value)}`` of every tile config in ``configs``."""
    import dataclasses
    return {(f.name, getattr(c, f.name)) for c in configs for f in dataclasses.fields(c)}
