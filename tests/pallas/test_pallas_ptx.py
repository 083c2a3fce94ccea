"""The kernels compile to the machine code a fast GPU kernel needs, checked without a GPU.

``scripts/inspect_kernels.py`` lowers each kernel for an abstract H100 and
compiles its Triton IR offline for ``sm_90a`` with the ``triton`` package.
These tests hold the properties the interpreter cannot see: global loads of
the channel-contiguous operands are vectorised (never scalar), the
implicit-GEMM operands are staged through ``cp.async`` and multiplied on
Hopper's ``wgmma`` tensor cores, nothing spills, and the forward-only max-pool
writes no index.  A kernel that regressed to scalar loads (as every kernel did
before the gather stopped rewriting masked indices) fails here.

They need ``triton`` (installed in CI's jax 0.11.2 environment, the lent
GPUs' versions) and skip, saying why, where it or the jax hook is missing.
"""
import importlib.util
import os
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax import lax
import pytest

import pallas_kernels as pk
from sweep import all_examples, sample

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "inspect_kernels.py")
_spec = importlib.util.spec_from_file_location("inspect_kernels", _PATH)
ik = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("inspect_kernels", ik)  # its dataclass looks its module up
_spec.loader.exec_module(ik)

try:
    ik._triton()
    ik._lowering_module()
except ik.Unavailable as _e:
    pytestmark = pytest.mark.skip(reason=str(_e))

S = jax.ShapeDtypeStruct
GPU = dict(interpret=False)
GEMM = pk.BlockConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3)
TILE = pk.BlockConfig(block_m=64, block_n=64, block_k=16, num_warps=4, num_stages=2)


def _grad(fn, argnums):
    return jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32)), argnums=argnums)


def _by_name(reports):
    return {r.name: r for r in reports}


def _assert_no_spills(r):
    assert r.spill_bytes in (0, None), f"{r.name}: {r.spill_bytes} bytes spilled"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_dense_conv_kernels_pipeline_onto_tensor_cores(dtype):
    # float32 at DEFAULT precision runs as TF32 on the tensor cores (the suite's
    # conftest makes HIGHEST the default, which Triton runs on the FMA units).
    def fn(x, w):
        return pk.conv2d(x, w, padding=1, config=GEMM, precision=lax.Precision.DEFAULT, **GPU)
    args = (S((2, 12, 12, 64), dtype), S((3, 3, 64, 64), dtype))
    reports = _by_name(ik.inspect(_grad(fn, (0, 1)), *args) + ik.inspect(fn, *args))
    assert set(reports) == {"jaxcnn_conv_fwd", "jaxcnn_conv_dgrad", "jaxcnn_conv_wgrad"}
    for r in reports.values():
        assert r.ld_scalar == 0, f"{r.name}: {r.ld_scalar} scalar global loads"
        assert r.cp_async > 0, f"{r.name}: operands not pipelined through cp.async"
        # TF32 (float32) tensor-core operands must be contiguous along the reduction:
        # the forward transposes its weights for that, but the weight gradient reduces
        # over pixels, and NHWC activations are contiguous along channels, so Triton
        # copies its float32 operands a word at a time.
        if dtype == jnp.bfloat16 or r.name != "jaxcnn_conv_wgrad":
            assert r.cp_async_narrow == 0, f"{r.name}: {r.cp_async_narrow} sub-16-byte copies"
        assert r.wgmma + r.mma_sync > 0, f"{r.name}: no tensor-core instruction"
        assert r.st_scalar == 0, f"{r.name}: scalar stores"
        _assert_no_spills(r)
    # The forward and input gradient are plain NHWC x HWIO products: Hopper's wgmma.
    assert reports["jaxcnn_conv_fwd"].wgmma > 0 and reports["jaxcnn_conv_dgrad"].wgmma > 0


def test_strided_input_gradient_keeps_pipelined_tensor_core_loads_and_vector_stores():
    """The stride-2 input gradient runs per phase and scatters its rows: its operands must
    still be staged by cp.async into wgmma, and its stores stay 16-byte vectors."""
    def fn(x, w):
        return pk.conv2d(x, w, padding=1, stride=2, config=GEMM, **GPU)
    args = (S((2, 12, 12, 64), jnp.bfloat16), S((3, 3, 64, 64), jnp.bfloat16))
    (r,) = [r for r in ik.inspect(_grad(fn, (0,)), *args) if r.name == "jaxcnn_conv_dgrad"]
    assert r.ld_scalar == 0 and r.cp_async > 0 and r.cp_async_narrow == 0 and r.wgmma > 0
    assert r.st_vector > 0 and r.st_scalar == 0
    _assert_no_spills(r)


