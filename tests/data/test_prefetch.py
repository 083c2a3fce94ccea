"""Prefetcher: order, device placement, exception propagation, closing without hanging."""
import threading
import time

import jax
import numpy as np
import pytest

from jaxcnn.data import Prefetcher


def _identity(batch):
    return batch


def test_iterable_order_and_end():
    with Prefetcher(iter(range(7)), size=2, device_put=_identity) as prefetcher:
        assert list(prefetcher) == list(range(7))
        with pytest.raises(StopIteration):
            next(prefetcher)


def test_step_function_with_start_and_stop():
    calls = []

    def make(step):
        calls.append(step)
        return {"x": np.full(2, step)}

    with Prefetcher(make, size=3, device_put=_identity, start=5, stop=9) as prefetcher:
        got = [int(batch["x"][0]) for batch in prefetcher]
    assert got == [5, 6, 7, 8] and calls == [5, 6, 7, 8]


def test_default_device_put_gives_jax_arrays():
    with Prefetcher(lambda step: {"image": np.ones((2, 3), np.float32) * step}, stop=2) as prefetcher:
        batches = list(prefetcher)
    assert all(isinstance(b["image"], jax.Array) for b in batches)
    np.testing.assert_array_equal(np.asarray(batches[1]["image"]), np.ones((2, 3)))


def test_sharding_aware_device_put():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[-1])
    with Prefetcher([np.zeros(4)], device_put=lambda b: jax.device_put(b, sharding)) as prefetcher:
        (batch,) = list(prefetcher)
    assert batch.sharding == sharding


@pytest.mark.parametrize("where", ["source", "device_put"])
def test_exception_reaches_the_consumer_after_earlier_batches(where):
    failure = RuntimeError("batch 3 is broken")

    def make(step):
        if where == "source" and step == 3:
            raise failure
        return step

    def put(batch):
        if where == "device_put" and batch == 3:
            raise failure
        return batch

    prefetcher = Prefetcher(make, device_put=put)
    assert [next(prefetcher) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(RuntimeError, match="batch 3 is broken") as info:
        next(prefetcher)
    assert info.value is failure
    with pytest.raises(StopIteration):
        next(prefetcher)
    prefetcher.close()


def test_close_stops_an_endless_producer_blocked_on_a_full_queue():
    made = []
    prefetcher = Prefetcher(lambda step: made.append(step) or step, size=1, device_put=_identity)
    assert next(prefetcher) == 0
    time.sleep(0.1)  # let the producer fill the queue and block
    started = time.monotonic()
    prefetcher.close()
    assert time.monotonic() - started < 1.0
    assert not prefetcher._thread.is_alive()
    assert len(made) <= 3  # it stopped instead of running on
    with pytest.raises(StopIteration):
        next(prefetcher)
    prefetcher.close()  # idempotent


def test_close_from_another_thread_releases_a_waiting_consumer():
    release = threading.Event()

    def slow(step):
        release.wait(5)
        return step

    prefetcher = Prefetcher(slow, device_put=_identity)
    threading.Timer(0.1, prefetcher.close, kwargs={"timeout": 0}).start()
    started = time.monotonic()
    with pytest.raises(StopIteration):
        next(prefetcher)
    assert time.monotonic() - started < 2.0
    release.set()
    prefetcher._thread.join(2)
    assert not prefetcher._thread.is_alive()


def test_runs_ahead_of_the_consumer():
    made = []
    prefetcher = Prefetcher(lambda step: made.append(step) or step, size=2, device_put=_identity, stop=10)
    deadline = time.monotonic() + 2
    while len(made) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made[:3] == [0, 1, 2]  # two queued and one waiting to be queued, before any next()
    prefetcher.close()


def test_bad_size():
    with pytest.raises(ValueError, match="size must be at least 1"):
        Prefetcher([], size=0)
