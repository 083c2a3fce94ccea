"""Handing a worker's batch arrays to the process that reads them through reused shared memory.

grain sends a worker's outputs through a pipe (pickled: the worker's feeder thread pickles
while the worker decodes, and the two share one interpreter) or through a fresh
``/dev/shm`` block per array. A fresh block costs the first touch of every page, many times
what a block written before costs, and the pickling slows a worker's decoding
(``docs/BENCHMARKS.md`` has both).
So each worker keeps a small ring of blocks it creates once and reuses: it writes a batch's
large arrays into the next block of its ring and sends through grain only a `Slot` (the
block's name, shape and dtype); the reading process copies them out and counts the batch as
read in a shared counter, which frees the block for that worker's batch ``ring`` of its batches later.

grain hands worker ``w`` of ``W`` the batches ``w, w + W, ...`` in order and the reader takes
them back in order, so batch ``j`` (counted from the start of the range) is the ``j // W``-th
batch of worker ``j % W``, and its block is ``(j // W) % ring`` of that worker's ring. A
worker waits for its block only while the reader has not yet read the batch that used it
last (batch ``j - workers * ring``); the batch the reader waits for is never one that waits, so
this cannot deadlock. Were grain to hand the batches out otherwise, two workers would meet at a
block name: the second sends its array through grain, slower but still right.

Arrays that are small, or when ``/dev/shm`` has no room for a block (a container's default
64 MB), go through grain as before: the fallback costs speed, never correctness. The reader
unlinks every block of every ring when it closes (after the workers have stopped), sent or not.
"""
from __future__ import annotations

import os
import secrets
import time
from multiprocessing import shared_memory
from typing import NamedTuple

import numpy as np

# Arrays smaller than this go through grain as they are (a block would not pay for itself).
MIN_BYTES = 1 << 20
# Room left free in /dev/shm beyond a new block.
_SHM_MARGIN = 64 << 20
_WAIT_S = 0.0005


# Arrays of a batch that may use blocks (the first this many keys).
MAX_KEYS = 8


def block_name(token: str, worker: int, slot: int, position: int) -> str:
    """The name of worker ``worker``'s block ``slot`` for the batch's ``position``-th array."""
    return f"{token}-{worker}-{slot}-{position}"


class Slot(NamedTuple):
    """A batch array left in a shared-memory block: what crosses the pipe instead of it."""
    name: str
    shape: tuple
    dtype: str


def _attach(name: str) -> shared_memory.SharedMemory:
    """Open an existing block. It is registered with the resource tracker the workers share with
    this process (a set: registering twice is once), and `RingReader.close`'s unlink unregisters it."""
    return shared_memory.SharedMemory(name=name, create=False)


def _unlink(name: str) -> None:
    try:
        block = _attach(name)
    except (FileNotFoundError, OSError):
        return
    block.close()
    block.unlink()


def _large(value) -> bool:
    """Whether ``value`` is an array worth a block (and too large for grain's pipe once stopping)."""
    return isinstance(value, np.ndarray) and value.nbytes >= MIN_BYTES


def _room_for(nbytes: int) -> bool:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return False
    return stat.f_bavail * stat.f_frsize >= nbytes + _SHM_MARGIN


class _Stopping(Exception):
    """The reader stopped while a worker waited for a block (`RingWriter._put`)."""