def test_fused_bn_relu_conv_keeps_vector_loads():
    def fn(x, w, s, t):
        return pk.conv2d(x, w, padding=1, input_scale=s, input_shift=t, relu=True,
                         residual=None, config=GEMM, **GPU)
    args = (S((2, 12, 12, 64), jnp.bfloat16), S((3, 3, 64, 64), jnp.bfloat16),
            S((64,), jnp.float32), S((64,), jnp.float32))
    (r,) = ik.inspect(fn, *args)
    assert r.ld_scalar == 0 and r.cp_async > 0 and r.cp_async_narrow == 0 and r.wgmma > 0
    _assert_no_spills(r)


def test_depthwise_kernels_load_vectors():
    def fn(x, w):
        return pk.conv2d(x, w, padding=1, groups=64, config=TILE, **GPU)
    args = (S((2, 12, 12, 64), jnp.bfloat16), S((3, 3, 1, 64), jnp.bfloat16))
    reports = _by_name(ik.inspect(_grad(fn, (0, 1)), *args) + ik.inspect(fn, *args))
    assert set(reports) == {"jaxcnn_depthwise_fwd", "jaxcnn_depthwise_dgrad",
                            "jaxcnn_depthwise_wgrad"}
    for r in reports.values():
        assert r.ld_scalar == 0 and r.ld_vector > 0, (r.name, r.ld_scalar, r.ld_vector)
        _assert_no_spills(r)


