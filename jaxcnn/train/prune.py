"""Magnitude pruning of convolution and linear weights, and the masks that keep them pruned in training.

* ``structure="unstructured"``: the individual weights of smallest ``|w|``
  are zeroed;
* ``structure="channel"``: whole output channels (filters) of smallest L2
  norm are zeroed, weight and bias; the model's last conv/linear layer (the
  logits) is never channel-pruned.

``scope="global"`` ranks all prunable weights together (channels by their
RMS, so layers of different fan-in compare fairly; every layer keeps at
least one channel); ``scope="layer"`` prunes each layer to the same
sparsity.  Masks are a flat ``{"layer.path.w": bool array}`` dict (True =
kept).  Training a pruned model is the trainer's job: its ``prune:`` config
section calls :func:`magnitude_prune` on the run's initial parameters
(``model.init_from``) and chains :func:`mask_updates` after the optimiser, so
pruned weights stay at exactly zero; :func:`jaxcnn.export.prune.fine_tune` sets that
up for a trained run directory and calls :func:`jaxcnn.train.run.train`.  Pruning and
masks belong to training; export re-exports these names from :mod:`jaxcnn.export.prune`.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcnn.errors import ConfigError, ExportError
from jaxcnn.interop.arrays import flatten, unflatten
from jaxcnn.layers._tree import child_path, get_path, leaves

PRUNABLE = ("conv2d", "linear")


def prunable_layers(model, params) -> list[str]:
    """Paths of the conv2d/linear layers with a weight ``w``, in model order."""
    return [path for path, layer in leaves(model)
            if layer.kind in PRUNABLE and "w" in get_path(params, path)]


def _ranked_prune(scores: np.ndarray, count: int) -> np.ndarray:
    """Boolean keep-mask dropping the ``count`` smallest scores (ties by position)."""
    keep = np.ones(scores.shape, bool)
    if count > 0:
        keep[np.argpartition(scores, count - 1)[:count]] = False
    return keep


def magnitude_prune(model, params, sparsity: float, *, scope: str = "global",
                    structure: str = "unstructured", exclude=()):
    """Zero the smallest-magnitude weights of the conv2d/linear layers.

    Arguments:
        model: the Layer tree (used to find the prunable layers).
        params: its parameters.
        sparsity: fraction in ``[0, 1)`` of the prunable weights (or of the
            output channels) to zero.
        scope: ``"global"`` or ``"layer"`` (see the module docstring).
        structure: ``"unstructured"`` or ``"channel"``.
        exclude: layer paths (or path prefixes such as ``"fc2"``) left dense.

    Returns:
        ``(pruned_params, masks)``: a new params tree and ``{leaf path: keep mask}``.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ExportError(f"prune sparsity must be in [0, 1), got {sparsity!r}")
    if scope not in ("global", "layer"):
        raise ExportError(f"prune scope must be 'global' or 'layer', got {scope!r}")
    if structure not in ("unstructured", "channel"):
        raise ExportError(f"prune structure must be 'unstructured' or 'channel', got {structure!r}")
    paths = [p for p in prunable_layers(model, params)
             if not any(p == e or p.startswith(e + ".") for e in exclude)]
    if structure == "channel" and paths and paths[-1] == prunable_layers(model, params)[-1]:
        paths = paths[:-1]  # pruning output channels of the last layer would remove classes
    if not paths:
        raise ExportError("nothing to prune: the model has no conv2d/linear weights left "
                          "after the exclusions")
    weights = {p: np.asarray(get_path(params, p)["w"], np.float32) for p in paths}
    if structure == "unstructured":
        scores = {p: np.abs(w).ravel() for p, w in weights.items()}
    else:  # per output channel (the last axis): RMS for global ranking, plain norm per layer
        scores = {p: np.sqrt(np.mean(np.square(w.reshape(-1, w.shape[-1])), axis=0)) for p, w in
                  weights.items()}
    keeps = {}
    if scope == "layer":
        for p, sc in scores.items():
            keeps[p] = _ranked_prune(sc, int(round(sparsity * sc.size)))
    else:
        allsc = np.concatenate([scores[p] for p in paths])
        keep = _ranked_prune(allsc, int(round(sparsity * allsc.size)))
        start = 0
        for p in paths:
            n = scores[p].size
            keeps[p] = keep[start:start + n]
            if structure == "channel" and not keeps[p].any():
                keeps[p][np.argmax(scores[p])] = True  # never remove a whole layer
            start += n
    flat = flatten(params)
    masks = {}
    for p in paths:
        w = weights[p]
        if structure == "unstructured":
            masks[child_path(p, "w")] = keeps[p].reshape(w.shape)
        else:
            masks[child_path(p, "w")] = np.broadcast_to(keeps[p], w.shape).copy()
            if child_path(p, "b") in flat:
                masks[child_path(p, "b")] = keeps[p].copy()
    return apply_masks(params, masks), masks


def apply_masks(params, masks: dict):
    """``params`` with every masked leaf multiplied by its keep-mask (dtype kept)."""
    flat = flatten(params)
    for key, mask in masks.items():
        if key not in flat:
            raise ExportError(f"mask for {key!r} matches no parameter")
        flat[key] = np.where(mask, flat[key], np.zeros((), flat[key].dtype))
    return unflatten(flat)


