"""The optax optimiser and learning-rate schedule a config asks for.

:func:`build_optimizer` turns the ``optim`` section of a run config (see
:mod:`jaxcnn.train.config`) into an ``optax.GradientTransformation`` and the
schedule it uses, so the trainer can log the learning rate of any step.

Chain order: global-norm clipping first (so every later statistic sees the
clipped gradient), then the optimiser.  Weight decay follows the convention
of the PyTorch optimiser of the same name: ``sgd``/``adam``/``lars`` add
``weight_decay * param`` to the gradient (L2), ``adamw``/``lamb`` decay the
weights decoupled from the adaptive scaling.  With ``mask_weight_decay``
(default) leaves with ``ndim <= 1`` (biases, norm scales and offsets) get no
decay and, for LARS, no trust-ratio scaling, as in Goyal et al. and You et al.

LARS and LAMB are assembled from optax transforms (the same ones, in the same
order, as ``optax.lars``/``optax.lamb``) because those aliases take no
``mu_dtype``; the tests check they match the aliases exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from jaxcnn.train.config import ConfigError, resolve_duration

_MU_DTYPES = {None: None, "f32": jnp.float32, "bf16": jnp.bfloat16}


def weight_decay_mask(params):
    """``True`` for leaves that get weight decay: those with ``ndim > 1``.

    Arguments:
        params: a pytree of arrays (conv kernels, dense weights, biases, ...).

    Returns:
        A pytree of bools with the structure of ``params``.
    """
    return jax.tree_util.tree_map(lambda p: jnp.ndim(p) > 1, params)


def _decay(schedule_cfg, steps_per_epoch):
    """The decay factor of the constant/step/multistep schedules: ``step -> float32``."""
    name = schedule_cfg.name
    gamma = schedule_cfg.decay_rate
    if name == "constant":
        def decay(step):
            return jnp.ones_like(step, jnp.float32)
    elif name == "step":
        every = resolve_duration(schedule_cfg.decay_every, steps_per_epoch, key="optim.schedule.decay_every")

        def decay(step):
            return jnp.float32(gamma) ** jnp.floor_divide(step, every).astype(jnp.float32)
    elif name == "multistep":
        milestones = [resolve_duration(m, steps_per_epoch, key=f"optim.schedule.milestones[{i}]")
                      for i, m in enumerate(schedule_cfg.milestones)]
        if any(b <= a for a, b in zip(milestones, milestones[1:])):
            raise ConfigError(f"optim.schedule.milestones: expected increasing steps, got {milestones} "
                              f"(from {list(schedule_cfg.milestones)})", path="optim.schedule.milestones")
        bounds = jnp.asarray(milestones, jnp.int32)

        def decay(step):
            passed = jnp.sum(jnp.asarray(step)[..., None] >= bounds, axis=-1)
            return jnp.float32(gamma) ** passed.astype(jnp.float32)
    else:
        raise ConfigError(f"optim.schedule.name: unknown schedule {name!r}", path="optim.schedule.name")
    return decay


def build_schedule(lr: float, schedule_cfg, *, total_steps: int, steps_per_epoch: int | None):
    """The learning rate as a function of the optimiser step.

    Schedules (``schedule_cfg.name``), with ``W`` the warm-up steps and ``T``
    ``total_steps``:

    - ``constant``: ``lr``;
    - ``step``: ``lr * decay_rate ** floor(t / decay_every)`` (PyTorch StepLR);
    - ``multistep``: ``lr * decay_rate ** #{m in milestones: m <= t}`` (MultiStepLR);
    - ``cosine``: warm-up to ``lr`` at ``W``, then a half cosine down to
      ``final_lr_fraction * lr`` at ``T`` (``optax.warmup_cosine_decay_schedule``);
    - ``onecycle``: ``optax.cosine_onecycle_schedule(T, lr, pct_start,
      div_factor, final_div_factor)``, PyTorch OneCycleLR's shape.

    For constant/step/multistep the warm-up multiplies the rate by a factor
    rising linearly from ``warmup_init_fraction`` at 0 to 1 at ``W``; decays
    count from step 0, not from the end of the warm-up.

    Arguments:
        lr: peak learning rate.
        schedule_cfg: the ``optim.schedule`` config section.
        total_steps: optimiser steps in the run (>= 1).
        steps_per_epoch: converts durations given in epochs.

    Returns:
        ``schedule(step) -> float32 scalar``, jit-able (``optax.Schedule``).

    Raises:
        ConfigError: a duration that does not fit ``total_steps``, or
            milestones that do not increase.
    """
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ConfigError(f"total_steps must be an int >= 1, got {total_steps!r}")
    name = schedule_cfg.name
    warmup = resolve_duration(schedule_cfg.warmup, steps_per_epoch, key="optim.schedule.warmup")
    if warmup > total_steps or (name == "cosine" and 0 < warmup == total_steps):
        raise ConfigError(
            f"optim.schedule.warmup: {warmup} steps ({schedule_cfg.warmup!r}) does not fit in a run of "
            f"{total_steps} steps; shorten it (e.g. optim.schedule.warmup=0)", path="optim.schedule.warmup")
    init_fraction = schedule_cfg.warmup_init_fraction

    if name == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=init_fraction * lr, peak_value=lr, warmup_steps=warmup,
            decay_steps=total_steps, end_value=schedule_cfg.final_lr_fraction * lr)
    if name == "onecycle":
        return optax.cosine_onecycle_schedule(
            total_steps, lr, pct_start=schedule_cfg.pct_start,
            div_factor=schedule_cfg.div_factor, final_div_factor=schedule_cfg.final_div_factor)

    decay = _decay(schedule_cfg, steps_per_epoch)

    def schedule(step):
        step = jnp.asarray(step, jnp.int32)
        if warmup > 0:
            ramp = jnp.minimum(step.astype(jnp.float32) / warmup, 1.0)
            factor = init_fraction + (1.0 - init_fraction) * ramp
        else:
            factor = 1.0
        return (lr * factor * decay(step)).astype(jnp.float32)

    return schedule


def build_optimizer(optim_cfg, *, total_steps: int, steps_per_epoch: int | None):
    """The optax optimiser for the ``optim`` config section.

    Arguments:
        optim_cfg: the ``optim`` section of a validated config.
        total_steps: optimiser steps in the run (schedules need it).
        steps_per_epoch: converts durations given in epochs; may be None when
            every duration is in steps.

    Returns:
        ``(transformation, schedule)``: an ``optax.GradientTransformation`` to
        use as ``tx.update(grads, opt_state, params)`` (params are required:
        weight decay and trust ratios read them), and ``schedule(step)``, the
        learning rate of optimiser step ``step``.

    Raises:
        ConfigError: see :func:`build_schedule`.
    """
    schedule = build_schedule(optim_cfg.lr, optim_cfg.schedule, total_steps=total_steps,
                              steps_per_epoch=steps_per_epoch)
    name = optim_cfg.name
    wd = optim_cfg.weight_decay
    mask = weight_decay_mask if optim_cfg.mask_weight_decay else None
    mu_dtype = _MU_DTYPES[optim_cfg.mu_dtype]
    momentum = optim_cfg.momentum

    parts = []
    if optim_cfg.grad_clip_norm is not None:
        parts.append(optax.clip_by_global_norm(optim_cfg.grad_clip_norm))
    if name in ("sgd", "adam") and wd > 0:
        parts.append(optax.add_decayed_weights(wd, mask))
    if name == "sgd":
        parts.append(optax.sgd(schedule, momentum=momentum or None, nesterov=optim_cfg.nesterov,
                               accumulator_dtype=mu_dtype))
    elif name == "adam":
        parts.append(optax.adam(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                                mu_dtype=mu_dtype))
    elif name == "adamw":
        parts.append(optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                                 mu_dtype=mu_dtype, weight_decay=wd, mask=mask))
    elif name == "lars":
        trust_ratio = optax.scale_by_trust_ratio(trust_coefficient=optim_cfg.trust_coefficient,
                                                 eps=optim_cfg.eps)
        parts += [
            optax.add_decayed_weights(wd, mask),
            trust_ratio if mask is None else optax.masked(trust_ratio, mask),
            optax.scale_by_learning_rate(schedule),
            optax.trace(decay=momentum, nesterov=optim_cfg.nesterov, accumulator_dtype=mu_dtype),
        ]
    elif name == "lamb":
        parts += [
            optax.scale_by_adam(b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps, mu_dtype=mu_dtype),
            optax.add_decayed_weights(wd, mask),
            optax.scale_by_trust_ratio(),
            optax.scale_by_learning_rate(schedule),
        ]
    else:
        raise ConfigError(f"optim.name: unknown optimiser {name!r}", path="optim.name")
    return optax.chain(*parts), schedule
