"""Multi-process runs: ``jax.distributed.initialize`` and global batches.

Every process runs the same program on its own devices; together they form one
mesh.  Each process loads only the rows of every global batch that its devices hold
(:func:`batch_share`: the rows of the data shards its devices hold, given to the input
makers as ``train_batch(..., process_index=index, process_count=count)``) and
:func:`global_batch` stitches the shares into one ``jax.Array``.  In the usual layout
(each data shard's devices in one process) that is ``(jax.process_index(),
jax.process_count())``; when another mesh axis (``pipe``, ``model``, ``spatial``) spans
processes, the processes that hold devices of the same data shards load the same rows.

:func:`initialize` takes its settings as arguments (the trainer passes its config's
``distributed`` section), each one not given from the environment:
``JAX_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JAX_NUM_PROCESSES`` and
``JAX_PROCESS_ID``.  ``mode="auto"`` initialises when more than one process is asked for;
``"on"`` always (letting JAX detect SLURM, Open MPI or a TPU pod for whatever is unset);
``"off"`` never.
"""
from __future__ import annotations

import atexit
import collections
import functools
import os
import re
import socket
import sys
import threading
import time

import jax
import numpy as np
from jax.sharding import NamedSharding

from jaxcnn.errors import DistributedError, SettingError  # DistributedError: importable from here too
from jaxcnn.parallel.mesh import DATA

# JAX is given this much longer than distributed.timeout_s for its first contact: when its
# own deadline passes, XLA ends the process (SIGABRT and a C++ stack trace) rather than
# raising, so the trainer's deadline has to come first.
_XLA_GRACE_S = 60
# What XLA's CPU collectives (gloo) and the coordination service say when a peer is gone.
_PEER_LOST = re.compile(r"gloo|connection (?:closed|reset) by peer|broken pipe|heartbeat|"
                        r"unhealthy|another task died", re.IGNORECASE)
_PEER_ADDRESS = re.compile(r"\[[^\]]+\]:\d+")


def _setting(name: str, value, env: str, cast=str):
    if value is not None:
        return value
    raw = os.environ.get(env)
    if raw in (None, ""):
        return None
    try:
        return cast(raw)
    except ValueError:
        raise SettingError(name, f"unset, and the environment variable {env}={raw!r} is not a "
                           f"valid {cast.__name__}") from None


def settings(coordinator_address: str | None = None, num_processes: int | None = None,
             process_id: int | None = None) -> dict:
    """``coordinator_address``, ``num_processes``, ``process_id`` as given, each one not given
    (None) from the environment (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``) or else None."""
    return {
        "coordinator_address": _setting("coordinator_address", coordinator_address,
                                        "JAX_COORDINATOR_ADDRESS"),
        "num_processes": _setting("num_processes", num_processes, "JAX_NUM_PROCESSES", int),
        "process_id": _setting("process_id", process_id, "JAX_PROCESS_ID", int),
    }


def initialize(mode: str = "auto", *, coordinator_address: str | None = None,
               num_processes: int | None = None, process_id: int | None = None,
               timeout_s: float = 300.0) -> bool:
    """Connect this process to the others.

    Must run before anything touches a JAX device.  On CPU, collectives
    between processes go through gloo.

    Arguments:
        mode: ``"auto"`` (initialise when there is more than one process to join, or a
            coordinator), ``"on"`` or ``"off"``.
        coordinator_address, num_processes, process_id: ``"host:port"`` of process 0, the
            number of processes and this one's index; None: from the environment
            (:func:`settings`), else auto-detected by ``jax.distributed``.
        timeout_s: seconds to wait for the coordinator and the other processes.

    Returns:
        True when ``jax.distributed`` was initialised (now or before), False for
        a single-process run.

    Raises:
        SettingError: an inconsistent setting (``process_id`` outside ``num_processes``, an
            unreadable environment variable), naming the argument.
        DistributedError: the coordinator could not be reached, or not every process
            joined, within ``timeout_s`` of this call (in the second case ``must_exit``
            is set: end the process after reporting it).
    """
    if mode == "off":
        return False
    if is_initialized():
        return True
    opts = settings(coordinator_address, num_processes, process_id)
    wanted = (opts["num_processes"] or 1) > 1 or opts["coordinator_address"] is not None
    if mode == "auto" and not wanted:
        return False
    n, pid = opts["num_processes"], opts["process_id"]
    if n is not None and pid is not None and not 0 <= pid < n:
        raise SettingError("process_id", f"{pid} is not in [0, num_processes={n})")
    timeout = max(1, int(round(timeout_s)))
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
    _start_watch(timeout, address)
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
    jax_opts = dict(opts)
    if address is not None and pid not in (None, 0):
        jax_opts["coordinator_address"] = _start_relay(address)

    def connect():
        try:
            jax.distributed.initialize(initialization_timeout=timeout + _XLA_GRACE_S,
                                       heartbeat_timeout_seconds=timeout, **jax_opts)
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


