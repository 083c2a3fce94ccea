"""Data parallelism: every strategy trains like one device on the same global batch."""
import functools

import jax
import numpy as np
import pytest

from jaxcnn.train.step import make_train_step

from _helpers import (MOMENTUM, SGD, batches, init, max_diff, model_and_shape, plan_for, run_plan,
                      run_single)

# float32, 3 steps: the per-device program sums gradients in another order than one device.
LOSS_TOL, PARAM_TOL = 2e-5, 2e-5


@pytest.mark.parametrize("strategy", ["jit", "shard_map", "pmap"])
def test_batch_norm_model_matches_one_device(strategy):
    """Global-batch BatchNorm (synced over 8 devices) and momentum SGD: same losses,
    params and running statistics as one device on the whole batch."""
    model, shape = model_and_shape("bn")
    data = batches(shape, 3)
    ref_losses, ref = run_single(model, MOMENTUM, shape, data)
    losses, state = run_plan(plan_for(model, MOMENTUM, shape, strategy), model, MOMENTUM, shape, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_TOL, atol=LOSS_TOL)
    assert max_diff(state.params, ref.params) < PARAM_TOL
    assert max_diff(state.state, ref.state) < PARAM_TOL
    assert int(state.step) == 3


@pytest.mark.slow  # jit is covered by the BN test above and by mnist_cnn in test_parallel_model
def test_mnist_cnn_under_jit_matches_one_device_dropout_included():
    """A global program draws the same dropout masks as one device (partitionable threefry)."""
    model, shape = model_and_shape("mnist_cnn")
    data = batches(shape, 3)
    ref_losses, ref = run_single(model, MOMENTUM, shape, data)
    losses, state = run_plan(plan_for(model, MOMENTUM, shape, "jit"), model, MOMENTUM, shape, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_TOL, atol=LOSS_TOL)
    assert max_diff(state.params, ref.params) < PARAM_TOL


