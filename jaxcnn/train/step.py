"""Pure train and eval steps.

:func:`make_train_step` returns a :class:`TrainStep`: its ``step(state, batch) -> (state,
metrics)`` is a pure function of a :class:`TrainState` and a batch ``{"image": (N, H, W, C),
"label": (N,)}`` (jit it, or give the whole tuple to ``plan.wrap_step`` for a mesh), and its
other fields are what the ``parallel`` package needs to run it: the BatchNorm axis, the
pipeline, and the per-stage pieces of an MPMD pipeline. :func:`make_eval_step` returns an
:class:`EvalStep` the same way.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxcnn import functional as F
from jaxcnn import precision as P
from jaxcnn.data import mix as mixing
from jaxcnn.layers.base import Choices
from jaxcnn.parallel.mesh import DATA
from jaxcnn.train.state import MasterCopyState, TrainState, init_opt_state


class StageFns(NamedTuple):
    """The pieces of a train step that :class:`jaxcnn.parallel.mpmd.MPMD` runs as one program
    per pipeline stage (``parallel.pipeline.engine: mpmd``)."""

    head: Callable          # (logits, labels, loss_scale) -> (scaled loss, (loss, top1))
    prepare: Callable       # batch images -> the first stage's input (normalised on the device)
    policy: Any
    choices: Choices
    init_opt: Callable      # params -> optimiser state (a stage's own)
    update: Callable        # (params, opt_state, grads, global norm) -> (grads, params, opt_state)
    finish: Callable        # see _finish
    sync_batch_norm: bool
    select_nonfinite: Callable  # state -> whether a non-finite step leaves the state unchanged


class TrainStep(NamedTuple):
    """A train step and what a mesh needs to run it.

    ``step(state, batch) -> (state, metrics)``: the pure step, one program (None for an MPMD
    pipeline, whose stages are separate programs: ``stages`` holds their pieces).
    ``batch_norm_axis_name``: the axis BatchNorm syncs over, or None. ``pipeline``: the
    :class:`jaxcnn.parallel.Pipeline` it was built for, or None. ``plan.wrap_step`` reads all four.
    """

    step: Callable | None
    batch_norm_axis_name: str | None
    pipeline: Any = None
    stages: StageFns | None = None


class EvalStep(NamedTuple):
    """``step(params, model_state, batch) -> sums``, and the pieces an MPMD pipeline runs
    stage by stage (``prepare(images)``, the model's input; ``sums(logits, batch)``, the
    policy and the layers' choices)."""

    step: Callable
    sums: Callable
    policy: Any
    choices: Choices
    prepare: Callable


def _loss_policy(policy):
    return None if policy is None else policy.for_layer("loss")


def device_normalize(images, image_norm):
    """``(images / 255 - mean) / std`` in float32 for ``uint8`` images when ``image_norm``
    is ``(mean, std)``; anything else unchanged."""
    if image_norm is None or images.dtype != jnp.uint8:
        return images
    mean, std = (jnp.asarray(v, jnp.float32) for v in image_norm)
    return (images.astype(jnp.float32) * (1.0 / 255.0) - mean) / std


def cross_device_mean(tree, axis_name):
    """``lax.pmean`` of a pytree over ``axis_name``; on the CPU, 16-bit floats as float32.

    XLA:CPU has no 16-bit all-reduce: it promotes one to float32 itself, and
    its promotion pass aborts the process on the reducer that ``shard_map``'s
    bfloat16 ``psum`` carries (jax 0.10.2 and 0.11.2). Promoting here first
    computes the same float32 sum without the abort. GPUs reduce 16-bit
    floats natively and keep them 16-bit on the wire.
    """
    if jax.default_backend() != "cpu":
        return jax.lax.pmean(tree, axis_name)
    narrow = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
    wide = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32) if narrow(x) else x, tree)
    mean = jax.lax.pmean(wide, axis_name)
    return jax.tree_util.tree_map(lambda m, x: m.astype(x.dtype), mean, tree)


# fold_in constant of the mixing draws: the model's own randomness (dropout) uses the step key
_MIX_STREAM = 0x6D6978


