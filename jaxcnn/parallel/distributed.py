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
import socket
import time

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
    address = opts["coordinator_address"]
    if address is not None and pid not in (None, 0):
        # XLA aborts the whole process (no Python exception) when it cannot reach the
        # coordinator, so a worker first checks that something listens there.
        _wait_for_coordinator(address, timeout, pid, n)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(initialization_timeout=timeout, heartbeat_timeout_seconds=timeout,
                                   **opts)
    except (RuntimeError, ValueError) as e:  # XlaRuntimeError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"jax.distributed could not start process {pid} of {n} with coordinator "
            f"{address or '(auto-detected)'}: {first}") from None
    return True


def _wait_for_coordinator(address: str, timeout: int, pid, n) -> None:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"process {pid} of {n} could not reach coordinator {address} within {timeout} s "
                    f"(distributed.timeout_s): {e.strerror or e}; is process 0 running and the "
                    "address reachable from here?") from None
            time.sleep(0.25)


def is_initialized() -> bool:
    """Whether ``jax.distributed`` has been initialised in this process."""
    try:  # no public query in jax 0.10/0.11 that does not start the backend
        from jax._src import distributed as _dist
        return _dist.global_state.client is not None
    except (ImportError, AttributeError):
        return False


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


def to_host(tree):
    """A pytree of (possibly sharded, multi-process) arrays as whole NumPy arrays.

    In a multi-process run every process must call it (it is a collective):
    arrays that no process sees whole are gathered with
    ``multihost_utils.process_allgather``.
    """
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(tree, tiled=True)
