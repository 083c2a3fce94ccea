"""Tests of jaxcnn.train.optim: optimisers against independent references,
schedules against closed forms, the weight-decay mask and gradient clipping."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxcnn.train.config import ConfigError, config_from_dict
from jaxcnn.train.optim import build_optimizer, build_schedule, weight_decay_mask

MINIMAL = {"model": {"name": "m"}, "train": {"steps": 10}}
# float32 updates against float64 references, a few steps: relative error ~1e-6.
RTOL, ATOL = 2e-5, 1e-7


def optim_cfg(*overrides):
    return config_from_dict(MINIMAL, list(overrides)).optim


def make_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"conv": {"w": (3, 3, 2, 4), "b": (4,)}, "bn": {"scale": (4,), "bias": (4,)}, "fc": {"w": (6, 3)}}
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                                  is_leaf=lambda s: isinstance(s, tuple))


def grads_for(step, params):
    rng = np.random.default_rng(100 + step)
    return jax.tree_util.tree_map(lambda p: rng.standard_normal(p.shape).astype(np.float32), params)


def run_steps(tx, params, steps):
    """Apply ``tx`` for ``steps`` steps of the fixed gradient sequence (eagerly:
    cheaper than compiling for a few steps of tiny arrays)."""
    state = tx.init(params)
    for t in range(steps):
        updates, state = tx.update(grads_for(t, params), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def reference_steps(step_fn, params, steps):
    """Float64 numpy loop: ``step_fn(t, p, g, slots, decayed) -> p`` per leaf."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    leaves = [np.asarray(p, np.float64) for p in leaves]
    slots = [{} for _ in leaves]
    for t in range(steps):
        grads = jax.tree_util.tree_leaves(grads_for(t, params))
        leaves = [step_fn(t, p, np.asarray(g, np.float64), s, p.ndim > 1)
                  for p, g, s in zip(leaves, grads, slots)]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
    jax.tree_util.tree_map(lambda a, e: np.testing.assert_allclose(np.asarray(a, np.float64), e,
                                                                   rtol=rtol, atol=atol), actual, expected)


# ------------------------------------------------------------- optimisers

def torch_sgd_step(lr, momentum, nesterov, wd):
    # PyTorch SGD (dampening 0): L2 added to the gradient, then momentum.
    def step(t, p, g, slot, decayed):
        d = g + (wd * p if decayed else 0.0)
        if momentum:
            slot["buf"] = d if t == 0 else momentum * slot["buf"] + d
            d = d + momentum * slot["buf"] if nesterov else slot["buf"]
        return p - lr * d
    return step


def adam_step(lr, b1, b2, eps, wd, decoupled):
    def step(t, p, g, slot, decayed):
        if not decoupled and decayed:
            g = g + wd * p
        slot["m"] = b1 * slot.get("m", 0.0) + (1 - b1) * g
        slot["v"] = b2 * slot.get("v", 0.0) + (1 - b2) * g * g
        m_hat = slot["m"] / (1 - b1 ** (t + 1))
        v_hat = slot["v"] / (1 - b2 ** (t + 1))
        update = m_hat / (np.sqrt(v_hat) + eps)
        if decoupled and decayed:
            update = update + wd * p
        return p - lr * update
    return step


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_pytorch_semantics(momentum, nesterov):
    cfg = optim_cfg("optim.name=sgd", "optim.lr=0.1", f"optim.momentum={momentum}",
                    f"optim.nesterov={str(nesterov).lower()}", "optim.weight_decay=0.01")
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    params = make_params()
    actual, _ = run_steps(tx, params, 4)
    assert_trees_close(actual, reference_steps(torch_sgd_step(0.1, momentum, nesterov, 0.01), params, 4))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_family_matches_reference(name):
    cfg = optim_cfg(f"optim.name={name}", "optim.lr=0.01", "optim.b1=0.8", "optim.b2=0.99",
                    "optim.eps=1e-6", "optim.weight_decay=0.05")
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    params = make_params()
    actual, _ = run_steps(tx, params, 4)
    expected = reference_steps(adam_step(0.01, 0.8, 0.99, 1e-6, 0.05, decoupled=name == "adamw"), params, 4)
    assert_trees_close(actual, expected)


