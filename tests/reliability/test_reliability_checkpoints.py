"""Damaged checkpoints and a full disk, through the trainer (``train_main``, ``checkpoint.resume=auto``).

The manager's own unit tests are in tests/train/test_checkpoint.py; here the faults meet the
whole resume path: a damaged checkpoint is reported with its path and skipped for the previous
good one, and the finished run is bitwise equal to an uninterrupted one, so no wrong value was
ever loaded silently.
"""
import errno
import gc
import logging
import re
import shutil

import jax
import numpy as np
import pytest
from orbax.checkpoint._src.path import async_path

from checkpoint_damage import chunk_files, flip_bits, truncate
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import load_config
from jaxcnn.train.metrics import read_metrics
from jaxcnn.train._build import abstract_state, build_run, init_state
from reliability_lib import (CHECKPOINTED_STEPS, ORBAX_LEFTOVER_WARNINGS, assert_params_bitwise_equal,
                             checkpointed_args, step_dirs, tiny_args, tiny_npz)

STEPS = CHECKPOINTED_STEPS

pytestmark = ORBAX_LEFTOVER_WARNINGS


run_args = checkpointed_args


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted 12-step run with a checkpoint every 2 steps: (data path, run directory)."""
    base = tmp_path_factory.mktemp("ckpt_faults")
    data = tiny_npz(base / "d.npz")
    assert train_main(run_args(data, base / "ref")) == 0
    assert step_dirs(base / "ref" / "checkpoints")[0] == [2, 4, 6, 8, 10, 12]
    return data, base / "ref"


def truncate_array_file(step_dir):
    truncate(chunk_files(step_dir)[0])


def flip_bytes(step_dir):
    flip_bits(chunk_files(step_dir)[0])


def delete_metadata(step_dir):
    shutil.rmtree(step_dir / "meta")


def older_values(step_dir):
    """Valid files, wrong values: step 2's arrays under this step's manifest."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "2" / "state", step_dir / "state")


def other_model(step_dir, data):
    """A real checkpoint of another model (7 classes: the classifier has other shapes) at this step."""
    cfg = load_config(tiny_args(data)[0], tiny_args(data, "model.num_classes=7")[1:])
    step = int(step_dir.name)
    shutil.rmtree(step_dir)
    with CheckpointManager(step_dir.parent, keep=100) as mgr:  # keep: retention must not touch the others
        assert mgr.save(step, init_state(build_run(cfg)), force=True)


def test_damaged_checkpoints_are_reported_and_skipped_for_the_last_good_one(reference, tmp_path, caplog, capsys):
    data, ref = reference
    work = tmp_path / "w"
    shutil.copytree(ref, work)
    (work / "params.npz").unlink()
    ckpt = work / "checkpoints"
    # Newest first, the resume meets five kinds of damage and another model's checkpoint; 2 is good.
    truncate_array_file(ckpt / "12")
    other_model(ckpt / "10", data)
    older_values(ckpt / "8")
    delete_metadata(ckpt / "6")
    flip_bytes(ckpt / "4")
    with caplog.at_level(logging.WARNING, logger="jaxcnn.train.checkpoint"):
        code = train_main(run_args(data, work))
    out = capsys.readouterr().out
    assert code == 0
    assert f"resumed from step 2: {ckpt}/2" in out
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    for step, needle in [(12, "could not be read|sha256"), (10, "does not match the target"), (8, "fails its sha256 check"),
                         (6, "manifest of checkpoint .* is missing"), (4, "could not be read|sha256")]:
        hits = [w for w in warnings if str(ckpt / str(step)) in w]
        assert hits and any(re.search(needle, w) for w in hits), (step, warnings)
    # All were moved aside, so that the resumed run checkpoints again from step 4 on.
    assert {p.name for p in ckpt.iterdir()} >= {"12.corrupt", "10.mismatch", "8.corrupt", "6.corrupt", "4.corrupt"}
    assert step_dirs(ckpt) == ([2, 4, 6, 8, 10, 12], [])
    assert "was not saved" not in out
    assert_params_bitwise_equal(work / "params.npz", ref / "params.npz")
    gc.collect()