class RingWriter:
    """Wraps a batch maker ``make(i) -> dict`` for grain's workers (picklable): its large
    arrays go into this worker's ring of blocks, and the batch carries `Slot`s in their place.

    Arguments:
        make: the batch maker.
        start: the first batch number of the loader's range.
        workers: the number of grain workers.
        ring: blocks per worker (at least the batches a worker may have made and not yet had read).
        counter: name of the reader's shared ``int64[2]``: batches read, and 1 once it is stopping.
        token: a prefix unique to this loader, for the blocks' names.
    """

    def __init__(self, make, *, start: int, workers: int, ring: int, counter: str, token: str):
        self.make, self.start, self.workers, self.ring = make, int(start), int(workers), int(ring)
        self.counter, self.token = counter, token
        self._blocks: dict[int, shared_memory.SharedMemory] = {}
        self._counter_block = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_blocks"], state["_counter_block"] = {}, None  # opened again in the worker
        return state

    def __call__(self, number: int) -> dict:
        """The batch ``make(number)`` with `Slot`s for its large arrays; an empty dict once the
        reader is stopping (looked at before making the batch, while waiting for a block, and
        before returning a batch that still holds a large array). Nobody reads that batch, and a
        large array sent through grain's pipe then would hold the worker's exit until grain gives
        up on it and kills it (25 s per worker in grain 0.2.18: its queue's feeder thread waits
        on a pipe that nobody empties any more)."""
        if self._reader_state()[1]:
            return {}
        batch = self.make(number)
        j = int(number) - self.start
        worker, k = j % self.workers, j // self.workers
        out = dict(batch)
        for position, (key, value) in enumerate(batch.items()):
            if _large(value) and position < MAX_KEYS:
                try:
                    slot = self._put(worker, k, position, value, free_after=j - self.workers * self.ring)
                except _Stopping:
                    return {}
                if slot is not None:
                    out[key] = slot
        if any(_large(value) for value in out.values()) and self._reader_state()[1]:
            return {}  # the reader stopped while this batch was made: no large array for the pipe
        return out

    def _reader_state(self) -> tuple[int, bool]:
        """(batches read, whether the reader is stopping)."""
        if self._counter_block is None:
            self._counter_block = _attach(self.counter)
        read, stopping = np.ndarray((2,), np.int64, buffer=self._counter_block.buf)
        return int(read), bool(stopping)

    def _put(self, worker: int, k: int, position: int, value: np.ndarray, free_after: int):
        """The `Slot` of ``value`` written into this worker's block for its ``k``-th batch, once
        batch ``free_after`` (the block's last user) has been read; None: ``value`` goes through
        grain instead (no room in ``/dev/shm``, or the block is smaller than ``value``). Raises
        `_Stopping` when the reader stops while it waits."""
        index = (k % self.ring, position)
        block = self._blocks.get(index)
        if block is None:
            if not _room_for(value.nbytes):
                return None
            try:
                block = shared_memory.SharedMemory(name=block_name(self.token, worker, *index), create=True,
                                                   size=value.nbytes)
            except OSError:
                return None
            self._blocks[index] = block
        if block.size < value.nbytes:  # a larger batch than the first: through grain
            return None
        while True:  # batch free_after used this block last: wait until it is read
            read, stopping = self._reader_state()
            if read > free_after:
                break
            if stopping:  # the loader is closing: nobody will read this batch
                raise _Stopping
            time.sleep(_WAIT_S)
        np.ndarray(value.shape, value.dtype, buffer=block.buf)[...] = value
        return Slot(block.name, value.shape, value.dtype.str)


class RingReader:
    """The reading side: `take` turns a batch of `Slot`s back into arrays and marks it read.

    Arguments:
        start, workers, ring: as for `RingWriter`.
    """

    def __init__(self, *, start: int, workers: int, ring: int):
        self.start, self.workers, self.ring = int(start), int(workers), int(ring)
        self.token = f"jaxcnn-{os.getpid()}-{secrets.token_hex(4)}"
        self._counter = shared_memory.SharedMemory(create=True, size=16)
        self._counts = np.ndarray((2,), np.int64, buffer=self._counter.buf)
        self._counts[...] = 0
        self._blocks: dict[str, shared_memory.SharedMemory] = {}

    def writer(self, make) -> RingWriter:
        """The maker to hand to grain in place of ``make``."""
        return RingWriter(make, start=self.start, workers=self.workers, ring=self.ring,
                          counter=self._counter.name, token=self.token)

    def take(self, batch: dict) -> dict:
        """``batch`` with its `Slot`s copied out of shared memory; the worker may then reuse them."""
        out = {}
        for key, value in batch.items():
            if isinstance(value, Slot):
                block = self._blocks.get(value.name)
                if block is None:
                    block = self._blocks[value.name] = _attach(value.name)
                value = np.ndarray(value.shape, np.dtype(value.dtype), buffer=block.buf).copy()
            out[key] = value
        self._counts[0] += 1
        return out

    def stop(self) -> None:
        """Tell the workers no more batches will be read, so none waits for a block or makes
        another batch (call it before stopping them)."""
        if self._counts is not None:
            self._counts[1] = 1

    def close(self) -> None:
        """Unlink every block the workers may have made, and the counter; idempotent. Call once the
        workers have stopped (a block made and never sent is unlinked too)."""
        if self._counter is None:
            return
        for block in self._blocks.values():
            block.close()
        self._blocks = {}
        for worker in range(self.workers):
            for slot in range(self.ring):
                for position in range(MAX_KEYS):
                    _unlink(block_name(self.token, worker, slot, position))
        counter, self._counter, self._counts = self._counter, None, None
        counter.close()
        counter.unlink()
