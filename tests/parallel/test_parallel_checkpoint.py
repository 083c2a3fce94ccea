"""A checkpoint saved on one mesh restores onto another (orbax reshards on load)."""
import jax
import numpy as np
import optax
import pytest

from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.step import make_train_step

from _helpers import batches, max_diff, model_and_shape, plan_for, run_plan

ADAM = optax.adam(1e-3)


def _layout(devices, data, model_axis):
    return {"devices": None if devices is None else jax.devices()[:devices], "data": data,
            "model_axis": model_axis}


# (saved on, restored onto): 8 devices -> 1, 1 -> 4, data-parallel -> 2-D (data 2 x model 4).
MOVES = [(_layout(None, 8, 1), _layout(1, 1, 1)),
         (_layout(1, 1, 1), _layout(4, 4, 1)),
         (_layout(None, 8, 1), _layout(None, 2, 4))]


@pytest.mark.parametrize("source,target", MOVES, ids=["8to1", "1to4", "dp_to_2d"])
def test_restore_onto_another_mesh(tmp_path, source, target):
    model, shape = model_and_shape("bn")
    (batch,) = batches(shape, 1, seed=5)
    saved_plan = plan_for(model, ADAM, shape, "jit", **source)
    _, state = run_plan(saved_plan, model, ADAM, shape, [batch])
    with CheckpointManager(tmp_path / "ckpt") as manager:
        assert manager.save(1, state)
        manager.wait()
    plan = plan_for(model, ADAM, shape, "jit", **target)
    with CheckpointManager(tmp_path / "ckpt") as manager:
        step, restored = manager.restore(target=plan.abstract_state)
    assert step == 1
    assert max_diff(restored, jax.device_get(state)) == 0.0
    for leaf, want in zip(jax.tree_util.tree_leaves(restored),
                          jax.tree_util.tree_leaves(plan.state_shardings)):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    w = restored.params["block"]["conv2"]["w"]  # (3, 3, 16, 16)
    want_shape = (3, 3, 16, 16 // target["model_axis"])
    assert {tuple(s.data.shape) for s in w.addressable_shards} == {want_shape}
    assert len(w.sharding.device_set) == len(plan.mesh.devices.reshape(-1))
    # Training goes on from the restored state on the new mesh.
    step_fn = plan.wrap_step(make_train_step(model, ADAM))
    new_state, metrics = step_fn(restored, plan.put_batch(batch))
    assert np.isfinite(float(metrics["loss"])) and int(new_state.step) == 2
