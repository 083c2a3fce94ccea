"""EMA of the parameters, gradient accumulation, mixup/CutMix and early stopping: each against
what it computes (a NumPy recurrence, one large batch, a NumPy reference of the mixing, the
CutMix box's area), and each through a kill-and-resume with bitwise-equal results.

Tolerances: float32 throughout. Accumulated gradients against one large batch: 2e-6 relative
(the same sums in another order); the EMA recurrence: 1e-6 relative (float32 rounding of
``d * a + (1 - d) * p``); mixup: 1e-6 (float32, fused multiply-adds allowed); CutMix: exact
(copies).
"""
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcnn import layers as L
from jaxcnn import precision as P
from jaxcnn.data import mix as mixing
from jaxcnn.train.cli import train_main
from jaxcnn.train.ema import ema, eval_params, find_ema
from jaxcnn.train._loop import EarlyStopping
from jaxcnn.train.metrics import read_metrics
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_train_step

from reliability.reliability_lib import assert_params_bitwise_equal, tiny_args, tiny_npz


def _small_model(classes=3):
    """Conv -> ReLU -> flatten -> linear: no BatchNorm, so micro-batches change nothing."""
    return L.serial(L.Conv2D(4, 3, padding=1), L.Relu(), L.Flatten(), L.Linear(classes))


def _batch(rng, n=8, hw=6, c=2, classes=3):
    return {"image": rng.standard_normal((n, hw, hw, c)).astype(np.float32),
            "label": rng.integers(0, classes, n).astype(np.int32)}


def _state(model, tx, shape, seed=0):
    return create_train_state(model, tx, jax.random.PRNGKey(seed), shape,
                              loss_scale=P.make_loss_scale("none"))


# -- gradient accumulation ---------------------------------------------------------------------

@pytest.mark.parametrize("k", [2, 4])
def test_accumulated_micro_batches_equal_one_large_batch(k):
    rng = np.random.default_rng(0)
    model, tx = _small_model(), optax.sgd(0.1, momentum=0.9)
    batch = _batch(rng)
    state = _state(model, tx, batch["image"].shape)
    big = jax.jit(make_train_step(model, tx).step)
    micro = jax.jit(make_train_step(model, tx, accumulate=k).step)
    s1, s2 = state, state
    for _ in range(3):
        s1, m1 = big(s1, batch)
        s2, m2 = micro(s2, batch)
    for a, b in zip(jax.tree_util.tree_leaves(s1.params), jax.tree_util.tree_leaves(s2.params)):
        np.testing.assert_allclose(b, a, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=2e-6)
    np.testing.assert_allclose(m2["top1"], m1["top1"], rtol=0, atol=1e-7)


def test_accumulation_needs_a_divisible_batch():
    model, tx = _small_model(), optax.sgd(0.1)
    batch = _batch(np.random.default_rng(0), n=6)
    state = _state(model, tx, batch["image"].shape)
    with pytest.raises(ValueError, match="accumulate_steps: 4 does not divide the batch of 6"):
        jax.jit(make_train_step(model, tx, accumulate=4).step)(state, batch)


def test_accumulation_runs_batch_norm_once_per_micro_batch():
    """The running statistics see k micro-batches in turn (PyTorch's behaviour when gradients
    are accumulated): momentum is applied k times, each with that micro-batch's statistics."""
    rng = np.random.default_rng(1)
    model = L.serial(L.BatchNorm(momentum=0.5), L.Flatten(), L.Linear(3))
    tx = optax.sgd(0.0)
    batch = _batch(rng, n=4, hw=2, c=1)
    state = _state(model, tx, batch["image"].shape)
    new, _ = jax.jit(make_train_step(model, tx, accumulate=2).step)(state, batch)
    x = batch["image"][..., 0]
    mean = 0.0
    for part in (x[0::2], x[1::2]):  # example i in micro-batch i % 2
        mean = 0.5 * mean + 0.5 * part.mean()
    (running,) = [v for k, v in _flat(new.state).items() if k.endswith("mean")]
    np.testing.assert_allclose(np.ravel(running), [mean], rtol=1e-6)


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = np.asarray(v)
    return out


