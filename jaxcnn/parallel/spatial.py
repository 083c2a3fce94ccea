"""Spatial partitioning: each image's height split over the mesh's ``spatial`` axis.

Under the ``jit`` strategy the step is one global program, so splitting activations along
height changes where the numbers are computed, never what they are. This module decides how
far the split goes and that it is sound:

* :func:`spatial_layout` reads the model as a sequence of units (the children of its
  ``serial``, nested ``serial`` layers opened) and splits the longest run from the input that
  can be split (``until="auto"``), or exactly up to ``until``, refusing before any compute,
  in one :class:`~jaxcnn.errors.SettingError` naming the first leaf that cannot be split;
* :func:`constrain` returns the same model (same ``init``, parameter names and rng streams)
  whose ``apply`` pins the activations height-sharded through the split units and gathers
  them after, gathering each unit's parameters as it runs (they rest split over
  ``spatial``);
* halos come from XLA's SPMD partitioner (``halo="partitioner"``, the default) or from
  ``ppermute`` inside ``shard_map`` (``halo="explicit"``, which also splits windows taller
  than their input and composes with a ``model`` axis).

Which layers split, the partitioner's faults this works around, and the parameter schedule:
``docs/design/spatial.md``.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcnn._fence import stored
from jaxcnn._geometry import dilated, explicit_pads
from jaxcnn.functional._halo import window_halo
from jaxcnn.layers import combinators as C
from jaxcnn.layers._tree import child_path, get_path, leaves
from jaxcnn.layers.base import Choices, Layer, choices_or_default, record_layers
from jaxcnn.errors import SettingError
from jaxcnn.parallel.mesh import DATA, SPATIAL

WINDOW_KINDS = frozenset({"conv2d", "max_pool2d", "avg_pool2d"})
ROW_KINDS = frozenset({
    "relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "hardswish", "hardsigmoid", "sigmoid",
    "tanh", "batch_norm", "group_norm", "dropout", "stochastic_depth", "identity", "layer_scale"})
HALOS = ("partitioner", "explicit")
RANDOM_KINDS = frozenset({"dropout", "stochastic_depth"})


class SpatialLayout(NamedTuple):
    """Where a model's activations are split over the spatial axis.

    Attributes:
        shards: devices on the spatial axis.
        units: every unit's dotted path, in execution order.
        split: the paths of the units computed height-sharded (a prefix of ``units``).
        halos: ``{leaf path: halo rows}`` of every window leaf inside the split units.
        stop: why the split ends where it does (``""`` when every unit is split).
    """

    shards: int
    units: tuple
    split: tuple
    halos: dict
    stop: str

    @property
    def gather_after(self) -> str | None:
        """The last split unit: the spatial axis is gathered after it."""
        return self.split[-1] if self.split else None


def _units(layer: Layer, path: str = ""):
    """``[(path, Layer)]``: a serial's children, nested serials opened."""
    if layer.kind != "serial":
        return [(path, layer)]
    out = []
    for name, child in layer.children:
        out += _units(child, child_path(path, name))
    return out


def _in(path: str, prefix: str) -> bool:
    return not prefix or path == prefix or path.startswith(prefix + ".")


def _describe(record) -> str:
    c = record.config
    kh = c["kernel_size"][0]
    return (f"{record.kind} {kh}x{c['kernel_size'][1]}, stride {c['stride'][0]}, "
            f"padding {c['padding'] if isinstance(c['padding'], str) else c['padding'][0]}")


def _row_wise(record) -> bool:
    """Computed at each position on its own: the row kinds, a LayerNorm over channels only and
    a linear layer over an image's channels (ConvNeXt's blocks)."""
    if record.kind in ROW_KINDS:
        return True
    rank = len(record.input_shape)
    if record.kind == "layer_norm":
        return rank == 4 and {a % rank for a in record.config["axes"]} == {rank - 1}
    return record.kind == "linear" and rank == 4


GLOBAL_POOLS = frozenset({"adaptive_avg_pool2d", "global_avg_pool2d"})


def _gated(layer: Layer, path: str, inside: bool = False) -> set:
    """The paths of the leaves of ``layer`` that are inside a ``gate``'s body."""
    if not layer.children:
        return {path} if inside else set()
    inside = inside or layer.kind == "gate"
    return set().union(*(_gated(child, child_path(path, name), inside) for name, child in layer.children))


