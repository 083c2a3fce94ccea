"""A loader's worker processes: how they start, and how the loader sees one die.

grain reads each worker's batches from a ``multiprocessing`` queue, and notices a dead worker
only while that worker's queue is empty. A worker killed while it writes a batch larger than
the pipe's buffer (SIGKILL from the out-of-memory killer, mid-send) leaves half a message in
the pipe, and grain's read of it waits for the rest for good: this process holds the pipe's
other end too, so no end-of-file ever comes. The trainer slept at 0% CPU with no message.

So a loader with workers never waits inside grain on its own thread:

- `Roster`: each worker writes its pid into a small shared block as it starts (`start_worker`);
  the loader finds the worker's `multiprocessing.Process` by that pid and reads its exit code.
- `Fetcher`: a daemon thread makes each ``next`` call into grain, and the loader waits for the
  answer in slices of `WATCH_S`, asking the roster between slices whether a worker has died.
  When one has, the loader raises :class:`jaxcnn.errors.DataWorkerDied` naming the worker, its
  pid and its signal; a thread left waiting in grain is a daemon and does not hold up the
  process's exit. The other workers are not killed: one killed mid-send would leave another
  half-sent batch, which grain's exit-time clean-up (``multiprocessing``'s finalizers, which
  drain each worker's queue) would then wait on. They end when grain's clean-up stops them or
  when this process ends (`start_worker`'s watch).

Workers start with SIGINT and SIGTERM blocked (`held_signals`) and ignore both once started:
the trainer that owns them decides when they stop.
"""
from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from multiprocessing import shared_memory

import numpy as np

from jaxcnn.errors import DataWorkerDied

