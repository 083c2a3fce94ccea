"""The tiles ``scripts/gpu_check.py`` times: at most three per Mosaic kernel launch, chosen on
the CPU.

A lent GPU gives minutes, not the hour a sweep over every candidate tile takes
(:meth:`~pallas_kernels.mgpu_conv.DenseCall.candidates` lists up to 49 per launch).  So each
launch of the check's shapes gets a shortlist, chosen ahead by a model and kept in
``scripts/gpu_check_tiles.json``:

1. the default tiles (what runs today without a tuned entry: the baseline);
2. the candidate the model ranks first;
3. the best-ranked one that differs from the second in its channel tile, tile row or warp
   specialisation (not only in its slots), so the three span the choices that matter most.

The model (:func:`score`) is an occupancy and reuse estimate, not a measurement:

- **wave fill**: CTAs over whole waves, where a wave is one CTA per resident slot (132 SMs
  times the CTAs one SM holds within 227 KiB of shared memory, :func:`resident`);
- **reuse** (dense kernels): a 64-pixel by ``block_n`` GEMM tile performs
  ``64 * block_n / (64 + block_n)`` multiply-adds per operand element it loads;
- **copy size** (window kernels, which stage one shifted 64-pixel tile per tap): a TMA row
  copy of ``b`` bytes moves ``b / (b + 128)`` of its time's worth (a fixed cost per copy);
- **pipelining**: ``stages / (stages + 1)`` of the loads hidden behind the compute.

``python scripts/gpu_check.py --plan-tiles`` writes the file again;
``tests/test_gpu_check.py`` fails when it differs from what this module computes.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from pallas_kernels import autotune
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_window as mw

PLAN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_check_tiles.json")
PER_LAUNCH = 3
SMS = 132  # an H100's and an H200's streaming multiprocessors
MAX_RESIDENT = 4  # CTAs one SM may hold, whatever the shared memory says


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _tile_rows(cfg) -> tuple:
    """``(rows, cols)`` of output pixels in a 64-pixel tile."""
    return mc.TILE_M // cfg.tile_w, cfg.tile_w


def _launch_hw(call) -> tuple:
    """``(height, width)`` of the launched kernel's output, per image (per stride phase for the
    gradients gathered by phase)."""
    width = call.launch_width()
    if isinstance(call, mc.DenseCall):
        oh, ow = call.out_hw()
        if call.part != "dgrad":
            return oh, ow
        sh = call.stride[0]
        return (call.x_shape[1] if sh == 1 else _cdiv(call.pads[0][0] + call.x_shape[1], sh),
                width)
    oh, _ = call.out_hw
    if call.part in ("bwd", "dgrad"):
        return _cdiv(call.x_shape[1] + sum(call.pads[0]), call.stride[0]), width
    return oh, width


def ctas(call, cfg) -> int:
    """CTAs one launch of ``call`` runs with the fitted ``cfg`` (an estimate of its grid)."""
    n, c = call.x_shape[0], call.x_shape[3]
    rows, cols = _tile_rows(cfg)
    if isinstance(call, mc.DenseCall):
        kh, kw, _, co = call.w_shape
        if call.part == "wgrad":
            return kh * kw * _cdiv(c, mc.TILE_M) * _cdiv(co, cfg.block_n) * cfg.split
        c_out = call.channels()[1]
        phases = call.stride[0] * call.stride[1] if call.part == "dgrad" else 1
        h, w = _launch_hw(call)
        return phases * n * _cdiv(h, rows) * _cdiv(w, cols) * _cdiv(c_out, cfg.block_n)
    if call.kernel == "mgpu_depthwise_wgrad":
        return call.taps() * _cdiv(c, cfg.block_c) * cfg.split
    phases = call.stride[0] * call.stride[1] if call.part in ("bwd", "dgrad") else 1
    h, w = _launch_hw(call)
    return phases * n * _cdiv(h, rows) * _cdiv(w, cols) * _cdiv(c, cfg.block_c)


def resident(call, cfg) -> int:
    """CTAs of this launch one SM holds at once, by shared memory (at most
    :data:`MAX_RESIDENT`)."""
    return max(1, min(MAX_RESIDENT, mc.MAX_SMEM // max(1, call.smem_bytes(cfg))))


def score(call, cfg) -> float:
    """The model's estimate of ``cfg``'s speed for ``call`` (higher is faster; only the order
    means anything): wave fill x reuse or copy size x pipelining (module docstring)."""
    slots = SMS * resident(call, cfg)
    n = ctas(call, cfg)
    fill = n / (_cdiv(n, slots) * slots)
    depth = cfg.stages / (cfg.stages + 1)
    if isinstance(call, mc.DenseCall):
        bn = mc._block_n(call.channels()[1], cfg)
        return fill * (mc.TILE_M * bn / (mc.TILE_M + bn)) * depth
    row_bytes = cfg.tile_w * cfg.block_c * jnp.dtype(call.dtype).itemsize
    return fill * depth * row_bytes / (row_bytes + mc.COPY_BYTES)


def _shape_of(cfg) -> tuple:
    """What the third pick must differ in from the second (not only the slots)."""
    return (getattr(cfg, "block_n", None), getattr(cfg, "block_c", None), cfg.tile_w,
            getattr(cfg, "warp_specialized", None))


def shortlist(call, n: int = PER_LAUNCH) -> list:
    """At most ``n`` fitted configs of ``call`` worth timing, within an H100's shared memory:
    the default first, then the model's picks (module docstring)."""
    found = call.candidates(mc.MAX_SMEM)
    if not found:
        return []
    ranked = sorted(found[1:], key=lambda c: -score(call, c))
    picks = [found[0]]
    if ranked and n > 1:
        picks.append(ranked[0])
        rest = [c for c in ranked[1:] if _shape_of(c) != _shape_of(ranked[0])] or ranked[1:]
        picks += rest[:n - 2]
    return picks[:n]