@pytest.mark.parametrize("strategy", ["shard_map", pytest.param("pmap", marks=pytest.mark.slow)])
def test_mnist_cnn_per_device_matches_the_mean_of_shard_steps(strategy):
    """Per-device strategies give device i the dropout key fold_in(rng, i) and average
    gradients, so one plain-SGD step equals the mean of 8 one-device steps on the
    8 slices of the batch (each with its key), with the loss their mean."""
    model, shape = model_and_shape("mnist_cnn")
    data = batches(shape, 2)
    n = jax.device_count()
    one = jax.jit(make_train_step(model, SGD).step)
    state = init(model, SGD, shape)
    ref_losses = []
    for b in data:
        outs = []
        for i in range(n):
            rng = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), i))
            shard = {k: v[i * shape[0] // n:(i + 1) * shape[0] // n] for k, v in b.items()}
            outs.append(one(state._replace(rng=rng), shard))
        ref_losses.append(np.mean([float(m["loss"]) for _, m in outs]))
        state = state._replace(step=state.step + 1, params=jax.tree_util.tree_map(
            lambda *p: np.mean(np.stack(p), axis=0), *[s.params for s, _ in outs]))
    losses, got = run_plan(plan_for(model, SGD, shape, strategy), model, SGD, shape, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_TOL, atol=LOSS_TOL)
    assert max_diff(got.params, state.params) < PARAM_TOL


def _bn1_input(params, images):
    """The activations entering ``bn1`` (the output of ``conv1``), computed with lax directly."""
    w = np.asarray(params["conv1"]["w"])
    return jax.lax.conv_general_dilated(images, w, (1, 1), ((1, 1), (1, 1)),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


@pytest.mark.parametrize("sync", [True, False])
def test_batch_norm_statistics_global_or_per_device(sync):
    """After one step the running statistics of ``bn1`` (momentum 0.1, from mean 0 and
    var 1) hold the global batch's mean and unbiased variance when synced, and the
    average over devices of each slice's statistics when not."""
    model, shape = model_and_shape("bn")
    (batch,) = batches(shape, 1, seed=3)
    # Shift each device's slice so that per-device and global statistics differ clearly.
    batch["image"] += np.repeat(np.arange(jax.device_count(), dtype=np.float32), 2)[:, None, None, None]
    params = init(model, SGD, shape).params
    _, state = run_plan(plan_for(model, SGD, shape, "shard_map", sync_batch_norm=sync),
                        model, SGD, shape, [batch])
    h = np.asarray(_bn1_input(params, batch["image"]), np.float64)
    if sync:
        mean, var = h.mean(axis=(0, 1, 2)), h.var(axis=(0, 1, 2), ddof=1)
    else:
        slices = np.split(h, jax.device_count())
        mean = np.mean([s.mean(axis=(0, 1, 2)) for s in slices], axis=0)
        var = np.mean([s.var(axis=(0, 1, 2), ddof=1) for s in slices], axis=0)
    got = jax.device_get(state.state["bn1"])
    np.testing.assert_allclose(got["mean"], 0.1 * mean, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["var"], 0.9 + 0.1 * var, rtol=1e-4, atol=1e-5)
    # The two differ for this batch, so the test tells them apart.
    assert np.max(np.abs(h.var(axis=(0, 1, 2), ddof=1) - np.mean(
        [s.var(axis=(0, 1, 2), ddof=1) for s in np.split(h, jax.device_count())], axis=0))) > 0.1


def test_a_step_built_for_other_batch_norm_syncing_is_refused():
    """The step passes BatchNorm its axis (an argument of apply, no scope a cached trace could
    miss), so a step built to sync otherwise than the plan says is refused, naming the fix."""
    model, shape = model_and_shape("bn")
    for strategy, sync, built in (("shard_map", False, dict(axis_name="data")),
                                  ("pmap", True, dict(axis_name="data", sync_batch_norm=False)),
                                  ("jit", True, dict(axis_name="data"))):
        plan = plan_for(model, SGD, shape, strategy, sync_batch_norm=sync)
        with pytest.raises(ValueError, match=r"syncs BatchNorm over .* but the strategy expects "
                                             r".*sync_batch_norm=plan.sync_batch_norm"):
            plan.wrap_step(make_train_step(model, SGD, **built))


@functools.cache
def _bf16_params_one_device():
    """The BN net's bf16_params initial state (host arrays), 3 batches and the state after 3
    one-device steps on them: computed once for both strategies of the test below."""
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    model, shape = model_and_shape("bn")
    policy = P.get_policy("bf16_params")
    state0 = jax.device_get(create_train_state(model, SGD, jax.random.PRNGKey(0), shape,
                                               loss_scale=P.make_loss_scale("none"),
                                               policy=policy))
    data = batches(shape, 3)
    single = jax.jit(make_train_step(model, SGD, policy=policy).step)
    ref = state0
    for b in data:
        ref, _ = single(ref, b)
    return policy, state0, data, jax.device_get(ref)


@pytest.mark.parametrize("strategy", ["shard_map", "pmap"])
def test_bf16_params_average_bf16_gradients_over_devices(strategy):
    """bf16 parameters (fp32 master copy) over 8 CPU devices: the bf16 gradients are
    averaged, not summed, and the run neither aborts (XLA:CPU's all-reduce promotion
    used to, on shard_map's bf16 psum) nor drifts from one device beyond bf16 rounding."""
    from jaxcnn.parallel import ParallelPlan, make_mesh
    model, shape = model_and_shape("bn")
    policy, state0, data, ref = _bf16_params_one_device()
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state0)
    plan = ParallelPlan(make_mesh(-1, 1), model, shape, abstract, strategy=strategy)
    step = plan.wrap_step(make_train_step(model, SGD, policy=policy, axis_name=plan.step_axis_name))
    state = plan.shard_state(state0)
    for b in data:
        state, m = step(state, plan.put_batch(b))
        assert np.isfinite(float(m["loss"]))
    master0, ref_master = state0.opt_state.master, ref.opt_state.master
    moved = max_diff(ref_master, master0)
    assert moved > 0
    # bf16 gradients of 2-image shards round differently from those of the 16-image batch;
    # a sum over the 8 devices instead of a mean would be off by 7x the update.
    assert max_diff(jax.device_get(state.opt_state.master), ref_master) < 0.1 * moved
    for leaf in jax.tree_util.tree_leaves(state.params):
        assert leaf.dtype == jax.numpy.bfloat16