@pytest.mark.parametrize("k, stride, hw, c", [(3, 2, 112, 96), (7, 1, 28, 96)])
def test_depthwise_weight_gradient_candidates_do_not_spill(k, stride, hw, c, monkeypatch):
    """The weight gradient keeps a loaded tile per tap live at once: the tuner leaves out
    tiles that would spill (256x64 on 8 warps did, 56-136 bytes, on MobileNet's 3x3
    layers), and a 7x7 filter is split into programs of one row of taps (all 49 in one
    program spilled 544-3424 bytes on every candidate).  Each candidate is a Triton
    compilation, so the default run compiles those at the tuner's bound, 32 values of a
    tile per thread (those using the most registers: 128-185 a thread, where the smaller
    32x32 and 64x32 tiles use 96-128 with the same code), and of those every other one
    (the first and the last among them); the long run (``tests/sweep.py``) compiles every
    candidate.  Only the weight gradient's kernel is compiled for each candidate."""
    from pallas_kernels import autotune
    every = autotune.candidates

    def at_the_bound(*a):
        found = every(*a)
        return found if all_examples() else sample(
            [c for c in found if c.block_m * c.block_n == 32 * 32 * c.num_warps])
    monkeypatch.setattr(autotune, "candidates", at_the_bound)
    compiled, report = [], ik.report
    monkeypatch.setattr(ik, "report", lambda name, *a, **kw: compiled.append(name) or report(
        name, *a, **kw))

    def fn(x, w):
        # (pinned: on an H100, a bfloat16 depthwise call takes the Mosaic kernels by default)
        return pk.conv2d(x, w, stride=stride, padding=k // 2, groups=c, backend="triton", **GPU)
    # Batch 256 (abstract: nothing allocated), as in the benchmarks.
    args = (S((256, hw, hw, c), jnp.bfloat16), S((k, k, 1, c), jnp.bfloat16))
    found = [(r, cfg) for r, cfg in ik._candidates(_grad(fn, (1,)), args, "NVIDIA H100 80GB HBM3",
                                                   kernels={"depthwise_wgrad"})]
    assert {r.name for r, _ in found} == {"jaxcnn_depthwise_wgrad"}
    assert len(found) >= 5
    assert compiled == [r.name for r, _ in found]  # nothing else was compiled for them
    for r, cfg in found:
        assert r.spill_bytes in (0, None), f"{cfg}: {r.spill_bytes} bytes spilled"


@pytest.mark.parametrize("op, kw", [
    ("max_pool2d", dict(kernel_size=3, stride=2, padding=1)),
    ("avg_pool2d", dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
])
def test_pool_kernels_load_and_store_vectors(op, kw):
    def fn(x):
        return getattr(pk, op)(x, **kw, config=TILE, **GPU)
    x = S((2, 16, 16, 64), jnp.bfloat16)
    forward = ik.inspect(fn, x)
    both = ik.inspect(_grad(fn, 0), x)
    for r in forward + both:
        assert r.ld_scalar_narrow == 0 and r.st_scalar == 0 and r.ld_vector > 0, r
        # Average pooling reads its per-pixel float32 divisor one pixel at a time.
        assert r.ld_scalar == 0 or op == "avg_pool2d", r
        _assert_no_spills(r)
    if op == "max_pool2d":
        # The forward pass alone runs the kernel that writes no index; training
        # writes one (int8 here) next to the output.
        assert [r.name for r in forward] == ["jaxcnn_max_pool_infer"]
        assert sorted(r.name for r in both) == ["jaxcnn_max_pool_bwd", "jaxcnn_max_pool_fwd"]
        assert _by_name(both)["jaxcnn_max_pool_fwd"].st_vector > forward[0].st_vector
        (ttir,) = [t for name, _, _, t in ik.lower_kernels(_grad(fn, 0), x)
                   if name == "jaxcnn_max_pool_fwd"]
        (signature,) = [line for line in ttir.splitlines()
                        if "tt.func" in line and "@jaxcnn_max_pool_fwd" in line]
        assert "!tt.ptr<i8>" in signature and "!tt.ptr<i32>" not in signature


def test_a_kernel_compiled_again_has_the_same_triton_cache_key():
    """compile_ttir's source text depends on the kernel's IR alone (its temporary file's
    path, which parsing puts in every location, is replaced by a fixed name), so Triton's
    cache serves a kernel compiled before: each compilation keyed by a fresh path made every
    key new.  (The forward-only max pool: its kernel is the pool test's, compiled there.)"""
    def fn(x):
        return pk.max_pool2d(x, kernel_size=3, stride=2, padding=1, config=TILE, **GPU)
    ((_, warps, stages, text),) = ik.lower_kernels(fn, S((2, 16, 16, 64), jnp.bfloat16))
    first, again = (ik.compile_ttir(text, warps, stages) for _ in range(2))
    assert first.hash == again.hash
    assert first.asm["ttir"] == again.asm["ttir"] and tempfile.gettempdir() not in first.asm["ttir"]


def test_inspect_script_prints_every_benchmark_kernel(capsys):
    assert ik.main(["--groups", "mnist,pool", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    for name in ("jaxcnn_conv_fwd", "jaxcnn_conv_dgrad", "jaxcnn_conv_wgrad",
                 "jaxcnn_max_pool_infer", "jaxcnn_max_pool_fwd", "jaxcnn_max_pool_bwd"):
        assert name in out
    assert "FAILED" not in out


def test_inspect_candidates_reports_each_kernel_under_each_of_its_configs(capsys):
    """Each row is the kernel compiled with its own candidate: the launch column (warps and
    pipeline slots, which differ between the candidates) is that candidate's.  The script
    hands over its jitted gradient, whose trace JAX caches: each candidate's lowering must
    trace it again under that candidate's tiles."""
    assert ik.main(["--groups", "pool", "--batch", "2", "--candidates"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    from pallas_kernels import autotune
    from pallas_kernels._common import geometry
    g = geometry((2, 112, 112, 64), (3, 3), (2, 2), (1, 1), ((1, 1), (1, 1)), (56, 56))
    want = {(f"{c.block_m}x{c.block_n}x{c.block_k}", f"{c.num_warps}w{c.num_stages}s")
            for c in autotune.candidates("max_pool2d_fwd", g, 64)}
    assert len({launch for _, launch in want}) > 1
    for kernel in ("jaxcnn_max_pool_fwd", "jaxcnn_max_pool_bwd"):
        assert {(r[3], r[4]) for r in rows if r[2] == kernel} == want
    assert ik.launch_names("dense_wgrad") == {"jaxcnn_conv_wgrad"}
    assert ik.launch_names("max_pool2d_fwd") == {"jaxcnn_max_pool_fwd", "jaxcnn_max_pool_infer"}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_shared_memory_estimate_bounds_what_triton_allocates(dtype):
    """The tuner drops configs whose estimate overflows shared memory; the estimate must
    never be below what Triton really allocates, or a dropped config could have run and
    a kept one could fail to launch.  The tiles: the smallest (two slots of 32-deep
    chunks), the largest both ways round (128x256 and 256x128 on 8 warps, three slots)
    and a four-slot 128x128 on 4 warps; each binds (Triton allocates exactly the estimate
    for every kernel but the float32 weight gradient, which takes half to three quarters
    of it).  A 128x128x32 tile on 8 warps with four slots, once among them, brings no field
    value these lack, and its allocation lies between theirs."""
    from pallas_kernels import autotune
    names = {"jaxcnn_conv_fwd": "dense_fwd", "jaxcnn_conv_dgrad": "dense_dgrad",
             "jaxcnn_conv_wgrad": "dense_wgrad"}
    args = (S((4, 14, 14, 256), dtype), S((3, 3, 256, 256), dtype))
    for tile in [(64, 64, 32, 4, 2), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
                 (128, 128, 64, 4, 4)]:
        cfg = pk.BlockConfig(*tile)

        def fn(x, w, cfg=cfg):
            return pk.conv2d(x, w, padding=1, config=cfg, precision=lax.Precision.DEFAULT, **GPU)
        for r in ik.inspect(_grad(fn, (0, 1)), *args, usage=False):  # no spill count read
            estimate = autotune.shared_memory_estimate(names[r.name], cfg, dtype)
            assert r.shared_bytes <= estimate, (tile, r.name, r.shared_bytes, estimate)