# A lost peer is learnt of on several threads at once: the step's collective fails (gloo sees the
# closed connection), the liveness watch below sees its socket close, and JAX's coordination client
# gets an error from the service. Each of ours ends the process through exit_now, whose lock lets
# only the first write its line. JAX's client must never be first: its only reaction is XLA's
# fatal log, SIGABRT and a C++ stack trace (jaxlib 0.10 and 0.11 take a missed_heartbeat_callback,
# but calling a Python one fails with std::bad_cast and std::terminate). So it is kept from hearing
# of the loss before we do: for the coordinator's death through the relay below; for any other
# process's, it hears only after distributed.timeout_s without heartbeats, while the watch hears
# at once. With more than one device per process the collective may never fail (see _start_watch).
_EXIT_LOCK = threading.Lock()
_program = "jaxcnn"
_WATCH_KEY = "jaxcnn/peer_watch_port"
_watch: dict = {"closing": False, "conns": {}, "lock": threading.Lock()}


def report_errors_as(program: str) -> None:
    """The name that begins the line a lost peer ends this process with (``PROGRAM: error: ...``);
    ``jaxcnn-train`` sets its own, the default is ``jaxcnn``."""
    global _program
    _program = program


def exit_now(line: str, code: int = 1) -> None:
    """Write ``line`` to stderr and end the process at once with ``code``.

    ``os._exit``: no exit hooks, so neither JAX's shutdown barrier (which would wait for the lost
    peer) nor XLA's abort runs. Only the first caller, on any thread, writes its line; another one
    waits here until the process is gone, so a lost peer is reported exactly once.
    """
    _EXIT_LOCK.acquire()  # never released: the process ends
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream must not keep the process alive
            pass
    try:
        os.write(2, (line.rstrip("\n").replace("\n", " ") + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(code)


def _peer_name(lost) -> str:
    if lost is None:
        return "another process"
    return "process 0 (the coordinator)" if lost == 0 else f"process {lost}"


def _exit_lost(lost, how: str, timeout) -> None:
    from jax._src import distributed as jd
    pid, n = jd.global_state.process_id, jd.global_state.num_processes
    exit_now(f"{_program}: error: {_who(pid, n)} lost {_peer_name(lost)}: {how}; it died or was "
             f"killed. Stopping now instead of waiting distributed.timeout_s={timeout:g} s for the "
             "coordination service to notice")


def _start_watch(timeout, address) -> None:
    """Watch the other processes' liveness over one TCP connection each to process 0.

    A process that dies (killed, crashed, ``os._exit``) has its sockets closed by the kernel at
    once. With one device per process the step's gloo all-reduce fails at once too; with more,
    one device's thread may wait in gloo for data from another device of its own process that
    gave up (the survivor then hears of the loss only from the coordination service, after
    ``distributed.timeout_s``). So process 0 listens on a port it publishes in the coordination
    service's key-value store; every other process connects and says ``hello PID``. When a
    connection closes without ``bye`` (sent at a normal interpreter exit), the survivor ends
    with one line: process 0 first tells the others ``lost PID``.
    """
    from jax._src import distributed as jd
    st = jd.global_state
    pid, n, client = st.process_id, st.num_processes, st.client
    if client is None or not n or n < 2:
        return
    atexit.register(_say_goodbye)
    _hold_cxx_terminate()
    if pid == 0:
        try:
            if socket.has_dualstack_ipv6():
                server = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True)
            else:
                server = socket.create_server(("", 0))
            client.key_value_set(_WATCH_KEY, str(server.getsockname()[1]))
        except Exception:  # noqa: BLE001 - no watch: a lost peer is then noticed as before this watch
            return
        target, args = _accept_peers, (server, n, timeout)
    else:
        host = (address or st.coordinator_address or "").rpartition(":")[0].strip("[]")
        target, args = _watch_coordinator, (client, host, pid, timeout)
    threading.Thread(target=target, args=args, name="jaxcnn-peer-watch", daemon=True).start()


# How long a C++ std::terminate waits for the liveness watch before it goes on (see below).
_TERMINATE_GRACE_S = 3.0
_terminate_hook: list = []


def _hold_cxx_terminate() -> None:
    """Makes a C++ ``std::terminate`` wait up to ``_TERMINATE_GRACE_S`` for the liveness watch.

    When a peer dies mid-collective, gloo's own thread may die first on what the dead peer left
    half-done (``gloo::EnforceNotMet ... Received data size doesn't match expected size``: an
    uncaught exception, so ``terminate called ...`` and SIGABRT; 1 of 20 kills of process 1 with 2
    devices per process). The handler installed here waits instead; the watch, which has seen the
    same closed connection, ends the process with its one line meanwhile. If nothing does, the
    previous handler (libstdc++'s, which prints the exception and aborts) runs as before.
    """
    if _terminate_hook:
        return
    try:
        import ctypes
        libstdcxx = ctypes.CDLL("libstdc++.so.6")
        set_terminate = libstdcxx._ZSt13set_terminatePFvvE  # std::set_terminate(void (*)())
    except (OSError, AttributeError):
        return
    handler_type = ctypes.CFUNCTYPE(None)
    set_terminate.restype = ctypes.c_void_p
    set_terminate.argtypes = [handler_type]

    def on_terminate():
        deadline = time.monotonic() + _TERMINATE_GRACE_S
        while time.monotonic() < deadline:
            time.sleep(0.01)  # releases the GIL: the watch thread may end the process now
        previous = _terminate_hook[1]
        if previous:
            handler_type(previous)()
        os.abort()

    hook = handler_type(on_terminate)
    _terminate_hook.extend([hook, None])  # the hook must outlive this call
    _terminate_hook[1] = set_terminate(hook)


# How long the relay keeps a worker's connection to the coordination service open after the
# coordinator's side closed: the liveness watch (or the failed collective) reports a dead
# coordinator within milliseconds; a connection closed by a live one is passed on after this.
_RELAY_HOLD_S = 5.0


def _start_relay(address: str) -> str:
    """A local relay between this process's coordination client and the coordinator at ``address``;
    returns the address for ``jax.distributed.initialize``.

    When process 0 dies the kernel closes its sockets, and a client connected to it directly
    fails its pending error poll at once: XLA then aborts the process, racing the trainer's own
    report (1 run in 21 aborted). Through the relay the client's connection stays open for
    ``_RELAY_HOLD_S`` after the coordinator's side closed (at once at a normal exit), and the
    loss is reported by the liveness watch first. The relay carries only the coordination
    service's small messages (heartbeats, barriers, key-value); gloo connects directly.
    """
    host, _, port = address.rpartition(":")
    upstream = (host.strip("[]"), int(port))
    server = socket.create_server(("127.0.0.1", 0))

    def accept():
        while True:
            try:
                down, _ = server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(upstream, timeout=10)
                up.settimeout(None)
            except OSError:
                down.close()
                continue
            for sock in (up, down):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(down, up, False), name="jaxcnn-relay", daemon=True).start()
            threading.Thread(target=_pump, args=(up, down, True), name="jaxcnn-relay", daemon=True).start()

    threading.Thread(target=accept, name="jaxcnn-relay", daemon=True).start()
    return f"127.0.0.1:{server.getsockname()[1]}"


