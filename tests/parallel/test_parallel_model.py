"""Model parallelism (model axis 2 and 4, and a 2-D data x model mesh) and fsdp:
same logits and gradients as the unsharded model, each device holding a slice."""
import jax
import numpy as np
import optax
import pytest

from _helpers import batches, init, max_diff, model_and_shape, plan_for, run_plan, run_single

LR1 = optax.sgd(1.0)  # new params = params - grads, so one step exposes the gradients
ADAM = optax.adam(1e-3)


def _logits(plan, model, state, images):
    sh = plan.state_shardings
    fwd = jax.jit(lambda p, s, x: model.apply(p, s, x, train=False)[0],
                  in_shardings=(sh.params, sh.state, plan.batch_sharding()))
    return fwd(state.params, state.state, images)


_UNSHARDED = {}


def _unsharded_logits(model):
    """The model's forward on one device, jitted once per model (op by op, each operation of its
    layers compiled on its own)."""
    if id(model) not in _UNSHARDED:  # holding the model keeps its id unique
        _UNSHARDED[id(model)] = (model, jax.jit(lambda p, s, x: model.apply(p, s, x, train=False)[0]))
    return _UNSHARDED[id(model)][1]


def _shard_shapes(x):
    return {tuple(s.data.shape) for s in x.addressable_shards}


# (model name, strategy, data, model axis): mnist_cnn has dropout, which only the global
# program (jit) draws exactly as one device does, so the per-device strategy is checked on the
# BN net.  Meshes: data 4 x model 2 (the data axis inferred) and data 2 x model 4 (given; (-1, 4)
# was a third case, the same mesh).  mnist_cnn (dropout) runs on both under jit; the BN net
# under jit on model 2 (every layer split) and under shard_map on model 4, where its 10-class
# fc stays whole while the convolutions and BatchNorm split (rules.py keeps a dimension the
# axis does not divide): split and whole layers in one partly manual program.  Its jit on model
# 4 and shard_map on model 2 were 2 of the test's 6 compilations of a sharded forward and step.
CASES = [("mnist_cnn", "jit", -1, 2), ("mnist_cnn", "jit", 2, 4), ("bn", "jit", -1, 2),
         ("bn", "shard_map", 2, 4)]


@pytest.mark.parametrize("name,strategy,data,model_axis", CASES)
def test_same_logits_and_gradients_as_unsharded(name, strategy, data, model_axis):
    model, shape = model_and_shape(name)
    (batch,) = batches(shape, 1, seed=1)
    plan = plan_for(model, LR1, shape, strategy, data=data, model_axis=model_axis)
    state0 = init(model, LR1, shape)
    placed = plan.shard_state(state0)
    # Output channels are split over "model": each device holds only its slice.
    conv = placed.params["conv2" if name == "mnist_cnn" else "conv1"]["w"]
    full = conv.shape
    assert _shard_shapes(conv) == {full[:3] + (full[3] // model_axis,)}
    ref_logits = _unsharded_logits(model)(state0.params, state0.state, batch["image"])
    logits = _logits(plan, model, placed, plan.put_batch(batch)["image"])
    np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), rtol=1e-5, atol=1e-5)

    _, ref = run_single(model, LR1, shape, [batch])
    _, got = run_plan(plan, model, LR1, shape, [batch])
    ref_grads = jax.tree_util.tree_map(np.subtract, state0.params, ref.params)
    grads = jax.tree_util.tree_map(lambda a, b: a - np.asarray(b), state0.params, got.params)
    assert max_diff(grads, ref_grads) < 2e-5
    assert max_diff(got.state, ref.state) < 2e-5
    # The updated state keeps the plan's shardings.
    for leaf, want in zip(jax.tree_util.tree_leaves(got.params),
                          jax.tree_util.tree_leaves(plan.state_shardings.params)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)


def test_row_parallel_rules_split_input_channels():
    model, shape = model_and_shape("bn")
    (batch,) = batches(shape, 1, seed=2)
    plan = plan_for(model, LR1, shape, "jit", data=2, model_axis=4, rules={"in": "model", "out": None})
    w = plan.shard_state(init(model, LR1, shape)).params["block"]["conv2"]["w"]  # (3, 3, 16, 16)
    assert _shard_shapes(w) == {(3, 3, 4, 16)}
    _, ref = run_single(model, LR1, shape, [batch])
    _, got = run_plan(plan, model, LR1, shape, [batch])
    assert max_diff(got.params, ref.params) < 2e-5


@pytest.mark.parametrize("strategy", ["jit", "shard_map"])
def test_fsdp_shards_params_and_adam_moments_over_data(strategy):
    """Sharded at rest, gathered for use: the numbers are those of the same strategy
    without fsdp (for jit: of one device)."""
    model, shape = model_and_shape("mnist_cnn")
    data = batches(shape, 2, seed=4)
    plan = plan_for(model, ADAM, shape, strategy, data=4, model_axis=2, fsdp=True)
    if strategy == "jit":  # dropout masks match one device only under the global program
        ref_losses, ref = run_single(model, ADAM, shape, data)
    else:
        ref_losses, ref = run_plan(plan_for(model, ADAM, shape, strategy, data=4, model_axis=2),
                                   model, ADAM, shape, data)
    losses, got = run_plan(plan, model, ADAM, shape, data)
    fc1, mu = got.params["fc1"]["w"], got.opt_state[0].mu["fc1"]["w"]  # (9216, 128)
    assert _shard_shapes(fc1) == _shard_shapes(mu) == {(9216 // 4, 128 // 2)}
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    assert max_diff(got.params, ref.params) < 2e-5
    assert max_diff(got.opt_state, ref.opt_state) < 2e-5
