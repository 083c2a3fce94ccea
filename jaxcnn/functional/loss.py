"""Classification loss and accuracy."""
from __future__ import annotations

import jax
import jax.numpy as jnp

_REDUCTIONS = ("mean", "sum", "none")


def _check_labels(op: str, logits, labels) -> None:
    l_shape, y_shape = tuple(jnp.shape(logits)), tuple(jnp.shape(labels))
    if len(l_shape) < 1 or y_shape != l_shape[:-1]:
        raise ValueError(
            f"{op}: labels shape {y_shape} must be logits shape {l_shape} without its "
            f"last (class) axis")
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise ValueError(f"{op}: labels must be integer class indices, got dtype "
                         f"{jnp.result_type(labels)}")


def _check_where(op: str, where, labels) -> None:
    if where is not None and tuple(jnp.shape(where)) != tuple(jnp.shape(labels)):
        raise ValueError(f"{op}: where shape {tuple(jnp.shape(where))} must match labels "
                         f"shape {tuple(jnp.shape(labels))}")


def cross_entropy(logits, labels, *, label_smoothing=0.0, reduction="mean", where=None):
    """Softmax cross-entropy with integer labels, like PyTorch's ``F.cross_entropy``.

    Computed in float32 whatever the dtype of ``logits``. With label smoothing
    ``eps`` the target puts ``1 - eps`` on the label and ``eps`` spread evenly
    over all ``K`` classes, so the loss is
    ``(1 - eps) * nll + eps * mean_k(-log p_k)``.

    Arguments:
        logits: ``(..., K)`` unnormalised scores.
        labels: ``(...)`` integer class indices in ``[0, K)`` (not checked:
            values are traced).
        label_smoothing: ``eps`` in ``[0, 1]``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        where: optional boolean mask like ``labels``; masked-out entries count
            for nothing, ``"mean"`` averages over the entries kept, and
            ``"none"`` gives them a loss of 0.

    Returns:
        A float32 scalar, or float32 ``(...)`` for ``reduction="none"``.
    """
    op = "cross_entropy"
    _check_labels(op, logits, labels)
    _check_where(op, where, labels)
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"{op}: label_smoothing must be in [0, 1], got {label_smoothing!r}")
    logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    loss = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
    if label_smoothing:
        loss = (1.0 - label_smoothing) * loss - label_smoothing * jnp.mean(logp, axis=-1)
    if where is not None:
        loss = jnp.where(where, loss, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return jnp.sum(loss)
    count = loss.size if where is None else jnp.sum(where, dtype=jnp.float32)
    return jnp.sum(loss) / count


def top_k_correct(logits, labels, k=1):
    """Whether each label is among the ``k`` highest logits.

    A label counts as correct when fewer than ``k`` classes score strictly
    higher, so ties are resolved in the label's favour (deterministically,
    unlike a ``top_k`` index comparison).

    Arguments:
        logits: ``(..., K)`` scores.
        labels: ``(...)`` integer class indices.
        k: how many top classes count, ``1 <= k``.

    Returns:
        Boolean ``(...)``.
    """
    op = "top_k_correct"
    _check_labels(op, logits, labels)
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"{op}: k must be a positive int, got {k!r}")
    label_score = jnp.take_along_axis(logits, labels[..., None], axis=-1)
    return jnp.sum(logits > label_score, axis=-1) < k


def top_k_accuracy(logits, labels, k=1, where=None):
    """Fraction of entries whose label is among the ``k`` highest logits.

    Arguments:
        logits: ``(..., K)`` scores.
        labels: ``(...)`` integer class indices.
        k: how many top classes count.
        where: optional boolean mask like ``labels``; the fraction is over the
            entries kept.

    Returns:
        A float32 scalar.
    """
    _check_where("top_k_accuracy", where, labels)
    correct = top_k_correct(logits, labels, k).astype(jnp.float32)
    if where is None:
        return jnp.mean(correct)
    return jnp.sum(jnp.where(where, correct, 0.0)) / jnp.sum(where, dtype=jnp.float32)