def test_sgd_adam_adamw_match_torch():
    torch = pytest.importorskip("torch")
    params = make_params()
    for name, overrides, make in [
        ("sgd", ["optim.momentum=0.9", "optim.nesterov=true"],
         lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9, nesterov=True)),
        ("adam", [], lambda groups: torch.optim.Adam(groups, lr=0.01, eps=1e-8)),
        ("adamw", [], lambda groups: torch.optim.AdamW(groups, lr=0.01, eps=1e-8)),
    ]:
        lr = 0.1 if name == "sgd" else 0.01
        cfg = optim_cfg(f"optim.name={name}", f"optim.lr={lr}", "optim.weight_decay=0.02", *overrides)
        tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
        actual, _ = run_steps(tx, params, 3)
        leaves, treedef = jax.tree_util.tree_flatten(params)
        tensors = [torch.tensor(np.asarray(p), dtype=torch.float64, requires_grad=True) for p in leaves]
        opt = make([{"params": [t for t in tensors if t.ndim > 1], "weight_decay": 0.02},
                    {"params": [t for t in tensors if t.ndim <= 1], "weight_decay": 0.0}])
        for step in range(3):
            for t, g in zip(tensors, jax.tree_util.tree_leaves(grads_for(step, params))):
                t.grad = torch.tensor(np.asarray(g), dtype=torch.float64)
            opt.step()
        expected = jax.tree_util.tree_unflatten(treedef, [t.detach().numpy() for t in tensors])
        assert_trees_close(actual, expected)


@pytest.mark.parametrize("masked", [True, False])
def test_lars_and_lamb_match_optax_aliases(masked):
    params = make_params()
    mask = weight_decay_mask if masked else None
    flag = f"optim.mask_weight_decay={str(masked).lower()}"
    cfg = optim_cfg("optim.name=lars", "optim.lr=0.5", "optim.momentum=0.8", "optim.nesterov=true",
                    "optim.weight_decay=0.01", "optim.trust_coefficient=0.002", "optim.eps=1e-9", flag)
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    ref = optax.lars(0.5, weight_decay=0.01, weight_decay_mask=mask or True, trust_coefficient=0.002,
                     eps=1e-9, trust_ratio_mask=mask or True, momentum=0.8, nesterov=True)
    assert_trees_close(run_steps(tx, params, 3)[0], run_steps(ref, params, 3)[0], rtol=1e-6)
    cfg = optim_cfg("optim.name=lamb", "optim.lr=0.01", "optim.b1=0.85", "optim.eps=1e-6",
                    "optim.weight_decay=0.01", flag)
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    ref = optax.lamb(0.01, b1=0.85, eps=1e-6, weight_decay=0.01, mask=mask)
    assert_trees_close(run_steps(tx, params, 3)[0], run_steps(ref, params, 3)[0], rtol=1e-6)


def test_lars_trust_ratio_by_hand():
    # One step, no momentum history yet: update = -lr * tc * |p| / |g + wd p| * (g + wd p).
    params = make_params()
    cfg = optim_cfg("optim.name=lars", "optim.lr=0.5", "optim.weight_decay=0.01", "optim.eps=0")
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    updates, _ = tx.update(grads_for(0, params), tx.init(params), params)
    w, g = np.float64(params["fc"]["w"]), np.float64(grads_for(0, params)["fc"]["w"])
    d = g + 0.01 * w
    np.testing.assert_allclose(updates["fc"]["w"], -0.5 * 1e-3 * np.linalg.norm(w) / np.linalg.norm(d) * d,
                               rtol=RTOL)
    # Masked leaves: plain momentum SGD step, no decay, no trust ratio.
    np.testing.assert_allclose(updates["conv"]["b"], -0.5 * grads_for(0, params)["conv"]["b"], rtol=RTOL)


@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lars", "lamb"])
def test_mu_dtype_sets_first_moment_dtype(name):
    params = make_params()
    for mu, dtype in [("bf16", jnp.bfloat16), ("f32", jnp.float32)]:
        tx, _ = build_optimizer(optim_cfg(f"optim.name={name}", f"optim.mu_dtype={mu}"),
                                total_steps=10, steps_per_epoch=None)
        _, state = run_steps(tx, params, 2)
        moments = [leaf for path, leaf in jax.tree_util.tree_leaves_with_path(state)
                   if any(getattr(k, "name", None) in ("mu", "trace") for k in path)]
        assert len(moments) == len(jax.tree_util.tree_leaves(params)), name
        assert all(m.dtype == dtype for m in moments), (name, mu, {m.dtype for m in moments})


