"""Multi-process runs: ``jax.distributed.initialize`` and global batches.

Every process runs the same program on its own devices; together they form one
mesh.  Each process loads only its share of every global batch
(``train_batch(..., process_index, process_count)``) and
:func:`global_batch` stitches the shares into one ``jax.Array``.

Settings come from the config's ``distributed`` section, or else from the
environment: ``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0),
``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``.  ``mode: auto`` initialises when
more than one process is asked for; ``on`` always (letting JAX detect SLURM,
Open MPI or a TPU pod for whatever is unset); ``off`` never.
"""
from __future__ import annotations

import os

import jax

from jaxcnn.train.config import ConfigError


class DistributedError(RuntimeError):
    """The processes of a multi-process run could not connect, or lost each other."""


def _setting(value, env: str, cast=str):
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw in (None, ""):
        return None
    try:
        return cast(raw)
    except ValueError:
        raise ConfigError(f"environment variable {env}={raw!r} is not a valid {cast.__name__}") from None


def settings(dist_cfg) -> dict:
    """``coordinator_address``, ``num_processes``, ``process_id`` from the config or the environment."""
    return {
        "coordinator_address": _setting(dist_cfg.coordinator_address, "JAX_COORDINATOR_ADDRESS"),
        "num_processes": _setting(dist_cfg.num_processes, "JAX_NUM_PROCESSES", int),
        "process_id": _setting(dist_cfg.process_id, "JAX_PROCESS_ID", int),
    }


def initialize(dist_cfg) -> bool:
    """Connect this process to the others, as the ``distributed`` section says.

    Must run before anything touches a JAX device.  On CPU, collectives
    between processes go through gloo.

    Arguments:
        dist_cfg: the ``distributed`` section (``mode``, ``coordinator_address``,
            ``num_processes``, ``process_id``, ``timeout_s``).

    Returns:
        True when ``jax.distributed`` was initialised (now or before), False for
        a single-process run.

    Raises:
        ConfigError: an inconsistent setting (``mode: on`` with nothing to go on).
        DistributedError: the coordinator could not be reached within ``timeout_s``.
    """
    if dist_cfg.mode == "off":
        return False
    if is_initialized():
        return True
    opts = settings(dist_cfg)
    wanted = (opts["num_processes"] or 1) > 1 or opts["coordinator_address"] is not None
    if dist_cfg.mode == "auto" and not wanted:
        return False
    n, pid = opts["num_processes"], opts["process_id"]
    if n is not None and pid is not None and not 0 <= pid < n:
        raise ConfigError(f"distributed.process_id: {pid} is not in [0, num_processes={n})",
                          path="distributed.process_id")
    timeout = max(1, int(round(dist_cfg.timeout_s)))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=timeout,
                                   **opts)
    except (RuntimeError, ValueError) as e:  # XlaRuntimeError is a RuntimeError
        where = opts["coordinator_address"] or "the auto-detected coordinator"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"jax.distributed could not connect process {pid} of {n} to coordinator {where} "
            f"within {timeout} s (distributed.timeout_s); is process 0 running and the address "
            f"reachable? ({first})") from None
    return True


def is_initialized() -> bool:
    """Whether ``jax.distributed`` has been initialised in this process."""
    from jax._src import distributed as _dist  # no public query exists in jax 0.10/0.11
    return _dist.global_state.client is not None


def global_batch(local_batch, sharding):
    """Stitch each process's share of a batch into global ``jax.Array``s.

    Arguments:
        local_batch: a pytree of host arrays ``(B / process_count, ...)``; process
            ``p`` holds rows ``[p * B/P, (p + 1) * B/P)`` of the global batch.
        sharding: the batch's ``NamedSharding`` (leading axis over ``data``).

    Returns:
        The same pytree of ``jax.Array`` with leading size ``B``.
    """
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, x, (x.shape[0] * jax.process_count(),) + tuple(x.shape[1:])),
        local_batch)
