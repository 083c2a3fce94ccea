"""One process of a two-process run on 127.0.0.1 (run by test_parallel_distributed.py).

    python _mp_worker.py PORT PROCESS_ID STEPS OUT_DIR [TIMEOUT_S]

Each process has 4 CPU devices; together they form one 8-device data mesh and
train mnist_cnn under shard_map on the global batches of ``_helpers.batches``,
each process feeding only its rows.  Process 0 prints ``step N`` after every
step and writes ``losses.json`` and ``params.npz``.  STEPS=0 trains until killed.
"""
from _mp_common import finish, run, start  # first: it sets the devices before JAX starts

import jax  # noqa: E402

from jaxcnn import parallel  # noqa: E402


def main(port, pid, steps, out_dir, timeout_s=60.0):
    start(port, pid, timeout_s)
    from _helpers import MOMENTUM, batches, init, model_and_shape, plan_for
    from jaxcnn.train.step import make_train_step

    model, shape = model_and_shape("mnist_cnn")
    plan = plan_for(model, MOMENTUM, shape, "shard_map")
    step = plan.wrap_step(make_train_step(model, MOMENTUM, axis_name=plan.step_axis_name))
    state = jax.jit(lambda: init(model, MOMENTUM, shape), out_shardings=plan.state_shardings)()
    data = batches(shape, max(steps, 1))
    local = shape[0] // 2
    losses, i = [], 0
    while steps == 0 or i < steps:
        b = data[i % len(data)]
        share = {k: v[pid * local:(pid + 1) * local] for k, v in b.items()}
        state, m = step(state, plan.put_batch(share))
        losses.append(float(m["loss"]))
        i += 1
        if pid == 0:
            print(f"step {i}", flush=True)
    finish(pid, out_dir, losses, state)


if __name__ == "__main__":
    run(main)