def _micro_batches(x, k: int):
    """``(N, ...) -> (k, N // k, ...)``, example ``i`` in micro-batch ``i % k`` (each device's
    rows stay on that device when the batch is sharded over its first axis)."""
    n = x.shape[0]
    if n % k:
        raise ValueError(f"train.accumulate_steps: {k} does not divide the batch of {n} examples "
                         "of each device's step")
    return x.reshape((n // k, k) + x.shape[1:]).swapaxes(0, 1)


def _as_applied(grads, opt_state, policy):
    """The gradients in the dtype the optimiser sees them (the master copy's, if any)."""
    if isinstance(opt_state, MasterCopyState):
        return P.cast_floating(grads, policy.master_dtype)
    return grads


def _clipped(grads, opt_state, policy, norm, max_norm):
    """``optax.clip_by_global_norm(max_norm)`` first in the chain, given the gradients' global
    norm ``norm``: in the dtype the optimiser sees them, unchanged below the bound, else scaled
    to it (``max_norm`` None: unchanged)."""
    if max_norm is None:
        return grads
    return jax.tree_util.tree_map(lambda g: jnp.where(norm < max_norm, g, (g / norm.astype(g.dtype)) * max_norm),
                                  _as_applied(grads, opt_state, policy))


def _finish(schedule):
    """``finish((step, loss_scale, skipped), finite, grad_norm, loss, top1) -> (step, loss_scale,
    skipped, metrics)``: the scalars of a train step after its update (every engine's)."""
    def finish(scalars, finite, grad_norm, loss, top1):
        step, loss_scale, skipped = scalars
        skipped = skipped + jnp.where(finite, 0, 1).astype(jnp.int32)
        metrics = {
            "loss": loss.astype(jnp.float32),
            "top1": top1.astype(jnp.float32),
            "grad_norm": grad_norm.astype(jnp.float32),
            "lr": jnp.asarray(schedule(step) if schedule is not None else 0.0, jnp.float32),
            "loss_scale": jnp.asarray(P.current_scale(loss_scale), jnp.float32),
            "finite": finite.astype(jnp.float32),
            "skipped": skipped,
        }
        return step + 1, loss_scale.adjust(finite), skipped, metrics

    return finish


def apply_optimizer(tx: optax.GradientTransformation, state: TrainState, grads, policy):
    """One optimiser update: ``(grads as applied, new params, new optimiser state)``.

    With a float32 master copy (:class:`MasterCopyState`, low-precision parameters) the
    gradients are cast to the master dtype, the master is updated and the parameters are its
    cast; otherwise the parameters are updated directly.
    """
    if isinstance(state.opt_state, MasterCopyState):
        master = state.opt_state.master
        grads = P.cast_floating(grads, policy.master_dtype)
        updates, inner = tx.update(grads, state.opt_state.inner, master)
        master = optax.apply_updates(master, updates)
        return grads, policy.cast_to_param(master), MasterCopyState(master, inner)
    updates, new_opt_state = tx.update(grads, state.opt_state, state.params)
    return grads, optax.apply_updates(state.params, updates), new_opt_state


def _loss_fn(model, *, policy, choices, label_smoothing, image_norm, mix):
    """``loss_fn(params, model_state, batch, rng, loss_scale) -> (scaled loss, (loss, top1,
    new model state))``: the batch normalised on the device, mixed (``mix``), through the
    model in training mode, against the labels (both labels of a mixed pair, weighted)."""
    loss_policy = _loss_policy(policy)
    mixes = mix is not None and mix.enabled

    def loss_fn(params, model_state, batch, rng, loss_scale):
        images, labels = device_normalize(batch["image"], image_norm), batch["label"]
        if mixes:
            if not jnp.issubdtype(images.dtype, jnp.floating):
                images = images.astype(jnp.float32)
            drawn = mixing.draw(jax.random.fold_in(rng, _MIX_STREAM), mix, images.shape[1:3])
            images, labels, others, lam = mixing.apply(images, labels, drawn)
        logits, new_model_state = model.apply(
            params, model_state, images, train=True, rng=rng, policy=policy, choices=choices)
        logits = P.cast_for(loss_policy, "loss", logits)
        loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        if mixes:  # the cross-entropy against the mixed target: it is linear in the target
            loss = lam * loss + (1.0 - lam) * F.cross_entropy(logits, others,
                                                              label_smoothing=label_smoothing)
        top1 = F.top_k_accuracy(logits, batch["label"], k=1)
        return loss_scale.scale(loss), (loss, top1, new_model_state)

    return loss_fn


def _head(*, policy, label_smoothing):
    """``head(logits, labels, loss_scale) -> (scaled loss, (loss, top1))``: the loss of
    :func:`_loss_fn` without mixing, for a pipeline's last stage."""
    loss_policy = _loss_policy(policy)

    def head(logits, labels, loss_scale):
        logits = P.cast_for(loss_policy, "loss", logits)
        loss = F.cross_entropy(logits, labels, label_smoothing=label_smoothing)
        return loss_scale.scale(loss), (loss, F.top_k_accuracy(logits, labels, k=1))

    return head


def _check_pipelined(pipeline, accumulate, axis_name, mix):
    """What a pipelined step (either engine) needs of ``make_train_step``'s arguments."""
    if axis_name is None:
        raise ValueError("parallel.pipeline: the step runs its stages under shard_map over the data "
                         "axis; build it with axis_name=plan.step_axis_name")
    if accumulate not in (1, pipeline.microbatches):
        raise ValueError(f"train.accumulate_steps: {accumulate} micro-batches, but the pipeline runs "
                         f"parallel.pipeline.microbatches={pipeline.microbatches}")
    if mix is not None and mix.enabled:
        raise ValueError("data.mix: mixup/CutMix is not supported with pipeline parallelism (mesh.pipe > 1)")


def _pipeline_gradients(pipeline, policy, choices, image_norm, label_smoothing, mix, accumulate,
                        axis_name, sync_batch_norm):
    """``gradients(state, batch, rng) -> (scaled gradients, loss, top1, new model state)`` of a
    whole (global) batch from a ``jaxcnn.parallel.Pipeline``'s GPipe schedule.

    A global function: only the schedule is a ``shard_map`` (manual over ``data`` and
    ``pipe``).  The parameters enter it as their ``pipe`` blocks (each device gathers its own
    stage's parameters inside ``pipeline.gradients``); the gradients leave it averaged over
    ``data`` and split over ``pipe`` as the parameters are at rest (``pipeline.split_dims``), so the optimiser that follows is a global program
    on those shards.  Each data shard folds its index into the step's key first, as
    ``jaxcnn.parallel.strategies.per_device`` does for the other shard_map steps (so the
    ``rng`` argument, the step's key before that fold, is not used).
    """
    from jax.sharding import PartitionSpec as PS
    _check_pipelined(pipeline, accumulate, axis_name, mix)
    if pipeline.mesh is None:
        raise ValueError("parallel.pipeline: the pipeline does not know where the parameters live; "
                         "use the one of a ParallelPlan (make_train_step(..., pipeline=plan.pipeline))")
    data_axis, pipe_axis = DATA, pipeline.axis_name
    piped = pipeline.gradients(_head(policy=policy, label_smoothing=label_smoothing),
                               prepare=lambda x: device_normalize(x, image_norm),
                               policy=policy, choices=choices, split_dims=pipeline.split_dims)

    def per_device(params, model_state, batch, rng, step, loss_scale):
        key = jax.random.fold_in(jax.random.wrap_key_data(rng), jax.lax.axis_index(data_axis))
        grads, loss, top1, new_model_state = piped(params, model_state, batch,
                                                   jax.random.fold_in(key, step), loss_scale)
        grads, loss, top1 = cross_device_mean((grads, loss, top1), data_axis)
        if not sync_batch_norm:  # statistics of each data shard's own: their mean stays replicated
            new_model_state = jax.tree_util.tree_map(
                lambda x: jax.lax.pmean(x, data_axis) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                new_model_state)
        return grads, loss, top1, new_model_state

    def spec(dim, p):
        return PS(*[pipe_axis if i == dim else None for i in range(len(p.shape))])

    def gradients(state, batch, rng):
        del rng  # each data shard's key is made inside, from the state's
        grad_specs = jax.tree_util.tree_map(spec, pipeline.split_dims, state.params,
                                            is_leaf=lambda x: x is None)
        # check_vma=False: see jaxcnn.parallel.strategies (replicated inputs' cotangents)
        mapped = jax.shard_map(per_device, mesh=pipeline.mesh,
                               in_specs=(grad_specs, PS(), PS(data_axis), PS(), PS(), PS()),
                               out_specs=(grad_specs, PS(), PS(), PS()),
                               axis_names={data_axis, pipe_axis}, check_vma=False)
        return mapped(state.params, state.state, batch, state.rng, state.step, state.loss_scale)

    return gradients


def _stage_fns(pipeline, tx, *, policy, choices, image_norm, label_smoothing, mix, accumulate,
               axis_name, sync_batch_norm, finish, skip_nonfinite, clip_norm) -> StageFns:
    """The pieces of a train step that :class:`jaxcnn.parallel.mpmd.MPMD` runs one program per
    stage (``plan.wrap_step`` builds it)."""
    _check_pipelined(pipeline, accumulate, axis_name, mix)

    def update(params, opt_state, grads, norm):  # norm: the whole model's gradients' global norm
        view = TrainState(None, params, None, opt_state, None, None, None)
        return apply_optimizer(tx, view, _clipped(grads, opt_state, policy, norm, clip_norm), policy)

    return StageFns(
        head=_head(policy=policy, label_smoothing=label_smoothing),
        prepare=lambda x: device_normalize(x, image_norm), policy=policy, choices=choices,
        init_opt=lambda params: init_opt_state(tx, params, policy), update=update, finish=finish,
        sync_batch_norm=sync_batch_norm,
        select_nonfinite=lambda state: skip_nonfinite or isinstance(state.loss_scale, P.DynamicLossScale))


def _gradients(loss_fn, accumulate: int):
    """``gradients(state, batch, rng) -> (scaled gradients, loss, top1, new model state)``,
    over ``accumulate`` micro-batches (see :func:`make_train_step`)."""
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an int >= 1, got {accumulate!r}")
    grad_fn = jax.grad(loss_fn, has_aux=True)

    def whole(state, batch, rng):
        grads, (loss, top1, new_model_state) = grad_fn(state.params, state.state, batch, rng,
                                                       state.loss_scale)
        return grads, loss, top1, new_model_state

    def accumulated(state, batch, rng):
        micro = jax.tree_util.tree_map(lambda x: _micro_batches(x, accumulate), batch)

        def one(carry, xs):
            total, model_state = carry
            part, i = xs
            grads, (loss, top1, model_state) = grad_fn(state.params, model_state, part,
                                                       jax.random.fold_in(rng, i), state.loss_scale)
            total = jax.tree_util.tree_map(lambda t, g: t + g.astype(t.dtype), total, grads)
            return (total, model_state), (loss, top1)

        zeros = jax.tree_util.tree_map(
            lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), state.params)
        (total, new_model_state), (losses, top1s) = jax.lax.scan(
            one, (zeros, state.state), (micro, jnp.arange(accumulate)))
        grads = jax.tree_util.tree_map(lambda t, p: (t / accumulate).astype(p.dtype), total,
                                       state.params)
        return grads, jnp.mean(losses), jnp.mean(top1s), new_model_state

    return whole if accumulate == 1 else accumulated


def _one_program_step(gradients, tx, *, policy, finish, axis_name, pipelined, skip_nonfinite, clip_norm):
    """``train_step(state, batch)`` as one program: ``gradients`` (one device's, accumulated or
    the SPMD pipeline's), then the mean over ``axis_name`` (not for a pipeline, whose gradients
    leave its schedule averaged), the optimiser and ``finish``."""
    def train_step(state: TrainState, batch):
        rng = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        grads, loss, top1, new_model_state = gradients(state, batch, rng)
        grads = state.loss_scale.unscale(grads)
        if axis_name is not None and not pipelined:
            grads, loss, top1 = cross_device_mean((grads, loss, top1), axis_name)
        finite = P.all_finite(grads)
        grad_norm = optax.tree.norm(_as_applied(grads, state.opt_state, policy))
        grads = _clipped(grads, state.opt_state, policy, grad_norm, clip_norm)
        _, new_params, new_opt_state = apply_optimizer(tx, state, grads, policy)
        if skip_nonfinite or isinstance(state.loss_scale, P.DynamicLossScale):
            new_params, new_opt_state, new_model_state = P.select_tree(
                finite, (new_params, new_opt_state, new_model_state),
                (state.params, state.opt_state, state.state))
        step, new_loss_scale, skipped, metrics = finish((state.step, state.loss_scale, state.skipped),
                                                        finite, grad_norm, loss, top1)
        new_state = TrainState(step, new_params, new_model_state, new_opt_state,
                               new_loss_scale, state.rng, skipped)
        return new_state, metrics

    return train_step


def make_train_step(model, tx: optax.GradientTransformation, *, policy=None,
                    choices: Choices | None = None, label_smoothing: float = 0.0,
                    schedule: Callable | None = None, skip_nonfinite: bool = False,
                    axis_name: str | None = None, image_norm: tuple | None = None,
                    sync_batch_norm: bool = True, mix: mixing.MixSpec | None = None,
                    accumulate: int = 1, pipeline=None, clip_norm: float | None = None) -> TrainStep:
    """Build a :class:`TrainStep`: ``step(state, batch) -> (state, metrics)`` and what a mesh
    needs to run it.

    Arguments:
        model: the ``Layer`` to train.
        tx: the optax optimiser.
        policy: a mixed-precision ``Policy``, its name (``"bf16"``) or None (the params' dtype).
        label_smoothing: passed to the cross-entropy loss.
        schedule: learning-rate schedule, only used to report ``lr``.
        skip_nonfinite: leave params, optimiser and model state unchanged on a
            step whose gradients are not finite (always done under dynamic loss
            scaling).
        axis_name: when the step runs under ``shard_map``/``pmap`` over a data
            axis, gradients, metrics and (with ``sync_batch_norm``) BatchNorm
            statistics are averaged over it.
        image_norm: ``(mean, std)`` on the unit scale (scalars or per channel):
            ``uint8`` batch images are then normalised on the device,
            ``(x / 255 - mean) / std`` in float32, so the host moves bytes
            (4x less than float32).  Float images are used as given.
        choices: the layers' kernels, BatchNorm backward and Conv -> BatchNorm fusion
            (:class:`jaxcnn.layers.Choices`; None: every default), passed to ``model.apply``.
            Its ``axis_name`` is the step's to set: BatchNorm syncs over ``axis_name`` when
            ``sync_batch_norm``; one set here that differs raises.
        sync_batch_norm: BatchNorm layers built without ``axis_name`` sync their
            statistics over ``axis_name`` (SyncBatchNorm); False keeps them per device
            (``parallel.per_device`` then averages the running statistics).
        mix: mixup/CutMix of each (micro-)batch (:mod:`jaxcnn.data.mix`), or None.
        accumulate: micro-batches per step (example ``i`` in micro-batch ``i % accumulate``),
            run in turn (``lax.scan``), gradients averaged into one update; BatchNorm uses
            and updates its statistics per micro-batch, as PyTorch does.
        pipeline: a :class:`jaxcnn.parallel.Pipeline` (``plan.pipeline``): gradients from its GPipe or 1F1B
            schedule over its micro-batches (``accumulate``: 1 or their count; ``engine="mpmd"``:
            one program per stage, run by ``plan.wrap_step``, :mod:`jaxcnn.parallel.mpmd`).
        clip_norm: clip the gradients to this global norm before ``tx`` (as ``optax.clip_by_global_norm``
            first in ``tx``; under ``mpmd`` each stage's ``tx`` sees its own gradients only).

    ``batch_norm_axis_name`` and ``pipeline`` of the result are checked by ``plan.wrap_step``
    (:func:`jaxcnn.parallel.strategies.wrap_train_step`).

    Metrics: ``loss`` (unscaled, float32), ``top1`` (batch accuracy),
    ``grad_norm``, ``lr``, ``loss_scale``, ``finite`` (1.0 when the step was
    applied) and ``skipped`` (steps skipped so far)."""
    policy, bn_axis = P.as_policy(policy), axis_name if sync_batch_norm else None
    choices = _step_choices(choices, bn_axis)
    loss_fn = _loss_fn(model, policy=policy, choices=choices, label_smoothing=label_smoothing,
                       image_norm=image_norm, mix=mix)
    finish = _finish(schedule)
    if pipeline is not None and getattr(pipeline, "engine", "spmd") == "mpmd":
        stages = _stage_fns(pipeline, tx, policy=policy, choices=choices, image_norm=image_norm,
                            label_smoothing=label_smoothing, mix=mix, accumulate=accumulate,
                            axis_name=axis_name, sync_batch_norm=sync_batch_norm, finish=finish,
                            skip_nonfinite=skip_nonfinite, clip_norm=clip_norm)
        return TrainStep(None, bn_axis, pipeline, stages)
    gradients = _gradients(loss_fn, accumulate) if pipeline is None else _pipeline_gradients(
        pipeline, policy, choices, image_norm, label_smoothing, mix, accumulate, axis_name, sync_batch_norm)

    step = _one_program_step(gradients, tx, policy=policy, finish=finish, axis_name=axis_name,
                             pipelined=pipeline is not None, skip_nonfinite=skip_nonfinite,
                             clip_norm=clip_norm)
    return TrainStep(step, bn_axis, pipeline)


def _step_choices(choices: Choices | None, bn_axis: str | None) -> Choices:
    """``choices`` with the step's BatchNorm axis."""
    choices = Choices() if choices is None else choices
    if not isinstance(choices, Choices):
        raise TypeError(f"choices: expected a jaxcnn.layers.Choices, got {type(choices).__name__}")
    if choices.axis_name not in (None, bn_axis):
        raise ValueError(f"choices.axis_name: {choices.axis_name!r}, but the step syncs BatchNorm over "
                         f"{bn_axis!r} (set axis_name and sync_batch_norm of make_train_step instead)")
    return dataclasses.replace(choices, axis_name=bn_axis)


# Classes up to which an evaluation counts its confusion matrix (ImageNet-1k's 1,000: 4 MB).
MAX_CONFUSION_CLASSES = 1000


def make_eval_step(model, *, policy=None, choices: Choices | None = None,
                   image_norm: tuple | None = None) -> EvalStep:
    """Build an :class:`EvalStep`: ``step(params, state, batch) -> sums``.

    ``batch`` may carry a boolean ``"mask"`` (padding of the last batch); the
    result holds sums over real examples only: ``loss_sum``, ``top1_sum``,
    ``top5_sum`` and ``count``, so any number of batches add up exactly; with at
    most :data:`MAX_CONFUSION_CLASSES` classes also ``confusion``, the
    ``(classes, classes)`` counts of true class (row) by top-1 prediction (column).
    ``choices``: the layers' kernels (:class:`jaxcnn.layers.Choices`, passed to
    ``model.apply``; None: every default); ``policy`` and ``image_norm`` (``uint8`` batch
    images normalised on the device): as for :func:`make_train_step`.
    """
    policy = P.as_policy(policy)
    loss_policy = _loss_policy(policy)
    choices = Choices() if choices is None else choices

    def sums(logits, batch):
        logits = P.cast_for(loss_policy, "loss", logits).astype(jnp.float32)
        labels = batch["label"]
        mask = batch.get("mask")
        if mask is None:
            mask = jnp.ones(labels.shape, bool)
        loss = F.cross_entropy(logits, labels, reduction="none")
        classes = logits.shape[-1]
        k5 = min(5, classes)
        out = {
            "loss_sum": jnp.sum(jnp.where(mask, loss, 0.0)),
            "top1_sum": jnp.sum(mask & F.top_k_correct(logits, labels, k=1)).astype(jnp.float32),
            "top5_sum": jnp.sum(mask & F.top_k_correct(logits, labels, k=k5)).astype(jnp.float32),
            "count": jnp.sum(mask).astype(jnp.float32),
        }
        if classes <= MAX_CONFUSION_CLASSES:
            out["confusion"] = jnp.zeros((classes, classes), jnp.float32).at[
                labels.reshape(-1), jnp.argmax(logits, -1).reshape(-1)].add(mask.reshape(-1).astype(jnp.float32))
        return out

    def prepare(images):
        if image_norm is None and images.dtype == jnp.uint8:  # an image folder's batch: bytes
            raise TypeError("make_eval_step: uint8 images are normalised on the device, which needs "
                            "image_norm=(mean, std); got image_norm=None")
        return device_normalize(images, image_norm)

    def eval_step(params, model_state, batch):
        logits, _ = model.apply(params, model_state, prepare(batch["image"]), train=False,
                                policy=policy, choices=choices)
        return sums(logits, batch)

    return EvalStep(eval_step, sums, policy, choices, prepare)
