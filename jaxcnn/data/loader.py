"""Batches of decoded, transformed images from an image folder or record file, made by grain workers.

`TrainBatches` is the batch for a step as a pure function of ``(seed, step)``: the indices
are `jaxcnn.data.pipeline.batch_indices` (an epoch is a permutation seeded by
``(seed, epoch)``; each example at most once per epoch, across all processes), this process
takes its contiguous share of the global batch (`process_share`, as for in-memory data),
and each example's crop and flip are drawn from ``(seed, step, position in the global
batch)``. `EvalBatches` covers a validation split once, in order, padded with a mask.

`Loader` runs either over a range of steps with grain: ``MapDataset.range(start, stop)``
mapped through the batch maker, then ``mp_prefetch`` with ``workers`` processes. grain hands
worker ``w`` the batches ``w, w + workers, ...`` and interleaves their outputs back in order,
so the batches are the same for any number of workers (0: in this process), and resuming at
step ``s`` is just starting the range at ``s``. An exception in a worker (a bad image with
``on_bad_image: fail``) is re-raised by the ``next`` that would have returned its batch; a
worker that dies is reported by grain as a ``RuntimeError`` rather than waited for.
Workers hand their images over through a ring of shared-memory blocks each reuses
(`jaxcnn.data.handover`), not pickled through grain's pipes.

A bad image with ``on_bad_image: skip`` is counted in the batch (``"bad_images"``, its
messages in ``"bad_files"``) and replaced, in training, by the next example of the dataset
that decodes (``index + 1, index + 2, ...``), so the batch stays full and still depends only
on the seed and the step; in evaluation its row is masked out.
"""
from __future__ import annotations

import contextlib
import functools
import os
import signal
import threading
import time

import numpy as np

from jaxcnn.data.folder import decode_image
from jaxcnn.data.handover import RingReader
from jaxcnn.data.pipeline import batch_indices, process_share, steps_per_epoch
from jaxcnn.data.transforms import eval_transform, example_rng, train_transform
from jaxcnn.errors import BadImageError, DataError

ON_BAD_IMAGE = ("skip", "fail")
# A run of this many bad images in a row is not bad luck but a broken dataset.
MAX_CONSECUTIVE_BAD = 64
# How often a worker checks that the process that started it is still there.
_PARENT_POLL_S = 0.5
# The keys of a batch that are bookkeeping, not arrays for the device.
INFO_KEYS = ("bad_images", "bad_files", "index")


def _check_common(source, batch_size, image_size, on_bad_image, process_index, process_count):
    if on_bad_image not in ON_BAD_IMAGE:
        raise ValueError(f"on_bad_image must be one of {list(ON_BAD_IMAGE)}, got {on_bad_image!r}")
    if len(image_size) != 2 or not all(int(s) > 0 for s in image_size):
        raise ValueError(f"image_size must be [H, W] with positive sides, got {image_size!r}")
    if len(source) == 0:
        raise DataError(f"{source.name}: no images")
    return process_share(batch_size, process_index, process_count)


def load_rgb(source, index: int):
    """The decoded RGB image ``index`` of ``source`` and its label; raises :class:`BadImageError`."""
    payload, label, name = source[index]
    return decode_image(payload, name), label


class TrainBatches:
    """``step -> batch``: this process's share of the training batch for ``step``.

    Arguments:
        source: a `jaxcnn.data.folder.FolderSource` or `jaxcnn.data.records.RecordSource`.
        seed: data seed.
        batch_size: global batch size, divisible by ``process_count``.
        image_size: ``(H, W)`` of the crops.
        on_bad_image: ``"skip"`` or ``"fail"``.
        process_index, process_count: this process among those sharing each global batch.

    A batch is ``{"image": (B, H, W, 3) uint8, "label": (B,) int32, "bad_images": () int32,
    "bad_files": tuple of messages, "index": (B,) int64 example numbers}`` with
    ``B = batch_size // process_count``.
    Picklable (it holds the file list or the record reader), so grain can send it to workers.
    """

    def __init__(self, source, *, seed: int, batch_size: int, image_size, on_bad_image: str = "fail",
                 process_index: int = 0, process_count: int = 1):
        self.start, self.local = _check_common(source, batch_size, image_size, on_bad_image,
                                               process_index, process_count)
        self.steps_per_epoch = steps_per_epoch(len(source), batch_size)
        self.source, self.seed, self.batch_size = source, int(seed), int(batch_size)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.on_bad_image = on_bad_image

    def __call__(self, step: int) -> dict:
        step = int(step)
        indices = batch_indices(len(self.source), self.batch_size, self.seed, step)
        indices = indices[self.start:self.start + self.local]
        images = np.empty((self.local,) + self.image_size + (3,), np.uint8)
        labels = np.empty(self.local, np.int32)
        used = np.empty(self.local, np.int64)
        bad = []
        for k, index in enumerate(indices):
            image, labels[k], used[k] = self._load(int(index), bad)
            train_transform(image, self.image_size, example_rng(self.seed, step, self.start + k), out=images[k])
        return {"image": images, "label": labels, "bad_images": np.int32(len(bad)), "bad_files": tuple(bad),
                "index": used}

    def _load(self, index, bad):
        n = len(self.source)
        for attempt in range(MAX_CONSECUTIVE_BAD):
            try:
                return load_rgb(self.source, (index + attempt) % n) + ((index + attempt) % n,)
            except BadImageError as err:
                if self.on_bad_image == "fail":
                    raise
                bad.append(str(err))
        raise DataError(f"{self.source.name}: {MAX_CONSECUTIVE_BAD} bad images in a row from example "
                        f"{index} (last: {bad[-1]})")


