"""The shared-memory ring that carries a worker's large batch arrays: the same batches as making
them in the process, blocks reused rather than one per batch, a worker that waits while its
block is still unread, arrays sent through grain when ``/dev/shm`` has no room or a batch
outgrows its block, and nothing left in ``/dev/shm`` after the loader closes, early or not."""
import os
import threading
import time

import numpy as np
import pytest

from jaxcnn.data import handover
from jaxcnn.data.handover import MIN_BYTES, RingReader, Slot
from jaxcnn.data.loader import Loader


class _Big:
    """A batch maker with one array large enough for the ring and one small enough for the pipe."""

    def __init__(self, size=MIN_BYTES):
        self.size = size

    def __call__(self, step):
        rng = np.random.default_rng(step)
        return {"x": rng.integers(0, 256, self.size, dtype=np.uint8), "y": np.full(3, step, np.int32)}


def _blocks(token):
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(token))


def _same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        for key in a:
            assert type(a[key]) is np.ndarray, key
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.filterwarnings("ignore:ResourceTracker called reentrantly:UserWarning")
def test_workers_through_the_ring_give_the_batches_made_here_and_reuse_their_blocks():
    want = [_Big()(step) for step in range(3, 15)]
    loader = Loader(_Big(), 3, 15, workers=2, buffer=1)
    token = loader._ring.token
    got, seen = [], set()
    for batch in loader:
        got.append(batch)
        seen.update(_blocks(token))
    _same(got, want)
    # 12 batches of 2 workers, each with a ring of buffer + 2 = 3 blocks (and a counter).
    assert 1 <= len(seen) <= 2 * 3, seen
    assert _blocks(token) == []  # unlinked once the loader ran to its end
    assert loader._ring._counter is None


@pytest.mark.filterwarnings("ignore:ResourceTracker called reentrantly:UserWarning")
def test_closing_early_unlinks_the_blocks_made_ahead():
    loader = Loader(_Big(), 0, 20, workers=2, buffer=2)
    token = loader._ring.token
    _same([next(loader), next(loader)], [_Big()(0), _Big()(1)])
    # Until the workers have made batches ahead: blocks beyond the two of the batches read (it
    # slept 0.5 s and asked only for some block; the workers fill their rings within ~0.1 s).
    deadline = time.monotonic() + 30
    while len(_blocks(token)) <= 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_blocks(token)) > 2
    loader.close()
    assert _blocks(token) == []


def test_pipes_only_when_asked():
    with Loader(_Big(), 0, 2, workers=1, shared_memory=False) as loader:
        assert loader._ring is None
        _same(list(loader), [_Big()(0), _Big()(1)])


def test_a_worker_waits_while_the_reader_holds_its_block():
    reader = RingReader(start=0, workers=1, ring=2)
    write = reader.writer(_Big())
    try:
        sent = [write(0), write(1)]
        assert all(isinstance(b["x"], Slot) and isinstance(b["y"], np.ndarray) for b in sent)
        done = []
        third = threading.Thread(target=lambda: done.append(write(2)), daemon=True)
        third.start()
        third.join(0.3)
        assert not done  # batch 2 goes into batch 0's block, which has not been read
        _same([reader.take(sent[0])], [_Big()(0)])
        third.join(10)
        assert len(done) == 1
        _same([reader.take(sent[1]), reader.take(done[0])], [_Big()(1), _Big()(2)])
        assert len(_blocks(reader.token)) == 2  # two blocks for three batches
    finally:
        reader.close()
    assert _blocks(reader.token) == []


def test_a_stopped_reader_gets_empty_batches_unmade_even_from_a_waiting_worker():
    # After stop, nothing large may go through grain's pipe: nobody empties it any more, and a
    # worker whose pipe is full does not exit until grain kills it (25 s per worker).
    reader = RingReader(start=0, workers=1, ring=1)
    try:
        made = []
        write = reader.writer(lambda step: made.append(step) or _Big()(step))
        assert isinstance(write(0)["x"], Slot)
        waiting = []
        second = threading.Thread(target=lambda: waiting.append(write(1)), daemon=True)
        second.start()
        second.join(0.3)
        assert not waiting  # batch 1 waits for batch 0's block
        reader.stop()
        second.join(10)
        assert waiting == [{}]
        assert write(2) == {} and made == [0, 1]  # batch 2 is not made
    finally:
        reader.close()
    assert _blocks(reader.token) == []


def test_a_batch_made_while_the_reader_stops_sends_no_large_array(monkeypatch):
    # /dev/shm without room (a container's 64 MB): every large array would go through grain's
    # pipe; one made while the reader stops is dropped instead.
    monkeypatch.setattr(handover, "_room_for", lambda nbytes: False)
    reader = RingReader(start=0, workers=1, ring=2)
    try:
        def make(step):
            if step == 1:
                reader.stop()  # the loader closes while the worker makes batch 1
            return _Big()(step)
        write = reader.writer(make)
        first = write(0)
        assert isinstance(first["x"], np.ndarray)  # through grain, as before
        _same([reader.take(first)], [_Big()(0)])
        assert write(1) == {}
    finally:
        reader.close()


def test_no_room_or_a_larger_batch_goes_through_grain(monkeypatch):
    reader = RingReader(start=0, workers=1, ring=2)
    try:
        write = reader.writer(_Big())
        first = write(0)
        assert isinstance(first["x"], Slot)
        _same([reader.take(first)], [_Big()(0)])
        write.make = _Big(MIN_BYTES + 1)  # batch 2 reuses batch 0's block, which is too small
        larger = write(2)
        assert isinstance(larger["x"], np.ndarray)
        _same([reader.take(larger)], [_Big(MIN_BYTES + 1)(2)])
        monkeypatch.setattr(handover, "_room_for", lambda nbytes: False)  # /dev/shm full
        inline = reader.writer(_Big())(1)
        assert isinstance(inline["x"], np.ndarray)
        _same([reader.take(inline)], [_Big()(1)])
    finally:
        reader.close()
    assert _blocks(reader.token) == []