# -------------------------------------------------------------- schedules

def schedule_values(overrides, total, steps_per_epoch=None, lr=0.1):
    cfg = optim_cfg(f"optim.lr={lr}", *overrides)
    schedule = build_schedule(cfg.lr, cfg.schedule, total_steps=total, steps_per_epoch=steps_per_epoch)
    values = np.asarray(jax.jit(jax.vmap(schedule))(jnp.arange(total + 1)))
    np.testing.assert_array_equal(values[[0, total]], [float(schedule(0)), float(schedule(total))])  # scalar too
    return values


def test_constant_with_warmup():
    values = schedule_values(["optim.schedule.warmup=4", "optim.schedule.warmup_init_fraction=0.2"], 10)
    expected = [0.1 * (0.2 + 0.8 * min(t / 4, 1)) for t in range(11)]
    np.testing.assert_allclose(values, expected, rtol=1e-6)
    np.testing.assert_allclose(schedule_values([], 5), 0.1, rtol=1e-7)


def test_step_schedule_in_epochs():
    values = schedule_values(["optim.schedule.name=step", "optim.schedule.decay_every=2ep",
                              "optim.schedule.decay_rate=0.5"], 30, steps_per_epoch=5)
    np.testing.assert_allclose(values, [0.1 * 0.5 ** (t // 10) for t in range(31)], rtol=1e-6)


def test_multistep_drops_at_milestones_after_warmup():
    values = schedule_values(["optim.schedule.name=multistep", "optim.schedule.milestones=[6, 2ep]",
                              "optim.schedule.decay_rate=0.1", "optim.schedule.warmup=2"], 20, steps_per_epoch=6)
    expected = [0.1 * min(t / 2, 1) * 0.1 ** ((t >= 6) + (t >= 12)) for t in range(21)]
    np.testing.assert_allclose(values, expected, rtol=1e-5)
    assert values[5] == pytest.approx(0.1) and values[6] == pytest.approx(0.01) and values[12] == pytest.approx(1e-3)


def test_cosine_with_warmup_closed_form():
    total, warmup, lr, final = 100, 10, 0.4, 0.05
    values = schedule_values(["optim.schedule.name=cosine", f"optim.schedule.warmup={warmup}",
                              f"optim.schedule.final_lr_fraction={final}"], total, lr=lr)
    for t in (0, 3, 10, 11, 40, 55, 99, 100):
        if t < warmup:
            expected = lr * t / warmup
        else:
            expected = lr * final + (lr - lr * final) * 0.5 * (1 + math.cos(math.pi * (t - warmup) / (total - warmup)))
        assert values[t] == pytest.approx(expected, rel=1e-5, abs=1e-7), t
    assert values.max() == pytest.approx(lr) and values[-1] == pytest.approx(lr * final)


def test_onecycle_closed_form():
    total, lr, pct, div, final_div = 50, 0.2, 0.3, 25.0, 1e4
    values = schedule_values(["optim.schedule.name=onecycle", f"optim.schedule.pct_start={pct}",
                              f"optim.schedule.div_factor={div}", f"optim.schedule.final_div_factor={final_div}"],
                             total, lr=lr)
    peak_at, start, end = int(pct * total), lr / div, lr / div / final_div

    def cos_interp(a, b, frac):
        return b + (a - b) * 0.5 * (1 + math.cos(math.pi * frac))

    for t in range(total + 1):
        if t <= peak_at:
            expected = cos_interp(start, lr, t / peak_at)
        else:
            expected = cos_interp(lr, end, (t - peak_at) / (total - peak_at))
        assert values[t] == pytest.approx(expected, rel=1e-5, abs=1e-9), t


def test_optimizer_uses_schedule_per_step():
    # Plain SGD under jit: the update of step t is exactly -schedule(t) * g.
    cfg = optim_cfg("optim.name=sgd", "optim.momentum=0", "optim.lr=0.3", "optim.schedule.name=cosine",
                    "optim.schedule.warmup=0.5ep")
    tx, schedule = build_optimizer(cfg, total_steps=12, steps_per_epoch=4)
    params = {"w": jnp.ones((2, 2))}
    state = tx.init(params)
    update = jax.jit(tx.update)
    for t in range(12):
        g = {"w": jnp.full((2, 2), 1.0 + t)}
        updates, state = update(g, state, params)
        # float32 under jit (fused cos) vs eager: a few ulps apart.
        np.testing.assert_allclose(updates["w"], -float(schedule(t)) * (1.0 + t), rtol=1e-5)
    assert float(schedule(1)) == pytest.approx(0.15)  # warm-up of 0.5ep = 2 steps


@pytest.mark.parametrize("overrides, total, spe, fragment", [
    (["optim.schedule.warmup=2ep"], 10, 8, "does not fit in a run of 10 steps"),
    (["optim.schedule.name=cosine", "optim.schedule.warmup=10"], 10, None, "does not fit"),
    (["optim.schedule.name=multistep", "optim.schedule.milestones=[1ep, 5]"], 20, 5, "expected increasing"),
    (["optim.schedule.warmup=1ep"], 10, None, "steps_per_epoch=None"),
])
def test_schedule_errors(overrides, total, spe, fragment):
    with pytest.raises(ConfigError, match=fragment):
        build_optimizer(optim_cfg(*overrides), total_steps=total, steps_per_epoch=spe)


def test_schedule_rejects_bad_total_steps():
    with pytest.raises(ConfigError, match="total_steps"):
        build_optimizer(optim_cfg(), total_steps=0, steps_per_epoch=None)


# ----------------------------------------------- weight-decay mask, clipping

@pytest.mark.parametrize("name", ["sgd", "adam", "adamw", "lamb"])
def test_weight_decay_mask_excludes_vectors(name):
    params = make_params()
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    for masked in (True, False):
        cfg = optim_cfg(f"optim.name={name}", "optim.momentum=0", "optim.weight_decay=0.1",
                        f"optim.mask_weight_decay={str(masked).lower()}")
        tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
        updates, _ = tx.update(zeros, tx.init(params), params)
        for (path, u), p in zip(jax.tree_util.tree_leaves_with_path(updates), jax.tree_util.tree_leaves(params)):
            if masked and p.ndim <= 1:
                assert np.all(np.asarray(u) == 0), (name, path)
            else:
                # Zero gradient: the whole update is the decay term, pointing against the weights.
                assert np.all(np.sign(u) == -np.sign(p)), (name, path)
                decay = 0.1 * np.float64(p)
                if name == "adam":  # L2 term goes through the adaptive scaling: -lr * d / (|d| + eps)
                    np.testing.assert_allclose(u, -1e-3 * decay / (np.abs(decay) + 1e-8), rtol=1e-5)
                elif name != "lamb":  # lamb rescales by the trust ratio
                    np.testing.assert_allclose(u, -1e-3 * decay, rtol=1e-6)


def test_weight_decay_mask_function():
    mask = weight_decay_mask(make_params())
    assert mask == {"conv": {"w": True, "b": False}, "bn": {"scale": False, "bias": False}, "fc": {"w": True}}


def test_clipping_is_applied_first():
    params = make_params()
    grads = jax.tree_util.tree_map(lambda p: 100.0 * jnp.ones_like(p), params)
    norm = float(optax.tree.norm(grads))
    cfg = optim_cfg("optim.name=sgd", "optim.momentum=0", "optim.lr=1", "optim.grad_clip_norm=2.0",
                    "optim.weight_decay=0.5")
    tx, _ = build_optimizer(cfg, total_steps=10, steps_per_epoch=None)
    updates, _ = tx.update(grads, tx.init(params), params)
    # Clip first, then add the (unclipped) L2 term: -(g * 2 / |g| + wd * p) on decayed leaves.
    expected = jax.tree_util.tree_map(lambda g, p: -(g * 2.0 / norm + (0.5 * p if p.ndim > 1 else 0.0)),
                                      grads, params)
    assert_trees_close(updates, expected)
    small = jax.tree_util.tree_map(lambda p: 1e-3 * jnp.ones_like(p), params)
    tx, _ = build_optimizer(optim_cfg("optim.name=sgd", "optim.momentum=0", "optim.lr=1",
                                      "optim.grad_clip_norm=2.0"), total_steps=10, steps_per_epoch=None)
    updates, _ = tx.update(small, tx.init(params), params)
    assert_trees_close(updates, jax.tree_util.tree_map(lambda g: -g, small))  # below the norm: unchanged
