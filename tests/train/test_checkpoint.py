"""Tests for jaxcnn.train.checkpoint: round trips, retention, atomicity, integrity, save errors, resume."""
import errno
import gc
import hashlib
import logging
import pathlib
import shutil
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.path import async_path

from checkpoint_damage import chunk_files, flip_bits, truncate
from jaxcnn.train.checkpoint import CheckpointCorruptError, CheckpointError, CheckpointManager
from jaxcnn.train.resume import restore_for_resume

LOGGER = "jaxcnn.train.checkpoint"


def make_state(seed=0, width=4):
    """A TrainState-like pytree: f32/bf16/int32/uint32 leaves, nested dicts, an optax adam state.

    Built from NumPy and put on device, so no XLA compilation is needed (op-by-op
    compiles of many small shapes would dominate the test time).
    """
    rng = np.random.default_rng(seed)

    def put(shape, dtype):
        return jax.device_put(rng.normal(size=shape).astype(dtype))

    params = {"conv1": {"w": put((3, 3, 2, width), np.float32), "b": put((width,), np.float32)},
              "fc": {"w": put((width, 3), jnp.bfloat16)}}
    # optax's own structure for adam (ScaleByAdamState inside a chain tuple), with non-zero moments.
    opt_def = jax.tree.structure(jax.eval_shape(optax.adam(1e-2).init, params))
    moments = [put(x.shape, x.dtype) for x in jax.tree.leaves(params) * 2]
    opt_state = jax.tree.unflatten(opt_def, [jax.device_put(np.int32(seed + 1))] + moments)
    return {"step": jax.device_put(np.int32(seed + 7)),
            "params": params,
            "state": {"bn": {"mean": rng.normal(size=(width,)).astype(np.float32),
                             "count": np.asarray(3, np.int32)}},
            "opt_state": opt_state,
            "loss_scale": jax.device_put(np.float32(2.0 ** 15)),
            "rng": jax.device_put(rng.integers(0, 2 ** 32, size=(2,), dtype=np.uint32))}


def abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if isinstance(x, jax.Array) else x, state)


def assert_bitwise_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), path
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), path


def saved_manager(tmp_path, steps=(1, 2), **kwargs):
    mgr = CheckpointManager(tmp_path / "ckpt", **kwargs)
    states = {s: make_state(seed=s) for s in steps}
    for s in steps:
        assert mgr.save(s, states[s]) is True
    return mgr, states


def test_round_trip_is_bitwise_and_keeps_types(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.save(10, state, metrics={"eval/top1": np.float32(0.5)}, config_dict={"lr": 0.1, "model": "cnn"})
        step, abstract_restored = mgr.restore(target=abstract(state))
        _, concrete_restored = mgr.restore(10, target=jax.tree.map(lambda x: x * 0, state))
        meta = mgr.metadata(10)
    assert step == 10
    assert_bitwise_equal(state, abstract_restored)
    assert_bitwise_equal(state, concrete_restored)
    assert isinstance(abstract_restored["opt_state"][0], optax.ScaleByAdamState)
    assert isinstance(abstract_restored["state"]["bn"]["mean"], np.ndarray)
    assert meta["config"] == {"lr": 0.1, "model": "cnn"} and meta["metrics"] == {"eval/top1": 0.5}
    entries = {e["path"]: e for e in meta["arrays"]}
    w = np.asarray(state["params"]["fc"]["w"])
    assert entries["params/fc/w"]["dtype"] == "bfloat16" and entries["params/fc/w"]["shape"] == [4, 3]
    assert entries["params/fc/w"]["sha256"] == hashlib.sha256(w.tobytes()).hexdigest()
    assert set(entries) == {"step", "params/conv1/w", "params/conv1/b", "params/fc/w", "state/bn/mean",
                            "state/bn/count", "opt_state/0/count", "opt_state/0/mu/conv1/w",
                            "opt_state/0/mu/conv1/b", "opt_state/0/mu/fc/w", "opt_state/0/nu/conv1/w",
                            "opt_state/0/nu/conv1/b", "opt_state/0/nu/fc/w", "loss_scale", "rng"}
    # Only JSON and tensorstore files are written: no pickle.
    for f in (tmp_path / "ckpt").rglob("*"):
        assert f.suffix not in (".pkl", ".pickle", ".npy")


def test_restore_onto_target_shardings(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    state = {"w": jnp.arange(32, dtype=jnp.float32).reshape(8, 4), "step": jnp.asarray(3, jnp.int32)}
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sharded),
              "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)}
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, state)
        _, restored = mgr.restore(target=target)
    assert restored["w"].sharding == sharded and restored["step"].sharding == replicated
    assert_bitwise_equal(state, restored)
    # Without a sharding in the target arrays land on the default device (host copies are
    # written, so no saved sharding exists to follow; drop one if orbax ever writes it).
    (tmp_path / "ckpt" / "1" / "state" / "_sharding").unlink(missing_ok=True)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        _, restored = mgr.restore(target=abstract(state))
    assert all(x.sharding == jax.sharding.SingleDeviceSharding(jax.local_devices()[0]) for x in restored.values())
    assert_bitwise_equal(state, restored)


