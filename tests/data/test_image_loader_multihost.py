"""Two ``jax.distributed`` processes on 127.0.0.1 share each epoch of an image folder: every
example exactly once per epoch across them, each process taking its share of the global batch
by ``jax.process_index()``, with grain workers in each."""
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

from jaxcnn.data.shapes import write_shapes_folder

ROOT = Path(__file__).resolve().parents[2]

CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from jaxcnn.data.folder import FolderSource, scan_split
    from jaxcnn.data.loader import Loader, TrainBatches

    def main():
        folder, port, pid, out = sys.argv[1:5]
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                                   process_id=int(pid), initialization_timeout=60)
        source = FolderSource(scan_split(folder, "train"))
        maker = TrainBatches(source, seed=7, batch_size=8, image_size=(16, 16),
                             process_index=jax.process_index(), process_count=jax.process_count())
        per_epoch = maker.steps_per_epoch
        seen = []
        with Loader(maker, 0, 2 * per_epoch, workers=1) as loader:
            for batch in loader:
                assert batch["image"].shape == (4, 16, 16, 3)
                seen.append(batch["index"].tolist())
        with open(out, "w") as f:
            json.dump({"process": jax.process_index(), "per_epoch": per_epoch, "seen": seen}, f)
        jax.distributed.shutdown()

    if __name__ == "__main__":
        main()
""")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_see_every_example_once_per_epoch(tmp_path):
    folder = tmp_path / "shapes"
    write_shapes_folder(folder, per_class=(8, 1), classes=["blue", "green", "red"], size_range=(16, 24))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               JAX_PLATFORMS="cpu", XLA_FLAGS="")
    procs = [subprocess.Popen([sys.executable, str(script), str(folder), str(port), str(pid),
                               str(tmp_path / f"out{pid}.json")], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=240)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, out in zip(procs, outputs):
        assert proc.returncode == 0, out[-3000:]
    results = sorted((json.loads((tmp_path / f"out{pid}.json").read_text()) for pid in (0, 1)),
                     key=lambda r: r["process"])
    assert [r["process"] for r in results] == [0, 1]
    per_epoch = results[0]["per_epoch"]
    assert per_epoch == 3  # 24 images, global batch 8
    for epoch in range(2):
        steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
        mine = [[i for s in steps for i in r["seen"][s]] for r in results]
        assert not set(mine[0]) & set(mine[1])
        assert sorted(mine[0] + mine[1]) == list(range(24)), epoch
    # A different order in the second epoch.
    assert results[0]["seen"][0] != results[0]["seen"][per_epoch]
