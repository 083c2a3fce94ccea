"""Record files and the grain loader: records give the folder's batches bit for bit, damaged
records are caught by their checksum, any number of workers gives the same batches, resuming
at a step gives the batches of a run that went through, bad images are skipped and counted or
stop the loader with the file's name, and processes share each epoch exactly once."""
import json
import os
import re
import shutil
import time

import numpy as np
import pytest
from PIL import Image

from jaxcnn.data.augment import FILE_RECIPE, Augment
from jaxcnn.data.cli import main as data_main
from jaxcnn.data.folder import FolderSource, scan_folder
from jaxcnn.data.loader import EvalBatches, Loader, TrainBatches, load_rgb, split_info
from jaxcnn.data.records import HEADER_BYTES, RecordSource, decode_record, encode_record, read_sidecar
from jaxcnn.data.shapes import write_shapes_folder
from jaxcnn.data.transforms import eval_transform, example_rng, random_resized_crop_box
from jaxcnn.errors import BadImageError, DataError, DataWorkerDied

SIZE = (16, 16)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes")
    write_shapes_folder(root, per_class=(6, 3), classes=["blue", "green", "red"], size_range=(16, 40))
    return root


@pytest.fixture(scope="module")
def records(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("records")
    # Two processes read and check the images; the records still come in the folder's order.
    assert data_main(["convert", str(folder), str(out), "--no-progress", "--workers", "2"]) == 0
    return out


def _batches(source, steps, workers=0, start=0, **kw):
    maker = TrainBatches(source, seed=3, batch_size=kw.pop("batch_size", 4), image_size=SIZE, **kw)
    with Loader(maker, start, steps, workers=workers) as loader:
        return list(loader)


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            np.testing.assert_array_equal(np.asarray(x[key]), np.asarray(y[key]), err_msg=key)


def test_record_roundtrip_and_damage():
    payload = b"\x89PNG not really" * 10
    record = encode_record(payload, 7)
    assert decode_record(record, "r") == (payload, 7)
    for n, damaged in enumerate([record[:HEADER_BYTES - 1], b"XXXX" + record[4:],
                                 record[:-1] + bytes([record[-1] ^ 1]),
                                 record[:5] + bytes([record[5] ^ 1]) + record[6:]]):  # the label
        with pytest.raises(BadImageError, match="damaged record") as err:
            decode_record(damaged, f"f.array_record[{n}]")
        assert f"f.array_record[{n}]" in str(err.value)


def test_records_give_the_folder_batches_bit_for_bit(folder, records):
    index = scan_folder(folder)
    rec = RecordSource(records, "train")
    assert rec.class_names == index["train"].class_names and len(rec) == len(index["train"]) == 18
    assert read_sidecar(records)["splits"]["val"]["count"] == 9
    _same(_batches(FolderSource(index["train"]), 6), _batches(rec, 6))
    ev_folder = EvalBatches(FolderSource(index["val"]), batch_size=4, image_size=SIZE, resize=18)
    ev_rec = EvalBatches(RecordSource(records, "val"), batch_size=4, image_size=SIZE, resize=18)
    assert len(ev_folder) == 3
    _same([ev_folder(b) for b in range(3)], [ev_rec(b) for b in range(3)])


def test_damaged_record_is_a_bad_image(folder, tmp_path):
    out = tmp_path / "rec"
    assert data_main(["convert", str(folder), str(out), "--splits", "train", "--no-progress"]) == 0
    path = out / read_sidecar(out)["splits"]["train"]["file"]
    data = bytearray(path.read_bytes())
    # Flip one byte inside a stored image: ArrayRecord's own chunk check or our SHA-256 must see it.
    first = RecordSource(out, "train")[0][0]
    at = bytes(data).find(first[40:80])
    assert at > 0
    data[at + 5] ^= 0x20
    path.write_bytes(bytes(data))
    source = RecordSource(out, "train")
    with pytest.raises(BadImageError, match=r"train-[0-9a-f]{8}\.array_record\[0\]: damaged record"):
        source[0]
    assert source[1][1] == 0  # the others still read
    batches = _batches(source, 5, on_bad_image="skip")
    assert sum(int(b["bad_images"]) for b in batches) >= 1
    assert all("damaged record" in f for b in batches for f in b["bad_files"])
    # A truncated file is refused when it is opened, in one line naming it (never an abort).
    for cut in (len(data) // 2, len(data) - 10, 0):
        path.write_bytes(bytes(data[:cut]))
        with pytest.raises(DataError, match="cannot open as an ArrayRecord file") as err:
            RecordSource(out, "train")
        assert str(path) in str(err.value) and "\n" not in str(err.value) and not str(err.value).endswith(": )")


# Python 3.12's resource tracker warns when a garbage collection inside it finalises grain's
# multiprocessing semaphores (nothing leaks: the tracker removes them at exit).
@pytest.mark.filterwarnings("ignore:ResourceTracker called reentrantly:UserWarning")
def test_workers_give_the_same_batches_and_resume(folder, monkeypatch):
    source = FolderSource(scan_folder(folder)["train"])
    serial = _batches(source, 9)  # 18 images, batch 4: 4 steps an epoch, so this crosses two epochs
    _same(_batches(source, 9, workers=2), serial)
    _same(_batches(source, 9, start=5), serial[5:])  # resume: the position is the step
    maker = TrainBatches(source, seed=3, batch_size=4, image_size=SIZE)
    import signal
    blocks, sigmask = [], signal.pthread_sigmask
    monkeypatch.setattr(signal, "pthread_sigmask", lambda how, sigs: (blocks.append(how == signal.SIG_BLOCK),
                                                                     sigmask(how, sigs))[1])
    with Loader(maker, 6, 9, workers=1, shared_memory=True) as loader:  # arrays via /dev/shm
        shared = list(loader)
    monkeypatch.undo()
    # The signals are held back while grain starts its threads and workers (iter and the first
    # next), not around every batch (3 batches here: it held them 4 times).
    assert sum(blocks) == 2, blocks
    assert all(type(b["image"]) is np.ndarray for b in shared)  # copied out of shared memory
    _same(shared, serial[6:])
    images = np.concatenate([b["image"] for b in serial[:4]])
    assert images.shape == (16,) + SIZE + (3,) and images.dtype == np.uint8
    assert not np.array_equal(serial[0]["image"], serial[4]["image"])  # a new epoch, new order and crops
    # Every augmentation step drawn: the same batches for any number of workers, and on resume.
    custom = dict(augment=Augment((0.3, 1.0), (0.5, 2.0), "bicubic", hflip=0.3, vflip=0.6, crop_padding=2,
                                  color_jitter=(0.4, 0.4, 0.4, 0.1), auto_augment="rand-m9-n2-mstd0.5-inc1-t3a",
                                  reprob=0.5))
    serial = _batches(source, 6, **custom)
    _same(_batches(source, 6, workers=2, **custom), serial)
    _same(_batches(source, 6, start=3, **custom), serial[3:])


class _DiesAtStep2:
    """A batch maker whose worker process dies (as if killed for memory) making step 2."""

    def __call__(self, step):
        if step == 2:
            os._exit(3)
        return {"x": np.full(2, step)}


def test_a_dead_worker_is_an_error_not_a_hang():
    with Loader(_DiesAtStep2(), 0, 6, workers=2) as loader:
        got = []
        with pytest.raises(DataWorkerDied, match=r"data worker 1 of 2 \(pid \d+\) exited with code 3 "
                                                 r"while the loader waited for batch \d"):
            for batch in loader:
                got.append(int(batch["x"][0]))
    # Batches the dying process had queued but not yet flushed to its pipe are lost with it.
    assert got in ([], [0], [0, 1])


def _grain_workers(before=frozenset()):
    """This process's grain worker processes not in ``before`` (pids): a loader whose worker
    died leaves its other workers running until the process ends."""
    import multiprocessing
    return [p for p in multiprocessing.active_children() if p.name.startswith("grain") and p.pid not in before]


def _wait_until_writing_a_pipe(pid, timeout=10):
    """Until a thread of process ``pid`` blocks writing a pipe (its queue's feeder thread,
    mid-send), as /proc's wchan shows; gives up after ``timeout`` s (wchan may read 0)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/wchan") as f:
                    if "pipe_write" in f.read():
                        return
            except OSError:
                pass
        time.sleep(0.02)


def _pids():
    import multiprocessing
    return frozenset(p.pid for p in multiprocessing.active_children())


def test_a_dead_worker_the_roster_never_saw_is_still_named_from_grains_error():
    """A worker reaped elsewhere in this process before the roster found it: grain's
    "terminated unexpectedly" is then the only word of it, and is still a DataWorkerDied."""
    from jaxcnn.data.workers import Roster, _describe_end, dead_worker_error
    roster = Roster(2)
    try:
        assert dead_worker_error(roster, 7) is None
        grain_says = RuntimeError("Worker process was terminated unexpectedly with exit code -9. Search the "
                                  "logs above for the source of the crash.")
        err = dead_worker_error(roster, 7, grain_says)
        assert isinstance(err, DataWorkerDied)
        assert str(err) == "a data worker was terminated unexpectedly with exit code -9 while the loader waited " \
                           "for batch 7"
        assert dead_worker_error(roster, 7, RuntimeError("something else")) is None
    finally:
        roster.close()
    assert _describe_end(3) == "exited with code 3"
    assert _describe_end(-15) == "was killed by SIGTERM"
    assert _describe_end(-40) == "was killed by signal 40"  # a real-time signal has no name


class _LargeBatches:
    """4 MB batches. Through grain's pipe (no shared memory) one takes 64 writes of the pipe's
    64 KB, and a worker's next batch waits half-sent in its pipe until the loader reads it."""

    def __call__(self, step):
        return {"x": np.full(1 << 20, step, np.int32)}


@pytest.mark.parametrize("shared_memory", [False, True])
def test_a_worker_killed_while_it_sends_a_large_batch_is_an_error_within_seconds(shared_memory):
    """SIGKILL (the out-of-memory killer) to a worker whose batch is half-way through its pipe
    left the loader reading the rest for good: 3 runs in 3 hung the trainer at 0% CPU. Killed
    after 1, 2 and 5 batches read (through the pipe), or with the batch in shared memory."""
    import signal
    import threading
    for read_first in ((1, 2, 5) if not shared_memory else (2,)):
        before = _pids()
        loader = Loader(_LargeBatches(), 0, 40, workers=2, shared_memory=shared_memory)
        got, raised = [], []

        def read():
            try:
                got.extend(int(b["x"][0]) for b in loader)
            except Exception as err:  # noqa: BLE001 - what the test inspects
                raised.append(err)
        try:
            for _ in range(read_first):
                got.append(int(next(loader)["x"][0]))
            deadline, workers = time.monotonic() + 60, []
            while len(workers) < 2 and time.monotonic() < deadline:
                workers = _grain_workers(before)
                time.sleep(0.01)
            victim = workers[0]  # its batch is next, or the one after
            if not shared_memory:  # its next batch made and waiting half-sent in its pipe
                _wait_until_writing_a_pipe(victim.pid)
            time.sleep(0.2)
            os.kill(victim.pid, signal.SIGKILL)
            reader = threading.Thread(target=read, daemon=True)
            started = time.monotonic()
            reader.start()
            reader.join(30)
            assert not reader.is_alive(), f"still waiting after 30 s (read {got})"
            assert len(raised) == 1 and isinstance(raised[0], DataWorkerDied), raised
            assert time.monotonic() - started < 5
            assert f"(pid {victim.pid}) was killed by SIGKILL" in str(raised[0]), raised[0]
            assert "\n" not in str(raised[0])
            assert got == list(range(len(got))) and len(got) < 40  # what was sent whole still comes
        finally:
            loader.close()


class _IgnoredSignals:
    """A batch maker that reports which of SIGINT and SIGTERM its worker process ignores."""

    def __call__(self, step):
        import signal
        return {"x": np.full(2, step), "ignored": np.array(
            [signal.getsignal(s) is signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM)])}


def test_ctrl_c_to_the_process_group_leaves_the_workers_to_the_trainer():
    """A terminal's Ctrl-C (a scheduler's SIGTERM) reaches every process of the job: a worker
    died of it, and the trainer stopped on grain's RuntimeError instead of saving a checkpoint."""
    import signal
    before = _pids()
    with Loader(_IgnoredSignals(), 0, 40, workers=2, shared_memory=False) as loader:
        # A batch from each worker (they take the steps in turn), so that both have started: a
        # worker still starting dies of the signal (the trainer reads that as the stop it asked
        # for: tests/train/test_trainer.py::test_a_data_worker_killed_by_the_stop_signal_is_that_stop).
        started = [next(loader), next(loader)]
        assert [b["ignored"].tolist() for b in started] == [[True, True]] * 2
        workers = _grain_workers(before)
        assert len(workers) == 2
        for worker in workers:
            os.kill(worker.pid, signal.SIGINT)
            os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        # Alive, or (having made all their batches) ended by themselves: never by the signal.
        assert all(worker.exitcode in (None, 0) for worker in workers), [w.exitcode for w in workers]
        rest = list(loader)
    assert [int(b["x"][0]) for b in started + rest] == list(range(40))
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process's are its own


def test_ctrl_c_while_the_workers_are_still_starting_is_no_worker_traceback(capfd):
    """A Ctrl-C that reaches the workers while they still import (before their start-up function
    ignores it) killed them with their own KeyboardInterrupt traceback on the terminal; they are
    now started with SIGINT and SIGTERM blocked, so the signal waits and is then ignored."""
    import signal
    import threading
    got = []
    before = _pids()
    loader = Loader(_IgnoredSignals(), 0, 6, workers=2, shared_memory=False)
    # The first batch starts the workers; the trainer asks for batches on its prefetch thread.
    reader = threading.Thread(target=lambda: got.extend(int(b["x"][0]) for b in loader), daemon=True)
    try:
        reader.start()
        deadline, workers = time.monotonic() + 30, []
        while len(workers) < 2 and time.monotonic() < deadline:
            workers = _grain_workers(before)
            time.sleep(0.002)
        assert len(workers) == 2
        for worker in workers:  # still importing: that takes a spawned Python well over a second
            os.kill(worker.pid, signal.SIGINT)
        reader.join(60)
    finally:
        loader.close()
    assert got == list(range(6))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this thread's mask is as it was


def _wait_until_python_catches_sigint(pid, timeout=30):
    """Until process ``pid`` has a SIGINT handler (its interpreter is up): /proc's SigCgt mask."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/status") as f:
                caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return
        if caught & (1 << (2 - 1)):  # bit SIGNUM - 1
            return
        time.sleep(0.001)


def test_ctrl_c_while_the_convert_workers_start_is_no_worker_traceback(folder, tmp_path, capfd):
    """jaxcnn-data convert --workers N: a Ctrl-C that reached its pool's workers while they still
    imported killed each with its own KeyboardInterrupt traceback."""
    import multiprocessing
    import signal
    import threading

    from jaxcnn.data.records import write_split
    index = scan_folder(folder)["train"]
    result = []
    writer = threading.Thread(target=lambda: result.append(write_split(index, tmp_path / "t.array_record",
                                                                        workers=2)), daemon=True)
    writer.start()
    deadline, workers = time.monotonic() + 30, []
    while len(workers) < 2 and time.monotonic() < deadline:
        workers = [p for p in multiprocessing.active_children() if "PoolWorker" in p.name]
        time.sleep(0.002)
    assert len(workers) == 2
    for worker in workers:  # once Python catches SIGINT (before, the signal ends it silently)
        _wait_until_python_catches_sigint(worker.pid)
        os.kill(worker.pid, signal.SIGINT)
    writer.join(120)
    assert result and result[0][:2] == (len(index), [])
    err = capfd.readouterr().err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_processes_share_each_epoch_exactly_once(folder):
    source = FolderSource(scan_folder(folder)["train"])
    per_epoch = TrainBatches(source, seed=3, batch_size=6, image_size=SIZE).steps_per_epoch
    assert per_epoch == 3  # 18 images, 6 a step

    def seen(process_index):
        maker = TrainBatches(source, seed=3, batch_size=6, image_size=SIZE, process_index=process_index,
                             process_count=3)
        from jaxcnn.data.pipeline import batch_indices
        rows = []
        for step in range(per_epoch):
            batch = maker(step)
            idx = batch_indices(len(source), 6, 3, step)[maker.start:maker.start + maker.local]
            assert [source.index.labels[i] for i in idx] == batch["label"].tolist()
            assert batch["index"].tolist() == idx.tolist()
            rows.extend(idx.tolist())
        return rows

    everything = seen(0) + seen(1) + seen(2)
    assert sorted(everything) == list(range(18))
    # The shares together are the single-process batch, crops included.
    whole = TrainBatches(source, seed=3, batch_size=6, image_size=SIZE)(1)
    parts = [TrainBatches(source, seed=3, batch_size=6, image_size=SIZE, process_index=p, process_count=3)(1)
             for p in range(3)]
    np.testing.assert_array_equal(np.concatenate([p["image"] for p in parts]), whole["image"])


def test_bad_image_skip_counts_fail_names_it_in_workers(folder, tmp_path):
    import shutil
    root = tmp_path / "f"
    shutil.copytree(folder, root)
    bad = sorted((root / "train" / "green").glob("*.jpg"))[0]
    bad.write_bytes(bad.read_bytes()[:100])  # truncated
    source = FolderSource(scan_folder(root)["train"])
    skipped = _batches(source, 4, workers=2, on_bad_image="skip")  # one epoch: the bad one once
    assert sum(int(b["bad_images"]) for b in skipped) == 1
    files = [f for b in skipped for f in b["bad_files"]]
    assert len(files) == 1 and str(bad) in files[0] and "truncated" in files[0]
    # Its place holds the next example of the dataset, with the full batch kept.
    _same(skipped, _batches(source, 4, workers=0, on_bad_image="skip"))
    arrays, count, names = split_info(skipped[0])
    assert set(arrays) == {"image", "label"} and count == int(skipped[0]["bad_images"])
    for workers in (0, 2):
        with pytest.raises(BadImageError) as err:
            _batches(source, 4, workers=workers, on_bad_image="fail")
        assert str(bad) in str(err.value)
    ev = EvalBatches(FolderSource(scan_folder(root)["train"]), batch_size=8, image_size=SIZE, resize=16,
                     on_bad_image="skip")
    masks = [ev(b)["mask"] for b in range(len(ev))]
    assert sum(int(m.sum()) for m in masks) == 17  # every image but the bad one, and the padding


def test_all_bad_is_an_error_not_a_hang(tmp_path):
    for n in range(3):
        os.makedirs(tmp_path / "train" / "a", exist_ok=True)
        (tmp_path / "train" / "a" / f"{n}.jpg").write_bytes(b"not a jpeg")
    source = FolderSource(scan_folder(tmp_path, splits=("train",))["train"])
    with pytest.raises(DataError, match="bad images in a row"):
        _batches(source, 1, batch_size=2, on_bad_image="skip")


def test_convert_cli_errors_are_one_line(tmp_path, capsys):
    assert data_main(["convert", str(tmp_path / "none"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    write_shapes_folder(tmp_path / "f", per_class=(2, 1), classes=["red"], size_range=(16, 18))
    bad = tmp_path / "f" / "train" / "red" / "00000.jpg"
    bad.write_bytes(b"\xff\xd8garbage")
    assert data_main(["convert", str(tmp_path / "f"), str(tmp_path / "out"), "--on-bad-image", "fail",
                      "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err
    assert data_main(["convert", str(tmp_path / "f"), str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "skipped" in out and str(bad) in out
    meta = read_sidecar(tmp_path / "out")
    sha = meta["splits"]["train"].pop("sha256")  # the folder's listing: a resume compares it
    assert re.fullmatch(r"train-[0-9a-f]{8}\.array_record", meta["splits"]["train"].pop("file"))
    assert meta["splits"]["train"] == {"count": 1, "skipped": 1, "per_class": [1]}
    assert len(sha) == 64 and sha != meta["splits"]["val"]["sha256"]
    # The trainer's start-up line on them: a corrupt image is no "file that is not an image",
    # nor left out of the record directory (it said both), and a folder names its strays.
    from jaxcnn.data.images import ImageData
    assert ImageData("records", tmp_path / "out", image_size=(16, 16)).skipped_note() == (
        f"1 file left out of {tmp_path / 'out'} by jaxcnn-data convert (not images, or bad ones; it named them)")
    for name in ("labels.csv", "notes.txt", "Thumbs.db"):  # Thumbs.db: OS litter, not counted
        (tmp_path / "f" / "val" / "red" / name).write_text("x")
    folder = ImageData("folder", tmp_path / "f", image_size=(16, 16), on_bad_image="skip")
    val = tmp_path / "f" / "val" / "red"
    assert folder.skipped_note() == (f"2 files left out of {tmp_path / 'f'} (not images by their names: "
                                     f"{val / 'labels.csv'}, {val / 'notes.txt'}; data.on_bad_image is skip)")
    for name in ("labels.csv", "notes.txt"):
        (val / name).unlink()
    assert ImageData("folder", tmp_path / "f", image_size=(16, 16)).skipped_note() is None
    # A sidecar that names a file which is no record file (a conversion removes the files the
    # one it replaces named: dataset.json itself, here) is refused.
    meta = read_sidecar(tmp_path / "out")
    meta["splits"]["val"]["file"] = "dataset.json"
    (tmp_path / "out" / "dataset.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match=r"key 'splits.val' must be \{'file': the name of an .array_record file"):
        RecordSource(tmp_path / "out", "train")
    (tmp_path / "out" / "dataset.json").write_text("{not json")
    with pytest.raises(DataError, match="not valid JSON"):
        RecordSource(tmp_path / "out", "train")


def test_a_full_disk_while_converting_is_one_line_and_leaves_no_partial_file(folder, tmp_path, capsys,
                                                                           monkeypatch):
    """jaxcnn-data convert on a full disk ended in a traceback (the ArrayRecord writer's
    RuntimeError, at close) and left its .partial file, so the disk stayed full."""
    from array_record.python import array_record_module

    real = array_record_module.ArrayRecordWriter

    class FullDisk:
        def __init__(self, path, options):
            self.path, self.writer = path, real(path, options)

        def write(self, record):
            self.writer.write(record)

        def close(self):
            self.writer.close()
            raise RuntimeError(f"write() failed: No space left on device; writing {self.path}; at "
                               f"byte 307200; Failed to close chunk_writer")
    monkeypatch.setattr(array_record_module, "ArrayRecordWriter", FullDisk)
    out = tmp_path / "out"
    assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    train = re.escape(str(out / "train-")) + r"[0-9a-f]{8}\.array_record"
    assert err.count("\n") == 1 and re.match(
        f"jaxcnn-data: error: {train}: cannot write the records \\(write\\(\\) failed: "
        f"No space left on device; writing {train};", err), err
    assert err.rstrip().endswith("; the partial file is removed")
    assert os.listdir(out) == []


def test_converting_again_writes_new_files_and_switches_readers_with_dataset_json(folder, tmp_path, monkeypatch,
                                                                                  capsys):
    """Converting again rewrote train.array_record and val.array_record in place, one after the
    other, under a running trainer: each conversion now writes files of new names and switches
    to them by renaming dataset.json; the old files go after the switch (an open reader keeps
    reading them, one opened anew is told why it cannot), and a conversion that fails half way
    leaves the directory as it was."""
    import copy

    from jaxcnn.data import records
    out = tmp_path / "out"
    assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 0
    before, sidecar = sorted(os.listdir(out)), (out / "dataset.json").read_text()
    opened = RecordSource(out, "val")
    labels = [opened[i][1] for i in range(len(opened))]
    write_split = records.write_split

    def val_on_a_full_disk(index, path, **kw):
        if os.path.basename(path).startswith("val-"):
            raise DataError(f"{path}: cannot write the records (No space left on device)")
        return write_split(index, path, **kw)
    monkeypatch.setattr(records, "write_split", val_on_a_full_disk)
    assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(os.listdir(out)) == before and (out / "dataset.json").read_text() == sidecar
    monkeypatch.setattr(records, "write_split", write_split)
    assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 0
    after = sorted(os.listdir(out))
    assert len(after) == 3 and not set(after) & (set(before) - {"dataset.json"}), (before, after)
    assert {e["file"] for e in read_sidecar(out)["splits"].values()} == set(after) - {"dataset.json"}
    assert [opened[i][1] for i in range(len(opened))] == labels  # its file is open
    with pytest.raises(DataError, match=r"val-[0-9a-f]{8}\.array_record: record file removed while the run "
                                        r"read it \(jaxcnn-data convert wrote .* again\)"):
        copy.deepcopy(opened)[0]  # opened anew, as a worker process opens it (grain's reader reopens its path)
    assert [RecordSource(out, "val")[i][1] for i in range(len(opened))] == labels
    from jaxcnn.data.images import ImageData
    reads, read = [], records.read_sidecar
    monkeypatch.setattr(records, "read_sidecar", lambda d: reads.append(d) or read(d))
    ImageData("records", out, image_size=(16, 16))
    assert len(reads) == 1  # both splits from one reading: never one of each of two conversions
    # What a conversion killed before its switch left is removed by the next; other files stay.
    left = ["train-0123abcd.array_record", "val-0123abcd.array_record.partial"]
    for name in left + ["notes.txt", "mine.array_record"]:
        (out / name).write_bytes(b"x")
    assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 0
    assert not set(left) & set(os.listdir(out)) and {"notes.txt", "mine.array_record"} < set(os.listdir(out))
    # One conversion at a time: each would remove the other's files.
    import fcntl
    fd = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capsys.readouterr()
        assert data_main(["convert", str(folder), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err == f"jaxcnn-data: error: {out}: another jaxcnn-data convert is writing into it; wait for it to " \
                      "end, or give another OUT\n", err
    finally:
        os.close(fd)


def test_data_changed_under_a_run_are_a_change_it_sees(folder, tmp_path):
    """Converting records again, or adding, removing or renaming images of an image folder's
    val split, under a running trainer changed its validation data silently: the opened data
    now tell what changed since they were opened (the trainer asks before each evaluation and
    stops, naming it)."""
    from jaxcnn.data.images import ImageData
    src = tmp_path / "src"
    shutil.copytree(folder, src)
    out = tmp_path / "out"
    assert data_main(["convert", str(src), str(out), "--no-progress"]) == 0
    opened = ImageData("records", out, image_size=(16, 16))
    assert opened.changes_since_opened() == []
    old_val = os.path.basename(opened.val.path)
    assert data_main(["convert", str(src), str(out), "--splits", "val", "--no-progress"]) == 0
    changes = opened.changes_since_opened()  # the same images, in a file that replaced the run's
    assert len(changes) == 1 and re.fullmatch(
        rf"val: converted again \(val-[0-9a-f]{{8}}\.array_record replaced {re.escape(old_val)}\)",
        changes[0]), changes
    extra = src / "val" / "red" / "zz_extra.png"
    shutil.copy(next((src / "val" / "red").iterdir()), extra)
    assert data_main(["convert", str(src), str(out), "--splits", "val", "--no-progress"]) == 0
    assert opened.changes_since_opened() == ["val: 10 images, the run's had 9"]
    extra.unlink()
    # An image folder: its val split is listed again.
    opened = ImageData("folder", src, image_size=(16, 16))
    assert opened.changes_since_opened() == []
    shutil.copy(next((src / "train" / "red").iterdir()), src / "train" / "red" / "zz_extra.png")
    assert opened.changes_since_opened() == []  # the training split's list is fixed when opened
    shutil.copy(next((src / "val" / "red").iterdir()), extra)
    assert opened.changes_since_opened() == ["val: 10 images, the run's had 9"]
    extra.unlink()
    assert opened.changes_since_opened() == []
    first = next((src / "val" / "red").iterdir())
    first.rename(first.with_name("zz_" + first.name))
    assert opened.changes_since_opened() == ["val: 9 images as before, but other file names"]
    (src / "val" / "purple").mkdir()
    changes = opened.changes_since_opened()
    assert len(changes) == 1 and "class folders differ from the training split's" in changes[0], changes


def test_convert_workers_are_bounded(tmp_path, capsys):
    """``--workers 100000`` started a pool of 100,000 processes; the trainer's data.workers had a bound."""
    write_shapes_folder(tmp_path / "f", per_class=(1, 1), classes=["red"], size_range=(16, 18))
    assert data_main(["convert", str(tmp_path / "f"), str(tmp_path / "out"), "--workers", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--workers 100000 is more than" in err and "processes" in err, err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_an_out_inside_root(tmp_path, capsys):
    """OUT inside ROOT (or ROOT itself) put the record files among the images: under a split they
    were a class of their own the next time the folder was read."""
    write_shapes_folder(tmp_path / "f", per_class=(2, 1), classes=["red"], size_range=(16, 18))
    os.symlink(tmp_path / "f", tmp_path / "link")
    for out in (tmp_path / "f", tmp_path / "f" / "train" / "records", tmp_path / "link" / "rec"):
        assert data_main(["convert", str(tmp_path / "f"), str(out), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"jaxcnn-data: error: OUT {out} is " in err, err
        assert "the record files would be read as images next time; give a directory outside it" in err
    assert not (tmp_path / "f" / "train" / "records").exists() and not (tmp_path / "f" / "rec").exists()
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["train", "val"]
    assert data_main(["convert", str(tmp_path / "f"), str(tmp_path / "f-records"), "--no-progress"]) == 0


def test_converting_one_split_keeps_the_others(tmp_path, capsys):
    """``convert ROOT OUT --splits val`` after a whole conversion wrote a sidecar listing val alone:
    the train records were still there but lost to the reader. Other classes cannot be kept."""
    write_shapes_folder(tmp_path / "f", per_class=(2, 1), classes=["blue", "red"], size_range=(16, 18))
    out = tmp_path / "out"
    assert data_main(["convert", str(tmp_path / "f"), str(out), "--no-progress"]) == 0
    before = read_sidecar(out)["splits"]
    assert data_main(["convert", str(tmp_path / "f"), str(out), "--splits", "val", "--no-progress"]) == 0
    after = read_sidecar(out)["splits"]
    assert after["train"] == before["train"] and len(RecordSource(out, "train")) == 4
    assert after["val"]["file"] != before["val"]["file"]  # a new file; the same records
    assert {k: v for k, v in after["val"].items() if k != "file"} == {
        k: v for k, v in before["val"].items() if k != "file"}
    before = after
    for split in ("train", "val"):
        os.rename(tmp_path / "f" / split / "red", tmp_path / f"red-{split}")
    capsys.readouterr()
    assert data_main(["convert", str(tmp_path / "f"), str(out), "--splits", "val", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out} holds the train records of other classes" in err, err
    assert read_sidecar(out)["splits"] == before  # nothing written
    assert data_main(["convert", str(tmp_path / "f"), str(out), "--no-progress"]) == 0
    assert read_sidecar(out)["class_names"] == ["blue"]


@pytest.mark.parametrize("option, value", [("--train", "0"), ("--val", "999999999999"), ("--train", "x")])
def test_shapes_counts_are_bounded(tmp_path, capsys, option, value):
    """``--train 999999999999`` wrote images until the disk filled (9 GB in ten minutes)."""
    with pytest.raises(SystemExit) as exit_:
        data_main(["shapes", str(tmp_path / "s"), option, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}: expected images per class from 1 to 10,000" in err
    assert not (tmp_path / "s").exists()


def test_shapes_never_writes_into_a_folder_that_holds_images(tmp_path, capsys):
    """jaxcnn-data shapes OUT over an existing image folder put its shapes among the photos there
    (replacing those of the same names)."""
    photo = tmp_path / "photos" / "train" / "red" / "00000.jpg"
    photo.parent.mkdir(parents=True)
    photo.write_bytes(b"precious")
    assert data_main(["shapes", str(tmp_path / "photos"), "--train", "1", "--val", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"jaxcnn-data: error: {tmp_path / 'photos' / 'train'} already holds files; jaxcnn-data shapes "
                   "writes a new example folder: give a directory without train/ and val/ (created if missing)\n")
    assert sorted(p.name for p in (tmp_path / "photos").rglob("*")) == ["00000.jpg", "red", "train"]
    assert data_main(["shapes", str(tmp_path / "new"), "--train", "1", "--val", "1"]) == 0


@pytest.mark.parametrize("module, package, source", [("grain", "grain", "folder"), ("PIL", "pillow", "records"),
                                                     ("array_record", "array-record", "records")])
def test_a_missing_data_package_is_one_line(module, package, source, folder, records, tmp_path, capsys,
                                            monkeypatch):
    """Without the [data] extra an image-folder run ended in a ModuleNotFoundError traceback at
    its first batch (jaxcnn-data convert likewise)."""
    import sys

    from jaxcnn.train.cli import train_main
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes_folder.yaml")
    assert train_main([config, f"data.source={source}", f"data.path={folder if source == 'folder' else records}",
                       "mesh.data=1", "data.batch_size=4", "data.eval_batch_size=4", "data.image_size=[16,16]", "train.steps=1",
                       "train.epochs=null", "optim.schedule.warmup=0", "checkpoint.enabled=false",
                       "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxcnn-train: error: data.source: '{source}' needs {package}, which is not installed: "
                          "pip install -e \".[data]\"") and err.count("\n") == 1, err
    if module != "grain":  # the converter needs no loader
        assert data_main(["convert", str(folder), str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"jaxcnn-data: error: jaxcnn-data convert needs {package}, not installed") and \
            err.count("\n") == 1, err
        assert not (tmp_path / "out").exists()


def test_out_that_is_a_file_is_one_clear_line(tmp_path, capsys):
    """It was "[Errno 17] File exists: 'x'" (convert) and "[Errno 20] Not a directory: 'x/train'" (shapes)."""
    write_shapes_folder(tmp_path / "f", per_class=(1, 1), classes=["red"], size_range=(16, 18))
    taken = tmp_path / "notes.txt"
    taken.write_text("x")
    for argv in (["convert", str(tmp_path / "f"), str(taken), "--no-progress"], ["shapes", str(taken)]):
        assert data_main(argv) == 2
        assert capsys.readouterr().err == (f"jaxcnn-data: error: {taken} is a file; give a directory to write "
                                           "into (created if missing)\n")
    assert data_main(["shapes", str(taken / "sub")]) == 2
    assert capsys.readouterr().err == f"jaxcnn-data: error: {taken / 'sub'}: Not a directory\n"
    assert taken.read_text() == "x"


def test_shapes_cli(tmp_path):
    assert data_main(["shapes", str(tmp_path / "s"), "--train", "2", "--val", "1"]) == 0
    index = scan_folder(tmp_path / "s")
    assert len(index["train"]) == 8 and len(index["val"]) == 4
    assert Image.open(os.path.join(index["train"].root, index["train"].paths[0])).size[0] >= 16


def test_image_data_opens_folder_and_records_alike(folder, records, tmp_path):
    from jaxcnn.data.images import ImageData
    a = ImageData("folder", folder, image_size=(16, 16))
    b = ImageData("records", records, image_size=(16, 16))
    assert a.class_names == b.class_names == ("blue", "green", "red") and a.num_classes == 3
    assert a.image_shape == (16, 16, 3) and a.eval_resize == 18 and len(a.train) == 18 and len(a.val) == 9
    _same([a.train_batches(seed=1, batch_size=6)(s) for s in range(2)],
          [b.train_batches(seed=1, batch_size=6)(s) for s in range(2)])
    _same([a.eval_batches(batch_size=6)(n) for n in range(2)], [b.eval_batches(batch_size=6)(n) for n in range(2)])
    with pytest.raises(ValueError, match="smaller than the crop"):
        ImageData("folder", folder, image_size=(16, 20), eval_resize=19)
    with pytest.raises(DataError, match="missing"):
        ImageData("records", tmp_path, image_size=(16, 16))


ORPHAN_SCRIPT = """
import os, sys, time
import numpy as np
from jaxcnn.data.loader import Loader


class Marks:
    def __init__(self, folder):
        self.folder = folder

    def __call__(self, step):
        open(os.path.join(self.folder, str(os.getpid())), "w").close()
        return {"x": np.zeros(4)}


if __name__ == "__main__":
    with Loader(Marks(sys.argv[1]), 0, 10**6, workers=2) as loader:
        next(loader)
        print("ready", flush=True)
        time.sleep(600)
"""


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_workers_end_when_their_process_is_killed(tmp_path):
    """SIGKILL runs no clean-up: the workers, blocked on a full queue, must see their parent go."""
    import signal
    import subprocess
    import sys
    import time
    script = tmp_path / "s.py"
    script.write_text(ORPHAN_SCRIPT)
    marks = tmp_path / "marks"
    marks.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(marks)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.time() + 60
        while len(os.listdir(marks)) < 2 and time.time() < deadline:
            time.sleep(0.1)
        workers = [int(p) for p in os.listdir(marks)]
        assert len(workers) == 2 and all(_running(p) for p in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 20
    while any(_running(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in workers), workers


def test_preprocessing_records_the_evaluation_resize():
    from jaxcnn.data.preprocessing import Preprocessing, from_dict
    prep = Preprocessing((16, 16, 3), "uint8", (0.5,) * 3, (0.25,) * 3, True, ("a", "b"), "folder", 18)
    d = prep.to_dict()
    assert d["resize"] == {"shorter_side": 18} and from_dict(d) == prep
    bicubic = prep._replace(resize_interpolation="bicubic")
    assert bicubic.to_dict()["resize"] == {"shorter_side": 18, "interpolation": "bicubic"}
    assert from_dict(bicubic.to_dict()) == bicubic
    assert "resize" not in prep._replace(resize_shorter_side=None).to_dict()  # older records unchanged
    for bad in ({"shorter_side": 0}, {"shorter_side": True}, {"longer_side": 18}, 18,
                {"shorter_side": 18, "interpolation": "lanczos"}):
        with pytest.raises(DataError, match="key 'resize' must be"):
            from_dict({**d, "resize": bad}, "p.json")


@pytest.mark.filterwarnings("ignore:ResourceTracker called reentrantly:UserWarning")
def test_a_val_split_gives_the_same_batches_for_any_workers_and_from_its_records(folder, tmp_path):
    """data.val_split on a folder of class folders (here the shapes' train/, ImageFolder's layout)
    and on its records (one split, train): the same training batches with 0 or 2 worker
    processes (the split is drawn once, when the data are opened), and the same from both."""
    from jaxcnn.data.images import ImageData
    assert data_main(["convert", str(folder / "train"), str(tmp_path / "r"), "--no-progress"]) == 0
    opened = [ImageData(source, path, image_size=SIZE, val_split=0.25, seed=5)
              for source, path in (("folder", folder / "train"), ("records", tmp_path / "r"))]
    assert [(len(i.train), len(i.val)) for i in opened] == [(12, 6), (12, 6)]
    _same(_batches(opened[1].train, 4, workers=2), _batches(opened[0].train, 4))


def _todays_train_transform(image, size, rng):
    """The training transform of an image before `Augment` (transcribed): ImageNet's crop box,
    Pillow's bilinear resize, then a flip on a draw below 1/2."""
    top, left, h, w = random_resized_crop_box(rng, image.height, image.width, (0.08, 1.0), (3 / 4, 4 / 3))
    array = np.asarray(image.crop((left, top, left + w, top + h)).resize(size[::-1], Image.BILINEAR), np.uint8)
    return array[:, ::-1] if rng.random() < 0.5 else array


@pytest.fixture(params=["folder", "records"])
def train_source(request, folder, records):
    if request.param == "folder":
        return FolderSource(scan_folder(folder)["train"])
    return RecordSource(records, "train")


def test_default_training_batches_are_the_ones_of_before(train_source):
    batches = _batches(train_source, 5, batch_size=6)
    for step, batch in enumerate(batches):
        for k, index in enumerate(batch["index"]):
            image = load_rgb(train_source, int(index))[0]
            want = _todays_train_transform(image, SIZE, example_rng(3, step, k))
            np.testing.assert_array_equal(batch["image"][k], want)


def test_each_augment_key_changes_file_batches_as_documented(train_source):
    def images(steps=3, seed=3, **keys):
        maker = TrainBatches(train_source, seed=seed, batch_size=6, image_size=SIZE, resize=18,
                             augment=FILE_RECIPE._replace(**keys))
        return np.stack([maker(step)["image"] for step in range(steps)])

    default = images()
    # None: evaluation's resize and centre crop, whatever the seed.
    none = images(seed=9, **Augment(interpolation="bilinear")._asdict())
    order = np.stack([TrainBatches(train_source, seed=9, batch_size=6, image_size=SIZE)(s)["index"] for s in range(3)])
    for step, row in enumerate(order):
        for k, index in enumerate(row):
            want = eval_transform(load_rgb(train_source, int(index))[0], SIZE, 18)
            np.testing.assert_array_equal(none[step, k], want)
    np.testing.assert_array_equal(images(vflip=1.0), default[:, :, ::-1])  # the same draws, then mirrored rows
    for keys in ({"hflip": 0.0}, {"scale": (0.9, 1.0)}, {"ratio": (1.0, 1.0)}, {"interpolation": "bicubic"},
                 {"crop_padding": 3}):
        assert not np.array_equal(images(**keys), default), keys
    padded = images(crop_padding=3)
    assert (padded[..., :3, :, :] == 0).all(axis=(2, 3, 4)).any()  # some crops begin in the zero padding
    with pytest.raises(ValueError, match="evaluation's resize, which must be at least the crop"):
        TrainBatches(train_source, seed=1, batch_size=6, image_size=SIZE, augment=Augment())