# -- EMA ----------------------------------------------------------------------------------------

def test_ema_follows_the_numpy_recurrence():
    rng = np.random.default_rng(2)
    model, decay = _small_model(), 0.8
    tx = optax.chain(optax.adam(0.05), ema(decay))
    batch = _batch(rng)
    state = _state(model, tx, batch["image"].shape)
    step = jax.jit(make_train_step(model, tx).step)
    expect = [np.asarray(p, np.float64) for p in jax.tree_util.tree_leaves(state.params)]
    for _ in range(5):
        state, _ = step(state, batch)
        params = jax.tree_util.tree_leaves(state.params)
        expect = [decay * e + (1 - decay) * np.asarray(p, np.float64) for e, p in zip(expect, params)]
    got = jax.tree_util.tree_leaves(find_ema(state.opt_state))
    for g, e, p in zip(got, expect, jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_allclose(g, e, rtol=1e-6, atol=1e-7)
        assert not np.allclose(g, p)  # the average is not the parameters
    assert eval_params(state) is find_ema(state.opt_state)
    assert find_ema(_state(model, optax.adam(0.1), batch["image"].shape).opt_state) is None
    with pytest.raises(ValueError, match="decay must be in"):
        ema(1.0)


def test_ema_under_a_master_copy_averages_the_float32_master():
    policy = P.get_policy("bf16_params")
    model = _small_model()
    tx = optax.chain(optax.sgd(0.1), ema(0.5))
    batch = _batch(np.random.default_rng(3))
    state = create_train_state(model, tx, jax.random.PRNGKey(0), batch["image"].shape,
                               loss_scale=P.make_loss_scale("none"), policy=policy)
    state, _ = jax.jit(make_train_step(model, tx, policy=policy).step)(state, batch)
    averaged = find_ema(state.opt_state)
    assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(averaged))
    out = eval_params(state, policy)
    assert [x.dtype for x in jax.tree_util.tree_leaves(out)] == \
        [x.dtype for x in jax.tree_util.tree_leaves(state.params)]


# -- mixup / CutMix -------------------------------------------------------------------------------