def test_no_usable_checkpoint_is_an_error_not_a_fresh_start(reference, tmp_path, capsys):
    data, ref = reference
    work = tmp_path / "w"
    shutil.copytree(ref, work)
    (work / "params.npz").unlink()
    ckpt = work / "checkpoints"
    for step in (2, 4, 6, 8, 10, 12):
        other_model(ckpt / str(step), data)
    capsys.readouterr()
    code = train_main(run_args(data, work))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"no usable checkpoint in {ckpt}: its checkpoints (steps 12, 10, 8, 6, 4, 2)" in err[0]
    assert f"more, in {ckpt}/12): another model's or optimiser's; start a new run with --workdir" in err[0]
    assert not (work / "params.npz").exists()


def disk_full_at(monkeypatch, steps):
    """Writes of checkpoint files for ``steps`` fail with ENOSPC, as a full disk reports it."""
    original = async_path.write_text

    async def write_text(path, text):
        if any(f"/{s}{'.orbax-checkpoint-tmp'}" in str(path) for s in steps):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return await original(path, text)
    monkeypatch.setattr(async_path, "write_text", write_text)


def test_disk_full_on_error_stop_keeps_previous_checkpoint_intact(reference, tmp_path, monkeypatch, capsys):
    data, ref = reference
    work = tmp_path / "w"
    ckpt = work / "checkpoints"
    with monkeypatch.context() as patch:
        disk_full_at(patch, [4])
        code = train_main(run_args(data, work, "checkpoint.on_error=stop"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"jaxcnn-train: error: saving checkpoint step 4 to {ckpt} failed: ENOSPC (errno 28)")
    assert "previous checkpoints are kept" in err[0]
    assert sorted(p.name for p in ckpt.iterdir()) == ["2"]  # intact, and no partial directory left
    with CheckpointManager(ckpt) as mgr:  # restores with every sha256 checked, equal to the reference's
        step, state = mgr.restore(target=abstract_state(build_run(load_config(*_cfg(data)))))
    with CheckpointManager(ref / "checkpoints") as mgr:
        _, expected = mgr.restore(2, target=state)
    assert step == 2 and all(a.tobytes() == b.tobytes() for a, b in
                             zip(map(np.asarray, jax.tree.leaves(state)), map(np.asarray, jax.tree.leaves(expected))))
    gc.collect()


def test_disk_full_on_error_warn_reports_and_continues(reference, tmp_path, monkeypatch, capsys, caplog):
    data, ref = reference
    work = tmp_path / "w"
    ckpt = work / "checkpoints"
    with monkeypatch.context() as patch, caplog.at_level(logging.WARNING, logger="jaxcnn.train.checkpoint"):
        disk_full_at(patch, [4, 6])
        code = train_main(run_args(data, work, "checkpoint.on_error=warn"))
    out = capsys.readouterr().out
    assert code == 0
    for step in (4, 6):
        assert f"[jaxcnn] warning: checkpoint at step {step} was not saved" in out
        assert f"saving checkpoint step {step} to {ckpt} failed: ENOSPC (errno 28)" in caplog.text
    assert step_dirs(ckpt) == ([2, 8, 10, 12], [])
    assert_params_bitwise_equal(work / "params.npz", ref / "params.npz")  # a failed save changes nothing
    gc.collect()


def test_disk_full_writing_metrics_is_one_line_and_the_rerun_repairs_the_file(reference, tmp_path, monkeypatch,
                                                                              capsys):
    """A disk filling between checkpoints: a 44-line traceback and a torn line in metrics.jsonl for
    good. Now one line, exit 2, the file cut back to its last whole record; the re-run resumes
    and ends bitwise equal to an uninterrupted run, each record once."""
    import builtins

    from jaxcnn.train import metrics
    from full_disk import FullDisk
    data, ref = reference
    work = tmp_path / "w"
    with monkeypatch.context() as patch:  # the second record (step 8 at log_every=4) fills the disk
        patch.setattr(metrics, "open", lambda path, mode="r", **k: FullDisk(builtins.open(path, mode, **k), 2)
                      if mode == "a" else builtins.open(path, mode, **k), raising=False)
        code = train_main(run_args(data, work))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0] == (f"jaxcnn-train: error: cannot write {work / 'metrics.jsonl'} (No space left on device) "
                      "at step 8; its earlier records and the checkpoints are kept")
    assert (work / "metrics.jsonl").read_text().endswith("\n")
    assert train_main(run_args(data, work)) == 0
    assert_params_bitwise_equal(work / "params.npz", ref / "params.npz")
    records = [(r["step"], r["kind"]) for r in read_metrics(str(work))]
    assert records == [(r["step"], r["kind"]) for r in read_metrics(str(ref))] and len(set(records)) == len(records)
    gc.collect()


