"""Multi-process runs on 127.0.0.1: two processes with 4 CPU devices each (gloo collectives)."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import xla_cache
from jaxcnn import parallel
from jaxcnn.interop import load_npz
from jaxcnn.train.config import ConfigError

from _helpers import MOMENTUM, batches, max_diff, model_and_shape, plan_for, run_plan

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "_mp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = xla_cache.subprocess_env()  # the workers of later tests load the programs of earlier ones
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    env["XLA_FLAGS"] = xla_cache.with_devices(4)  # each worker's 4 devices, the suite's flags
    return env


def _start(port, pid, steps, out_dir, timeout_s):
    return subprocess.Popen([sys.executable, WORKER, str(port), str(pid), str(steps), str(out_dir),
                             str(timeout_s)], env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _finish(procs, limit):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    return outs


def test_two_processes_train_like_one_process_with_eight_devices(tmp_path):
    steps = 2
    port = _free_port()
    procs = [_start(port, pid, steps, tmp_path, 60) for pid in (0, 1)]
    results = _finish(procs, 300)
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    with open(tmp_path / "losses.json") as f:
        losses = json.load(f)
    params, _ = load_npz(tmp_path / "params.npz")
    model, shape = model_and_shape("mnist_cnn")
    ref_losses, ref = run_plan(plan_for(model, MOMENTUM, shape, "shard_map"), model, MOMENTUM, shape,
                               batches(shape, steps))
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5, atol=2e-5)
    assert max_diff(params, ref.params) < 2e-5


# The long form: tests/reliability/test_reliability_multihost.py::
# test_peer_killed_mid_run_ends_the_other_process[1-2] checks the same in the default run (process
# 1 of two, each with several CPU devices, SIGKILLed while both train; the survivor ended by the
# library's liveness watch within distributed.timeout_s, exit 1, one line naming the lost
# process and the timeout, no XLA abort), through jaxcnn-train, whose line begins with the
# program name it gives report_errors_as.  What only this test checks: the library's own
# shard_map step (not the trainer's) with 4 devices per process.  The default name of a program
# that never calls report_errors_as: test_a_lost_peer_line_begins_with_the_default_program_name.
@pytest.mark.slow
def test_killing_one_process_stops_the_other_within_the_timeout(tmp_path):
    timeout_s = 5
    port = _free_port()
    survivor, victim = (_start(port, pid, 0, tmp_path, timeout_s) for pid in (0, 1))
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "step 1" not in line and time.monotonic() < deadline:
            line = survivor.stdout.readline()
            assert line or survivor.poll() is None, survivor.stderr.read()[-3000:]
        assert "step 1" in line, "the two processes never trained a step"
        victim.kill()
        killed_at = time.monotonic()
        (rc, _, err), = _finish([survivor], 6 * timeout_s + 30)
        elapsed = time.monotonic() - killed_at
    finally:
        for p in (survivor, victim):
            if p.poll() is None:
                p.kill()
                p.communicate()
    # With 4 devices per process the survivor's collective does not fail (one device thread waits
    # in gloo for another of its own process); it used to wait for the coordination service to
    # miss process 1's heartbeats and then be aborted by XLA (SIGABRT, C++ stack trace). The
    # library's liveness watch ends it at once, with one line naming the lost process.
    assert rc == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("jaxcnn: error:")]
    assert len(lines) == 1 and lines[0].startswith("jaxcnn: error: process 0 of 2 lost process 1:"), err[-3000:]
    assert f"distributed.timeout_s={timeout_s} s" in lines[0]
    assert "Check failure" not in err and "Terminating process" not in err, err[-3000:]
    assert elapsed < timeout_s, f"took {elapsed:.1f} s"


def test_unreachable_coordinator_is_a_clear_error():
    port = _free_port()  # nobody listens there
    code = ("import sys; from jaxcnn import parallel\n"
            "try:\n    parallel.initialize('on', coordinator_address='127.0.0.1:%d', num_processes=2,"
            " process_id=1, timeout_s=3)\n"
            "except parallel.DistributedError as e:\n    print(e); sys.exit(3)\n" % port)
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 3, p.stderr[-3000:]
    assert f"could not reach coordinator 127.0.0.1:{port} within 3 s" in p.stdout
    assert "\n" not in p.stdout.strip()
    assert time.monotonic() - t0 < 60


def test_modes_and_settings(monkeypatch):
    assert parallel.initialize("off", coordinator_address="127.0.0.1:1", num_processes=2, process_id=0,
                               timeout_s=1) is False
    auto = dict(mode="auto", timeout_s=1)
    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(var, raising=False)
    assert parallel.initialize(**auto) is False  # one process: nothing to do
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", "2")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    from jaxcnn.parallel.distributed import settings
    assert settings() == {"coordinator_address": "10.0.0.1:1234", "num_processes": 4, "process_id": 2}
    assert settings(num_processes=3)["num_processes"] == 3  # an argument over the environment
    monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
    with pytest.raises(ValueError, match="JAX_NUM_PROCESSES='four' is not a valid int"):
        settings()
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"^process_id: 5 is not in \[0, num_processes=2\)"):
        parallel.initialize(**auto)
    from jaxcnn.train._plan import parallel_config_errors  # the trainer's calls: ConfigErrors
    with pytest.raises(ConfigError, match=r"distributed.process_id: 5 is not") as err, parallel_config_errors():
        parallel.initialize(**auto)
    assert err.value.path == "distributed.process_id"
    monkeypatch.setenv("JAX_NUM_PROCESSES", "four")
    with pytest.raises(ConfigError, match="JAX_NUM_PROCESSES='four' is not a valid int") as err, \
            parallel_config_errors():
        parallel.initialize(**auto)
    assert err.value.path == "distributed.num_processes"


def test_lost_peer_only_in_a_multi_process_run():
    """A gloo failure becomes the lost-peer error only when jax.distributed runs (the subprocess
    tests in tests/reliability/test_reliability_multihost.py cover that side)."""
    from jaxcnn.parallel.distributed import DistributedError, lost_peer
    gloo = RuntimeError("UNKNOWN: Gloo all-reduce failed: Read error [127.0.0.1]:6042: Connection reset by peer")
    assert lost_peer(gloo, 10) is None  # this test process is a single-process run
    assert lost_peer(DistributedError("heartbeat"), 10) is None
    assert DistributedError("x").must_exit is False and DistributedError("x", must_exit=True).must_exit


def _cli(workdir, extra_env, *overrides):
    env = _env()
    env.update(extra_env)
    return subprocess.Popen(
        [sys.executable, "-m", "jaxcnn.train.cli", os.path.join(ROOT, "configs", "mnist_cnn.yaml"),
         "train.steps=3", "data.batch_size=16", "logging.log_every=1", "train.eval_every=null",
         "logging.progress=lines", "precision.matmul_precision=highest", "distributed.timeout_s=60",
         *overrides, "--workdir", str(workdir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_trainer_cli_two_processes_match_one(tmp_path):
    """The whole trainer: two processes (4 devices each) write one metrics.jsonl
    (process 0 only), one checkpoint (through orbax, both processes) and the same
    losses and final evaluation as one 8-device process."""
    port = _free_port()
    two = [_cli(tmp_path / "two", {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                                   "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": str(pid)})
           for pid in (0, 1)]
    results = _finish(two, 600)
    one = _finish([_cli(tmp_path / "one", {"XLA_FLAGS": xla_cache.with_devices(8)})], 600)
    for rc, out, err in results + one:
        assert rc == 0, err[-3000:]
    assert "2 processes" in results[0][1] and "[jaxcnn]" not in results[1][1]  # only process 0 prints
    from jaxcnn.train.metrics import read_metrics
    a, b = read_metrics(str(tmp_path / "two")), read_metrics(str(tmp_path / "one"))
    assert [r["kind"] for r in a] == [r["kind"] for r in b] == ["train"] * 3 + ["eval", "per_class"]
    assert a[-1]["confusion"] == b[-1]["confusion"]
    for ra, rb in zip(a[:-1], b[:-1]):
        for key in ("loss", "top1"):
            assert abs(ra[key] - rb[key]) < 2e-5, (ra, rb)
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["3"]
    pa, _ = load_npz(tmp_path / "two" / "params.npz")
    pb, _ = load_npz(tmp_path / "one" / "params.npz")
    assert max_diff(pa, pb) < 2e-5


def test_exit_now_writes_one_line_whichever_thread_comes_first():
    """A lost peer is noticed by several threads at once (the failed step, the liveness watch);
    each ends the process through exit_now, and only the first one's line is written."""
    code = ("import threading\nfrom jaxcnn.parallel.distributed import exit_now\n"
            "go = threading.Event()\n"
            "def end(i):\n    go.wait(); exit_now(f'jaxcnn: error: line {i}', 1)\n"
            "threads = [threading.Thread(target=end, args=(i,)) for i in range(8)]\n"
            "[t.start() for t in threads]\ngo.set()\nend(8)\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-3000:]
    assert len(p.stderr.splitlines()) == 1 and p.stderr.startswith("jaxcnn: error: line "), p.stderr


def test_a_lost_peer_line_begins_with_the_default_program_name():
    """A program that never calls report_errors_as ends on a lost peer with a line that begins
    ``jaxcnn: error:`` and names both processes and the timeout (a fresh process: the suite's
    in-process trainer runs set the name to jaxcnn-train)."""
    code = ("from jax._src import distributed as jd\nfrom jaxcnn.parallel import distributed as d\n"
            "d.exit_now = lambda line, code=1: print(line)\n"
            "jd.global_state.process_id, jd.global_state.num_processes = 0, 2\n"
            "d._exit_lost(1, 'its liveness connection closed', 5)\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.startswith("jaxcnn: error: process 0 of 2 lost process 1: its liveness connection "
                               "closed;"), p.stdout
    assert "distributed.timeout_s=5 s" in p.stdout, p.stdout


def test_relay_holds_a_closed_coordinator_connection_until_the_process_ends(monkeypatch):
    """A worker's coordination client talks to process 0 through a local relay: when process 0's
    side closes, the client's side stays open (the liveness watch reports the loss first; JAX's
    client would abort the process), and is closed at once when this process is exiting anyway."""
    from jaxcnn.parallel import distributed as dist
    monkeypatch.setattr(dist, "_watch", dict(dist._watch, closing=False))
    monkeypatch.setattr(dist, "_RELAY_HOLD_S", 1.5)
    upstream = socket.create_server(("127.0.0.1", 0))
    relay = dist._start_relay(f"127.0.0.1:{upstream.getsockname()[1]}")
    host, port = relay.rsplit(":", 1)
    for closing in (False, True):
        client = socket.create_connection((host, int(port)), timeout=5)
        server_side, _ = upstream.accept()
        client.sendall(b"ping")
        assert server_side.recv(4) == b"ping"
        server_side.sendall(b"pong")
        assert client.recv(4) == b"pong"
        dist._watch["closing"] = closing
        t0 = time.monotonic()
        server_side.close()  # the coordinator's side goes away
        assert client.recv(4) == b""
        held = time.monotonic() - t0
        assert (held >= 1.4) if not closing else (held < 1.0), (closing, held)
        client.close()
    upstream.close()


@pytest.mark.parametrize("lost", [True, False])
def test_cxx_terminate_waits_for_the_liveness_watch(lost):
    """gloo's thread may die on a dead peer's half-sent data (an uncaught C++ exception:
    std::terminate, SIGABRT) while the liveness watch is about to report the loss: the terminate
    handler waits for the watch's one line. Without a loss to report, libstdc++'s handler runs."""
    code = ("import ctypes, threading, time\nfrom jaxcnn.parallel import distributed as d\n"
            "d._TERMINATE_GRACE_S = 1.0\nd._hold_cxx_terminate()\n"
            f"if {lost}:\n"
            "    threading.Timer(0.2, d.exit_now, ('jaxcnn: error: process 0 of 2 lost process 1: x',)).start()\n"
            "ctypes.CDLL('libstdc++.so.6')._ZSt9terminatev()\n")
    p = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120)
    if lost:
        assert p.returncode == 1, p.stderr[-3000:]
        assert p.stderr == "jaxcnn: error: process 0 of 2 lost process 1: x\n", p.stderr
    else:
        assert p.returncode == -6 and "terminate called without an active exception" in p.stderr, p.stderr


