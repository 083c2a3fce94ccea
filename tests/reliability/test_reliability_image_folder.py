"""Kill -9 of a trainer reading an image folder with grain workers, then resume: the finished
run's parameters are bitwise equal to an uninterrupted run's (the batch for a step depends
only on the seed and the step, so the resumed run reads the same images in the same order),
and the killed run's workers do not outlive it."""
import os
import re

import pytest

import xla_cache
from jaxcnn.data.shapes import write_shapes_folder
from jaxcnn.train.cli import train_main
from reliability_lib import (ORBAX_LEFTOVER_WARNINGS, ROOT, Killable, assert_params_bitwise_equal, resumed_step,
                             step_dirs, wait_for)

pytestmark = ORBAX_LEFTOVER_WARNINGS
STEPS = 16


def _args(folder, workdir, *extra):
    return [str(ROOT / "configs" / "shapes_folder.yaml"), f"data.path={folder}", "mesh.data=1",
            "data.image_size=[16,16]", "data.batch_size=12", "data.eval_batch_size=12", "data.prefetch=1",
            "optim.name=adam", "optim.lr=0.003", "optim.schedule.name=constant", "optim.schedule.warmup=0",
            f"train.steps={STEPS}",
            "train.epochs=null", "train.eval_every=null", "logging.log_every=2", "logging.progress=lines",
            "checkpoint.every=2", "checkpoint.keep=10", "data.on_bad_image=skip", *extra,
            "--workdir", str(workdir)]


def _children(pid):
    """Process ids whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# The long form (25-30 s on 2 cores): each of its parts stays checked in the default run by a
# faster test of the same code:
# * kill -9 of jaxcnn-train, then resume bitwise equal to an uninterrupted run:
#   tests/reliability/test_reliability_kill.py (kills during a checkpoint write and after a commit);
# * grain workers ending when the process that owns them is SIGKILLed:
#   tests/data/test_image_loader.py::test_workers_end_when_their_process_is_killed;
# * the image folder's batches the same for any number of workers and on resume (the step is
#   the position): tests/data/test_image_loader.py::test_workers_give_the_same_batches_and_resume;
# * the trainer on an image folder with workers and data.on_bad_image=skip, stopped, resumed
#   from its checkpoint bitwise equal to an uninterrupted run: tests/train/
#   test_image_folder_training.py::test_a_data_worker_killed_mid_run_is_one_line_and_a_checkpoint.
@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_kill_minus_9_with_workers_then_resume_is_bitwise(tmp_path, capsys):
    import time
    folder = tmp_path / "shapes"
    write_shapes_folder(folder, per_class=(12, 2), classes=["blue", "green", "red"], size_range=(16, 32))
    (folder / "train" / "red" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 40)
    # The uninterrupted reference saves no checkpoints (they change no step: its programs are the
    # killed run's, which loads them from the cache); the killed and resumed run saves them.
    assert train_main(_args(folder, tmp_path / "ref", "checkpoint.enabled=false")) == 0

    work = tmp_path / "killed"
    # the suite's compilation cache holds the reference run's programs: the subprocess only loads them
    proc = Killable(_args(folder, work, "data.workers=2"), cache_dir=xla_cache.directory())
    try:
        assert wait_for(lambda: 6 in step_dirs(work / "checkpoints")[0], proc), proc.output
        workers = [p for p in _children(proc.proc.pid) if _running(p)]
    finally:
        proc.kill()
    assert not (work / "params.npz").exists()
    deadline = time.time() + 20  # the workers see their trainer gone and end
    while any(_running(p) for p in workers) and time.time() < deadline:
        time.sleep(0.1)
    assert workers and not any(_running(p) for p in workers), workers

    capsys.readouterr()
    assert train_main(_args(folder, work, "data.workers=1")) == 0
    assert resumed_step(capsys.readouterr().out) >= 6
    assert_params_bitwise_equal(tmp_path / "ref" / "params.npz", work / "params.npz")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_a_worker_killed_mid_send_ends_jaxcnn_train_with_one_line(tmp_path):
    """SIGKILL (the OOM killer) to one of jaxcnn-train's 2 grain workers while its batches (400 KB
    in the report) go through grain's pipe left the trainer asleep at 0% CPU, deaf to SIGTERM (3 runs
    in 3). Now it exits 1 within seconds: one line naming the worker and its signal, and a
    checkpoint of the steps done.

    The batches here are 32 images of 32x32x3 bytes, 98 KB: under the shared-memory handover's
    1 MB, so they go through grain's pipe, and over the pipe's 64 KB, so a worker that runs
    ahead of the trainer waits half-way through sending one, as the 400 KB batches did (at
    64x64 each of the ~13 steps before and after the kill took 0.3 s instead of 0.1 s).  The
    loader's own test kills a worker it has seen blocked mid-send, at three points:
    tests/data/test_image_loader.py::test_a_worker_killed_while_it_sends_a_large_batch_is_an_error_within_seconds."""
    import signal
    import time
    folder = tmp_path / "shapes"
    write_shapes_folder(folder, per_class=(12, 2), classes=["blue", "green", "red"], size_range=(64, 80))
    work = tmp_path / "w"
    proc = Killable(_args(folder, work, "data.workers=2", "data.image_size=[32,32]", "data.batch_size=32",
                          "train.steps=1000", "checkpoint.every=1000", "logging.log_every=1"),
                    cache_dir=xla_cache.directory())
    try:
        assert wait_for(lambda: proc.saw("step 3/"), proc), proc.output
        workers = [p for p in _children(proc.proc.pid) if _running(p)
                   and b"resource_tracker import" not in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        killed = time.monotonic()
        proc.finish(timeout=60)
    finally:
        if proc.alive():
            proc.kill()
    assert time.monotonic() - killed < 15
    assert proc.proc.returncode == 1, proc.output
    errors = [line for line in proc.lines if not line.startswith("[jaxcnn]") and not line.startswith("step ")]
    assert len(errors) == 1, errors
    assert re.match(rf"jaxcnn-train: error: data worker [12] of 2 \(pid {workers[1]}\) was killed by SIGKILL ",
                    errors[0]), errors
    step = int(errors[0].rsplit("checkpoint saved at step ", 1)[1])
    assert step >= 3 and str(step) in os.listdir(work / "checkpoints")