def sparsity_report(model, params) -> dict:
    """Fraction of exact zeros per prunable layer and overall.

    Returns:
        ``{"layers": {path: {"zeros", "size", "sparsity"}}, "prunable_sparsity":
        zeros / size over conv2d/linear weights, "total_sparsity": over all
        parameters}``.
    """
    layers = {}
    for p in prunable_layers(model, params):
        w = np.asarray(get_path(params, p)["w"])
        zeros = int(np.sum(w == 0))
        layers[p] = {"zeros": zeros, "size": int(w.size), "sparsity": zeros / max(w.size, 1)}
    flat = flatten(params)
    total_zeros = sum(int(np.sum(v == 0)) for v in flat.values())
    total = sum(int(v.size) for v in flat.values())
    pz, ps = sum(v["zeros"] for v in layers.values()), sum(v["size"] for v in layers.values())
    return {"layers": layers, "prunable_sparsity": pz / max(ps, 1),
            "total_sparsity": total_zeros / max(total, 1)}


class PruneMask(NamedTuple):
    """Optimiser state of :func:`mask_updates`.

    Arguments:
        keep: a tree shaped like the parameters (their dtype), 1 where a
            weight trains and 0 where it was pruned.  It lives in the train
            state, so checkpoints carry it and a resumed run keeps its masks.
    """

    keep: Any


def mask_updates() -> optax.GradientTransformation:
    """An optax transformation that zeroes the updates of pruned weights.

    Chained after the optimiser (``optax.chain(tx, mask_updates())``), it
    acts on the final updates, so neither weight decay nor momentum can move
    a pruned weight off zero.  ``init`` keeps everything (all ones); set the
    masks in the initial state with :func:`with_keep`.
    """
    def init(params):
        return PruneMask(jax.tree_util.tree_map(jnp.ones_like, params))

    def update(updates, state, params=None):
        del params
        # where, not a product: a pruned weight's update is 0 even if the raw one is not finite
        masked = jax.tree_util.tree_map(
            lambda u, k: jnp.where(k != 0, u, jnp.zeros((), u.dtype)), updates, state.keep)
        return masked, state

    return optax.GradientTransformation(init, update)


def keep_tree(params, masks: dict):
    """The ``keep`` tree of :class:`PruneMask` for ``params``: float32 ones,
    with the leaves named in ``masks`` (from :func:`magnitude_prune`) set to them."""
    flat = {k: np.ones(v.shape, np.float32) for k, v in flatten(params).items()}
    for key, mask in masks.items():
        if key not in flat:
            raise ExportError(f"mask for {key!r} matches no parameter")
        flat[key] = np.asarray(mask, np.float32)
    return unflatten(flat)


def with_keep(opt_state, keep):
    """``opt_state`` with the ``keep`` of every :class:`PruneMask` in it replaced
    by ``keep`` (cast to the dtype it had)."""
    def put(node):
        if not isinstance(node, PruneMask):
            return node
        return PruneMask(jax.tree_util.tree_map(lambda old, new: jnp.asarray(new, old.dtype),
                                                node.keep, keep))

    return jax.tree_util.tree_map(put, opt_state, is_leaf=lambda n: isinstance(n, PruneMask))


# -- the trainer's prune section: one setup, in two halves (the optimiser exists before the
#    parameters it will prune, which are the run's initial ones) --------------------------------

def prune_optimizer(tx: optax.GradientTransformation, amount: float) -> optax.GradientTransformation:
    """``tx`` followed by :func:`mask_updates` when the run prunes (``amount > 0``), else ``tx``."""
    return optax.chain(tx, mask_updates()) if amount > 0 else tx


def prune_start(model, trees, *, amount: float, scope: str, structure: str):
    """The run's starting point pruned as its ``prune`` section says.

    Arguments:
        model: the run's model (its layer kinds decide what is prunable).
        trees: ``(params, model_state)`` host trees the run starts from.
        amount, scope, structure: the ``prune`` section (see :func:`magnitude_prune`).

    Returns:
        ``(trees, keep)``: the pruned ``(params, model_state)`` and the ``keep`` tree for
        :func:`with_keep`; ``(trees, None)`` unchanged when ``amount`` is 0.

    Raises:
        ConfigError: ``prune.amount`` cannot be applied to this model.
    """
    if amount == 0:
        return trees, None
    try:
        params, masks = magnitude_prune(model, trees[0], amount, scope=scope, structure=structure)
    except ExportError as e:
        raise ConfigError(f"prune.amount: {e}", path="prune.amount") from None
    return (params, trees[1]), keep_tree(params, masks)


def describe_keep(keep) -> str:
    """``"N of M parameters held at zero"`` for a ``keep`` tree."""
    leaves = jax.tree_util.tree_leaves(keep)
    return (f"{sum(int(np.sum(k == 0)) for k in leaves)} of {sum(k.size for k in leaves)} "
            "parameters held at zero")