# jaxcnn-train with the pipe axis across the two processes: data 2 x pipe 4 laid out with
# mesh.order=[pipe], so stages 0-1 of both data shards run on process 0 and stages 2-3 on
# process 1; each process then loads the whole batch (its devices hold both data shards).
PIPE_ACROSS = ["model.name=lenet5", "data.source=synthetic", "data.image_size=[28,28,1]",
               "data.num_train=64", "data.num_eval=40", "data.batch_size=16", "data.eval_batch_size=16",
               "mesh.data=2", "mesh.pipe=4", "mesh.order=[pipe]", "parallel.pipeline.microbatches=2",
               "train.steps=4", "train.eval_every=2", "checkpoint.every=2", "checkpoint.keep=3",
               "logging.log_every=1", "logging.progress=lines", "precision.matmul_precision=highest",
               "distributed.timeout_s=60", "data.prefetch=1"]


def _pipe_across_two(workdir, *extra):
    port = _free_port()
    procs = []
    for pid in (0, 1):
        env = _env()
        env.update({"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
                    "JAX_PROCESS_ID": str(pid)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "jaxcnn.train.cli", os.path.join(ROOT, "configs", "lenet5_mnist.yaml"),
             *PIPE_ACROSS, *extra, "--workdir", str(workdir)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = _finish(procs, 300)
    for rc, out, err in results:
        assert rc == 0, err[-3000:]
    return results[0][1]


def test_trainer_with_the_pipe_axis_across_two_processes_matches_one_and_resumes(tmp_path):
    """Two jaxcnn-train processes (4 CPU devices each), data 2 x pipe 4 with every data shard's
    stages spread over both processes: the same train losses, evaluations (40 test images in
    batches of 16, the last padded: each counted once) and final parameters as one 8-device
    process with the same config (float32 rounding), and the step-2 checkpoint resumed by two
    processes ends there too."""
    import contextlib
    import io
    import shutil

    from jaxcnn.train.cli import train_main
    from jaxcnn.train.metrics import read_metrics
    out = _pipe_across_two(tmp_path / "two")
    # the layout the trainer built: each data shard's devices in both processes, whole batches
    assert "pipeline over 4 stages" in out and ("2 processes (a data shard's devices span 2 processes; "
                                                "each process loads the whole batch)") in out, out
    with contextlib.redirect_stdout(io.StringIO()) as one_out:
        assert train_main([os.path.join(ROOT, "configs", "lenet5_mnist.yaml"), *PIPE_ACROSS,
                           "--workdir", str(tmp_path / "one")]) == 0
    assert "processes" not in one_out.getvalue()
    a, b = read_metrics(str(tmp_path / "two")), read_metrics(str(tmp_path / "one"))
    assert [(r["kind"], r["step"]) for r in a] == [(r["kind"], r["step"]) for r in b] == \
        [("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("eval", 4), ("per_class", 4)]
    assert a[-1]["confusion"] == b[-1]["confusion"] and sum(a[-1]["images"]) == 40
    a, b = a[:-1], b[:-1]
    for ra, rb in zip(a, b):
        for key in ("loss", "top1"):
            assert abs(ra[key] - rb[key]) < 2e-5, (ra, rb)
        if ra["kind"] == "eval":
            assert ra["count"] == rb["count"] == 40
    pa, _ = load_npz(tmp_path / "two" / "params.npz")
    pb, _ = load_npz(tmp_path / "one" / "params.npz")
    assert max_diff(pa, pb) < 2e-5
    resumed = tmp_path / "resumed"
    shutil.copytree(tmp_path / "two", resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    (resumed / "params.npz").unlink()
    out = _pipe_across_two(resumed, "checkpoint.resume=must")
    assert "resumed from step 2" in out, out
    pr, _ = load_npz(resumed / "params.npz")
    assert max_diff(pr, pb) < 2e-5
    c = read_metrics(str(resumed))
    assert [(r["kind"], r["step"]) for r in c[:-1]] == [(r["kind"], r["step"]) for r in b]
    assert c[-1]["kind"] == "per_class"
    for rc_, rb in zip(c[:-1], b):
        assert abs(rc_["loss"] - rb["loss"]) < 2e-5, (rc_, rb)