def _whole_in_gate(record) -> bool:
    """A leaf of a gate's body that the partitioner computes on whole images as they are:
    a global average pooling (``(N, 1, 1, C)`` out: squeeze-and-excitation's squeeze, a sum
    over the split rows and an all-reduce) or a layer on such ``(N, 1, 1, C)`` values.  The
    gate's product broadcasts them back over the split rows."""
    shape, out = record.input_shape, record.output_shape
    if len(shape) != 4 or len(out) != 4:
        return False
    if record.kind in GLOBAL_POOLS:
        return out[1:3] == (1, 1)
    return shape[1:3] == (1, 1) and (record.kind == "conv2d" or _row_wise(record))


def _draws(record) -> bool:
    """Whether a dropout or stochastic-depth leaf draws at all (its rate above 0)."""
    return float(record.config.get("rate", record.config.get("p", 0.0))) > 0


def _leaf_problem(record, shards: int, halos: dict, halo: str) -> str | None:
    """Why this leaf cannot be computed height-sharded, or None (recording its halo)."""
    name = record.path or "the model"
    if record.kind not in WINDOW_KINDS and not _row_wise(record):
        return f"{name} ({record.kind}) is not computed row by row"
    if halo == "explicit" and record.kind in RANDOM_KINDS and _draws(record):
        return (f"{name} ({record.kind}) draws random numbers per example or position, which one "
                f"device's block would not draw as the whole batch does (explicit halos)")
    if len(record.input_shape) != 4 or len(record.output_shape) != 4:
        return f"{name} ({record.kind}) has input {record.input_shape}, not an (N, H, W, C) image"
    height, out_height = record.input_shape[1], record.output_shape[1]
    for what, size in (("input", height), ("output", out_height)):
        if size % shards:
            return (f"{name} ({record.kind}): its {what} height {size} does not divide into "
                    f"{shards} spatial shards")
    if record.kind in WINDOW_KINDS:
        c = record.config
        window = dilated(c["kernel_size"], c["dilation"])
        pads = explicit_pads(c["padding"], record.input_shape[1:3], window, c["stride"])
        if window[0] > height and halo == "partitioner":
            return (f"{name} ({_describe(record)}): its window ({window[0]} rows) is taller than its "
                    f"whole {height}-row input (XLA's partitioner gets such a window's input gradient "
                    f"wrong when the image is split, so it is not split)")
        need = window_halo(height, out_height, shards, c["kernel_size"][0], c["stride"][0],
                           tuple(pads[0]), c["dilation"][0])
        if need > height // shards:
            return (f"{name} ({_describe(record)}) needs {need} halo rows from its neighbour but a "
                    f"shard of its {height}-row input holds {height // shards}")
        halos[record.path] = need
    return None


