"""Wrapping a pure ``train_step(state, batch) -> (state, metrics)`` for a mesh.

Three strategies, the same numbers (up to float32 reduction order):

* ``shard_map`` (default): every device runs the step on its slice of the
  batch; the step averages gradients and metrics with ``lax.pmean`` over
  ``data`` (build it with ``make_train_step(..., axis_name="data")``) and
  BatchNorm averages its statistics there too (unless the step was built with
  ``sync_batch_norm=False``).  Only ``data`` is manual: the
  ``model`` axis stays automatic, so model-parallel and fsdp shardings of the
  state are handled by XLA (gathered on entry, re-split on exit).  A pipelined
  step (``make_train_step(..., pipeline=plan.pipeline)``) is instead jitted as a
  global program that holds its own ``shard_map`` over ``data`` and ``pipe``
  (see :mod:`jaxcnn.parallel.pipeline`).
* ``pmap``: the legacy form of the same per-device program; data parallel only.
* ``jit``: one global program; ``jit`` with ``NamedSharding`` in/out shardings
  and XLA's SPMD partitioner inserts every collective (build the step with
  ``axis_name=None``).  BatchNorm statistics are those of the global batch.

On the CPU backend with several (emulated) devices at most
:data:`CPU_MAX_IN_FLIGHT` steps are left queued: XLA:CPU runs each device's
share on a shared thread pool, and with many multi-device steps queued an
all-reduce can wait past XLA's 40 s rendezvous limit, which aborts the process
(seen with jax 0.10.2 and 0.11.2 on 2 cores).

``shard_map`` runs with ``check_vma=False``: with the check on, JAX transposes
the implicit broadcast of replicated parameters into a ``psum``, so gradients
would arrive already summed and the step's ``pmean`` would be wrong.
"""
from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcnn.errors import SettingError
from jaxcnn.parallel.mesh import DATA

STRATEGIES = ("shard_map", "pmap", "jit")
CPU_MAX_IN_FLIGHT = 2

_shard_map = jax.shard_map  # jax >= 0.6 (pyproject requires 0.10.2)


def step_axis_name(strategy: str) -> str | None:
    """The ``axis_name`` to build the step with: ``"data"`` for per-device strategies."""
    return None if strategy == "jit" else DATA


def step_fn(train_step):
    """The pure ``step(state, batch)`` of a :class:`jaxcnn.train.step.TrainStep`, or
    ``train_step`` itself when it is a plain function (a step of the caller's own)."""
    return getattr(train_step, "step", train_step)


def per_device(train_step, *, axis_name: str = DATA, sync_batch_norm: bool = True):
    """The per-device program shared by ``shard_map`` and ``pmap``.

    Each device draws its own dropout masks (the index on ``axis_name`` is folded
    into the rng; the state keeps the shared key).  Without ``sync_batch_norm``
    each device normalises with its own statistics and the running statistics
    are averaged over devices after the step, so the state stays replicated.

    Arguments:
        train_step: a ``TrainStep`` built with ``axis_name`` and the same
            ``sync_batch_norm`` (``make_train_step``'s arguments: the step passes
            BatchNorm its axis, so a cached trace cannot miss it), or a plain
            ``(state, batch) -> (state, metrics)``.
        axis_name: the mapped data axis.
        sync_batch_norm: BatchNorm statistics over the global batch.

    Raises:
        SettingError: naming ``train_step`` when its ``batch_norm_axis_name`` says that
            BatchNorm syncs otherwise.
    """
    _check_batch_norm_axis(train_step, axis_name if sync_batch_norm else None)
    fn = step_fn(train_step)

    def step(state, batch):
        shared_rng = state.rng
        key = jax.random.fold_in(jax.random.wrap_key_data(shared_rng), jax.lax.axis_index(axis_name))
        state = state._replace(rng=jax.random.key_data(key))
        new_state, metrics = fn(state, batch)
        if not sync_batch_norm:
            new_state = new_state._replace(state=jax.tree_util.tree_map(
                lambda x: jax.lax.pmean(x, axis_name) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                new_state.state))
        return new_state._replace(rng=shared_rng), metrics

    return step


def _check_batch_norm_axis(train_step, expected) -> None:
    if callable(train_step):
        return  # a step not made by make_train_step: its BatchNorm axis is its own business
    got = train_step.batch_norm_axis_name
    if got != expected:
        raise SettingError(
            "train_step", f"syncs BatchNorm over {got!r} but the strategy expects "
            f"{expected!r}; build it with make_train_step(..., axis_name=plan.step_axis_name, "
            f"sync_batch_norm=plan.sync_batch_norm)")