def _pump(src, dst, from_coordinator: bool) -> None:
    while True:
        try:
            data = src.recv(65536)
        except OSError:
            data = b""
        if not data:
            break
        try:
            dst.sendall(data)
        except OSError:
            break
    if from_coordinator and dst.fileno() != -1 and not _watch["closing"]:
        deadline = time.monotonic() + _RELAY_HOLD_S
        while time.monotonic() < deadline and not _watch["closing"]:
            time.sleep(0.05)
    for sock in (dst, src):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


def _lines(conn):
    """The newline-ended lines a socket receives, until it closes or fails."""
    buf = b""
    while True:
        try:
            chunk = conn.recv(256)
        except OSError:
            return
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            yield line.decode("ascii", "replace").strip()


def _send(conn, text: str) -> None:
    try:
        conn.sendall(text.encode("ascii"))
    except OSError:
        pass


def _say_goodbye() -> None:
    """At a normal interpreter exit: the others must not take this process's closed socket for a loss."""
    with _watch["lock"]:
        _watch["closing"] = True
        for conn in _watch["conns"].values():
            _send(conn, "bye\n")


def _accept_peers(server, n, timeout) -> None:
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=_watch_peer, args=(conn, n, timeout), name="jaxcnn-peer-watch",
                         daemon=True).start()


