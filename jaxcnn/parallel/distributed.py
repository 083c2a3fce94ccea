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
import re
import socket
import threading
import time

import jax

from jaxcnn.train.config import ConfigError


class DistributedError(RuntimeError):
    """The processes of a multi-process run could not connect, or lost each other.

    ``must_exit`` is True when JAX's own connection attempt is still under way in a
    background thread (it cannot be cancelled) or JAX's exit hook would wait for a lost
    peer: report the error, then end the process with ``os._exit`` as ``jaxcnn-train``
    does; a normal exit would leave XLA to end it, with SIGABRT and a C++ stack trace.
    """

    def __init__(self, message: str, *, must_exit: bool = False):
        super().__init__(message)
        self.must_exit = must_exit


# JAX is given this much longer than distributed.timeout_s for its first contact: when its
# own deadline passes, XLA ends the process (SIGABRT and a C++ stack trace) rather than
# raising, so the trainer's deadline has to come first.
_XLA_GRACE_S = 60
# What XLA's CPU collectives (gloo) and the coordination service say when a peer is gone.
_PEER_LOST = re.compile(r"gloo|connection (?:closed|reset) by peer|broken pipe|heartbeat|"
                        r"unhealthy|another task died", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[[^\]]+\]:\d+")


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
        DistributedError: the coordinator could not be reached, or not every process
            joined, within ``timeout_s`` of this call (in the second case ``must_exit``
            is set: end the process after reporting it).
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
    deadline = time.monotonic() + timeout
    address = opts["coordinator_address"]
    if address is not None and pid not in (None, 0):
        # XLA aborts the whole process (no Python exception) when it cannot reach the
        # coordinator, so a worker first checks that something listens there.
        _wait_for_coordinator(address, timeout, deadline, pid, n)
        # A coordinator that came up late still gets a moment to take the registration.
        deadline = max(deadline, time.monotonic() + min(timeout, 5))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    _connect(opts, timeout, deadline)
    return True


def _who(pid, n) -> str:
    if pid is None:
        return "this process"
    return f"process {pid}" if n is None else f"process {pid} of {n}"


def _connect(opts: dict, timeout: int, deadline: float) -> None:
    """``jax.distributed.initialize``, given up at ``deadline`` with a DistributedError.

    JAX waits for every process to register; when its deadline passes first, XLA ends the
    process from C++. So JAX gets a longer deadline and runs in a daemon thread, and this
    thread gives up at ours (the process must then end: ``must_exit``).
    """
    pid, n, address = opts["process_id"], opts["num_processes"], opts["coordinator_address"]
    outcome: dict = {}

    def connect():
        try:
            jax.distributed.initialize(initialization_timeout=timeout + _XLA_GRACE_S,
                                       heartbeat_timeout_seconds=timeout, **opts)
            outcome["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported by the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=connect, name="jaxcnn-distributed-connect", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if thread.is_alive():
        if pid == 0 and n == 2:
            missing = "process 1 never joined"
        elif pid == 0 or n is None:
            missing = "not every process joined"
        else:
            missing = f"not every process joined the coordinator at {address}"
        raise DistributedError(
            f"{_who(pid, n)}: {missing} within {timeout} s (distributed.timeout_s); check that "
            f"all {n or 'the'} processes were started with the same coordinator address and "
            "num_processes", must_exit=True)
    error = outcome.get("error")
    if error is not None:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DistributedError(
            f"jax.distributed could not start {_who(pid, n)} with coordinator "
            f"{address or '(auto-detected)'}: {first}", must_exit=is_initialized()) from None


def _wait_for_coordinator(address: str, timeout: int, deadline: float, pid, n) -> None:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"{_who(pid, n)} could not reach coordinator {address} within {timeout} s "
                    f"(distributed.timeout_s): {e.strerror or e}; is process 0 running and the "
                    "address reachable from here?") from None
            time.sleep(0.25)


def lost_peer(exc: BaseException, timeout_s: float) -> DistributedError | None:
    """The error to report when ``exc`` is a collective that failed because a peer process went away.

    Arguments:
        exc: an exception raised while training (by a step, or by fetching its results).
        timeout_s: ``distributed.timeout_s``, named in the message.

    Returns:
        A ``DistributedError`` (``must_exit``) naming the lost process, when this is a
        multi-process run and ``exc`` is a gloo or coordination-service failure; else None.
        Only in a run of two processes is the lost one known for sure; with more, gloo
        gives the peer's address, which the message repeats.
    """
    if isinstance(exc, DistributedError) or not is_initialized() or not _PEER_LOST.search(str(exc)):
        return None
    pid, n = jax.process_index(), jax.process_count()
    if n < 2:
        return None
    if n == 2:
        lost = "process 1" if pid == 0 else "process 0 (the coordinator)"
    else:
        found = _PEER_ADDRESS.search(str(exc))
        lost = "another process" + (f" (at {found.group(0)})" if found else "")
    first = str(exc).strip().splitlines()[0][:300]
    return DistributedError(
        f"{_who(pid, n)} lost {lost} during a collective ({first}); it died or was killed. "
        f"Stopping now instead of waiting distributed.timeout_s={timeout_s:g} s for the "
        "coordination service to notice", must_exit=True)


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
