"""Fold inference-mode BatchNorm into the convolution (or linear layer) before it.

In eval mode ``BatchNorm(conv(x) + b)`` is ``(conv(x) + b - mean) * g + bias``
with ``g = scale / sqrt(var + eps)``, an affine map per output channel, so the
pair is one convolution with weight ``w * g`` (scaling each output channel)
and bias ``(b - mean) * g + bias``.  The folded weights are computed in
float64 and rounded once to the parameters' dtype, so the folded model agrees
with the original to float32 rounding.
"""
from __future__ import annotations

import numpy as np

from jaxcnn import layers as L
from jaxcnn.layers._tree import child_path, rewrite, sequence_names

_FOLDABLE = ("conv2d", "linear")


def _with_bias(layer):
    """The same conv2d/linear layer, now with a bias."""
    c = layer.config
    if layer.kind == "linear":
        return L.Linear(c["out_features"], use_bias=True)
    return L.Conv2D(c["out_channels"], c["kernel_size"], stride=c["stride"], padding=c["padding"],
                    dilation=c["dilation"], groups=c["groups"], use_bias=True)


def fold_pair(w, b, bn_params, bn_state, eps: float):
    """Folded ``(w, b)`` of a conv/linear layer followed by BatchNorm.

    Arguments:
        w: weight whose last axis is the output channel: ``(KH, KW, C_in // g, C_out)``
            or ``(in, out)``.
        b: bias ``(C_out,)`` or None.
        bn_params: ``{"scale", "bias"}`` of the BatchNorm, each ``(C_out,)``.
        bn_state: ``{"mean", "var"}`` running statistics, each ``(C_out,)``.
        eps: the BatchNorm's epsilon.

    Returns:
        ``(w', b')`` in ``w``'s dtype, same shapes (``b'`` is ``(C_out,)``).
    """
    dtype = np.asarray(w).dtype
    g = (np.asarray(bn_params["scale"], np.float64)
         / np.sqrt(np.asarray(bn_state["var"], np.float64) + eps))
    b64 = np.zeros_like(g) if b is None else np.asarray(b, np.float64)
    w_new = np.asarray(w, np.float64) * g
    b_new = (b64 - np.asarray(bn_state["mean"], np.float64)) * g \
        + np.asarray(bn_params["bias"], np.float64)
    return w_new.astype(dtype), b_new.astype(dtype)


def fold_batch_norm(model, params, state):
    """Fold every BatchNorm that directly follows a conv2d or linear layer.

    Pairs are looked for among siblings that run in sequence (a serial's
    children, a residual's main branch).  The folded layer gains a bias; the
    BatchNorm becomes an ``Identity`` under the same name, so every other
    path (and so the PyTorch naming) is unchanged.  A BatchNorm with no such
    predecessor is kept as it is.

    Arguments:
        model: a Layer (e.g. from :func:`jaxcnn.models.get`).
        params, state: its parameters and state (BatchNorm running statistics).

    Returns:
        ``(model, params, state)`` for inference: the normal ``apply`` with
        ``train=False`` gives the original model's eval-mode output up to
        float32 rounding. (Training the folded model is not the same model.)
    """
    def seq_fn(path, layer, items):
        seq = set(sequence_names(layer))
        for prev, item in zip(items, items[1:]):
            if not (prev[0] in seq and item[0] in seq and prev[1].kind in _FOLDABLE
                    and item[1].kind == "batch_norm"):
                continue
            _, conv, conv_params, conv_state = prev
            w, b = fold_pair(conv_params["w"], conv_params.get("b"), item[2], item[3],
                             item[1].config["eps"])
            prev[1:] = [_with_bias(conv), {"w": w, "b": b}, conv_state]
            item[1:] = [L.Identity(), {}, {}]
        return items

    return rewrite(model, params, state, seq_fn=seq_fn)


def batch_norm_paths(model, path: str = "") -> list[str]:
    """Paths of the BatchNorm layers left in ``model``."""
    if model.kind == "batch_norm":
        return [path]
    return [p for name, child in model.children
            for p in batch_norm_paths(child, child_path(path, name))]
