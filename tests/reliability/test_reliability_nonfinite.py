"""Non-finite losses: ``train.nan_policy`` stop | skip, and fp16 loss-scale overflow skipping.

The fault is real data: a float ``.npz`` dataset (finite, so the loader accepts it) in which one
training image is all 3e38. Any forward pass over it overflows to inf/NaN, so the first bad step
is the first step whose batch holds that image, known in advance from ``batch_indices``.
"""
import math
import os

import numpy as np
import pytest

from jaxcnn.data import batch_indices
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.cli import train_main
from jaxcnn.train.metrics import read_metrics
from reliability_lib import tiny_args

N_TRAIN, BATCH = 64, 8


def poisoned_npz(path, bad_step, seed=0):
    """Float dataset whose image seen at 0-based step ``bad_step`` (first epoch) is all 3e38.

    Returns (path, 1-based number of the first step whose loss is not finite)."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, N_TRAIN + 32)
    x = (rng.random((N_TRAIN + 32, 10, 10, 1)) * 0.2 + labels[:, None, None, None] * 0.2).astype(np.float32)
    bad = batch_indices(N_TRAIN, BATCH, 0, bad_step)[3]
    x[bad] = 3e38
    np.savez(path, x_train=x[:N_TRAIN], y_train=labels[:N_TRAIN], x_test=x[N_TRAIN:], y_test=labels[N_TRAIN:])
    first = min(s for s in range(100) if bad in batch_indices(N_TRAIN, BATCH, 0, s))
    assert first == bad_step
    return str(path), bad_step + 1


def checkpoint_params_finite(workdir):
    """{step: whether every floating array of the checkpoint is finite}."""
    import jax
    from jaxcnn.train.config import load_config
    from jaxcnn.train._build import abstract_state, build_run
    run = build_run(load_config(os.path.join(workdir, "config.resolved.yaml")))
    target = abstract_state(run)
    with CheckpointManager(os.path.join(workdir, "checkpoints")) as mgr:
        return {s: all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(mgr.restore(s, target=target)[1])
                       if np.issubdtype(np.asarray(x).dtype, np.floating))
                for s in mgr.all_steps()}


@pytest.mark.parametrize("policy, bad_step, log_every, ckpt_every", [
    ("fp32", 6, 5, 2),    # first bad step 7, reported at the log boundary 10, after checkpoint 8 is due
    ("bf16", 3, 4, 3),    # first bad step 4: on a log boundary
])
def test_stop_at_first_nonfinite_loss_names_step_and_last_good_checkpoint(tmp_path, capsys, policy, bad_step,
                                                                          log_every, ckpt_every):
    data, first_bad = poisoned_npz(tmp_path / "d.npz", bad_step)
    work = tmp_path / "w"
    code = train_main(tiny_args(data, "data.normalize=false", f"precision.policy={policy}", "train.steps=12",
                                f"logging.log_every={log_every}", f"checkpoint.every={ckpt_every}",
                                "checkpoint.keep=10", "--workdir", str(work)))
    err = capsys.readouterr().err.strip().splitlines()
    last_good = (first_bad - 1) // ckpt_every * ckpt_every
    assert code == 1, err
    assert err == [f"jaxcnn-train: stopped: non-finite loss at step {first_bad}; train.nan_policy is 'stop'; "
                   f"last good checkpoint: {work / 'checkpoints' / str(last_good)}"]
    finite = checkpoint_params_finite(work)
    # No checkpoint of a step at or after the bad one: the one named is the newest, and it is clean.
    assert max(finite) == last_good and all(finite.values()), finite
    losses = {r["step"]: r["loss"] for r in read_metrics(work) if r["kind"] == "train"}
    assert all(math.isfinite(float(v)) for v in losses.values())  # nothing non-finite was logged as a result
    assert not (work / "params.npz").exists()


def test_nan_policy_skip_leaves_the_bad_steps_out(tmp_path, capsys):
    data, first_bad = poisoned_npz(tmp_path / "d.npz", 2)
    work = tmp_path / "w"
    # 12 steps over 8-step epochs: the poisoned image comes again in the second epoch, if at all.
    bad_steps = [s + 1 for s in range(12) if np.isin(batch_indices(N_TRAIN, BATCH, 0, 2)[3],
                                                      batch_indices(N_TRAIN, BATCH, 0, s))]
    code = train_main(tiny_args(data, "data.normalize=false", "train.nan_policy=skip", "train.steps=12",
                                "checkpoint.every=4", "--workdir", str(work)))
    assert code == 0, capsys.readouterr().err
    records = [r for r in read_metrics(work) if r["kind"] == "train"]
    assert [r["step"] for r in records if not math.isfinite(float(r["loss"]))] == bad_steps
    assert records[-1]["skipped"] == len(bad_steps) and first_bad in bad_steps
    assert all(checkpoint_params_finite(work).values())
    from jaxcnn.interop import load_npz
    params, _ = load_npz(work / "params.npz")
    assert all(np.isfinite(np.asarray(v)).all() for v in _leaves(params))


def test_fp16_gradient_overflow_is_skipped_not_stopped(tmp_path, capsys):
    """Under fp16 the dynamic loss scale starts too high on purpose: scaled gradients overflow
    float16, those steps are skipped with the scale halved, and training carries on (nan_policy stop)."""
    from reliability_lib import tiny_npz
    data = tiny_npz(tmp_path / "d.npz")
    work = tmp_path / "w"
    code = train_main(tiny_args(data, "precision.policy=fp16", f"precision.loss_scale_init={2.0 ** 24}",
                                "train.steps=20", "checkpoint.every=10", "--workdir", str(work)))
    assert code == 0, capsys.readouterr().err
    records = [r for r in read_metrics(work) if r["kind"] == "train"]
    assert all(math.isfinite(float(r["loss"])) for r in records)
    skips = [r["skipped"] for r in records]
    lead = next(i for i, n in enumerate(skips) if n != i + 1)  # overflowing steps at the start
    # 2**24 times the loss gradient overflows float16 (max 65504): the scale halves until it fits.
    assert lead >= 2 and skips[-1] <= 14, skips
    assert [r["loss_scale"] for r in records[:lead + 1]] == [2.0 ** (24 - i) for i in range(lead + 1)]
    losses = [r["loss"] for r in records]
    assert np.mean(losses[-3:]) < np.mean(losses[lead:lead + 3]) - 0.2  # it trains after the skips


def _leaves(tree):
    for value in tree.values():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield value


@pytest.mark.parametrize("normalize", [False, True])
def test_training_batches_follow_data_normalize_like_evaluation(tmp_path, normalize):
    """``data.normalize: false`` used to be ignored by training batches (evaluation honoured it),
    which also hid the poisoned image above behind normalisation statistics."""
    from jaxcnn.data import normalize as normalise, to_unit_scale
    from jaxcnn.train.config import load_config
    from jaxcnn.train._data import batch_fn
    from jaxcnn.train._build import build_run
    from reliability_lib import tiny_npz
    args = tiny_args(tiny_npz(tmp_path / "d.npz"), f"data.normalize={str(normalize).lower()}", "train.steps=4",
                     "data.augment.crop_padding=0")
    run = build_run(load_config(args[0], args[1:]))
    images = run.dataset.x_train[batch_indices(N_TRAIN, BATCH, 0, 3)]
    expected = normalise(images, run.dataset.mean, run.dataset.std) if normalize else to_unit_scale(images)
    np.testing.assert_array_equal(batch_fn(run)(3)["image"], expected)