def _numpy_mix(images, labels, kind, lam, centre):
    """The reference: timm's batch-mode mixup and cutmix (rand_bbox, correct_lam), as loops."""
    n, h, w, _ = images.shape
    out = images.copy()
    if kind == 1:
        for i in range(n):
            out[i] = np.float32(lam) * images[i] + np.float32(1 - lam) * images[n - 1 - i]
        return out, labels, labels[::-1], np.float32(lam)
    if kind == 2:
        ratio = np.sqrt(1.0 - np.float32(lam))
        cut_h, cut_w = int(np.float32(h) * ratio), int(np.float32(w) * ratio)
        cy, cx = centre
        top, bottom = np.clip(cy - cut_h // 2, 0, h), np.clip(cy + cut_h // 2, 0, h)
        left, right = np.clip(cx - cut_w // 2, 0, w), np.clip(cx + cut_w // 2, 0, w)
        for i in range(n):
            for r in range(top, bottom):
                for c in range(left, right):
                    out[i, r, c] = images[n - 1 - i, r, c]
        area = (bottom - top) * (right - left)
        return out, labels, labels[::-1], np.float32(1 - area / (h * w))
    return out, labels, labels[::-1], np.float32(1.0)


@pytest.mark.parametrize("kind, lam, centre", [(0, 1.0, (0, 0)), (1, 0.3, (0, 0)), (2, 0.6, (3, 5)),
                                               (2, 0.2, (0, 6)), (2, 0.05, (6, 1))])
def test_mixing_matches_the_reference(kind, lam, centre):
    rng = np.random.default_rng(4)
    images = rng.standard_normal((4, 7, 8, 3)).astype(np.float32)
    labels = rng.integers(0, 10, 4).astype(np.int32)
    drawn = mixing.MixDraw(jnp.int32(kind), jnp.float32(lam), jnp.asarray(centre, jnp.int32))
    got = jax.jit(mixing.apply)(images, labels, drawn)
    want = _numpy_mix(images, labels, kind, lam, centre)
    if kind == 1:  # XLA may contract lam * x + (1 - lam) * y into fused multiply-adds
        np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-6)
    else:  # copies: exact
        np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    np.testing.assert_array_equal(got[2], want[2])
    np.testing.assert_allclose(got[3], want[3], rtol=1e-6)


# Typed keys with both kinds on only: that branch alone turns keys into data and back.
@pytest.mark.parametrize("make_key, mixup_alpha, cutmix_alpha", [
    (jax.random.PRNGKey, 0.4, 0.7), (jax.random.key, 0.4, 0.7), (jax.random.PRNGKey, 0.4, 0.0),
    (jax.random.PRNGKey, 0.0, 0.7), (jax.random.PRNGKey, 0.0, 0.0)],
    ids=["both", "both-typed-key", "mixup", "cutmix", "off"])
def test_lam_is_the_chosen_kinds_beta_draw_from_its_key(make_key, mixup_alpha, cutmix_alpha):
    """``lam`` is Beta(alpha, alpha) of the batch's kind from that kind's key (mixup's the second
    of the five keys, CutMix's the third); 1 when nothing is mixed; with either kind off or both,
    with raw and typed keys.  With one kind on, bit for bit the draw of that kind's constant
    alpha; with both, one draw whose alpha is picked at run time, which XLA does not fold as it
    folds a constant's: to float32 rounding (a wrong key or alpha gives another value)."""
    spec = mixing.MixSpec(mixup_alpha=mixup_alpha, mixup_prob=0.5, cutmix_alpha=cutmix_alpha, cutmix_prob=0.3)
    keys = jax.random.split(make_key(1), 64)

    def with_references(key):
        _, k_mix, k_cut, _, _ = jax.random.split(key, 5)
        mix = jax.random.beta(k_mix, mixup_alpha, mixup_alpha) if mixup_alpha else jnp.float32(1)
        cut = jax.random.beta(k_cut, cutmix_alpha, cutmix_alpha) if cutmix_alpha else jnp.float32(1)
        return mixing.draw(key, spec, (8, 8)), mix, cut
    draws, lam_mix, lam_cut = jax.jit(jax.vmap(with_references))(keys)
    kinds, lam = np.asarray(draws.kind), np.asarray(draws.lam)
    assert lam.dtype == np.float32 and set(np.unique(kinds)) <= (
        {0} | ({1} if mixup_alpha else set()) | ({2} if cutmix_alpha else set()))
    assert np.all(lam[kinds == 0] == 1.0)
    check = (np.testing.assert_array_equal if not (mixup_alpha and cutmix_alpha) else
             lambda got, want: np.testing.assert_allclose(got, want, rtol=2e-6, atol=0))
    check(lam[kinds == 1], np.asarray(lam_mix)[kinds == 1])
    check(lam[kinds == 2], np.asarray(lam_cut)[kinds == 2])
    if mixup_alpha or cutmix_alpha:
        assert np.any(kinds != 0) and np.all((lam[kinds != 0] > 0) & (lam[kinds != 0] < 1))


def test_draws_pick_each_kind_at_its_probability_and_the_box_area_is_one_minus_lam():
    """Also: with both kinds on, lam is what separate draws give (to float32 rounding: see the
    test above), Beta(mixup_alpha) from the mixup key on a mixup batch and Beta(cutmix_alpha)
    from the cutmix key on a CutMix batch."""
    spec = mixing.MixSpec(mixup_alpha=0.4, mixup_prob=0.3, cutmix_alpha=1.0, cutmix_prob=0.5)
    keys = jax.random.split(jax.random.PRNGKey(0), 4000)

    def with_references(key):
        _, k_mix, k_cut, _, _ = jax.random.split(key, 5)
        return (mixing.draw(key, spec, (32, 32)), jax.random.beta(k_mix, 0.4, 0.4),
                jax.random.beta(k_cut, 1.0, 1.0))
    draws, lam_mix, lam_cut = jax.jit(jax.vmap(with_references))(keys)  # eager: 26 compilations
    kinds = np.asarray(draws.kind)
    for kind, p in ((0, 0.2), (1, 0.3), (2, 0.5)):
        assert abs(np.mean(kinds == kind) - p) < 0.03, (kind, np.mean(kinds == kind))
    lam = np.asarray(draws.lam)
    assert np.all(lam[kinds == 0] == 1.0)
    np.testing.assert_allclose(lam[kinds == 1], np.asarray(lam_mix)[kinds == 1], rtol=2e-6, atol=0)
    np.testing.assert_allclose(lam[kinds == 2], np.asarray(lam_cut)[kinds == 2], rtol=2e-6, atol=0)
    assert abs(lam[kinds == 1].mean() - 0.5) < 0.03  # Beta(a, a) has mean 1/2
    # Unclipped boxes (centre far from the border, small boxes) cover 1 - lam of the image, up to
    # the rounding of their sides to whole, even pixels.
    box = jax.jit(jax.vmap(lambda l, c: mixing.cutmix_box(l, c, (32, 32))))(draws.lam, draws.centre)
    top, bottom, left, right = (np.asarray(b) for b in box)
    ratio = np.sqrt(1 - lam)
    sides = (np.floor(32 * ratio) // 2) * 2
    whole = (kinds == 2) & (top > 0) & (left > 0) & (bottom < 32) & (right < 32)
    assert whole.sum() > 100
    np.testing.assert_array_equal((bottom - top)[whole], sides[whole])
    area = ((bottom - top) * (right - left))[whole] / 32**2
    assert np.all(np.abs(area - (1 - lam[whole])) <= 2 * 2 * ratio[whole] / 32 + 4 / 32**2)


def test_mixed_loss_is_the_cross_entropy_against_the_mixed_target():
    """A mixed step's loss equals the soft-target cross-entropy (label smoothing included)."""
    from jaxcnn import functional as F
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.standard_normal((6, 5)), jnp.float32)
    a, b = rng.integers(0, 5, 6), rng.integers(0, 5, 6)
    lam, eps = 0.35, 0.1
    mixed = lam * F.cross_entropy(logits, a, label_smoothing=eps) + \
        (1 - lam) * F.cross_entropy(logits, b, label_smoothing=eps)
    target = lam * np.eye(5)[a] + (1 - lam) * np.eye(5)[b]
    target = (1 - eps) * target + eps / 5
    ref = -np.mean(np.sum(target * np.asarray(jax.nn.log_softmax(logits)), axis=-1))
    np.testing.assert_allclose(mixed, ref, rtol=1e-6)


# -- early stopping -------------------------------------------------------------------------------

def test_early_stopping_counts_evaluations_without_improvement():
    es = EarlyStopping("top1", patience=2, min_delta=0.01)
    assert [es.update({"top1": v}) for v in (0.5, 0.505, 0.6, 0.6, 0.59)] == \
        [False, False, False, False, True]
    low = EarlyStopping("loss", patience=1, min_delta=0.0)
    assert [low.update({"loss": v}) for v in (1.0, 0.9, 0.95)] == [False, False, True]
    replayed = EarlyStopping("top1", patience=2, min_delta=0.0)
    replayed.replay([{"kind": "train", "step": 1, "loss": 1.0}, {"kind": "eval", "step": 2, "top1": 0.5},
                     {"kind": "eval", "step": 4, "top1": 0.4}, {"kind": "eval", "step": 6, "top1": 0.3}],
                    upto=4)
    assert (replayed.best, replayed.bad, replayed.stopped) == (0.5, 1, False)


# -- through jaxcnn-train: config, and kill-and-resume bitwise ----------------------------------------

FEATURES = {
    "ema+accumulate+mix": ["mesh.data=2", "train.ema_decay=0.9", "train.accumulate_steps=2",
                           "data.augment.mixup.alpha=0.4", "data.augment.mixup.prob=0.5",
                           "data.augment.cutmix.alpha=1.0", "data.augment.cutmix.prob=0.5"],
    # lr so small nothing improves: evaluations at steps 2, 4, 6; the run stops at 6 of 12
    "early_stopping": ["optim.lr=1e-12", "train.eval_every=2", "train.early_stopping.patience=2"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return tiny_npz(tmp_path_factory.mktemp("data") / "tiny.npz")


# A checkpoint every 4 steps (about 0.3 s a save): step 4's is the one resumed from, and the
# EMA case restores step 12's.
def _args(data, workdir, extra):
    return tiny_args(data, "train.steps=12", "checkpoint.every=4", "checkpoint.keep=10", *extra,
                     "--workdir", str(workdir))


@pytest.mark.parametrize("name", list(FEATURES))
def test_a_resumed_run_ends_bitwise_equal(data, tmp_path, capsys, name):
    """A run with the feature, and the same run resumed from its checkpoint at step 4 (what a
    kill after that checkpoint leaves), end with identical parameters and records."""
    ref = tmp_path / "ref"
    assert train_main(_args(data, ref, FEATURES[name])) == 0
    out = capsys.readouterr().out
    work = tmp_path / "resumed"
    shutil.copytree(ref, work)
    for step in os.listdir(work / "checkpoints"):
        if step.isdigit() and int(step) > 4:
            shutil.rmtree(work / "checkpoints" / step)
    os.remove(work / "params.npz")
    assert train_main(_args(data, work, FEATURES[name])) == 0
    resumed = capsys.readouterr().out
    assert "resumed from step 4" in resumed
    assert_params_bitwise_equal(ref / "params.npz", work / "params.npz")
    evals = [(r["step"], r["top1"]) for r in read_metrics(str(ref)) if r["kind"] == "eval"]
    assert evals == [(r["step"], r["top1"]) for r in read_metrics(str(work)) if r["kind"] == "eval"]
    if name == "early_stopping":
        assert "early stopping at step 6" in out and "early stopping at step 6" in resumed
        assert [s for s, _ in evals] == [2, 4, 6]
        assert "final eval at step 6" in resumed
        # the early-stopping evaluation is the final one, and its per-class report is recorded
        assert [r["step"] for r in read_metrics(str(ref)) if r["kind"] == "per_class"] == [6]
    else:  # the exported parameters are the moving average
        from jaxcnn.interop import load_npz
        from jaxcnn.train.checkpoint import CheckpointManager
        from jaxcnn.train.config import load_config
        from jaxcnn.train._build import abstract_state, build_run
        run = build_run(load_config(str(ref / "config.resolved.yaml")))
        manager = CheckpointManager(str(ref / "checkpoints"), read_only=True, step_leaf="step")
        _, state = manager.restore(12, target=abstract_state(run))
        manager.close()
        saved = load_npz(str(ref / "params.npz"))[0]
        for a, b in zip(jax.tree_util.tree_leaves(saved),
                        jax.tree_util.tree_leaves(find_ema(state.opt_state))):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("extra, needle", [
    (["data.augment.mixup.alpha=0.2", "data.augment.cutmix.alpha=1"],
     "data.augment.mixup.prob: 1 + data.augment.cutmix.prob 1 is more than 1"),
    (["mesh.data=2", "train.accumulate_steps=3"], "train.accumulate_steps: 3 does not divide the 4 "
                                                  "examples of each device's batch"),
    (["train.early_stopping.patience=2"], "train.early_stopping.patience: early stopping watches "
                                          "evaluations, and train.eval_every is null"),
    (["train.ema_decay=1"], "train.ema_decay"),
])
def test_feature_settings_that_cannot_run_are_one_line(data, tmp_path, capsys, extra, needle):
    code = train_main(tiny_args(data, "train.steps=2", *extra, "--dry-run"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
