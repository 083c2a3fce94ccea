"""Mixed precision through layers and the trainer: dtypes under every preset,
fp16 overflow skipping, loss-scale checkpointing and bf16 vs fp32 accuracy."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn import precision as P
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import load_config
from jaxcnn.train._build import build_run, init_state
from jaxcnn.train.metrics import read_metrics
from jaxcnn.train.state import MasterCopyState
from jaxcnn.train.step import make_train_step

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "configs")
PRESETS = ["fp32", "bf16", "bf16_params", "fp16"]
FP32_KINDS = {"batch_norm", "layer_norm", "group_norm", "softmax"}

# Every layer type, with an input shape it accepts.
LAYERS = {
    "conv2d": (L.Conv2D(4, 3, padding=1), (2, 6, 6, 3)),
    "conv2d_depthwise": (L.Conv2D(3, 3, groups=3), (2, 6, 6, 3)),
    "conv_transpose2d": (L.ConvTranspose2D(4, 3, stride=2), (2, 5, 5, 3)),
    "linear": (L.Linear(5), (2, 7)),
    "batch_norm": (L.BatchNorm(), (4, 3, 3, 3)),
    "layer_norm": (L.LayerNorm(), (2, 3, 3, 4)),
    "group_norm": (L.GroupNorm(2), (2, 3, 3, 4)),
    "dropout": (L.Dropout(0.5), (2, 8)),
    "max_pool2d": (L.MaxPool2D(2), (2, 4, 4, 3)),
    "avg_pool2d": (L.AvgPool2D(3, stride=2, padding=1), (2, 5, 5, 3)),
    "adaptive_avg_pool2d": (L.AdaptiveAvgPool2D(2), (2, 5, 5, 3)),
    "global_avg_pool2d": (L.GlobalAvgPool2D(), (2, 4, 4, 3)),
    "flatten": (L.Flatten(), (2, 3, 3, 2)),
    "identity": (L.Identity(), (2, 5)),
    "relu": (L.Relu(), (2, 5)), "relu6": (L.Relu6(), (2, 5)), "leaky_relu": (L.LeakyRelu(), (2, 5)),
    "elu": (L.Elu(), (2, 5)), "gelu": (L.Gelu(), (2, 5)), "gelu_tanh": (L.Gelu(approximate=True), (2, 5)),
    "silu": (L.Silu(), (2, 5)), "hardswish": (L.Hardswish(), (2, 5)), "sigmoid": (L.Sigmoid(), (2, 5)),
    "tanh": (L.Tanh(), (2, 5)), "softmax": (L.Softmax(), (2, 5)), "log_softmax": (L.LogSoftmax(), (2, 5)),
    "serial": (L.serial(L.Conv2D(4, 3), L.BatchNorm(), L.Relu()), (2, 5, 5, 3)),
    "residual": (L.residual(L.Conv2D(3, 3, padding=1), L.BatchNorm(), shortcut=L.Identity(),
                            activation=L.Relu()), (2, 5, 5, 3)),
    "parallel": (L.parallel(L.Conv2D(2, 1), L.MaxPool2D(3, stride=1, padding=1)), (2, 5, 5, 3)),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_dtypes_under_every_preset(name):
    """Every preset, checked per preset, from one compiled program per layer (the four
    presets' forwards and gradients side by side): a compile per (layer, preset) cost
    about four times as long, and the dtypes come from tracing, the same either way."""
    layer, shape = LAYERS[name]
    params0, state, out_shape = layer.init(jax.random.PRNGKey(0), shape)
    policies = {preset: P.get_policy(preset) for preset in PRESETS}
    params = {preset: policy.cast_to_param(params0) for preset, policy in policies.items()}
    for preset, policy in policies.items():
        for leaf in jax.tree_util.tree_leaves(params[preset]):
            assert leaf.dtype == policy.param_dtype, (name, preset)
    # Mid-network, activations arrive in the compute dtype.
    x0 = jax.random.normal(jax.random.PRNGKey(1), shape)
    xs = {preset: x0.astype(policy.compute_dtype) for preset, policy in policies.items()}
    rng = jax.random.PRNGKey(2)

    def forward_and_grads(policy, p, x):
        def run(p, x):
            y, new_state = layer.apply(p, state, x, train=True, rng=rng, policy=policy)
            return y, new_state
        return run(p, x), jax.grad(lambda p, x: jnp.sum(run(p, x)[0].astype(jnp.float32)), argnums=(0, 1))(p, x)

    results = jax.jit(lambda params, xs: {
        preset: forward_and_grads(policy, params[preset], xs[preset])
        for preset, policy in policies.items()})(params, xs)
    for preset, policy in policies.items():
        (y, new_state), grads = results[preset]
        assert y.shape == out_shape, (name, preset)
        assert y.dtype == policy.compute_dtype, (name, preset, y.dtype)
        for leaf in jax.tree_util.tree_leaves(new_state):  # BatchNorm statistics stay float32
            if jnp.issubdtype(leaf.dtype, jnp.floating):
                assert leaf.dtype == jnp.float32, (name, preset)
        for leaf in jax.tree_util.tree_leaves(grads[0]):
            assert leaf.dtype == policy.param_dtype, (name, preset)
        assert grads[1].dtype == policy.compute_dtype, (name, preset)
        assert all(np.all(np.isfinite(np.asarray(g, np.float32)))
                   for g in jax.tree_util.tree_leaves(grads)), (name, preset)


def test_norm_layers_compute_in_float32_under_bf16():
    """A bf16 BatchNorm whose statistics were computed in bf16 would differ visibly from f32."""
    layer, shape = LAYERS["batch_norm"]
    params, state, _ = layer.init(jax.random.PRNGKey(0), shape)
    x = (jax.random.normal(jax.random.PRNGKey(1), shape) * 0.01 + 300.0)
    y16, s16 = layer.apply(params, state, x.astype(jnp.bfloat16), train=True, policy=P.get_policy("bf16"))
    y32, s32 = layer.apply(params, state, x.astype(jnp.bfloat16).astype(jnp.float32), train=True)
    np.testing.assert_allclose(np.asarray(s16["mean"]), np.asarray(s32["mean"]), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(y16, np.float32), np.asarray(y32), atol=2e-2)


def _tiny_run(policy, extra=()):
    cfg = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"),
                      [f"precision.policy={policy}", "data.batch_size=16", "train.steps=100",
                       "optim.name=adam", "optim.lr=1e-3", "optim.schedule.name=constant", *extra])
    return build_run(cfg)


# The settings test_fp16_overflow_step_is_skipped_and_scale_round_trips and
# test_master_copy_keeps_small_updates need (a scale that halves to 512 and does not grow in
# their 12 steps; an update bf16 would round away), taken by test_train_step_dtypes under the
# same presets: each of those tests' steps is one program of the dtypes test (compiled once,
# then served by the suite's compilation cache), where each compiled its own.
SMALL_SCALE = ["precision.loss_scale_init=1024", "precision.growth_interval=1000"]
SMALL_SGD = ["optim.name=sgd", "optim.lr=1e-4", "optim.momentum=0"]
PRESET_SETTINGS = {"fp16": SMALL_SCALE, "bf16_params": SMALL_SGD}


@pytest.mark.parametrize("preset", PRESETS)
def test_train_step_dtypes(preset):
    run = _tiny_run(preset, PRESET_SETTINGS.get(preset, ()))
    state = init_state(run)
    policy = run.policy
    for leaf in jax.tree_util.tree_leaves(state.params):
        assert leaf.dtype == policy.param_dtype
    if policy.needs_master_copy:
        assert isinstance(state.opt_state, MasterCopyState)
        assert all(leaf.dtype == jnp.float32 for leaf in jax.tree_util.tree_leaves(state.opt_state.master))
    step = jax.jit(make_train_step(run.model, run.tx, policy=policy, schedule=run.schedule).step)
    batch = {"image": jnp.zeros((16, 28, 28, 1)) + 0.1, "label": jnp.arange(16) % 10}
    new, metrics = step(state, batch)
    for before, after in zip(jax.tree_util.tree_leaves(state.params), jax.tree_util.tree_leaves(new.params)):
        assert after.dtype == before.dtype
    assert metrics["loss"].dtype == jnp.float32 and np.isfinite(float(metrics["loss"]))
    # The whole model's output: float32 under every preset (a dtype from tracing: no compilation,
    # where the eager forward compiled each of its operations for each preset's dtypes).
    logits, _ = jax.eval_shape(lambda p, s, x: run.model.apply(p, s, x, policy=policy),
                               new.params, new.state, batch["image"])
    assert logits.dtype == policy.output_dtype


def test_steps_take_a_policy_by_name():
    """make_train_step / make_eval_step take a policy's name as the layers do: the same step as
    with the Policy object (a name gave an AttributeError inside the step)."""
    from jaxcnn.train.step import make_eval_step
    run = _tiny_run("bf16")
    state = init_state(run)
    batch = {"image": jnp.zeros((16, 28, 28, 1)) + 0.1, "label": jnp.arange(16) % 10}
    # With the run's schedule, the step of test_train_step_dtypes[bf16] on its batch: the
    # suite's compilation cache serves both of these programs (its own took 3 s more).
    by_name = jax.jit(make_train_step(run.model, run.tx, policy="bf16", schedule=run.schedule).step)(state, batch)
    by_object = jax.jit(make_train_step(run.model, run.tx, policy=run.policy, schedule=run.schedule).step)(
        state, batch)
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(
        lambda a, b: bool(jnp.array_equal(a, b)), by_name, by_object))
    sums = [jax.jit(make_eval_step(run.model, policy=p).step)(state.params, state.state, batch)
            for p in ("bf16", run.policy)]
    assert jax.tree_util.tree_all(jax.tree_util.tree_map(lambda a, b: bool(jnp.array_equal(a, b)), *sums))
    with pytest.raises(ValueError, match=r"^policy='bf17': "):
        make_train_step(run.model, run.tx, policy="bf17").step


def test_master_copy_keeps_small_updates():
    """bf16 params updated directly would round a 1e-4 relative update away; the master keeps it."""
    run = _tiny_run("bf16_params", SMALL_SGD)
    state = init_state(run)
    step = jax.jit(make_train_step(run.model, run.tx, policy=run.policy, schedule=run.schedule).step)
    batch = {"image": jnp.ones((16, 28, 28, 1)), "label": jnp.arange(16) % 10}
    master0 = state.opt_state.master
    for _ in range(3):
        state, _ = step(state, batch)
    moved = jax.tree_util.tree_map(lambda a, b: jnp.any(a != b), master0, state.opt_state.master)
    assert all(bool(m) for m in jax.tree_util.tree_leaves(moved))
    recast = run.policy.cast_to_param(state.opt_state.master)
    for a, b in zip(jax.tree_util.tree_leaves(recast), jax.tree_util.tree_leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_fp16_overflow_step_is_skipped_and_scale_round_trips(tmp_path):
    run = _tiny_run("fp16", SMALL_SCALE)
    assert isinstance(run.loss_scale, P.DynamicLossScale)
    state = init_state(run)
    step = jax.jit(make_train_step(run.model, run.tx, policy=run.policy, schedule=run.schedule).step)
    rng = np.random.default_rng(0)
    images = rng.normal(size=(16, 28, 28, 1)).astype(np.float32)
    batch = {"image": images, "label": np.arange(16, dtype=np.int32) % 10}
    losses = []
    for i in range(12):
        if i == 5:  # inject an overflow: fp16 activations of 1e5-scaled inputs become inf
            before = state
            state, m = step(state, {"image": images * 1e5, "label": batch["label"]})
            assert float(m["finite"]) == 0.0 and int(m["skipped"]) == 1
            assert float(P.current_scale(state.loss_scale)) == 512.0  # halved from 1024
            for a, b in zip(jax.tree_util.tree_leaves((before.params, before.opt_state, before.state)),
                            jax.tree_util.tree_leaves((state.params, state.opt_state, state.state))):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            continue
        state, m = step(state, batch)
        assert float(m["finite"]) == 1.0
        losses.append(float(m["loss"]))
    assert int(state.skipped) == 1 and losses[-1] < 0.5 * losses[0]
    manager = CheckpointManager(tmp_path / "ckpt", keep=1)
    manager.save(int(state.step), state)
    manager.wait()
    _, restored = manager.restore(target=jax.eval_shape(lambda: state))
    manager.close()
    assert float(P.current_scale(restored.loss_scale)) == 512.0
    assert int(restored.loss_scale.counter) == int(state.loss_scale.counter)
    assert int(restored.skipped) == 1
    assert restored.loss_scale.min_scale == state.loss_scale.min_scale


def test_bf16_matches_fp32_accuracy_on_short_mnist_run(tmp_path):
    """Shortened version of the README's full bf16-vs-fp32 comparison: lenet5, 200 steps of 32
    digits (0.95 in float32 when written; mnist_cnn, 120 steps of 64, took 2.5x as long)."""
    accuracy = {}
    for policy in ("fp32", "bf16"):
        work = tmp_path / policy
        assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), "model.name=lenet5", f"precision.policy={policy}",
                           "train.steps=200", "data.batch_size=32", "checkpoint.enabled=false",
                           "train.eval_every=null", "logging.log_every=40", "logging.progress=none", "mesh.data=1",
                           "--workdir", str(work)]) == 0
        final = [r for r in read_metrics(work) if r["kind"] == "eval"][-1]
        accuracy[policy] = final["top1"]
    assert accuracy["fp32"] > 0.93
    assert abs(accuracy["bf16"] - accuracy["fp32"]) <= 0.01, accuracy
