"""One process of a two-process run on 127.0.0.1 (run by test_parallel_distributed.py).

    python _mp_worker.py PORT PROCESS_ID STEPS OUT_DIR [TIMEOUT_S]

Each process has 4 CPU devices; together they form one 8-device data mesh and
train mnist_cnn under shard_map on the global batches of ``_helpers.batches``,
each process feeding only its rows.  Process 0 prints ``step N`` after every
step and writes ``losses.json`` and ``params.npz``.  STEPS=0 trains until killed.
"""
import json
import os
import sys
import types

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxcnn import parallel  # noqa: E402
from jaxcnn.interop import save_npz  # noqa: E402


def main(port, pid, steps, out_dir, timeout_s=60.0):
    parallel.initialize(types.SimpleNamespace(mode="on", coordinator_address=f"127.0.0.1:{port}",
                                              num_processes=2, process_id=pid, timeout_s=timeout_s))
    from _helpers import MOMENTUM, batches, init, model_and_shape, plan_for
    from jaxcnn.train.step import make_train_step

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
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
    params = parallel.to_host(state.params)
    if pid == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
        save_npz(os.path.join(out_dir, "params.npz"), params, {})


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], *(float(x) for x in a[4:]))