class EvalBatches:
    """``batch number -> batch``: this process's share of evaluation batch ``b`` of a split.

    Arguments:
        source: as for `TrainBatches`.
        batch_size: global batch size, divisible by ``process_count``.
        image_size: ``(H, W)`` of the centre crops.
        resize: the shorter side is resized to this before the crop (``>= max(H, W)``).
        on_bad_image: ``"skip"`` (the row is masked out and counted) or ``"fail"``.
        process_index, process_count: as for `TrainBatches`.

    ``len(self)`` batches cover every example exactly once, in order; a batch is
    ``{"image", "label", "mask": (B,) bool, "bad_images", "bad_files"}``, padding rows zero
    with mask False (as `jaxcnn.data.eval_batches` pads in-memory data).
    """

    def __init__(self, source, *, batch_size: int, image_size, resize: int, on_bad_image: str = "fail",
                 process_index: int = 0, process_count: int = 1):
        self.start, self.local = _check_common(source, batch_size, image_size, on_bad_image,
                                               process_index, process_count)
        self.source, self.batch_size = source, int(batch_size)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        if int(resize) < max(self.image_size):
            raise ValueError(f"eval resize {resize} is smaller than the crop {list(self.image_size)}")
        self.resize, self.on_bad_image = int(resize), on_bad_image

    def __len__(self):
        return -(-len(self.source) // self.batch_size)

    def __call__(self, number: int) -> dict:
        total = len(self.source)
        lo = min(int(number) * self.batch_size + self.start, total)
        hi = min(int(number) * self.batch_size + self.start + self.local, total)
        images = np.zeros((self.local,) + self.image_size + (3,), np.uint8)
        labels = np.zeros(self.local, np.int32)
        mask = np.zeros(self.local, bool)
        bad = []
        for k, index in enumerate(range(lo, hi)):
            try:
                image, label = load_rgb(self.source, index)
            except BadImageError as err:
                if self.on_bad_image == "fail":
                    raise
                bad.append(str(err))
                continue
            images[k] = eval_transform(image, self.image_size, self.resize)
            labels[k], mask[k] = label, True
        return {"image": images, "label": labels, "mask": mask, "bad_images": np.int32(len(bad)),
                "bad_files": tuple(bad)}


def _exit_with_parent(parent: int, worker_index: int = 0, worker_count: int = 1) -> None:
    """In a worker: a daemon thread that ends this process once the process that started it is
    gone. A trainer killed with SIGKILL runs no clean-up, and its grain workers, blocked on a
    full queue, were left behind for good (re-parented to init).

    The worker also ignores SIGINT and SIGTERM from here on: a terminal's Ctrl-C (a scheduler's
    SIGTERM) reaches every process of the job, and a worker that died of it stopped the trainer
    on grain's "Worker process was terminated unexpectedly" instead of the checkpoint the trainer
    saves for them; the trainer stops its workers itself. (A signal that comes while the worker
    is still importing, before this runs, is held back until here: see `held_signals`.)"""
    for sig in _HELD_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # discards one that came while starting (held back)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _HELD_SIGNALS)

    def watch():
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="jaxcnn-loader-parent-watch", daemon=True).start()


