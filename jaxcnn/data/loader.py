"""Batches of decoded, transformed images from an image folder or record file, made by grain workers.

`TrainBatches` is the batch for a step as a pure function of ``(seed, step)``: the indices
are `jaxcnn.data.pipeline.batch_indices` (an epoch is a permutation seeded by
``(seed, epoch)``; each example at most once per epoch, across all processes), this process
takes its contiguous share of the global batch (`process_share`, as for in-memory data),
and each example's augmentation (`jaxcnn.data.Augment`: crop, flips...) is drawn from
``(seed, step, position in the global batch)``. `EvalBatches` covers a validation split once,
in order, padded with a mask.

`Loader` runs either over a range of steps with grain: ``MapDataset.range(start, stop)``
mapped through the batch maker, then ``mp_prefetch`` with ``workers`` processes. grain hands
worker ``w`` the batches ``w, w + workers, ...`` and interleaves their outputs back in order,
so the batches are the same for any number of workers (0: in this process), and resuming at
step ``s`` is just starting the range at ``s``. An exception in a worker (a bad image with
``on_bad_image: fail``) is re-raised by the ``next`` that would have returned its batch; a
worker that dies (killed by any signal, at any point: mid-send of a large batch too) is a
:class:`DataWorkerDied` naming it, raised within about a second (`jaxcnn.data.workers`).
Workers hand their images over through a ring of shared-memory blocks each reuses
(`jaxcnn.data.handover`), not pickled through grain's pipes.

A bad image with ``on_bad_image: skip`` is counted in the batch (``"bad_images"``, its
messages in ``"bad_files"``) and replaced, in training, by the next example of the dataset
that decodes (``index + 1, index + 2, ...``), so the batch stays full and still depends only
on the seed and the step; in evaluation its row is masked out.
"""
from __future__ import annotations

import functools
import os
import threading

import numpy as np

from jaxcnn.data.folder import decode_image
from jaxcnn.data.handover import RingReader
from jaxcnn.data.augment import FILE_RECIPE, as_augment
from jaxcnn.data.pipeline import batch_indices, process_share, steps_per_epoch
from jaxcnn.data.transforms import eval_transform, example_rng, train_transform
from jaxcnn.data.workers import Fetcher, Roster, dead_worker_error, held_signals, start_worker
from jaxcnn.errors import BadImageError, DataError, DataWorkerDied