def wrap_train_step(train_step, strategy: str, mesh: Mesh, state_shardings, *,
                    sync_batch_norm: bool = True, donate: bool = True):
    """Distribute ``train_step`` over ``mesh``.

    Arguments:
        train_step: a ``TrainStep`` built with ``axis_name=step_axis_name(strategy)``, or a
            plain ``(state, batch) -> (state, metrics)``.
        strategy: ``"shard_map"``, ``"pmap"`` or ``"jit"``.
        mesh: the ``(data, model)`` mesh.
        state_shardings: a ``TrainState`` of ``NamedSharding`` (where the state lives).
        sync_batch_norm: see :func:`per_device` (``jit`` always uses global statistics).
        donate: let the step reuse the input state's buffers (not for ``pmap``).

    Returns:
        ``step(state, batch) -> (state, metrics)``, taking the batch as placed by
        :func:`batch_sharding` / ``pmap_batch`` and returning replicated metrics.
    """
    step = _compile(train_step, strategy, mesh, state_shardings, sync_batch_norm, donate)
    devices = mesh.devices.reshape(-1)
    if devices.size > 1 and devices[0].platform == "cpu":
        return _Bounded(step, CPU_MAX_IN_FLIGHT)
    return step


def _compile(train_step, strategy, mesh, state_shardings, sync_batch_norm, donate):
    replicated = NamedSharding(mesh, P())
    donate_argnums = (0,) if donate else ()
    if strategy == "jit":
        _check_batch_norm_axis(train_step, None)
        return jax.jit(step_fn(train_step), in_shardings=(state_shardings, batch_sharding(mesh)),
                       out_shardings=(state_shardings, replicated), donate_argnums=donate_argnums)
    if not callable(train_step) and train_step.pipeline is not None:
        # A pipelined step is a global program: only its stages' schedule is a shard_map
        # (manual over data and pipe, inside the step), so XLA partitions the optimiser
        # update over the parameters' pipe shards.
        if strategy != "shard_map":
            raise SettingError("strategy", f"pipeline parallelism runs under shard_map, got {strategy!r}")
        _check_batch_norm_axis(train_step, DATA if sync_batch_norm else None)
        return jax.jit(step_fn(train_step), in_shardings=(state_shardings, batch_sharding(mesh)),
                       out_shardings=(state_shardings, replicated), donate_argnums=donate_argnums)
    program = per_device(train_step, sync_batch_norm=sync_batch_norm)
    if strategy == "shard_map":
        mapped = _shard_map(program, mesh=mesh, in_specs=(P(), P(DATA)), out_specs=(P(), P()),
                            axis_names={DATA}, check_vma=False)
        return jax.jit(mapped, in_shardings=(state_shardings, batch_sharding(mesh)),
                       out_shardings=(state_shardings, replicated), donate_argnums=donate_argnums)
    if strategy == "pmap":
        devices = list(mesh.devices.reshape(-1))
        return jax.pmap(program, axis_name=DATA, in_axes=(None, 0), out_axes=(None, None),
                        devices=devices)
    raise SettingError("strategy", f"expected one of {STRATEGIES}, got {strategy!r}")


class _Bounded:
    """``step`` that waits for the metrics of the step ``max_in_flight`` calls back
    before returning, so no more than that many steps are ever queued; ``lower`` is the
    step's (the trainer compiles it ahead)."""

    def __init__(self, step, max_in_flight: int):
        self.step, self.max_in_flight, self.pending = step, max_in_flight, collections.deque()
        self.lower = step.lower

    def __call__(self, state, batch):
        new_state, metrics = self.step(state, batch)
        self.pending.append(metrics)
        if len(self.pending) > self.max_in_flight:
            jax.block_until_ready(self.pending.popleft())
        return new_state, metrics


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches split on their leading axis over ``data`` (replicated over ``model``)."""
    return NamedSharding(mesh, P(DATA))


def pmap_batch(batch, n_devices: int):
    """Reshape a host batch ``(B, ...)`` to ``(n_devices, B // n_devices, ...)`` for ``pmap``."""
    return jax.tree_util.tree_map(lambda x: x.reshape((n_devices, -1) + tuple(x.shape[1:])), batch)