def _cfg(data):
    args = tiny_args(data, f"train.steps={STEPS}")
    return args[0], args[1:]


def test_reference_run_checkpoints_hold_what_training_held(reference):
    """The uninterrupted run's last checkpoint restores to the parameters it wrote at the end."""
    data, ref = reference
    run = build_run(load_config(*_cfg(data)))
    with CheckpointManager(ref / "checkpoints") as mgr:
        step, state = mgr.restore(target=abstract_state(run))
    from jaxcnn.interop import load_npz
    params, _ = load_npz(ref / "params.npz")
    assert step == STEPS
    saved = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    for path, x in jax.tree_util.tree_flatten_with_path(state.params)[0]:
        assert saved[path].tobytes() == jax.device_get(x).tobytes(), path


def test_a_truncated_data_file_is_found_before_orbax_reads(reference, tmp_path, monkeypatch):
    """The check before orbax reads finds a truncated data file and names the value, with no
    orbax read started (orbax abandons its other reads at the first failure, and their late
    completions print tracebacks from TensorStore's threads); a good checkpoint reads whole.
    The check reads the index only (data files' sizes against the byte ranges it lists): it read
    every value of the checkpoint, in every process, before orbax read them again."""
    import tensorstore as ts

    from jaxcnn.train import _checkpoint_files as files
    from jaxcnn.train import checkpoint as C

    data, ref = reference
    work = tmp_path / "ckpt"
    shutil.copytree(ref / "checkpoints", work)
    with monkeypatch.context() as no_reads:  # no value read: only the index
        no_reads.setattr(ts.KvStore, "read", lambda *a, **k: pytest.fail("a value was read"))
        assert files.unreadable_value(work / "12" / "state") is None
        truncate_array_file(work / "12")
        key, error = files.unreadable_value(work / "12" / "state")
    assert key.endswith(("/0", "/0.0", "/0.0.0.0")) and "(truncated)" in str(error), (key, error)
    assert isinstance(error, files.DataFileError) and f"{work / '12' / 'state'}/" in str(error), error
    by_reading = files.unreadable_by_reading(work / "12" / "state")  # what orbax would meet
    assert by_reading is not None and "OUT_OF_RANGE" in str(by_reading[1]), by_reading
    cfg = load_config(tiny_args(data)[0], tiny_args(data)[1:])
    target = abstract_state(build_run(cfg))
    with CheckpointManager(work, read_only=True) as mgr:
        reads, restore = [], mgr._mgr.restore

        def orbax_restore(step, args):
            reads.append(sorted(args.keys()))
            return restore(step, args=args)

        monkeypatch.setattr(mgr._mgr, "restore", orbax_restore)
        with pytest.raises(C.CheckpointCorruptError, match=rf"12/state could not be read \({re.escape(key)}: "):
            mgr.restore(12, target=target)
        assert reads and all(C._STATE not in r for r in reads), reads  # the manifest only
        assert mgr.restore(10, target=target)[0] == 10
        assert any(C._STATE in r for r in reads)