def spatial_layout(model: Layer, input_shape, shards: int, *, until: str = "auto",
                   halo: str = "partitioner") -> SpatialLayout:
    """Decide which units of ``model`` run height-sharded over ``shards`` devices.

    Shape driven (``jax.eval_shape`` of ``init``): nothing is computed.

    Arguments:
        model: the model Layer.
        input_shape: its global input shape ``(N, H, W, C)``.
        shards: devices on the spatial axis (>= 2).
        until: ``"auto"`` (the longest run of units that can be split), or the path
            of the last unit (or nested ``serial``) to split.
        halo: who brings the halo rows, ``"partitioner"`` or ``"explicit"`` (see
            :func:`constrain`): explicit halos split windows taller than their whole
            input too, and never units that draw random numbers per position (dropout).

    Returns:
        A :class:`SpatialLayout`.

    Raises:
        SettingError: naming ``shards`` when the input height does not divide or the first
            unit cannot be split, ``until`` when it names no unit or a leaf up to it cannot be
            split (which leaf and why: height, halo or kind), or ``halo``.
    """
    input_shape = tuple(int(d) for d in input_shape)
    check_halo(halo)
    if len(input_shape) != 4:
        raise SettingError("shards", f"splits images (N, H, W, C); the model input is {input_shape}")
    if input_shape[1] % shards:
        raise SettingError("shards", f"the input height {input_shape[1]} (input shape {input_shape}) "
                           f"does not divide into {shards} spatial shards")
    with record_layers() as records:
        jax.eval_shape(lambda k: model.init(k, input_shape)[:2], jax.random.PRNGKey(0))
    by_path = {r.path: r for r in records}
    units = _units(model)
    paths = tuple(p for p, _ in units)
    if until != "auto":
        if not isinstance(until, str) or not any(_in(p, until) for p in paths):
            raise SettingError("until", f"{until!r} names no layer of the model's sequence; "
                               f"expected 'auto' or one of {list(paths)}")
        last = max(i for i, p in enumerate(paths) if _in(p, until))
    split, halos, stop = [], {}, ""
    for i, (path, unit) in enumerate(units):
        if until != "auto" and i > last:
            stop = f"until is {until!r}"
            break
        problem, gated = None, _gated(unit, path) if halo == "partitioner" else set()
        for leaf_path, _ in leaves(unit, path):
            record = by_path.get(leaf_path)
            if record is not None and leaf_path in gated and _whole_in_gate(record):
                continue
            problem = (f"{leaf_path or 'the model'} is not a recorded jaxcnn layer" if record is None
                       else _leaf_problem(record, shards, halos, halo))
            if problem:
                break
        if problem:
            if until != "auto":
                raise SettingError("until", f"cannot split up to {until!r} over {shards} spatial "
                                   f"shards: {problem}")
            if not split:
                raise SettingError("shards", f"{shards} spatial shards cannot split even the first "
                                   f"layer: {problem}")
            stop = problem
            break
        split.append(path)
    return SpatialLayout(shards, paths, tuple(split), halos, stop)


def check_halo(halo) -> None:
    if halo not in HALOS:
        raise SettingError("halo", f"expected one of {HALOS}, got {halo!r}")


def activation_sharding(mesh: Mesh) -> NamedSharding:
    """Images split over ``data`` (batch) and ``spatial`` (height), the rest whole."""
    return NamedSharding(mesh, P(DATA, SPATIAL))


def gathered_sharding(mesh: Mesh) -> NamedSharding:
    """Batch over ``data``, the spatial axis gathered."""
    return NamedSharding(mesh, P(DATA))


def _split_choices(choices) -> Choices:
    """The caller's choices with XLA's own convolution and pooling (``impl="xla"``) and no
    fused Conv -> BatchNorm kernel (``conv_bn="off"``): a Pallas or Mosaic kernel is a
    custom call that XLA's partitioner cannot split along height (it would gather)."""
    return dataclasses.replace(choices_or_default(choices), impl="xla", conv_bn="off")


def _pinned(layer: Layer, sharding) -> Layer:
    def apply(params, state, x, **kwargs):
        kwargs["choices"] = _split_choices(kwargs.get("choices"))
        y, new_state = layer.apply(params, state, x, **kwargs)
        return jax.lax.with_sharding_constraint(y, sharding), new_state
    return layer._replace(apply=apply)


def _explicit(layer: Layer, mesh: Mesh) -> Layer:
    """``layer`` run per block, inside ``shard_map`` over the whole mesh: each device gets
    its images' block of rows (``P(data, spatial)``) and the unit's parameters and state
    whole; its convolutions and pooling bring their halo rows with ``ppermute``
    (``Choices.height_axis``), BatchNorm reduces over ``data`` and ``spatial``
    (``Choices.axis_name``).  ``check_vma`` stays on, so the parameters' gradients are
    summed over the blocks (the transpose of their broadcast) and the state must leave
    the same on every device, which BatchNorm's ``pmean`` makes it."""
    def apply(params, state, x, *, rng=None, **kwargs):
        whole = _split_choices(kwargs.pop("choices", None))
        choices = dataclasses.replace(whole, axis_name=(DATA, SPATIAL), height_axis=SPATIAL)
        # the weights' 16-bit casts made here, outside the shard_map, where the per-unit gather
        # (_gathering's _entry_casts) sees them and drops them from the residuals
        params = _cast_leaves(params, _entry_casts(
            lambda w, x: layer.apply(w, state, x, rng=rng, choices=whole, **kwargs), params, x))

        def block(params, state, x, rng):
            return layer.apply(params, state, x, rng=rng, choices=choices, **kwargs)

        rows = P(DATA, SPATIAL)
        return jax.shard_map(block, mesh=mesh, in_specs=(P(), P(), rows, P()), out_specs=(rows, P()),
                             check_vma=True)(params, state, x, rng)
    return layer._replace(apply=apply)