def launches(fn, args) -> list:
    """The Mosaic calls (:class:`~pallas_kernels.mgpu_conv.DenseCall`,
    :class:`~pallas_kernels.mgpu_window.WindowCall`) ``fn(*args)`` and its gradient with
    respect to every floating argument look their tiles up, by traced shapes only."""
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    argnums = tuple(i for i, a in enumerate(args) if jnp.issubdtype(a.dtype, jnp.floating))

    def loss(*a):
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(fn(*a)))
    with autotune._recording() as launched:
        jax.eval_shape(jax.grad(loss, argnums=argnums), *abstract)
    return [call for kernel, call, _, _ in launched.values()
            if kernel in mc.KERNELS or kernel in mw.KERNELS]


def plan(calls) -> dict:
    """``{call key: [config dict]}`` (the shortlist of each call), keys sorted."""
    return {c.key: [cfg.to_dict() for cfg in shortlist(c)] for c in
            sorted({c.key: c for c in calls}.values(), key=lambda c: c.key)}


def write(entries: dict, path: str = PLAN) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"per_launch": PER_LAUNCH, "model": "scripts/_gpu_check_tiles.py",
                   "kernels": entries}, f, indent=1, sort_keys=True)
        f.write("\n")


def load(path: str = PLAN) -> dict:
    """The kept plan's ``{call key: [config dict]}`` ({} if the file is absent)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["kernels"]
    except FileNotFoundError:
        return {}


def candidate_fn(kept: dict, limit: int = PER_LAUNCH):
    """A ``candidate_fn`` for :func:`pallas_kernels.autotune.tune_op`: the kept shortlist of a
    Mosaic launch (its :func:`shortlist` where the plan lacks it), at most ``limit`` configs;
    a Triton launch gets its default tiles only."""
    def candidates(kernel, g, co):
        if isinstance(g, (mc.DenseCall, mw.WindowCall)):
            cls = mc.MgpuConfig if isinstance(g, mc.DenseCall) else mw.WindowConfig
            if g.key in kept:
                return [cls.from_dict(d) for d in kept[g.key]][:limit]
            return shortlist(g, limit)
        return [autotune.default_config(kernel, g, co, interpret=False)]
    return candidates


def describe(cfg) -> str:
    """A config in the tables' short form: ``w<row>n<channels>k<chunk>s<slots>[ws][/<split>]``
    (dense) or ``w<row>c<channels>s<slots>[/<split>]`` (window)."""
    if isinstance(cfg, dict):
        cfg = (mc.MgpuConfig if "block_n" in cfg else mw.WindowConfig)(**cfg)
    split = f"/{cfg.split}" if cfg.split > 1 else ""
    if isinstance(cfg, mc.MgpuConfig):
        return (f"w{cfg.tile_w}n{cfg.block_n}k{cfg.block_k}s{cfg.stages}"
                + ("ws" if cfg.warp_specialized else "") + split)
    return f"w{cfg.tile_w}c{cfg.block_c}s{cfg.stages}{split}"


__all__ = ["PLAN", "PER_LAUNCH", "ctas", "resident", "score", "shortlist", "launches", "plan",
           "write", "load", "candidate_fn", "describe"]