ON_BAD_IMAGE = ("skip", "fail")
# A run of this many bad images in a row is not bad luck but a broken dataset.
MAX_CONSECUTIVE_BAD = 64
# The keys of a batch that are bookkeeping, not arrays for the device.
INFO_KEYS = ("bad_images", "bad_files", "index")
# How long a loader whose worker died waits for grain's clean-up before it leaves it running:
# after a half-sent batch grain's clean-up waits for good on its thread reading that batch.
_CLOSE_S = 0.5


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
        augment: the `jaxcnn.data.Augment` each image gets (`jaxcnn.data.transforms.train_transform`);
            one without a random crop (``scale`` None) is evaluation's resize to ``resize``
            and centre crop.
        resize: the evaluation resize (`EvalBatches`), needed only by such an ``augment``.

    A batch is ``{"image": (B, H, W, 3) uint8, "label": (B,) int32, "bad_images": () int32,
    "bad_files": tuple of messages, "index": (B,) int64 example numbers}`` with
    ``B = batch_size // process_count``.
    Picklable (it holds the file list or the record reader), so grain can send it to workers.
    """

    def __init__(self, source, *, seed: int, batch_size: int, image_size, on_bad_image: str = "fail",
                 process_index: int = 0, process_count: int = 1, augment=FILE_RECIPE, resize: int | None = None):
        self.start, self.local = _check_common(source, batch_size, image_size, on_bad_image,
                                               process_index, process_count)
        self.steps_per_epoch = steps_per_epoch(len(source), batch_size)
        self.source, self.seed, self.batch_size = source, int(seed), int(batch_size)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        self.on_bad_image = on_bad_image
        self.augment, self.resize = as_augment(augment), resize
        if self.augment.scale is None and (resize is None or int(resize) < max(self.image_size)):
            raise ValueError(f"augment without a random crop takes evaluation's resize, which must be at least "
                             f"the crop {list(self.image_size)}, got resize={resize!r}")

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
            train_transform(image, self.image_size, example_rng(self.seed, step, self.start + k), self.augment,
                            resize=self.resize, out=images[k])
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
        interpolation: the resize's filter (`jaxcnn.data.transforms.INTERPOLATIONS`).
        on_bad_image: ``"skip"`` (the row is masked out and counted) or ``"fail"``.
        process_index, process_count: as for `TrainBatches`.

    ``len(self)`` batches cover every example exactly once, in order; a batch is
    ``{"image", "label", "mask": (B,) bool, "bad_images", "bad_files"}``, padding rows zero
    with mask False (as `jaxcnn.data.eval_batches` pads in-memory data).
    """

    def __init__(self, source, *, batch_size: int, image_size, resize: int, on_bad_image: str = "fail",
                 process_index: int = 0, process_count: int = 1, interpolation: str = "bilinear"):
        self.start, self.local = _check_common(source, batch_size, image_size, on_bad_image,
                                               process_index, process_count)
        self.source, self.batch_size = source, int(batch_size)
        self.image_size = (int(image_size[0]), int(image_size[1]))
        if int(resize) < max(self.image_size):
            raise ValueError(f"eval resize {resize} is smaller than the crop {list(self.image_size)}")
        self.resize, self.on_bad_image = int(resize), on_bad_image
        self.interpolation = interpolation

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
            images[k] = eval_transform(image, self.image_size, self.resize, self.interpolation)
            labels[k], mask[k] = label, True
        return {"image": images, "label": labels, "mask": mask, "bad_images": np.int32(len(bad)),
                "bad_files": tuple(bad)}


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

        self._ring = self._roster = self._fetcher = None
        if workers > 0 and shared_memory:
            # Blocks for the batches a worker may hold: its buffer, the one it makes, the one read.
            self._ring = RingReader(start=start, workers=workers, ring=max(1, int(buffer)) + 2)
            make = self._ring.writer(make)
        try:
            self._iter = self._grain_iterator(grain, make, start, stop, workers, buffer)
        except BaseException:
            self._release()
            raise
        if workers > 0:
            self._fetcher = Fetcher(self._iter)
        self._next_batch, self._closed = int(start), False

    def _grain_iterator(self, grain, make, start, stop, workers, buffer):
        ds = grain.MapDataset.range(int(start), int(stop)).map(make)
        ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        if workers > 0:
            _absl_flags_parsed()
            self._roster = Roster(workers)
            # grain's own shared memory takes a fresh block per array (slow to fill): pipes for
            # whatever the ring does not carry.
            ds = grain.experimental.WithOptionsIterDataset(
                ds, grain.experimental.DatasetOptions(min_shm_size=1 << 62))
            ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=int(workers),
                                                             per_worker_buffer_size=max(1, int(buffer))),
                                worker_init_fn=functools.partial(start_worker, os.getpid(), self._roster.name))
        # grain's `iter` and first `next` start threads and processes: `iter` here with the
        # signals held back, every `next` on the fetcher's thread, which holds them for its life.
        with held_signals(workers > 0):
            return iter(ds)

    def __iter__(self):
        return self

    def __next__(self):
        if self._closed:
            raise StopIteration
        try:
            if self._fetcher is None:
                batch = next(self._iter)
            else:
                batch = self._fetcher.next(
                    lambda cause=None: dead_worker_error(self._roster, self._next_batch, cause),
                    lambda: self._closed)
                self._roster.track()
                if self._closed:  # closed from another thread meanwhile: a stopped worker's batch
                    raise StopIteration
            self._next_batch += 1
            return self._ring.take(batch) if self._ring is not None else batch
        except DataWorkerDied:
            self._abandon()
            raise
        except BaseException:
            self.close()
            raise

    def _abandon(self):
        """After a worker died: grain's clean-up gets `_CLOSE_S` on a daemon thread, then this
        loader's shared memory is unlinked. When the worker died mid-send, grain's thread reading
        its half-sent batch never returns and neither does its clean-up: both are left behind
        as daemon threads, and the other workers run on until the process ends (see
        `jaxcnn.data.workers`; ``jaxcnn-train`` then ends its process at once)."""
        self._closed = True
        if self._ring is not None:
            self._ring.stop()  # no worker waits for a block the reader will never free
        self._fetcher.stop()
        closer = threading.Thread(target=self._close_grain, args=(True,), name="jaxcnn-loader-close",
                                  daemon=True)
        closer.start()
        closer.join(_CLOSE_S)
        self._release()

    def close(self):
        """Stops the worker processes; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._ring is not None:
            self._ring.stop()
        if self._fetcher is not None:
            self._fetcher.stop()
        self._close_grain()
        self._release()

    def _close_grain(self, abandoned: bool = False):
        close = getattr(self._iter, "close", None)
        if close is None:
            return
        try:
            close()
        except Exception:  # noqa: BLE001
            # After a worker died, grain's clean-up can race its own reading thread on the dead
            # worker's iterator (an AttributeError on a process it has just cleared): nothing is
            # left to clean, and a traceback on a thread would break the trainer's one line.
            if not abandoned:
                raise

    def _release(self):
        """Unlinks this loader's shared memory (once its workers have stopped)."""
        for shared in (self._ring, self._roster):
            if shared is not None:
                shared.close()

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