def _gathering(layer: Layer, shardings, remat: bool = False) -> Layer:
    """``layer`` gathering its own parameters as it runs (FSDP's schedule, per unit): the
    forward gathers them once its input exists and keeps them out of what the backward
    reads; the backward gathers them again once the output's gradient exists, and lets the
    input's gradient leave only with the parameters' gradient reduce-scattered.  So one
    unit's whole parameters and gradient are live at a time, not the whole model's.

    A ``custom_vjp``: the forward takes ``jax.vjp`` of the unit and drops the gathered
    weights from its residuals (found by identity; a weight the unit only casts, to bfloat16
    under a 16-bit policy, is cast here first, so the cast is what is dropped: see
    :func:`_entry_casts`; any other value made from them stays a residual), the backward
    gathers them again and puts them back.  The
    order comes from conditionals (:func:`jaxcnn._fence.stored`), not ``jax.checkpoint`` or
    ``optimization_barrier``: XLA:CPU drops the barriers, then merges a recomputed gather
    with the forward's, schedules every gather at the start of the program and combines
    every gradient's reduction into one all-reduce at its end (this order takes less memory
    per device: docs/BENCHMARKS.md).

    ``remat``: the forward keeps only the unit's input (and its parameters' split), and the
    backward computes the unit again from a stored copy of it made once the output's
    gradient exists (``parallel.spatial.remat``: one more forward of the model, its
    activations kept at the units' boundaries only)."""
    whole = jax.tree_util.tree_map(lambda s: NamedSharding(s.mesh, P()), shardings)
    own = bool(jax.tree_util.tree_leaves(shardings))

    def gather(p):
        return jax.lax.with_sharding_constraint(p, whole)

    def apply(params, state, x, *, rng=None, **kwargs):
        def run(w, x, state, rng):
            return layer.apply(w, state, x, rng=rng, **kwargs)

        static = {}  # the backward's residual layout, found when the forward is traced

        @jax.custom_vjp
        def unit(params, x, state, rng):
            return run(gather(params), x, state, rng)

        def fwd(params, x, state, rng):
            w = gather(stored(params, after=x) if own else params)
            if remat:
                return run(w, x, state, rng), (params, x, state, rng)
            # the weights as the unit computes with them (a 16-bit cast under a 16-bit
            # policy, made here rather than inside): these are what its residuals hold
            static["casts"] = _entry_casts(lambda w, x: run(w, x, state, rng), w, x)
            w = _cast_leaves(w, static["casts"])
            out, vjp = jax.vjp(lambda w, x: run(w, x, state, rng), w, x)
            ids = {id(leaf): i for i, leaf in enumerate(jax.tree_util.tree_leaves(w))}
            leaves, static["tree"] = jax.tree_util.tree_flatten(vjp)
            static["slots"] = [ids.get(id(leaf), -1) for leaf in leaves]
            kept = [None if k >= 0 else leaf for leaf, k in zip(leaves, static["slots"])]
            return out, (params, kept)

        def bwd(res, ct):
            if remat:
                params, x, state, rng = res
                w = gather(stored(params, after=ct[0]) if own else params)
                _, vjp = jax.vjp(lambda w, x: run(w, x, state, rng), w, stored(x, after=ct[0]))
            else:
                params, kept = res
                w = jax.tree_util.tree_leaves(_cast_leaves(gather(stored(params, after=ct[0])), static["casts"]))
                vjp = jax.tree_util.tree_unflatten(static["tree"], [
                    w[k] if k >= 0 else leaf for leaf, k in zip(kept, static["slots"])])
            d_w, d_x = vjp(ct)
            d_w = jax.tree_util.tree_map(lambda g, p: g.astype(p.dtype), d_w, params)
            d_params = jax.lax.with_sharding_constraint(d_w, shardings)
            leaves = [g for g in jax.tree_util.tree_leaves(d_params) if g.ndim]
            d_x = stored(d_x, after=leaves) if leaves else d_x
            return d_params, d_x, None, None

        unit.defvjp(fwd, bwd)
        return unit(params, x, state, rng)
    return layer._replace(apply=apply)


