"""Walking and rebuilding a model's Layer tree together with its params and state.

Export, folding, quantisation and pruning all read a model through the
static description every :class:`~jaxcnn.layers.base.Layer` carries (``kind``,
``config``, ``children``) and some of them rebuild it with some leaves
replaced.  The combinators are rebuilt from their kind and config:
``serial(*children)``, ``residual(*main, shortcut=..., shortcut_name=...,
activation=...)``, ``parallel(*branches, combine=...)`` and ``gate(*body)``.
"""
from __future__ import annotations

from typing import Callable

from jaxcnn.errors import ExportError
from jaxcnn.layers import combinators as L
from jaxcnn.layers.base import Layer

COMBINATORS = ("serial", "residual", "parallel", "gate")


def child_path(path: str, name: str) -> str:
    """Dotted path of child ``name`` of the layer at ``path`` (``""`` is the root)."""
    return f"{path}.{name}" if path else name


def show(path: str) -> str:
    """A layer path for messages (the root has the empty path)."""
    return repr(path) if path else "the root"


def residual_parts(layer: Layer):
    """Split a residual's children into ``(main, shortcut, activation)``.

    ``shortcut`` and ``activation`` are ``(name, Layer)`` pairs or None.  The
    activation is a trailing child named ``"activation"`` (what
    :func:`jaxcnn.layers.residual` names it) that is not the only main layer.
    """
    children = list(layer.children)
    sc_name = layer.config["shortcut_name"]
    shortcut = next((c for c in children if c[0] == sc_name), None)
    rest = [c for c in children if c[0] != sc_name]
    activation = None
    if len(rest) > 1 and rest[-1][0] == "activation":
        activation = rest.pop()
    return rest, shortcut, activation


def sequence_names(layer: Layer) -> list[str]:
    """Names of the children that run one after the other on one tensor: all
    of a serial's and a gate's, a residual's main branch, none of a parallel's."""
    if layer.kind in ("serial", "gate"):
        return [n for n, _ in layer.children]
    if layer.kind == "residual":
        return [n for n, _ in residual_parts(layer)[0]]
    return []


def rebuild(layer: Layer, children: list[tuple[str, Layer]]) -> Layer:
    """The combinator ``layer`` with its children replaced (same names, same order)."""
    new = dict(children)
    if layer.kind == "serial":
        return L.serial(*children)
    if layer.kind == "parallel":
        return L.parallel(*children, combine=layer.config["combine"])
    if layer.kind == "gate":
        return L.gate(*children)
    if layer.kind == "residual":
        main, shortcut, activation = residual_parts(layer)
        return L.residual(*[(n, new[n]) for n, _ in main],
                          shortcut=None if shortcut is None else new[shortcut[0]],
                          shortcut_name=layer.config["shortcut_name"],
                          activation=None if activation is None else new["activation"])
    raise ExportError(f"cannot rebuild layer kind {layer.kind!r}")


def rewrite(model: Layer, params: dict, state: dict, *,
            leaf_fn: Callable | None = None, seq_fn: Callable | None = None, path: str = ""):
    """Rebuild ``model`` bottom-up, letting callbacks replace parts of it.

    Arguments:
        model: the Layer (tree) to rewrite.
        params, state: its parameter and state trees.
        leaf_fn: ``(path, layer, params, state) -> (layer, params, state)`` called
            on every leaf.
        seq_fn: ``(path, layer, items) -> items`` called on every combinator
            after its children were rewritten; ``items`` is a list of
            ``[name, layer, params, state]`` (mutable lists), and the names in
            :func:`sequence_names` run one after the other.
        path: dotted path of ``model`` (for messages and callbacks).

    Returns:
        ``(model, params, state)`` rebuilt; empty child trees are left out, as
        the combinators do.
    """
    if model.kind not in COMBINATORS:
        if leaf_fn is None:
            return model, params, state
        return leaf_fn(path, model, params, state)
    items = []
    for name, child in model.children:
        items.append(list(rewrite(child, params.get(name, {}), state.get(name, {}),
                                  leaf_fn=leaf_fn, seq_fn=seq_fn,
                                  path=child_path(path, name))))
        items[-1].insert(0, name)
    if seq_fn is not None:
        items = seq_fn(path, model, items)
    new_model = rebuild(model, [(name, layer) for name, layer, _, _ in items])
    new_params = {name: p for name, _, p, _ in items if p}
    new_state = {name: s for name, _, _, s in items if s}
    return new_model, new_params, new_state


def leaves(model: Layer, path: str = ""):
    """``[(path, Layer)]`` of every leaf, in execution order of the tree."""
    if model.kind not in COMBINATORS:
        return [(path, model)]
    out = []
    for name, child in model.children:
        out += leaves(child, child_path(path, name))
    return out


def get_path(tree: dict, path: str):
    """The subtree of a nested dict at a dotted ``path`` (``{}`` where absent)."""
    node = tree
    for part in path.split(".") if path else ():
        node = node.get(part, {}) if isinstance(node, dict) else {}
    return node