# How long a loader waits for a batch before it looks at its workers again.
WATCH_S = 0.25
# How often a worker checks that the process that started it is still there.
_PARENT_POLL_S = 0.5
# Held back from a worker process until `start_worker` ignores them (see `held_signals`).
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_signals(active: bool, signals=_HELD_SIGNALS):
    """Blocks SIGINT and SIGTERM in the calling thread while it may start worker processes.

    grain starts its workers (``spawn``) from threads it creates inside ``iter`` and the first
    ``next``; a thread inherits the mask of the thread that creates it, and a process that of
    the thread that starts it, across ``exec``. So a worker begins with both signals blocked: a
    Ctrl-C that reaches the process group while it still imports stays pending instead of
    killing it with its own ``KeyboardInterrupt`` traceback, and is discarded when
    `start_worker` sets them to be ignored. This process is not deaf meanwhile: its other
    threads take the signal (the handler runs on the main thread as usual), and a signal pending
    for this thread is delivered when the mask is restored. (``jaxcnn-data convert``'s pool holds
    back SIGINT alone: ``Pool.terminate`` stops its workers with SIGTERM.)"""
    if not active or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # multiprocessing starts its resource tracker with the first semaphore (grain's queues, a
    # Pool's locks) and then *unblocks* SIGINT and SIGTERM in the thread that did, whatever its
    # mask was: started first, here, it leaves the mask alone.
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def ignore_interrupts() -> None:
    """In a worker process started under ``held_signals(True, [SIGINT])``: ignore SIGINT from
    now on (one that came while starting is dropped) and unblock it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def start_worker(parent: int, roster: str | None, worker_index: int = 0, worker_count: int = 1) -> None:
    """In a worker (grain's ``worker_init_fn``): ignore SIGINT and SIGTERM, write this process's
    pid into slot ``worker_index`` of the shared block named ``roster`` (when given), and end
    the process once the process that started it is gone.

    A trainer killed with SIGKILL runs no clean-up, and its grain workers, blocked on a full
    queue, were left behind for good (re-parented to init). A terminal's Ctrl-C (a scheduler's
    SIGTERM) reaches every process of the job: a worker that died of it stopped the trainer on
    grain's "Worker process was terminated unexpectedly" instead of the checkpoint the trainer
    saves for them; the trainer stops its workers itself. (A signal that comes while the worker
    is still importing, before this runs, is held back until here: see `held_signals`.)"""
    for sig in _HELD_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # discards one that came while starting (held back)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)
    if roster is not None:
        # Registered with the resource tracker this process shares with the loader's (a set:
        # registering twice is once); the loader's unlink unregisters it.
        block = shared_memory.SharedMemory(name=roster, create=False)
        np.ndarray((worker_count,), np.int64, buffer=block.buf)[worker_index] = os.getpid()
        block.close()

    def watch():
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="jaxcnn-loader-parent-watch", daemon=True).start()


def _describe_end(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:  # a real-time signal without a name
        name = f"signal {-code}"
    if -code == signal.SIGKILL:
        return (f"was killed by {name} (what the out-of-memory killer sends: give the run more "
                f"memory or fewer data.workers)")
    return f"was killed by {name}"


class Roster:
    """The worker processes of one loader, as they report themselves.

    ``name`` is a shared block of ``workers`` pids, zero until worker ``w`` has started and
    written its own (`start_worker`). `dead` names the first worker that has ended with a
    signal or a nonzero exit code; a worker that has made all its batches ends with 0 and is
    not dead. Only children of this process are looked at, so a stray pid can never name
    another process.

    A worker's exit code is read from its ``multiprocessing.Process``, found by pid among this
    process's children (`track`) while it runs: once it has ended, any ``Process.start`` or
    ``active_children`` call reaps it and drops it from that list. One that ended before it
    was found is read with ``waitid(WNOWAIT)``, which leaves it to be reaped as before.
    """

    def __init__(self, workers: int):
        self.workers = int(workers)
        self._block = shared_memory.SharedMemory(create=True, size=8 * self.workers)
        self._pids = np.ndarray((self.workers,), np.int64, buffer=self._block.buf)
        self._pids[...] = 0
        self._processes = {}  # worker index -> multiprocessing.Process, found while it ran
        self._ended = {}  # worker index -> (pid, exit code) of one that ended before it was found

    @property
    def name(self) -> str:
        return self._block.name

    def track(self) -> None:
        """Finds the processes of the workers that have written their pids; cheap once all are."""
        if self._pids is None or len(self._processes) + len(self._ended) == self.workers:
            return
        wanted = {}
        for w, pid in enumerate(self._pids.tolist()):
            if pid and w not in self._processes and w not in self._ended:
                code = _unreaped_exit_code(pid)
                if code is None:
                    wanted[pid] = w
                else:  # ended already: read before active_children below reaps it
                    self._ended[w] = (pid, code)
        if wanted:
            import multiprocessing
            for process in multiprocessing.active_children():
                if process.pid in wanted:
                    self._processes[wanted[process.pid]] = process

    def dead(self) -> str | None:
        """``"data worker W of N (pid P) was killed by SIGKILL ..."`` for the first worker that
        died, or None while none has."""
        self.track()
        ends = dict(self._ended)
        ends.update((w, (p.pid, p.exitcode)) for w, p in self._processes.items())
        for w, (pid, code) in sorted(ends.items()):
            if code:  # None: running; 0: ended after its last batch
                return f"data worker {w + 1} of {self.workers} (pid {pid}) {_describe_end(code)}"
        return None

    def close(self) -> None:
        """Unlinks the shared block; idempotent."""
        if self._pids is not None:
            self._pids = None
            self._block.close()
            self._block.unlink()


def _unreaped_exit_code(pid: int):
    """The exit code (``-signal`` for a signal) of child ``pid`` if it has ended and not been
    reaped, else None; the child stays unreaped."""
    if not hasattr(os, "waitid"):
        return None
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already, or not our child
        return None
    if info is None:
        return None
    return -info.si_status if info.si_code in (os.CLD_KILLED, os.CLD_DUMPED) else info.si_status


class Fetcher:
    """Calls ``next(iterator)`` on a daemon thread, one call per `next`, with SIGINT and SIGTERM
    blocked in that thread for its life (grain starts its threads and worker processes from it:
    see `held_signals`).

    `next` waits for the answer in slices of `WATCH_S`; between slices it calls ``check()``,
    which returns an error to raise (a dead worker) or None, and stops waiting once
    ``closed()`` is true. A ``RuntimeError`` from ``next(iterator)`` goes through
    ``check(error)`` first, which may explain it (grain's "terminated unexpectedly" is a dead
    worker); any exception is re-raised.
    """

    def __init__(self, iterator):
        self._iterator = iterator
        self._requests: queue.Queue = queue.Queue()
        self._answers: queue.Queue = queue.Queue()
        self._busy = False
        threading.Thread(target=self._serve, name="jaxcnn-loader-fetch", daemon=True).start()

    def _serve(self) -> None:
        with held_signals(True):
            while self._requests.get():
                try:
                    self._answers.put((True, next(self._iterator)))
                except BaseException as err:  # noqa: BLE001 - handed to the caller, who re-raises it
                    self._answers.put((False, err))

    def next(self, check, closed):
        if not self._busy:
            self._busy = True
            self._requests.put(True)
        while True:
            try:
                ok, value = self._answers.get(timeout=WATCH_S)
                break
            except queue.Empty:
                error = check()
                if error is not None:
                    raise error
                if closed():
                    raise StopIteration
        self._busy = False
        if ok:
            return value
        if isinstance(value, RuntimeError) and not isinstance(value, DataWorkerDied):
            error = check(value)
            if error is not None:
                raise error from value
        raise value

    def stop(self) -> None:
        """Ends the thread after the call under way, if any (requests are served in order)."""
        self._requests.put(False)


def dead_worker_error(roster: Roster, batch: int, cause: BaseException | None = None):
    """The `DataWorkerDied` to raise for ``roster``'s first dead worker, or None. ``cause``:
    an error grain raised; its "terminated unexpectedly" is a dead worker even when the roster
    never saw that worker (one reaped by another part of this process before it was found)."""
    dead = roster.dead()
    if dead is None and cause is not None and "terminated unexpectedly" in str(cause):
        dead = f"a data worker {str(cause).split('. ')[0].replace('Worker process was ', 'was ')}"
    if dead is None:
        return None
    return DataWorkerDied(f"{dead} while the loader waited for batch {batch}")