# Held back from a worker process until its start-up function ignores them (see `held_signals`).
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def held_signals(active: bool, signals=_HELD_SIGNALS):
    """Blocks SIGINT and SIGTERM in the calling thread while grain may start worker processes.

    grain starts its workers (``spawn``) from threads it creates inside ``iter`` and the first
    ``next``; a thread inherits the mask of the thread that creates it, and a process that of
    the thread that starts it, across ``exec``. So a worker begins with both signals blocked: a
    Ctrl-C that reaches the process group while it still imports stays pending instead of
    killing it with its own ``KeyboardInterrupt`` traceback, and is discarded when
    `_exit_with_parent` sets them to be ignored. This process is not deaf meanwhile: its other
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


def _absl_flags_parsed():
    """grain reads one of its absl flags when it starts worker processes, which fails with
    ``UnparsedFlagAccessError`` outside an absl app (where nothing ever parses flags). Marking
    them parsed, only then, leaves every flag at its default or the value already set."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class Loader:
    """Iterates over ``make(i)`` for ``i`` in ``[start, stop)``, made by ``workers`` grain processes.

    Arguments:
        make: a picklable ``int -> batch`` (`TrainBatches`, `EvalBatches`).
        start, stop: the range of steps (or evaluation batch numbers).
        workers: grain worker processes; 0 makes the batches in this process, on demand.
        buffer: batches each worker may hold ready.
        shared_memory: workers hand their large arrays over through a ring of shared-memory
            blocks each reuses (`jaxcnn.data.handover`), falling back to grain's pipes for any
            array ``/dev/shm`` has no room for; False: always through the pipes (pickled).
            Arrays are copied out of shared memory as they arrive.

    The batches are the same, in the same order, for every ``workers``. `close` (or leaving a
    ``with`` block) stops the workers; so does running to the end.
    """

    def __init__(self, make, start: int, stop: int, *, workers: int = 0, buffer: int = 2,
                 shared_memory: bool = True):
        if workers < 0:
            raise ValueError(f"workers must be non-negative, got {workers}")
        if not 0 <= start <= stop:
            raise ValueError(f"Loader: need 0 <= start <= stop, got start={start}, stop={stop}")
        if workers > 0:  # the files the workers hold once started: a floor, so only a sure failure
            check_open_files(workers, margin=0)
        import grain

        self._ring = None
        if workers > 0 and shared_memory:
            # Blocks for the batches a worker may hold: its buffer, the one it makes, the one read.
            self._ring = RingReader(start=start, workers=workers, ring=max(1, int(buffer)) + 2)
            make = self._ring.writer(make)
        ds = grain.MapDataset.range(int(start), int(stop)).map(make)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if workers > 0:
            _absl_flags_parsed()
            # grain's own shared memory takes a fresh block per array (slow to fill): pipes for
            # whatever the ring does not carry.
            ds = grain.experimental.WithOptionsIterDataset(
                ds, grain.experimental.DatasetOptions(min_shm_size=1 << 62))
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(workers),
                                                             per_worker_buffer_size=max(1, int(buffer))),
                                worker_init_fn=functools.partial(_exit_with_parent, os.getpid()))
        # Only grain's `iter` and first `next` start threads and processes: the signals are held
        # back for those two calls alone (each hold costs the resource tracker's check and two
        # sigmask calls, once per batch before).
        self._held = workers > 0
        with held_signals(self._held):
            self._iter = iter(ds)
        self._closed = False

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed:
            raise StopIteration
        try:
            if self._held:
                with held_signals(True):
                    batch = next(self._iter)
                self._held = False
            else:
                batch = next(self._iter)
            return self._ring.take(batch) if self._ring is not None else batch
        except StopIteration:
            self.close()
            raise
        except BaseException:
            self.close()
            raise

    def close(self):
        """Stops the worker processes; idempotent."""
        if not self._closed:
            self._closed = True
            if self._ring is not None:
                self._ring.stop()
            close = getattr(self._iter, "close", None)
            if close is not None:
                close()
            if self._ring is not None:
                self._ring.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


# Open files a worker costs the process that starts it (pipes, queues, its shared-memory ring:
# 6-8 once started, more while it starts), and what grain's start-up takes besides. Measured
# with jaxcnn-train on an image folder, 2 workers for training and evaluation: `ulimit -n 48`
# ran out of files while the workers started, 56 ran.
FILES_PER_WORKER = 8
FILES_TO_START = 8


def check_open_files(workers: int, loaders: int = 1, *, margin: int = FILES_TO_START) -> None:
    """Refuses to start ``loaders`` loaders of ``workers`` processes each when ``ulimit -n``
    (``RLIMIT_NOFILE``) leaves too few open files for them (``FILES_PER_WORKER`` each, and
    ``margin`` per loader for the start): ``ulimit -n 32`` with 2 workers ended in a 116-line
    traceback of grain's start-up. A :class:`DataError` naming the limit and what would do
    (the trainer asks for its training and evaluation loaders at once, before it trains)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/proc/self/fd"))
    except (ImportError, OSError, ValueError):
        return  # no such limit here, or no way to count: grain reports what goes wrong
    need = open_now + loaders * (FILES_PER_WORKER * workers + margin)
    if soft != resource.RLIM_INFINITY and need > soft:
        each = " for each of training and evaluation" if loaders == 2 else ""
        raise DataError(f"{workers} data worker processes{each} need about {need} open files "
                        f"({open_now} open now) but ulimit -n allows {soft}: raise it "
                        f"(ulimit -n {max(1024, 2 * need)}) or use fewer workers")


def split_info(batch: dict):
    """``(arrays, bad_images, bad_files)``: the batch without its bookkeeping keys, and those."""
    arrays = {k: v for k, v in batch.items() if k not in INFO_KEYS}
    return arrays, int(batch.get("bad_images", 0)), tuple(batch.get("bad_files", ()))
