"""What the two-process workers (``_mp_worker.py``, ``_mp_pipe_worker.py``) share.

Imported first by a worker: it sets this process to 4 CPU devices before JAX is imported.

    python _mp_<kind>_worker.py PORT PROCESS_ID STEPS OUT_DIR [TIMEOUT_S]
"""
import json
import os
import sys

import xla_cache  # tests/, on the worker's PYTHONPATH (no JAX inside)

os.environ["XLA_FLAGS"] = xla_cache.with_devices(4)  # the suite's flags, 4 devices
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from jaxcnn import parallel  # noqa: E402
from jaxcnn.interop import save_npz  # noqa: E402


def start(port: int, pid: int, timeout_s: float) -> None:
    """Join the two-process run whose coordinator is 127.0.0.1:``port``."""
    parallel.initialize("on", coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                        timeout_s=timeout_s)
    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4


def finish(pid: int, out_dir: str, losses: list, state) -> None:
    """Every process gathers the parameters; process 0 writes ``losses.json`` and ``params.npz``."""
    params = parallel.to_host(state.params)
    if pid == 0:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)
        save_npz(os.path.join(out_dir, "params.npz"), params, {})


def run(main) -> None:
    """``main(port, pid, steps, out_dir[, timeout_s])`` from the command line."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3], *(float(x) for x in a[4:]))
