"""Magnitude pruning of convolution and linear weights, and a masked fine-tune.

* ``structure="unstructured"``: the individual weights of smallest ``|w|``
  are zeroed;
* ``structure="channel"``: whole output channels (filters) of smallest L2
  norm are zeroed, weight and bias; the model's last conv/linear layer (the
  logits) is never channel-pruned.

``scope="global"`` ranks all prunable weights together (channels by their
RMS, so layers of different fan-in compare fairly; every layer keeps at
least one channel); ``scope="layer"`` prunes each layer to the same
sparsity.  Masks are a flat ``{"layer.path.w": bool array}`` dict (True =
kept); :func:`fine_tune` trains with the trainer's step and optimiser while
keeping pruned weights at exactly zero.
"""
from __future__ import annotations

import numpy as np

from jaxcnn.export._tree import ExportError, child_path, get_path, leaves
from jaxcnn.interop.arrays import flatten, unflatten

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


def fine_tune(cfg, model, params, state, masks: dict, *, steps: int, seed: int = 0):
    """Train a pruned model for ``steps`` steps, pruned weights held at zero.

    Uses the trainer's pieces: the run's data, optimiser (built from
    ``cfg.optim`` for a run of ``steps`` steps, so set ``optim.lr`` in ``cfg``
    for a gentler fine-tune), precision policy and ``make_train_step``; the
    optimiser's updates are multiplied by the masks, so weight decay and
    momentum cannot revive a pruned weight.

    Arguments:
        cfg: a validated run config (e.g. a run directory's resolved config).
        model: the Layer tree; params/state its (pruned) trees.
        masks: from :func:`magnitude_prune`.
        steps: number of optimiser steps (>= 1).
        seed: dropout seed.

    Returns:
        ``(params, state)`` after fine-tuning, as host NumPy trees.
    """
    import jax
    import jax.numpy as jnp
    import optax

    from jaxcnn.train.config import with_overrides
    from jaxcnn.train.loop import batch_fn, build_run, matmul_precision
    from jaxcnn.train.state import TrainState
    from jaxcnn.train.step import make_train_step

    if steps < 1:
        raise ExportError(f"fine-tune steps must be >= 1, got {steps}")
    cfg = with_overrides(cfg, [f"train.steps={int(steps)}"])  # the schedule spans the fine-tune
    run = build_run(cfg)
    keep = unflatten({k: v.astype(np.float32) for k, v in
                      {**{k: np.ones((), np.float32) for k in flatten(params)}, **masks}.items()})
    tx = optax.chain(run.tx, optax.stateless(
        lambda updates, _: jax.tree_util.tree_map(lambda u, m: u * m.astype(u.dtype), updates, keep)))
    params = jax.tree_util.tree_map(jnp.asarray, params)
    train_state = TrainState(step=jnp.zeros((), jnp.int32), params=params,
                             state=jax.tree_util.tree_map(jnp.asarray, state),
                             opt_state=tx.init(params), loss_scale=run.loss_scale,
                             rng=jax.random.key_data(jax.random.key(seed)),
                             skipped=jnp.zeros((), jnp.int32))
    step = jax.jit(make_train_step(model, tx, policy=run.policy,
                                   label_smoothing=cfg.optim.label_smoothing))
    make_batch = batch_fn(run)
    with matmul_precision(cfg):
        for i in range(steps):
            train_state, _ = step(train_state, make_batch(i))
    return jax.device_get((train_state.params, train_state.state))
