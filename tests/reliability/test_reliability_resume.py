"""Resuming a run honestly, through the trainer and jaxcnn-eval.

* a re-run with settings that train differently stops before any compute (exit 2, one line
  naming the keys and the ways on) and leaves the run directory as it was; with
  ``checkpoint.on_config_change=continue`` it continues and keeps every config it ran under;
* re-running a finished run adds no second final evaluation to metrics.jsonl;
* a checkpoint from another config (its config digest) is refused like a changed config;
* a checkpoint whose directory name is not its step is damaged, skipped for the previous one;
* jaxcnn-eval changes nothing in the run directory, even over a damaged checkpoint;
* damage and a full disk are reported in one line each, not hundreds.
"""
import gc
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys

import jax.numpy as jnp
import pytest
import yaml

import xla_cache
from jaxcnn.train import _data
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import load_config, to_dict
from jaxcnn.train._build import build_run, init_state
from jaxcnn.train.metrics import read_metrics
from reliability_lib import (CHECKPOINTED_STEPS, ORBAX_LEFTOVER_WARNINGS, checkpointed_args,
                             assert_params_bitwise_equal, resumed_step, step_dirs, subprocess_env,
                             tiny_npz, train_command)

STEPS = CHECKPOINTED_STEPS

pytestmark = ORBAX_LEFTOVER_WARNINGS


run_args = checkpointed_args


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """A finished 12-step run with a checkpoint every 2 steps: (data path, run dir, compile cache:
    the suite's, where this in-process run left its programs for the subprocess runs)."""
    base = tmp_path_factory.mktemp("resume")
    data = tiny_npz(base / "d.npz")
    assert train_main(run_args(data, base / "ref")) == 0
    assert step_dirs(base / "ref" / "checkpoints")[0] == [2, 4, 6, 8, 10, 12]
    return data, base / "ref", xla_cache.directory() or base / "cache"