def _watch_peer(conn, n, timeout) -> None:
    """Process 0's side of one connection: ``hello PID``, then nothing until ``bye`` or the end."""
    lines = _lines(conn)
    hello = next(lines, "").split()
    if len(hello) != 2 or hello[0] != "hello" or not hello[1].isdigit() or not 0 < int(hello[1]) < n:
        conn.close()
        return
    peer = int(hello[1])
    with _watch["lock"]:
        if peer in _watch["conns"]:
            conn.close()
            return
        _watch["conns"][peer] = conn
    if any(line == "bye" for line in lines):
        return
    with _watch["lock"]:
        if _watch["closing"]:
            return
        for other, c in _watch["conns"].items():
            if other != peer:
                _send(c, f"lost {peer}\n")
    _exit_lost(peer, "its liveness connection closed without a goodbye", timeout)


def _watch_coordinator(client, host, pid, timeout) -> None:
    """Another process's side: connect to process 0, then wait for ``bye``, ``lost PID`` or the end."""
    try:
        port = int(client.blocking_key_value_get(_WATCH_KEY, int(timeout * 1000)))
        conn = socket.create_connection((host, port), timeout=timeout)
        conn.settimeout(None)
        conn.sendall(f"hello {pid}\n".encode("ascii"))
    except Exception:  # noqa: BLE001 - no watch: a lost peer is then noticed as before this watch
        return
    with _watch["lock"]:
        _watch["conns"][0] = conn
    lost, how = 0, "its liveness connection closed without a goodbye"
    for line in _lines(conn):
        if line == "bye":
            return
        word, _, peer = line.partition(" ")
        if word == "lost" and peer.isdigit():
            lost, how = int(peer), "process 0 saw its liveness connection close without a goodbye"
            break
    with _watch["lock"]:
        if _watch["closing"]:
            return
    _exit_lost(lost, how, timeout)


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


