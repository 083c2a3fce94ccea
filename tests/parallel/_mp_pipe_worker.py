"""One process of a two-process pipeline run on 127.0.0.1 (run by test_parallel_pipeline.py).

    python _mp_pipe_worker.py PORT PROCESS_ID STEPS OUT_DIR [TIMEOUT_S]

Each process has 4 CPU devices; together they form a ``data 2 x pipe 4`` mesh whose
pipe axis crosses the processes (stages 0-1 on process 0, stages 2-3 on process 1, for
both data shards), so activations and their gradients travel between the processes
(``ppermute`` over gloo).  Every process holds rows of both data shards, so each feeds
the whole global batch of ``_helpers.batches`` (``plan.batch_share`` says so, and
``plan.put_batch`` takes it).  Every leaf of 64 or more elements lives split over
pipe, so across the processes.  Process 0 writes ``losses.json`` and ``params.npz``.
"""
from _mp_common import finish, run, start  # first: it sets the devices before JAX starts

import jax  # noqa: E402

from jaxcnn import parallel  # noqa: E402

SHAPE, MICROBATCHES = (16, 8, 8, 3), 4


def pipe_devices():
    """Mesh order (data, pipe): pipe stages 0-1 on process 0, 2-3 on process 1."""
    by_process = [[d for d in jax.devices() if d.process_index == p] for p in (0, 1)]
    return [by_process[s // 2][2 * d + s % 2] for d in range(2) for s in range(4)]


def main(port, pid, steps, out_dir, timeout_s=60.0):
    start(port, pid, timeout_s)
    from _helpers import MOMENTUM, batches, bn_net, init
    from jaxcnn.train.step import make_train_step

    from jaxcnn.parallel import rules
    rules.FSDP_MIN_SIZE = 64  # bn_net's leaves are small: split them over pipe, across the processes
    model = bn_net()
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                      init(model, MOMENTUM, SHAPE))
    mesh = parallel.make_mesh(2, 1, pipe=4, devices=pipe_devices())
    plan = parallel.ParallelPlan(mesh, model, SHAPE, abstract, pipeline={"microbatches": MICROBATCHES})
    owners = {tuple(sorted({d.process_index for d in mesh.devices[:, s].reshape(-1)})) for s in range(4)}
    assert owners == {(0,), (1,)}, owners  # every stage on one process, the stages on both
    split = [s for s in jax.tree_util.tree_leaves(plan.state_shardings.params) if "pipe" in str(s.spec)]
    assert split, plan.state_shardings.params  # parameters live split over the stages' processes
    step = plan.wrap_step(make_train_step(model, MOMENTUM, axis_name=plan.step_axis_name,
                                          pipeline=plan.pipeline))
    state = jax.jit(lambda: init(model, MOMENTUM, SHAPE), out_shardings=plan.state_shardings)()
    losses = []
    assert plan.batch_share == (0, 1)  # both processes load the whole batch
    for b in batches(SHAPE, steps, seed=4):
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
    finish(pid, out_dir, losses, state)


if __name__ == "__main__":
    run(main)