def test_async_save_round_trip(tmp_path):
    state = make_state(3)
    with CheckpointManager(tmp_path / "ckpt", async_save=True) as mgr:
        assert mgr.save(1, state) and mgr.save(2, make_state(4))
        mgr.wait()
        assert mgr.all_steps() == [1, 2]
        _, restored = mgr.restore(1, target=abstract(state))
    assert_bitwise_equal(state, restored)


def test_keep_last_k(tmp_path):
    mgr, _ = saved_manager(tmp_path, steps=(1, 2, 3, 4), keep=2)
    assert mgr.all_steps() == [3, 4] and mgr.latest_step() == 4
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["3", "4"]
    mgr.close()


@pytest.mark.parametrize("mode, values, best", [("max", [0.2, 0.9, 0.1, 0.3], 20),
                                                ("min", [0.5, 0.1, 0.7, 0.3], 20)])
def test_keep_best(tmp_path, mode, values, best):
    with CheckpointManager(tmp_path / "ckpt", keep=2, keep_best=True, best_mode=mode) as mgr:
        for i, value in enumerate(values, start=1):
            assert mgr.save(10 * i, make_state(i), metrics={"eval/top1": value, "train/loss": 1.0})
            assert mgr.save(10 * i + 5, make_state(i))  # no metric: never ranks as best
        assert mgr.all_steps() == [best, 40, 45] and mgr.best_step() == best
        _, restored = mgr.restore(best, target=abstract(make_state()))
        assert_bitwise_equal(make_state(best // 10), restored)
    # A fresh manager (a resumed run) sees the same best and keeps it.
    with CheckpointManager(tmp_path / "ckpt", keep=1, keep_best=True, best_mode=mode) as mgr:
        assert mgr.best_step() == best
        mgr.save(200, make_state(0), metrics={"eval/top1": float("nan")})
        assert mgr.all_steps() == [best, 200] and mgr.best_step() == best


def test_half_written_step_dir_is_ignored(tmp_path, caplog):
    mgr, states = saved_manager(tmp_path)
    mgr.close()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(ckpt / "2", ckpt / "3")
    (ckpt / "3" / "commit_success.txt").unlink()
    shutil.copytree(ckpt / "2", ckpt / "4.orbax-checkpoint-tmp")  # an interrupted save of step 4
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        mgr = CheckpointManager(ckpt)
        assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
        with pytest.raises(CheckpointCorruptError, match=f"{ckpt / '3'} is half-written"):
            mgr.restore(3, target=abstract(states[2]))
        step, restored = mgr.restore(target=abstract(states[2]))
    assert step == 2
    assert_bitwise_equal(states[2], restored)
    assert f"half-written checkpoint {ckpt / '3'}" in caplog.text
    assert f"half-written checkpoint {ckpt / '4.orbax-checkpoint-tmp'}" in caplog.text
    assert not (ckpt / "4.orbax-checkpoint-tmp").exists()
    assert (ckpt / "3.corrupt").is_dir() and mgr.save(3, states[2])  # moved aside: step 3 can be saved again
    mgr.close()


def truncate_all(step_dir):
    for f in chunk_files(step_dir):
        truncate(f)


def flip_bytes(step_dir):
    for f in chunk_files(step_dir):
        flip_bits(f)


def delete_manifest(step_dir):
    shutil.rmtree(step_dir / "meta")


def swap_values(step_dir):
    """Same structure, other values: step 1's arrays under step 2's manifest; only the sha256 can tell."""
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "1" / "state", step_dir / "state")


def delete_orbax_metadata(step_dir):
    (step_dir / "state" / "_METADATA").unlink()


def corrupt_manifest_json(step_dir):
    (step_dir / "meta" / "metadata").write_text('{"format": 1, "arrays": [')


def strip_manifest_entry(step_dir):
    meta = step_dir / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"sha256": ', '"sha": ', 1))


def tolerates_orbax_leftovers(test):
    """orbax leaves tensorstore callbacks and coroutines behind after a failed read or write: they hit
    a closed event loop or are never awaited. The tests call gc.collect() at their end so that these
    report there, under these filters, rather than in a later test."""
    test = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")(test)
    return pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")(test)


@tolerates_orbax_leftovers
@pytest.mark.parametrize("damage, expected", [(truncate_all, "could not be read|sha256"),
                                              (flip_bytes, "could not be read|sha256"),
                                              (swap_values, "fails its sha256 check"),
                                              (delete_orbax_metadata, "could not be read"),
                                              (corrupt_manifest_json, "manifest .* unreadable"),
                                              (strip_manifest_entry, "manifest .* malformed"),
                                              (delete_manifest, "manifest .* unreadable")])
def test_damaged_checkpoint_is_detected_and_skipped(tmp_path, caplog, damage, expected):
    mgr, states = saved_manager(tmp_path)
    mgr.close()
    ckpt = tmp_path / "ckpt"
    damage(ckpt / "2")
    mgr = CheckpointManager(ckpt)
    with pytest.raises(CheckpointCorruptError, match=str(ckpt / "2")) as info:
        mgr.restore(2, target=abstract(states[2]))
    assert info.match(expected)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        step, restored = mgr.restore(target=abstract(states[1]))
    assert step == 1
    assert_bitwise_equal(states[1], restored)
    assert str(ckpt / "2") in caplog.text
    # The damaged step is moved aside, so the run can save step 2 again after resuming from 1.
    assert (ckpt / "2.corrupt").is_dir() and not (ckpt / "2").exists()
    assert mgr.save(2, states[2]) is True
    assert_bitwise_equal(states[2], mgr.restore(target=abstract(states[2]))[1])
    damage(ckpt / "2")  # the same step damaged again is moved aside under a new name
    assert mgr.restore(target=abstract(states[1]))[0] == 1 and (ckpt / "2.corrupt-2").is_dir()
    mgr.close()
    gc.collect()


def test_target_from_another_model_is_rejected_before_loading(tmp_path, caplog):
    small, big = make_state(seed=1, width=4), make_state(seed=2, width=8)
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.save(1, small)
        mgr.save(2, big)
        with pytest.raises(CheckpointError, match=r"'opt_state/0/mu/conv1/w' is float32\(3, 3, 2, 8\) in the "
                                                  r"checkpoint, float32\(3, 3, 2, 4\) in the target.*and 5 more") as info:
            mgr.restore(2, target=abstract(small))
        assert not isinstance(info.value, CheckpointCorruptError) and str(tmp_path / "ckpt" / "2") in str(info.value)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            step, restored = mgr.restore(target=abstract(small))
        assert step == 1 and str(tmp_path / "ckpt" / "2") in caplog.text
        assert_bitwise_equal(small, restored)
        assert mgr.all_steps() == [1, 2]  # a mismatch is not damage: nothing moved aside
        extra = dict(abstract(small), extra=jax.ShapeDtypeStruct((2,), jnp.float32))
        with pytest.raises(CheckpointError, match="'extra' is in the target but not in the checkpoint"):
            mgr.restore(1, target=extra)
        retyped = jax.tree.map(lambda x: x, abstract(small))
        retyped["loss_scale"] = jax.ShapeDtypeStruct((), jnp.bfloat16)
        with pytest.raises(CheckpointError, match=r"'loss_scale' is float32\(\) in the checkpoint, bfloat16\(\)"):
            mgr.restore(1, target=retyped)


def disk_full(monkeypatch, style):
    """Every file orbax writes through its async path layer (array metadata, commit marker) hits ENOSPC.

    style "oserror": as Python file I/O reports it; "tensorstore": as the array writer reports it
    (a ValueError tagged with the OS error code, checked on a real 64 KiB tmpfs).
    """
    async def write_text(path, text):
        if style == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        raise ValueError(f'RESOURCE_EXHAUSTED: Failed writing: "{path}": No space left on device '
                         "[os_error_code='28']")
    monkeypatch.setattr(async_path, "write_text", write_text)


@tolerates_orbax_leftovers
@pytest.mark.parametrize("on_error, style", [("warn", "oserror"), ("stop", "oserror"), ("warn", "tensorstore")])
def test_save_error_keeps_previous_checkpoint(tmp_path, monkeypatch, caplog, on_error, style):
    ckpt = tmp_path / "ckpt"
    mgr = CheckpointManager(ckpt, on_error=on_error)
    state1 = make_state(1)
    assert mgr.save(1, state1)
    with monkeypatch.context() as patch:
        disk_full(patch, style)
        if on_error == "stop":
            with pytest.raises(CheckpointError, match=f"step 2 to {ckpt} failed: ENOSPC \\(errno 28\\)"):
                mgr.save(2, make_state(2))
        else:
            with caplog.at_level(logging.WARNING, logger=LOGGER):
                assert mgr.save(2, make_state(2)) is False
            assert f"saving checkpoint step 2 to {ckpt} failed: ENOSPC (errno 28)" in caplog.text
    assert sorted(p.name for p in ckpt.iterdir()) == ["1"]  # no partial directory left behind
    assert mgr.all_steps() == [1]
    assert_bitwise_equal(state1, mgr.restore(target=abstract(state1))[1])
    assert mgr.save(2, make_state(2)) and mgr.all_steps() == [1, 2]  # the disk has room again
    mgr.close()
    gc.collect()


def test_save_refusals(tmp_path, caplog):
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(TypeError, match="'rng' is a typed PRNG key"):
            mgr.save(1, {"rng": jax.random.key(0)})
        with pytest.raises(TypeError, match="'w' has unsupported type str"):
            mgr.save(1, {"w": "abc"})
        with pytest.raises(TypeError, match="not JSON-serialisable"):
            mgr.save(1, {"w": np.ones(2)}, config_dict={"f": object()})
        assert mgr.save(5, {"w": np.ones(2)})
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert mgr.save(4, {"w": np.zeros(2)}) is False
        assert "latest saved step is 5" in caplog.text
        assert mgr.save(4, {"w": np.zeros(2)}, force=True) and mgr.all_steps() == [4, 5]
        with pytest.raises(CheckpointError, match="step 5 already exists"):
            mgr.save(5, {"w": np.zeros(2)}, force=True)
    with pytest.raises(ValueError, match="on_error"):
        CheckpointManager(tmp_path / "x", on_error="ignore")


def test_resume_policies(tmp_path):
    target = abstract(make_state())
    empty = CheckpointManager(tmp_path / "empty")
    assert restore_for_resume(empty, target, "never") is None
    assert restore_for_resume(empty, target, "auto") is None
    with pytest.raises(CheckpointError, match="resume='must' but there is no checkpoint in .*empty"):
        restore_for_resume(empty, target, "must")
    with pytest.raises(CheckpointError, match="no checkpoint to restore"):
        empty.restore(target=target)
    with pytest.raises(ValueError, match="resume must be"):
        restore_for_resume(empty, target, "sometimes")
    empty.close()

    mgr, states = saved_manager(tmp_path, steps=(3, 6))
    assert restore_for_resume(mgr, target, "never") is None
    for policy in ("auto", "must"):
        step, restored = restore_for_resume(mgr, target, policy)
        assert step == 6
        assert_bitwise_equal(states[6], restored)
    mgr.close()
    # Checkpoints exist but none is usable: even "auto" refuses to start afresh silently.
    for step in (3, 6):
        delete_manifest(tmp_path / "ckpt" / str(step))
    with CheckpointManager(tmp_path / "ckpt") as broken:
        assert broken.all_steps() == []
        for policy in ("auto", "must"):
            with pytest.raises(CheckpointError, match="no usable checkpoint .*manifest"):
                restore_for_resume(broken, target, policy)


def _tree(root):
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@tolerates_orbax_leftovers
def test_read_only_manager_reports_damage_and_changes_nothing(tmp_path, caplog):
    mgr, states = saved_manager(tmp_path, steps=(1, 2, 3))
    mgr.close()
    ckpt = tmp_path / "ckpt"
    truncate_all(ckpt / "3")
    (ckpt / "2.orbax-checkpoint-tmp-5").mkdir()  # an interrupted save: a writable manager removes it
    (ckpt / "9").symlink_to(ckpt / "1")          # a link: a writable manager moves it aside
    before = _tree(ckpt)
    with caplog.at_level(logging.WARNING, logger=LOGGER), \
            CheckpointManager(ckpt, read_only=True, log_path=tmp_path / "log") as ro:
        step, restored = ro.restore(target=abstract(states[2]))
        with pytest.raises(CheckpointError, match="read-only"):
            ro.save(4, states[2])
    assert step == 2
    assert_bitwise_equal(states[2], restored)
    assert _tree(ckpt) == before and not (tmp_path / "log").exists()
    damaged = [r.getMessage() for r in caplog.records if str(ckpt / "3") in r.getMessage()]
    assert len(damaged) == 1 and "could not be read" in damaged[0] and "\n" not in damaged[0], damaged
    assert "TensorStore" not in damaged[0]  # not orbax's 60-line spec
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointManager(tmp_path / "nowhere", read_only=True)
    assert not (tmp_path / "nowhere").exists()
    gc.collect()


def test_a_read_only_restore_takes_the_newer_checkpoint_when_its_own_is_removed_under_it(tmp_path, monkeypatch):
    """jaxcnn-eval during training with checkpoint.keep=1 failed 4 times in 11 with "no usable
    checkpoint": the training run removed the checkpoint being read as it saved the next. The
    read-only manager lists the checkpoints again and restores the newer one."""
    mgr, states = saved_manager(tmp_path, steps=(4,), keep=1)
    ckpt = tmp_path / "ckpt"
    load = CheckpointManager._load
    raced = []

    def racing_load(self, step, target):  # training saves 6 (keep=1 removes 4) during the read
        if not raced:
            raced.append(step)
            assert mgr.save(6, states[4], force=True)
            assert not (ckpt / "4").exists()
        return load(self, step, target)
    monkeypatch.setattr(CheckpointManager, "_load", racing_load)
    with CheckpointManager(ckpt, read_only=True) as ro:
        step, restored = ro.restore(target=abstract(states[4]))
    mgr.close()
    assert raced == [4] and step == 6
    assert_bitwise_equal(states[4], restored)
    gc.collect()


@tolerates_orbax_leftovers
def test_damage_detail_goes_to_the_log_file(tmp_path, caplog):
    mgr, states = saved_manager(tmp_path, steps=(1, 2))
    mgr.close()
    truncate_all(tmp_path / "ckpt" / "2")
    log = tmp_path / "checkpoints.log"
    with caplog.at_level(logging.WARNING, logger=LOGGER), CheckpointManager(tmp_path / "ckpt", log_path=log) as m:
        assert m.restore(target=abstract(states[1]))[0] == 1
    line = next(r.getMessage() for r in caplog.records if "could not be read" in r.getMessage())
    assert "\n" not in line and len(line) < 800 and f"(details in {log})" in line
    assert "(truncated)" in log.read_text() and str(tmp_path / "ckpt" / "2") in log.read_text()
    gc.collect()


def test_checkpoint_whose_name_or_state_disagrees_with_its_step_is_damaged(tmp_path, caplog):
    mgr, states = saved_manager(tmp_path, steps=(7, 8), step_leaf="step")  # make_state: step leaf = seed + 7
    mgr.close()
    ckpt = tmp_path / "ckpt"
    # (a) cp -a 8 9: the manifest says 8.
    shutil.copytree(ckpt / "8", ckpt / "9")
    # (b) a manifest edited to say 10 over step 8's state.
    shutil.copytree(ckpt / "8", ckpt / "10")
    meta = ckpt / "10" / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"step": 8', '"step": 10', 1))
    with CheckpointManager(ckpt, step_leaf="step") as m:
        with pytest.raises(CheckpointCorruptError, match=r"10/state: its state is at step 15, not 10"):
            m.restore(10, target=abstract(states[8]))
        with pytest.raises(CheckpointCorruptError, match=r"9 holds step 8 by its manifest, not 9"):
            m.restore(9, target=abstract(states[8]))
    states[8]["step"] = jax.device_put(np.int32(8))  # a consistent step 8 (seed 8's leaf says 15)
    shutil.rmtree(ckpt / "8")
    with CheckpointManager(ckpt, keep=10, step_leaf="step") as m:
        assert m.save(8, states[8], force=True)
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            step, _ = m.restore(target=abstract(states[8]))
        assert step == 8
        assert sorted(p.name for p in ckpt.iterdir()) == ["10.corrupt", "7", "8", "9.corrupt"]


def test_checkpoint_from_another_config_is_refused(tmp_path):
    from jaxcnn.train.checkpoint import ConfigChangedError
    from jaxcnn.train.config import config_changes, config_digest
    cfg = {"optim": {"lr": 0.1, "name": "sgd"}, "train": {"seed": 0, "eval_every": 5},
           "logging": {"progress": "bar"}, "checkpoint": {"keep": 3, "resume": "auto"},
           "data": {"prefetch": 2, "batch_size": 8}}
    same = {**cfg, "logging": {"progress": "none"}, "checkpoint": {"keep": 9, "resume": "must"},
            "data": {"prefetch": 0, "batch_size": 8}, "train": {"seed": 0, "eval_every": 7}}
    other = {**cfg, "optim": {"lr": 0.2, "name": "sgd"}, "train": {"seed": 1, "eval_every": 5}}
    assert config_digest(cfg) == config_digest(same) and config_changes(cfg, same) == []
    assert config_changes(cfg, other) == ["optim.lr: 0.1 -> 0.2", "train.seed: 0 -> 1"]
    state = make_state()
    target = abstract(state)
    with CheckpointManager(tmp_path / "ckpt", keep=10) as mgr:
        mgr.save(1, state)                      # no config at all: accepted
        mgr.save(2, state, config_dict=cfg)
    with CheckpointManager(tmp_path / "ckpt", keep=10) as mgr:
        assert mgr.restore(1, target=target, config=other)[0] == 1
        assert mgr.restore(target=target, config=same)[0] == 2
        with pytest.raises(ConfigChangedError, match=r"ckpt/2 was trained under another config "
                                                     r"\(optim.lr: 0.1 -> 0.2, train.seed: 0 -> 1\)"):
            restore_for_resume(mgr, target, config=other)
        # A manifest from before digests (config only) is judged by its config.
        meta = tmp_path / "ckpt" / "2" / "meta" / "metadata"
        meta.write_text(meta.read_text().replace('"config_digest"', '"other_key"'))
        with pytest.raises(ConfigChangedError, match="optim.lr"):
            mgr.restore(target=target, config=other)
        assert restore_for_resume(mgr, target, config=None)[0] == 2  # on_config_change=continue



def test_a_checkpoint_saved_before_a_key_existed_resumes_when_the_key_is_at_its_default(tmp_path):
    """A jaxcnn that adds config keys (train.ema_decay, ...) still resumes the checkpoints of one
    without them, unless the new key is set to something other than its default."""
    from jaxcnn.train.checkpoint import ConfigChangedError
    from jaxcnn.train.config import config_changes
    from jaxcnn.train.config import load_config, to_dict
    new = to_dict(load_config(str(pathlib.Path(__file__).parents[2] / "configs" / "mnist_cnn.yaml")))
    old = {**new, "train": {k: v for k, v in new["train"].items()
                            if k not in ("ema_decay", "early_stopping")}}
    assert config_changes(old, new) == []
    changed = {**new, "train": {**new["train"], "ema_decay": 0.5}}
    assert config_changes(old, changed) == ["train.ema_decay: '(unset)' -> 0.5"]
    assert config_changes(new, old) != []  # a key the new config lacks is a change
    state = make_state()
    with CheckpointManager(tmp_path / "ckpt", keep=10) as mgr:
        mgr.save(3, state, config_dict=old)
    with CheckpointManager(tmp_path / "ckpt", keep=10) as mgr:
        assert restore_for_resume(mgr, abstract(state), config=new)[0] == 3
        with pytest.raises(ConfigChangedError, match=r"train.ema_decay: '\(unset\)' -> 0.5"):
            restore_for_resume(mgr, abstract(state), config=changed)

def test_cli_hook_sends_abandoned_orbax_coroutines_to_the_log(tmp_path, monkeypatch):
    """jaxcnn-train/-eval's process hook: an orbax coroutine's late "Exception ignored" report
    goes to the log, any other unraisable exception to the previous hook."""
    import types

    from jaxcnn.train._orbax_noise import quiet_abandoned_orbax_coroutines

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    log = tmp_path / "checkpoints.log"
    quiet_abandoned_orbax_coroutines(str(log))

    def info(obj):
        return types.SimpleNamespace(exc_type=ValueError, exc_value=ValueError("x"),
                                     exc_traceback=None, err_msg=None, object=obj)

    class OrbaxCoroutine:
        def __repr__(self):
            return "<coroutine object orbax.checkpoint._read_array_index_and_device_put>"

    sys.unraisablehook(info(OrbaxCoroutine()))
    other = info("<coroutine object mine>")
    sys.unraisablehook(other)
    assert seen == [other]
    assert "_read_array_index_and_device_put" in log.read_text()


def test_cli_hook_sends_late_orbax_future_reports_to_the_log(tmp_path, monkeypatch, caplog):
    """asyncio reports an abandoned TensorStore read ("Future exception was never retrieved")
    when the future is collected, after the restore has reported the damage: the CLI hook sends
    that record to the log; other asyncio records still reach the handlers."""
    import logging

    from jaxcnn.train._orbax_noise import LateOrbaxFutures, quiet_abandoned_orbax_coroutines

    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
    asyncio_log = logging.getLogger("asyncio")
    log = tmp_path / "checkpoints.log"
    try:
        quiet_abandoned_orbax_coroutines(str(log))
        quiet_abandoned_orbax_coroutines(str(log))  # idempotent: one filter
        assert sum(isinstance(f, LateOrbaxFutures) for f in asyncio_log.filters) == 1
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            asyncio_log.error("Future exception was never retrieved\nfuture: <Future finished "
                              "exception=ValueError('OUT_OF_RANGE: Error reading \"a/0.0\" in OCDBT "
                              "database at local file \"/x/state/\"')>")
            asyncio_log.error("Future exception was never retrieved\nfuture: <Future mine>")
        assert [r.getMessage().splitlines()[-1] for r in caplog.records] == ["future: <Future mine>"]
        assert "OCDBT database" in log.read_text()
    finally:
        for f in [f for f in asyncio_log.filters if isinstance(f, LateOrbaxFutures)]:
            asyncio_log.removeFilter(f)


def test_checkpoints_of_another_model_are_named_so_not_offered_continue(tmp_path):
    """A run directory of another model: the refusal said 'continue with
    checkpoint.on_config_change=continue', and continuing printed every checkpoint's mismatches
    (three 600-character lines)."""
    import yaml

    from jaxcnn.train.checkpoint import ConfigChangedError
    from jaxcnn.train.resume import check_resume_config
    from jaxcnn.train.config import config_changes
    assert config_changes({"model": {"name": "a", "options": {}}},
                          {"model": {"name": "a", "options": {"act": "relu"}}}) == [
        "model.options.act: '(unset)' -> 'relu'"]  # not also "model.options: {} -> '(unset)'"
    work = tmp_path / "run"
    (work / "checkpoints" / "5").mkdir(parents=True)
    saved = {"model": {"name": "lenet5", "options": {"act": "relu"}}, "optim": {"lr": 0.05}}
    (work / "config.resolved.yaml").write_text(yaml.safe_dump(saved))
    other = {"model": {"name": "mnist_cnn", "options": {}}, "optim": {"lr": 0.003}}
    with pytest.raises(ConfigChangedError) as refused:
        check_resume_config(str(work), other)
    assert str(refused.value) == (
        f"{work} holds the checkpoints of model 'lenet5', not 'mnist_cnn' as configured "
        "(model.name: 'lenet5' -> 'mnist_cnn', model.options.act: 'relu' -> '(unset)', "
        "optim.lr: 0.05 -> 0.003); start a new run with --workdir DIR")
    with pytest.raises(ConfigChangedError, match="optim.lr: 0.05 -> 0.003.*on_config_change=continue"):
        check_resume_config(str(work), {**saved, "optim": {"lr": 0.003}})
    assert check_resume_config(str(work), other, on_change="continue") != []

    mgr, states = saved_manager(tmp_path, steps=(1, 2))
    wider = abstract(make_state(width=6))
    with pytest.raises(CheckpointError) as none_usable:
        restore_for_resume(mgr, wider, "auto")
    ckpt = tmp_path / "ckpt"
    assert str(none_usable.value) == (
        f"no usable checkpoint in {ckpt}: its checkpoints (steps 2, 1) hold arrays that differ from "
        "this run's state ('params/conv1/b' is float32(4,) in the checkpoint, float32(6,) in the target, "
        f"and 9 more, in {ckpt}/2): another model's or optimiser's; start a new run with --workdir DIR")
    assert sorted(p.name for p in ckpt.iterdir()) == ["1", "2"]  # left as they were
    # jaxcnn-eval --step 5: which steps there are, not only that 5 is not
    with pytest.raises(CheckpointError, match=r"no checkpoint for step 5: .*ckpt/5 does not exist "
                                              r"\(steps saved: 1, 2\)$"):
        mgr.restore(5, target=abstract(states[1]))
    mgr.close()
