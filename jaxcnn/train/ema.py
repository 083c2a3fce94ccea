"""An exponential moving average of the parameters, kept in the optimiser state.

:func:`ema` is an optax transformation chained last: it passes the updates through unchanged
and keeps ``ema = decay * ema + (1 - decay) * (params + updates)``, starting from the initial
parameters (as timm's ``ModelEmaV2`` and Flax's examples do). Living in the optimiser state, the
average is checkpointed with it, sharded like the parameters (``parallel.rules.follow_params``),
restored exactly on resume and left unchanged on a skipped (non-finite) step. Under a policy
with a float32 master copy it averages the master. Only the trained parameters are averaged;
BatchNorm's running statistics are already a moving average and are used as they are.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class EmaState(NamedTuple):
    """Optimiser state of :func:`ema`: the averaged parameters (float, like the params)."""

    params: Any


def ema(decay: float) -> optax.GradientTransformation:
    """The moving average of ``params + updates`` with weight ``decay`` on the old average.

    Raises:
        ValueError: ``decay`` outside ``[0, 1)``.
    """
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"ema decay must be in [0, 1), got {decay!r}")

    def init(params):
        return EmaState(jax.tree_util.tree_map(jnp.asarray, params))

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("ema needs the parameters: call tx.update(updates, state, params)")
        new = optax.apply_updates(params, updates)
        averaged = jax.tree_util.tree_map(
            lambda a, p: (decay * a + (1.0 - decay) * p.astype(a.dtype)).astype(a.dtype),
            state.params, new)
        return updates, EmaState(averaged)

    return optax.GradientTransformation(init, update)


def find_ema(opt_state):
    """The averaged parameters in an optimiser state (a :class:`EmaState` anywhere in it), or
    None when the optimiser keeps none."""
    found = []

    def visit(node):
        if isinstance(node, EmaState):
            found.append(node.params)
        return node

    jax.tree_util.tree_map(visit, opt_state, is_leaf=lambda n: isinstance(n, EmaState))
    return found[0] if found else None


def eval_params(state, policy=None):
    """The parameters a run evaluates and exports: the moving average when the optimiser keeps
    one (cast to the policy's parameter dtype), else the trained parameters."""
    averaged = find_ema(state.opt_state)
    if averaged is None:
        return state.params
    return policy.cast_to_param(averaged) if policy is not None else averaged
