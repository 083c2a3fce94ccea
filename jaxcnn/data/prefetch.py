"""A background thread that prepares upcoming batches and moves them to the device."""
import itertools
import queue
import threading

# How often a producer blocked on a full queue checks whether it has been closed.
_POLL_SECONDS = 0.05


class Prefetcher:
    """Iterates over batches prepared ahead of time by a daemon thread.

    Arguments:
        source: an iterable of batches, or a function ``step -> batch`` called for
            ``start, start + 1, ...`` (up to ``stop``, exclusive, or forever when None).
        size: how many prepared batches may wait in the queue.
        device_put: applied to each batch in the thread before it is queued; None uses
            `jax.device_put`. Pass a sharding-aware function (for instance
            ``lambda b: jax.device_put(b, sharding)`` or one built on
            ``jax.make_array_from_process_local_data``) for multi-device runs, or
            ``lambda b: b`` to keep host arrays.
        start: first step, when ``source`` is a function.
        stop: step to stop before, when ``source`` is a function.

    Batches come out in the order the source makes them. An exception raised by the source or
    by ``device_put`` is re-raised by the ``next`` call that would have returned that batch;
    iteration then ends. `close` (or leaving a ``with`` block) stops the thread after at most
    the batch it is preparing.
    """

    def __init__(self, source, size: int = 2, *, device_put=None, start: int = 0, stop=None):
        if size < 1:
            raise ValueError(f"Prefetcher: size must be at least 1, got {size}")
        if callable(source) and not hasattr(source, "__iter__"):
            steps = itertools.count(start) if stop is None else range(start, stop)
            items = map(source, steps)
        else:
            items = iter(source)
        if device_put is None:
            import jax

            device_put = jax.device_put
        self._device_put = device_put
        self._queue = queue.Queue(maxsize=size)
        self._closed = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._produce, args=(items,), name="jaxcnn-prefetch", daemon=True)
        self._thread.start()

    def _offer(self, entry) -> bool:
        while not self._closed.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self, items):
        try:
            for item in items:
                if self._closed.is_set() or not self._offer(("batch", self._device_put(item))):
                    return
            self._offer(("end", None))
        except BaseException as err:  # noqa: BLE001 - handed to the consumer, who re-raises it
            self._offer(("error", err))

    def __iter__(self):
        return self

    def __next__(self):
        if self._finished:
            raise StopIteration
        while True:
            # Polling rather than a blocking get, so a close() from another thread ends the wait.
            if self._closed.is_set():
                self._finished = True
                raise StopIteration
            try:
                kind, value = self._queue.get(timeout=_POLL_SECONDS)
                break
            except queue.Empty:
                continue
        if kind == "batch":
            return value
        self._finished = True
        if kind == "error":
            raise value
        raise StopIteration

    def close(self, timeout=None):
        """Stops the thread and waits for it (at most ``timeout`` seconds when given); idempotent."""
        self._closed.set()
        self._finished = True
        self._thread.join(timeout)
        # Drop queued batches so their device buffers can be freed now.
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()