def copy_run(ref, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(ref, work, symlinks=True)
    return work


def tree_digest(root):
    """{relative path: sha256 (files) / "dir" / "link -> target"} of everything under root."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link -> " + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def truncate_array_file(step_dir):
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    f = max(files, key=lambda p: p.stat().st_size)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def eval_command(run_dir, *extra):
    code = "import sys; from jaxcnn.train.cli import eval_main; sys.exit(eval_main())"
    return [sys.executable, "-c", code, str(run_dir), *extra]


def run(command, cache):
    return subprocess.run(command, env=subprocess_env(cache), capture_output=True, text=True, timeout=300)


# -- a changed config ---------------------------------------------------------------------------

def test_rerun_with_changed_config_stops_before_compute_and_changes_nothing(reference, tmp_path, monkeypatch,
                                                                           capsys):
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    before = tree_digest(work)

    def no_compute(cfg, seed):
        raise AssertionError("the data were opened: the config check must come first")
    monkeypatch.setattr(_data, "build_data", no_compute)
    capsys.readouterr()
    code = train_main(run_args(data, work, "optim.lr=0.01", "train.steps=16"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"jaxcnn-train: error: {work} was trained under another config")
    assert "optim.lr: 0.003 -> 0.01" in err[0] and "train.steps: 12 -> 16" in err[0]
    assert "--workdir" in err[0] and "checkpoint.on_config_change=continue" in err[0]
    assert tree_digest(work) == before  # config.resolved.yaml, run_meta.json, checkpoints: untouched


def test_settings_that_do_not_change_training_are_not_a_change(reference, tmp_path, capsys):
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    (work / "params.npz").unlink()
    shutil.rmtree(work / "checkpoints" / "12")
    capsys.readouterr()
    code = train_main(run_args(data, work, "logging.progress=none", "logging.log_every=3", "data.prefetch=0",
                                "data.eval_batch_size=16", "train.eval_every=5", "checkpoint.keep=4",
                                "checkpoint.resume=must", "checkpoint.on_error=warn", "model.impl=xla"))
    assert code == 0, capsys.readouterr().err
    assert resumed_step(capsys.readouterr().out) == 10
    assert_params_bitwise_equal(work / "params.npz", ref / "params.npz")
    assert not (work / "config_history").exists()


def test_continue_with_changes_keeps_the_config_history(reference, tmp_path, capsys):
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    first = (work / "config.resolved.yaml").read_bytes()
    capsys.readouterr()
    code = train_main(run_args(data, work, "optim.lr=0.01", "train.steps=14",
                               "checkpoint.on_config_change=continue"))
    assert code == 0, capsys.readouterr().err
    assert resumed_step(capsys.readouterr().out) == 12
    history = work / "config_history"
    assert sorted(p.name for p in history.iterdir()) == ["from_step_0.yaml", "from_step_12.yaml"]
    assert (history / "from_step_0.yaml").read_bytes() == first
    latest = yaml.safe_load((work / "config.resolved.yaml").read_text())
    assert latest == yaml.safe_load((history / "from_step_12.yaml").read_text())
    assert latest["optim"]["lr"] == 0.01 and latest["train"]["steps"] == 14
    # The run now is that config: running it again (without the opt-in) resumes it as it is.
    assert train_main(run_args(data, work, "optim.lr=0.01", "train.steps=14")) == 0
    assert resumed_step(capsys.readouterr().out) == 14


def test_rerunning_a_finished_run_records_its_final_eval_once(reference, tmp_path, capsys):
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    assert train_main(run_args(data, work)) == 0
    assert resumed_step(capsys.readouterr().out) == STEPS
    evals = [r["step"] for r in read_metrics(work) if r["kind"] == "eval"]
    assert evals == [STEPS]
    assert [r["step"] for r in read_metrics(work)] == [r["step"] for r in read_metrics(ref)]


def test_checkpoint_from_another_config_is_refused_unless_asked(reference, tmp_path, capsys):
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    ckpt = work / "checkpoints"
    # A step-12 checkpoint with the same shapes from a run with another lr and seed, copied in.
    other = load_config(run_args(data, work)[0], run_args(data, work, "optim.lr=0.05", "train.seed=3")[1:-2])
    state = init_state(build_run(other))
    shutil.rmtree(ckpt / "12")
    with CheckpointManager(ckpt, keep=100) as mgr:
        assert mgr.save(STEPS, state._replace(step=jnp.asarray(STEPS, state.step.dtype)), force=True,
                        config_dict=to_dict(other))
    before = tree_digest(work)
    capsys.readouterr()
    assert train_main(run_args(data, work)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert f"checkpoint {ckpt}/12 was trained under another config" in err[0]
    assert "optim.lr: 0.05 -> 0.003" in err[0] and "train.seed: 3 -> 0" in err[0]
    assert "checkpoint.on_config_change=continue" in err[0]
    assert tree_digest(work) == before  # run_meta.json included: it was rewritten for the refused run
    assert train_main(run_args(data, work, "checkpoint.on_config_change=continue")) == 0
    assert resumed_step(capsys.readouterr().out) == STEPS
    gc.collect()


def test_a_failed_continue_is_one_line_and_loses_nothing(reference, tmp_path, capfd, caplog):
    """``on_config_change=continue`` under another optimiser: no checkpoint holds its state.
    Each checkpoint logged a warning line before the refusal (N + 1 lines), and the refused run
    had already rewritten run_meta.json and preprocessing.json with its own argv and settings."""
    data, ref, _ = reference
    work = copy_run(ref, tmp_path)
    before = tree_digest(work)
    capfd.readouterr()
    assert train_main(run_args(data, work, "optim.name=sgd", "checkpoint.on_config_change=continue")) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "no usable checkpoint" in err[0] and "steps 12, 10, 8, 6, 4, 2" in err[0], err
    # The warnings went through logging (pytest captures them there; a terminal shows them).
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert tree_digest(work) == before
    gc.collect()


# -- a checkpoint that lies about its step --------------------------------------------------------

def test_checkpoint_named_for_another_step_is_damaged(reference, tmp_path, capsys):
    data, ref, cache = reference
    work = copy_run(ref, tmp_path)
    (work / "params.npz").unlink()
    ckpt = work / "checkpoints"
    shutil.rmtree(ckpt / "12")
    shutil.rmtree(ckpt / "10")
    shutil.copytree(ckpt / "8", ckpt / "10")  # cp -a checkpoints/8 checkpoints/10
    before = tree_digest(work)
    # jaxcnn-eval: evaluates step 8 (labelled 8) and changes nothing.
    done = run(eval_command(work, "--json"), cache)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 8
    assert f"{ckpt}/10 holds step 8 by its manifest, not 10" in done.stderr
    assert tree_digest(work) == before
    # Training: resumes from step 8, moves 10 aside, and ends where the uninterrupted run did.
    capsys.readouterr()
    assert train_main(run_args(data, work)) == 0
    assert resumed_step(capsys.readouterr().out) == 8
    assert (ckpt / "10.corrupt").is_dir()
    assert_params_bitwise_equal(work / "params.npz", ref / "params.npz")


# -- jaxcnn-eval is read-only; one line per damaged checkpoint ------------------------------------

def test_eval_over_a_damaged_checkpoint_is_read_only_and_says_it_in_one_line(reference, tmp_path):
    _, ref, cache = reference
    work = copy_run(ref, tmp_path)
    truncate_array_file(work / "checkpoints" / "12")
    before = tree_digest(work)
    done = run(eval_command(work, "--json"), cache)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["step"] == 10
    err = done.stderr.strip().splitlines()
    assert len(err) <= 3, done.stderr
    assert any(f"{work}/checkpoints/12" in line and "could not be read" in line for line in err), err
    assert tree_digest(work) == before  # no 12.corrupt, no log file, nothing


def test_training_over_a_damaged_checkpoint_reports_it_in_one_line(reference, tmp_path):
    data, ref, cache = reference
    work = copy_run(ref, tmp_path)
    truncate_array_file(work / "checkpoints" / "12")
    done = run(train_command(run_args(data, work)), cache)
    assert done.returncode == 0, done.stderr
    err = done.stderr.strip().splitlines()
    assert len(err) <= 4, done.stderr
    assert any(f"{work}/checkpoints/12/state could not be read" in line for line in err), err
    assert (work / "checkpoints" / "12.corrupt").is_dir()
    log = (work / "checkpoints.log").read_text()  # the detail, in the run directory: which file, how short
    assert f"{work}/checkpoints/12/state/" in log and "(truncated)" in log, log


ENOSPC_AT_STEP_4 = r'''
import errno, sys
from orbax.checkpoint._src.path import async_path
original = async_path.write_text
async def write_text(path, text):  # a full disk, as tests/reliability/test_reliability_checkpoints.py has it
    if "/4.orbax-checkpoint-tmp" in str(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return await original(path, text)
async_path.write_text = write_text
from jaxcnn.train.cli import train_main
sys.exit(train_main(sys.argv[1:]))
'''


@pytest.mark.parametrize("on_error", ["stop", "warn"])
def test_disk_full_is_one_line_not_orbax_tracebacks(reference, tmp_path, on_error):
    data, _, cache = reference
    work = tmp_path / "w"
    done = run([sys.executable, "-c", ENOSPC_AT_STEP_4,
                *run_args(data, work, f"checkpoint.on_error={on_error}")], cache)
    err = done.stderr.strip().splitlines()
    assert done.returncode == (2 if on_error == "stop" else 0), done.stderr
    assert len(err) <= 2, done.stderr
    assert "saving checkpoint step 4" in err[-1 if on_error == "stop" else 0] and "ENOSPC" in done.stderr
    assert "Traceback" in (work / "checkpoints.log").read_text()