def _entry_casts(fn, w, *args) -> list:
    """Per leaf of ``w``: the dtype ``fn(w, *args)`` converts it to where that conversion is
    all ``fn`` does with it (every use of the leaf a ``convert_element_type`` to that one
    dtype: a layer's policy cast), else None.  Casting such a leaf first computes the same
    values: the conversion inside is then the identity, which JAX drops."""
    jaxpr = jax.make_jaxpr(fn)(w, *args).jaxpr
    leaves = jax.tree_util.tree_leaves(w)
    targets = {id(v): set() for v in jaxpr.invars[:len(leaves)]}
    other = {id(v) for v in jaxpr.outvars}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if id(v) not in targets:
                continue
            if eqn.primitive.name == "convert_element_type":
                targets[id(v)].add(np.dtype(eqn.params["new_dtype"]))
            else:
                other.add(id(v))
    casts = []
    for v, leaf in zip(jaxpr.invars, leaves):
        dtypes = targets[id(v)]
        one = len(dtypes) == 1 and id(v) not in other and next(iter(dtypes)) != np.dtype(leaf.dtype)
        casts.append(next(iter(dtypes)) if one else None)
    return casts


def _cast_leaves(tree, casts):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return jax.tree_util.tree_unflatten(treedef, [
        leaf if dt is None else leaf.astype(dt) for leaf, dt in zip(leaves, casts)])


def _unfused(layer: Layer, children) -> Layer:
    """A rebuilt ``serial``: its children one after the other, each through its own
    ``apply``, never through the Conv -> BatchNorm fusion's chain walk (which would call
    the fused kernel on the children's parameters directly, past their sharding
    constraints and parameter gathers; the children's insides keep the caller's
    fusion choice)."""
    def apply(params, state, x, **kwargs):
        return C.apply_in_turn(children, params, state, x, **kwargs)

    return layer._replace(apply=apply, children=tuple(children))


def constrain(model: Layer, layout: SpatialLayout, mesh: Mesh, params=None,
              remat: bool = False, halo: str = "partitioner") -> Layer:
    """``model`` with its activations pinned as ``layout`` says (see the module docs).

    The result has the same ``init`` (parameter and state trees, rng use) and computes
    the same function; only ``apply`` adds sharding constraints.  ``params``: the
    at-rest ``NamedSharding`` of each parameter when they are split (over ``spatial``,
    as the plan keeps them, or ``data``): each unit then gathers its own as it runs
    (:func:`_gathering`).  ``remat``: every unit is computed again in the backward from its
    input (:func:`_gathering`), so the activations inside units are not kept.
    ``halo``: ``"partitioner"`` leaves the split units to XLA's SPMD partitioner, which
    inserts the halo exchanges; ``"explicit"`` runs each split unit per block of rows inside
    ``shard_map`` (:func:`_explicit`), its windows' halo rows exchanged by ``ppermute``
    (:mod:`jaxcnn.functional._halo`).  Build ``layout`` with the same ``halo``.
    """
    check_halo(halo)
    split, last = set(layout.split), layout.gather_after
    inner, gathered = activation_sharding(mesh), gathered_sharding(mesh)

    def unit(layer: Layer, path: str) -> Layer:
        if path in split:
            layer = _pinned(_explicit(layer, mesh) if halo == "explicit" else layer,
                            gathered if path == last else inner)
        own = get_path(params, path) if params is not None else {}
        return _gathering(layer, own, remat) if own or remat else layer

    def rebuild(layer: Layer, path: str) -> Layer:
        if layer.kind != "serial":
            return unit(layer, path)
        if params is None and not remat and not any(_in(p, path) for p in split):
            return layer
        return _unfused(layer, [(name, rebuild(child, child_path(path, name)))
                                for name, child in layer.children])

    if not split:
        return model
    body = rebuild(model, "")

    def apply(p, state, x, **kwargs):
        return body.apply(p, state, jax.lax.with_sharding_constraint(x, inner), **kwargs)

    return body._replace(apply=apply)
