"""Sharding rules: logical axis names for every parameter, mapped onto mesh axes.

Every array of a model gets a tuple of *logical* axis names from the kind of
layer that owns it (recorded with :func:`jaxcnn.layers.record_layers`, so no
forward pass runs):

=====================================  ===========================  ==========
layer kind                             array                        logical axes
=====================================  ===========================  ==========
conv2d, conv_transpose2d               ``w`` (KH, KW, C_in/g, C_out) ``(kh, kw, in, out)``
linear                                 ``w`` (in, out)              ``(in, out)``
conv / linear                          ``b`` (C_out,)               ``(out,)``
batch_norm, group_norm, 1-D layer_norm ``scale``, ``bias``, ``mean``, ``var``  ``(out,)``
anything else (``count``, multi-axis layer_norm)  any               replicated
=====================================  ===========================  ==========

A rule table maps logical names to mesh axes (``"model"``, ``"data"``) or None.
The built-in table, :data:`DEFAULT_RULES`, is column-parallel: output channels
over ``model``.  ``{"in": "model", "out": null}`` makes every layer row-parallel
(input channels split; XLA adds the partial-sum reduction).  A dimension stays
whole when its size does not divide over the mesh axis, or when that mesh axis
already splits another dimension of the same array.

With ``fsdp`` every array of at least :data:`FSDP_MIN_SIZE` elements is also
split over ``data`` (or ``fsdp_axis``: pipeline parallelism splits over ``pipe``)
on its largest free dimension that divides; optimiser moments follow the sharding
of the parameter they belong to.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcnn.errors import SettingError
from jaxcnn.layers.base import record_layers
from jaxcnn.parallel.mesh import DATA, MODEL
DEFAULT_RULES: dict[str, str | None] = {"kh": None, "kw": None, "in": None, "out": "model"}

# Smaller arrays are not worth an all-gather per step under fsdp (64 KiB in float32).
FSDP_MIN_SIZE = 2 ** 14

_WEIGHTED = {"conv2d": ("kh", "kw", "in", "out"), "conv_transpose2d": ("kh", "kw", "in", "out"),
             "linear": ("in", "out")}
_CHANNEL_KINDS = {"batch_norm", "group_norm", "layer_norm"}


def _leaf_axes(kind: str, name: str, ndim: int) -> tuple:
    if kind in _WEIGHTED:
        if name == "w":
            return _WEIGHTED[kind]
        if name == "b":
            return ("out",)
    if kind in _CHANNEL_KINDS and name in ("scale", "bias", "mean", "var") and ndim == 1:
        return ("out",)
    return (None,) * ndim


def _dict_path(keypath) -> tuple[str, ...]:
    return tuple(str(k.key) for k in keypath if isinstance(k, jax.tree_util.DictKey))


def logical_axes(model, input_shape) -> tuple[Any, Any]:
    """Logical axis names of a model's parameters and state.

    Arguments:
        model: a ``jaxcnn.layers.Layer``.
        input_shape: its input shape ``(N, H, W, C)``.

    Returns:
        ``(params_axes, state_axes)``: trees shaped like ``params`` and ``state``
        whose leaves are tuples with one name (or None) per array dimension.
    """
    with record_layers() as records:
        params, state, _ = jax.eval_shape(lambda k: model.init(k, input_shape), jax.random.PRNGKey(0))
    kinds = {r.path: r.kind for r in records}

    def axes_of(keypath, leaf):
        path = _dict_path(keypath)
        return _leaf_axes(kinds.get(".".join(path[:-1]), ""), path[-1], len(leaf.shape))

    return (jax.tree_util.tree_map_with_path(axes_of, params),
            jax.tree_util.tree_map_with_path(axes_of, state))


def merge_rules(overrides: Mapping[str, str | None] | None = None) -> dict[str, str | None]:
    """:data:`DEFAULT_RULES` with ``overrides`` (the config's ``parallel.rules``) on top.

    Raises:
        SettingError: naming ``rules.<axis>`` when an override names an unknown logical axis or
            mesh axis.
    """
    rules = dict(DEFAULT_RULES)
    for name, target in dict(overrides or {}).items():
        if name not in DEFAULT_RULES:
            raise SettingError(f"rules.{name}", f"unknown logical axis {name!r}; expected one of "
                               f"{sorted(DEFAULT_RULES)}")
        if target not in (None, DATA, MODEL):
            raise SettingError(f"rules.{name}", f"expected 'data', 'model' or null, got {target!r}")
        rules[name] = target
    return rules


def partition_spec(axes: tuple, shape: tuple, mesh: Mesh, rules: Mapping[str, str | None], *,
                   fsdp: bool = False, fsdp_axis: str = DATA) -> P:
    """The ``PartitionSpec`` of one array.

    Arguments:
        axes: logical name (or None) per dimension.
        shape: the array's shape.
        mesh: the mesh (only axis sizes are read).
        rules: logical name -> mesh axis or None.
        fsdp: also split the largest free, divisible dimension over ``fsdp_axis`` when
            the array has at least :data:`FSDP_MIN_SIZE` elements.
        fsdp_axis: the mesh axis of ``fsdp`` (``"data"``; ``"pipe"`` for pipeline stages).

    Returns:
        A ``PartitionSpec`` with one entry per dimension.
    """
    spec: list = [None] * len(shape)
    used = set()
    for i, (name, size) in enumerate(zip(axes, shape)):
        target = rules.get(name) if name is not None else None
        if target is None or target in used or mesh.shape[target] == 1 or size % mesh.shape[target]:
            continue
        spec[i] = target
        used.add(target)
    n_split = mesh.shape.get(fsdp_axis, 1)
    if fsdp and fsdp_axis not in used and n_split > 1 and int(np.prod(shape, dtype=np.int64)) >= FSDP_MIN_SIZE:
        free = [i for i in range(len(shape)) if spec[i] is None and shape[i] % n_split == 0]
        if free:
            spec[max(free, key=lambda i: shape[i])] = fsdp_axis
    return P(*spec)


def _is_axes(x) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def tree_shardings(axes_tree, abstract_tree, mesh: Mesh, rules, *, fsdp: bool = False,
                   fsdp_axis: str = DATA):
    """``NamedSharding`` for every leaf of ``abstract_tree`` from its logical axes.

    Arguments:
        axes_tree: from :func:`logical_axes`.
        abstract_tree: arrays or ``ShapeDtypeStruct`` of the same structure.
        mesh, rules, fsdp, fsdp_axis: as :func:`partition_spec`.
    """
    return jax.tree_util.tree_map(
        lambda axes, x: NamedSharding(mesh, partition_spec(axes, tuple(x.shape), mesh, rules, fsdp=fsdp,
                                                           fsdp_axis=fsdp_axis)),
        axes_tree, abstract_tree, is_leaf=_is_axes)


def follow_params(tree, params, param_shardings, mesh: Mesh):
    """Shardings for an optimiser state: a leaf takes the sharding of the parameter
    whose dict path ends its own path and whose shape it has (optax keeps moments
    as trees shaped like the params); every other leaf (counts, scalars) is replicated.

    Arguments:
        tree: the abstract optimiser state.
        params: the abstract params.
        param_shardings: their shardings (same structure as ``params``).
        mesh: the mesh.
    """
    by_path = {}
    for (kp, p), (_, s) in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                               jax.tree_util.tree_flatten_with_path(param_shardings)[0]):
        by_path[_dict_path(kp)] = (tuple(p.shape), s)
    replicated = NamedSharding(mesh, P())

    def pick(keypath, leaf):
        path = _dict_path(keypath)
        for start in range(len(path)):
            hit = by_path.get(path[start:])
            if hit is not None:
                return hit[1] if hit[0] == tuple(leaf.shape) else replicated
        return replicated

    return jax.tree_util.tree_map_with_path(pick, tree)
