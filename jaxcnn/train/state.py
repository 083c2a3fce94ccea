"""The training state: the one pytree a step consumes and a checkpoint stores."""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jaxcnn import precision as P


class TrainState(NamedTuple):
    """Everything that changes during training, as a pytree of arrays.

    Arguments:
        step: int32 scalar, the number of optimiser steps taken.
        params: the model's trainable parameters (nested dicts).
        state: the model's non-trained variables (BatchNorm statistics).
        opt_state: the optax optimiser state (a :class:`MasterCopyState` when
            the policy keeps a float32 master copy of low-precision parameters).
        loss_scale: the loss-scale state (see ``jaxcnn.precision``).
        rng: uint32 key data; the key for step ``s`` is ``fold_in(rng, s)``,
            so a resumed run draws the same dropout masks as an uninterrupted one.
        skipped: int32 scalar, steps skipped for non-finite gradients.
    """

    step: Any
    params: Any
    state: Any
    opt_state: Any
    loss_scale: Any
    rng: Any
    skipped: Any


class MasterCopyState(NamedTuple):
    """Optimiser state under a policy with a master copy (``bf16_params``):
    the optimiser updates ``master`` (float32) and the stored low-precision
    parameters are re-cast from it after every step, so small updates
    accumulate instead of rounding away."""

    master: Any
    inner: Any


def create_train_state(model, tx, key, input_shape, *, loss_scale, policy=None) -> TrainState:
    """Initialise a model and its optimiser.

    Arguments:
        model: a ``jaxcnn.layers.Layer``.
        tx: an ``optax.GradientTransformation``.
        key: a PRNG key (typed or raw); split into init and dropout keys.
        input_shape: the model's input shape ``(N, H, W, C)``.
        loss_scale: the initial loss-scale state.
        policy: optional ``Policy``; parameters are stored in its ``param_dtype``.
    """
    init_key, dropout_key = jax.random.split(key)
    params, state, _ = model.init(init_key, input_shape)
    opt_state = init_opt_state(tx, params, policy)
    if policy is not None:
        params = policy.cast_to_param(params)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        state=state,
        opt_state=opt_state,
        loss_scale=loss_scale,
        rng=jax.random.key_data(dropout_key) if _is_typed_key(dropout_key) else dropout_key,
        skipped=jnp.zeros((), jnp.int32),
    )


def init_opt_state(tx, params, policy=None):
    """``tx.init`` of ``params``, or under a policy that keeps a float32 master copy, a
    :class:`MasterCopyState` of that copy and ``tx.init`` of it."""
    if policy is not None and policy.needs_master_copy:
        master = P.cast_floating(params, policy.master_dtype)
        return MasterCopyState(master, tx.init(master))
    return tx.init(params)


def _is_typed_key(key) -> bool:
    return jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