def batch_shares(mesh) -> dict[int, tuple[int, int]]:
    """Which rows of every global batch each process loads, read from the mesh's devices.

    A batch is split over the mesh's ``data`` axis (its first): data shard ``i`` of ``D`` holds
    rows ``[i * B/D, (i + 1) * B/D)``, on every device of ``mesh.devices[i]`` (the other axes
    replicate it).  A process must load the rows of every data shard one of its devices holds,
    and the input makers load one contiguous run of rows, share ``index`` of ``count`` equal
    shares.  So every process must hold a contiguous, aligned block of ``k`` data shards, the
    same ``k`` for all (then ``index = first shard / k`` and ``count = D / k``, and processes
    whose devices hold the same data shards load the same rows).  With each data shard's devices
    in one process this is ``(process_index, process_count)``: the usual split.

    Arguments:
        mesh: a ``jax.sharding.Mesh`` (or anything with ``devices``, an array whose first axis
            is ``data``, of objects with a ``process_index``, and ``axis_names``).

    Returns:
        ``{process_index: (index, count)}`` for every process that holds a device of the mesh.

    Raises:
        SettingError: ``"mesh.data: ..."`` (one line) when a process's data shards are not a
            contiguous block, or the processes hold blocks of different sizes or overlapping
            blocks; before any compute, since the trainer reads it when it builds its plan.
    """
    devices = np.asarray(mesh.devices, dtype=object)
    n_data = devices.shape[0]
    held = collections.defaultdict(set)
    for shard in range(n_data):
        for device in devices[shard].reshape(-1):
            held[int(device.process_index)].add(shard)
    names = tuple(getattr(mesh, "axis_names", ()))
    layout = " x ".join(f"{a} {n}" for a, n in zip(names, devices.shape)) or f"data {n_data}"
    sizes = {p: len(s) for p, s in held.items()}
    shares = {}
    for process, shards in sorted(held.items()):
        first, k = min(shards), len(shards)
        if sorted(shards) != list(range(first, first + k)):
            raise SettingError(
                "mesh.data", f"process {process} holds devices of data shards {sorted(shards)} of the "
                f"{layout} mesh, not a contiguous block; the trainer loads each process one "
                "contiguous run of every batch's rows: lay the devices out (mesh.order, mesh.pipe, "
                "mesh.data) so that each process's data shards are neighbours")
        if len(set(sizes.values())) > 1 or n_data % k or first % k:
            other = next((p for p in sorted(held) if p != process
                          and (sizes[p] != k or (held[p] & shards and held[p] != shards))), None)
            with_ = "" if other is None else f" while process {other} holds {_shards(held[other])}"
            raise SettingError(
                "mesh.data", f"process {process} holds devices of {_shards(shards)} of "
                f"the {layout} mesh{with_}; the trainer needs every process to hold the same number "
                "of data shards, in blocks that are the same or do not overlap (lay the devices out "
                "with mesh.order, or change mesh.data / mesh.pipe)")
        shares[process] = (first // k, n_data // k)
    return shares


def _shards(shards) -> str:
    first, last = min(shards), max(shards)
    return f"data shard {first}" if first == last else f"data shards {first}-{last}"


@functools.lru_cache(maxsize=32)
def _shares_of(mesh) -> dict:
    return batch_shares(mesh)


def batch_share(mesh, process_index: int | None = None) -> tuple[int, int]:
    """``(index, count)``: the share of every global batch that a process loads (this one by
    default): rows ``[index * B/count, (index + 1) * B/count)``, as the input makers take them
    (``process_index=index, process_count=count``).  See :func:`batch_shares`.

    Raises:
        SettingError: naming ``mesh.data``, for a layout :func:`batch_shares` refuses or a process
            that holds no device of the mesh.
    """
    process = jax.process_index() if process_index is None else process_index
    shares = _shares_of(mesh)
    if process not in shares:
        raise SettingError("mesh.data", f"process {process} holds no device of the mesh, so it has no "
                           "rows of the batch to load")
    return shares[process]


def _split_over_data(sharding) -> bool:
    spec = getattr(sharding, "spec", ())
    return (isinstance(sharding, NamedSharding) and len(spec) > 0 and spec[0] in (DATA, (DATA,))
            and sharding.mesh.axis_names[0] == DATA)


def global_batch(local_batch, sharding):
    """Stitch each process's share of a batch into global ``jax.Array``s.

    Arguments:
        local_batch: a pytree of host arrays: the rows of the batch this process loads. For a
            batch split over ``data`` (``P("data")``) that is the share :func:`batch_share`
            names: ``(B / count, ...)``, rows ``[index * B/count, (index + 1) * B/count)`` (in
            the usual layout ``count`` is the process count and ``index`` this process's);
            for another sharding, rows ``[p * B/P, (p + 1) * B/P)`` of ``P`` processes.
        sharding: the batch's ``NamedSharding`` (leading axis over ``data``).

    Returns:
        The same pytree of ``jax.Array`` with leading size ``B``.
    """
    count = batch_share(sharding.mesh)[1] if _split_over_data(sharding) else jax.process_count()
    return jax.tree_util.tree_map(
        lambda x: jax.make_array_from_process_local_data(
            sharding, x, (x.shape[0] * count,) + tuple(x.shape[1:])),
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
