"""``jaxcnn-train --dry-run`` checks what the real run checks, with the same function (the run
function, ``jaxcnn.train.run.train``, stopped after its steps): mesh and plan, the wrapped train
and eval steps (traced, lowered and compiled from abstract inputs), sizes against the data and
memory, and the workdir."""
import errno
import importlib
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import yaml

from jaxcnn.train import _build, _data, _memory, _plan, rundir
from jaxcnn.train.config import load_config

from train_cli import cli, one_line

runner = importlib.import_module("jaxcnn.train.run")  # the module; jaxcnn.train.run is the function

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "mnist_cnn.yaml")

# Synthetic 12x12 images held in memory: small enough to compile and run in seconds.
TINY = {"model": {"name": "mnist_cnn"}, "train": {"steps": 2, "eval_every": None},
        "data": {"source": "synthetic", "image_size": [12, 12, 1], "num_train": 32, "num_eval": 16,
                 "batch_size": 8, "prefetch": 0},
        "logging": {"progress": "lines"}, "mesh": {"data": 1}}




@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return str(path)


# ---------------------------------------------------------------- the same setup as the real run

def test_mesh_larger_than_the_devices_fails_the_dry_run_like_the_real_run(tiny, tmp_path):
    """mesh.data=3 on a 1-device machine passed --dry-run, then the real run exited 2 (here: 9 of 8)."""
    n = jax.device_count() + 1
    dry = one_line(*cli([tiny, f"mesh.data={n}", "--dry-run"])[::2])
    real = one_line(*cli([tiny, f"mesh.data={n}", "--workdir", tmp_path / "w"])[::2])
    assert dry == real and f"mesh.data: data x model = {n} x 1" in dry, (dry, real)


def test_dry_run_lowers_the_wrapped_steps_of_the_real_run(tiny, monkeypatch):
    """The dry run traces the step the plan wraps (here pmap over all devices: it used to
    trace an unwrapped step with jax.eval_shape, and missed a pmap-only crash) and the eval step."""
    from jaxcnn.parallel.plan import ParallelPlan
    lowered = []

    def spy(wrap, kind):
        def wrapped(self, step, *a, **k):
            fn = wrap(self, step, *a, **k)
            lower = fn.lower

            def counting_lower(*args):
                lowered.append((kind, self.strategy, jax.tree_util.tree_map(np.shape, args[-1])))
                return lower(*args)
            try:
                fn.lower = counting_lower
            except AttributeError:  # jit objects: wrap them instead
                class Lowering:
                    def __init__(self):
                        self.lower = counting_lower

                    def __call__(self, *args):
                        return fn(*args)
                return Lowering()
            return fn
        return wrapped

    monkeypatch.setattr(ParallelPlan, "wrap_step", spy(ParallelPlan.wrap_step, "train"))
    monkeypatch.setattr(ParallelPlan, "wrap_eval", spy(ParallelPlan.wrap_eval, "eval"))
    n = jax.device_count()  # 28x28 digits, 16 a device: the shapes of the crash on mnist_cnn.yaml
    code, out, err = cli([tiny, "parallel.strategy=pmap", "mesh.data=-1", f"data.batch_size={16 * n}",
                          f"data.num_train={32 * n}", "data.image_size=[28,28,1]", "--dry-run"])
    assert code == 0, err
    assert "(pmap)" in out and "dry run ok" in out
    assert lowered[0] == ("train", "pmap", {"image": (n, 16, 28, 28, 1), "label": (n, 16)}), lowered
    assert lowered[1][:2] == ("eval", "pmap"), lowered


@pytest.mark.parametrize("strategy", ["shard_map", "pmap", "jit"])
@pytest.mark.parametrize("source", ["synthetic", "in-memory"])
def test_abstract_batch_is_what_the_loop_feeds(tiny, strategy, source):
    """The dry run compiles the step for exactly the batch the loop will put on the devices,
    so the real run's first call reuses that executable."""
    n = jax.device_count()
    overrides = [f"parallel.strategy={strategy}", "mesh.data=-1", f"data.batch_size={n}"]
    if source == "synthetic":  # per-step bytes (uint8), as throughput runs make them
        overrides += ["data.num_train=4000000"]
    cfg = load_config(tiny, overrides)
    run = _build.build_run(cfg)
    plan = _plan.make_plan(cfg, run.model, run.input_shape, _build.abstract_state(run))
    real = plan.put_batch(_data.batch_fn(run)(0))
    abstract = _plan.abstract_batch(run, plan)

    def describe(x):
        return (tuple(x.shape), np.dtype(x.dtype), getattr(x, "sharding", None) if strategy != "pmap" else None)
    assert jax.tree_util.tree_map(describe, real) == jax.tree_util.tree_map(describe, abstract)


# ---------------------------------------------------------------- sizes against the data and memory

@pytest.mark.parametrize("override, needle", [
    ("model.num_classes=1000000000", "model.num_classes=1000000000: the model's"),      # hung
    ("data.image_size=[100000,100000,3]", "data.image_size=[100000, 100000, 3]: the model's"),  # hung
    ("data.augment.crop_padding=100000", "data.augment.crop_padding: 100000 must be smaller than the "
                                         "image side (12"),                            # 2.85 TiB
])
def test_sizes_that_cannot_fit_fail_dry_run_and_real_run(tiny, tmp_path, override, needle, monkeypatch):
    """Both exit 2 with the same line naming the key, before anything is allocated."""
    dry = one_line(*cli([tiny, override, "--dry-run"])[::2])
    monkeypatch.setattr(_build, "initial_params", lambda *a, **k: pytest.fail("allocation started"))
    real = one_line(*cli([tiny, override, "--workdir", tmp_path / "w"])[::2])
    assert needle in dry and dry.split("; this machine")[0] == real.split("; this machine")[0], (dry, real)


def test_state_and_step_memory_are_checked_against_what_is_available(tiny, monkeypatch):
    """The training state from its shapes, then the compiled step's memory_analysis, against the
    memory available; the message names the keys that size it."""
    prepared = runner.train(load_config(tiny, []), dry_run=True)
    state, step = prepared.memory["state"], prepared.memory["train_step"]
    assert 0 < state < step < prepared.memory["available"]
    monkeypatch.setattr(_memory, "available_memory", lambda devices: (state - 1, "host"))
    line = one_line(*cli([tiny, "--dry-run"])[::2])
    assert "parameters and their optimiser state need" in line and "data.image_size=[12, 12, 1]" in line
    monkeypatch.setattr(_memory, "available_memory", lambda devices: ((state + step) // 2, "host"))
    line = one_line(*cli([tiny, "--dry-run"])[::2])
    assert "data.batch_size=8" in line and "one train step needs" in line, line


def test_eval_batch_larger_than_the_test_set_is_clipped(tiny, tmp_path):
    """data.eval_batch_size=1000000000 allocated 2.85 TiB of padding at the first evaluation; like
    PyTorch's DataLoader, the batch is the test set's size (a note says so)."""
    args = [tiny, "data.eval_batch_size=1000000000"]
    code, out, err = cli(args + ["--dry-run"])
    assert code == 0 and "eval batch 16 (data.eval_batch_size 1000000000 clipped" in out, err
    code, out, err = cli(args + ["--workdir", tmp_path / "w"])
    assert code == 0, err
    assert "data.eval_batch_size 1000000000 clipped to the 16 test images" in out
    assert "final eval at step 2" in out and "(16 images)" in out


# ---------------------------------------------------------------- the workdir

def _no_compute(monkeypatch):
    monkeypatch.setattr(_data, "build_data", lambda cfg, seed: pytest.fail("compute started"))


def test_workdir_that_is_a_file(tiny, tmp_path, monkeypatch):
    _no_compute(monkeypatch)
    afile = tmp_path / "passwd"
    afile.write_text("root:x:0:0\n")
    line = one_line(*cli([tiny, "--workdir", afile])[::2])
    assert line == f"jaxcnn-train: error: --workdir {afile} is a file, not a directory"
    line = one_line(*cli([tiny, "--workdir", afile / "runs" / "run"])[::2])
    assert line == (f"jaxcnn-train: error: --workdir {afile / 'runs' / 'run'} cannot be created: "
                    f"{afile} is not a directory")


def test_a_good_workdir_is_left_as_it_was_when_the_config_fails(tiny, tmp_path):
    """The checks write nothing that stays: a run refused for its config leaves no directory."""
    code, _, err = cli([tiny, "data.augment.crop_padding=100", "--workdir", tmp_path / "runs" / "run"])
    assert code == 2 and os.listdir(tmp_path) == ["tiny.yaml"], err


@pytest.mark.parametrize("where, err, needle", [
    ("create", errno.EACCES, "cannot be created in {parent} (Permission denied)"),
    ("create", errno.EROFS, "cannot be created in {parent} (Read-only file system)"),
    ("write", errno.EROFS, "is not writable (Read-only file system)"),
    ("write", errno.ENOSPC, "is not writable (No space left on device)"),
    ("statvfs", None, "is on a full disk (4.1 kB free"),
])
def test_unusable_workdir_is_one_line_before_compute(tiny, tmp_path, monkeypatch, where, err, needle):
    """A read-only or unwritable workdir (existing, or to be created in a parent), or a full
    disk (simulated: the tests run as root, where chmod does not stop writes)."""
    import tempfile
    _no_compute(monkeypatch)
    workdir = tmp_path / "runs" / "run"
    if where != "create":
        workdir.mkdir(parents=True)

    def fail(*a, **k):
        raise OSError(err, os.strerror(err))
    if where == "create":
        monkeypatch.setattr(tempfile, "mkdtemp", fail)
    elif where == "write":
        monkeypatch.setattr(tempfile, "mkstemp", fail)
    else:
        monkeypatch.setattr(rundir, "_free_disk", lambda path: 4096)
    line = one_line(*cli([tiny, "--workdir", workdir])[::2])
    assert line.startswith(f"jaxcnn-train: error: --workdir {workdir} "), line
    assert needle.format(parent=tmp_path) in line, line
    assert os.listdir(tmp_path) == ["tiny.yaml"] + (["runs"] if where != "create" else [])
    assert not workdir.exists() or os.listdir(workdir) == []  # the probes are removed


def test_full_disk_while_writing_params_keeps_checkpoints_and_removes_the_partial_file(tiny, tmp_path,
                                                                                     monkeypatch):
    """ENOSPC while params.npz is written: one line, exit 2; the partial file is removed, the
    previous params.npz is untouched and the checkpoints are kept."""
    import numpy as np
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "params.npz").write_bytes(b"the previous file")

    def full_disk(file, *a, **k):  # NumPy's writer, half way through the file
        file.write(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file.name)
    monkeypatch.setattr(np, "savez", full_disk)
    line = one_line(*cli([tiny, "checkpoint.enabled=true", "--workdir", workdir])[::2])
    assert f"cannot write {workdir / 'params.npz'} (No space left on device)" in line
    assert "partial file was removed" in line and "checkpoints in" in line and "are kept" in line
    assert (workdir / "params.npz").read_bytes() == b"the previous file"
    assert not [n for n in os.listdir(workdir) if "partial" in n], os.listdir(workdir)
    assert "2" in os.listdir(workdir / "checkpoints")


def test_available_memory_on_an_accelerator_is_the_least_free_device():
    """Accelerators: each device's limit less what it already holds; the tightest one counts.
    A backend without memory statistics means no check, not a refusal."""
    class Device:
        platform = "gpu"

        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats
    gb = 10**9
    devices = [Device({"bytes_limit": 80 * gb, "bytes_in_use": 10 * gb}),
               Device({"bytes_limit": 80 * gb, "bytes_in_use": 30 * gb})]
    assert _memory.available_memory(devices) == (50 * gb, "per device")
    assert _memory.available_memory([Device(None)]) is None
    free, scope = _memory.available_memory(jax.devices("cpu")[:1])
    assert scope == "host" and 0 < free


def _fake_host(root, cgroup, mountinfo, files, meminfo_kb=16_000_000):
    """A made-up /proc and /sys under ``root`` for :func:`_memory.host_available`."""
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: 32000000 kB\nMemAvailable: {meminfo_kb} kB\n")
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    (root / "proc" / "self" / "mountinfo").write_text(mountinfo)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return str(root)


GB = 10**9


def test_host_memory_reads_the_processs_own_cgroup_v1_and_v2_limits(tmp_path):
    """Inside a 1.2 GB cgroup-v1 limit the dry run said "21 GB available" (it read only cgroup
    v2's root file) and the run was OOM-killed at step 1. The process's own cgroup and those
    above it count, in either version; the tightest room wins."""
    v1 = _fake_host(tmp_path / "v1", "5:memory:/jobs/job7\n4:cpu:/\n0::/\n",
                    "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                    "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
                    {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
                     "sys/fs/cgroup/memory/memory.usage_in_bytes": "9000000000\n",
                     "sys/fs/cgroup/memory/jobs/job7/memory.limit_in_bytes": f"{int(1.2 * GB)}\n",
                     "sys/fs/cgroup/memory/jobs/job7/memory.usage_in_bytes": f"{int(0.2 * GB)}\n"})
    assert _memory.host_available(v1) == 1 * GB
    v2 = _fake_host(tmp_path / "v2", "0::/user.slice/run-1.scope\n",
                    "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                    {"sys/fs/cgroup/memory.current": "1\n",
                     "sys/fs/cgroup/user.slice/memory.max": f"{3 * GB}\n",
                     "sys/fs/cgroup/user.slice/memory.current": f"{1 * GB}\n",
                     "sys/fs/cgroup/user.slice/run-1.scope/memory.max": "max\n",
                     "sys/fs/cgroup/user.slice/run-1.scope/memory.current": f"{GB // 2}\n"})
    assert _memory.host_available(v2) == 2 * GB  # the slice's limit, above the process's own cgroup
    # a namespaced mount shows the process's cgroup as its root: the mount point's files count
    ns = _fake_host(tmp_path / "ns", "0::/kubepods/pod1\n",
                    "30 23 0:26 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n",
                    {"sys/fs/cgroup/memory.max": f"{4 * GB}\n", "sys/fs/cgroup/memory.current": "0\n"})
    assert _memory.host_available(ns) == 4 * GB
    free = _fake_host(tmp_path / "free", "0::/\n", "", {}, meminfo_kb=7_000_000)
    assert _memory.host_available(free) == 7_000_000 * 1024


def test_host_memory_counts_what_ulimit_v_leaves():
    """``ulimit -v`` ended in SIGABRT (std::bad_alloc) or a RESOURCE_EXHAUSTED traceback; the
    address space it leaves is now part of what the size check reads."""
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30)); "
            "from jaxcnn.train import _memory; print(_memory.host_available())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert 0 < int(out) < 8 << 30


@pytest.mark.parametrize("kind", ["fifo", "link-to-dev-zero"])
def test_init_from_must_be_a_regular_file(tiny, tmp_path, kind):
    """model.init_from naming a FIFO or a link to a device: one line naming the key (it said
    'does not exist' for them)."""
    path = tmp_path / f"params-{kind}.npz"
    os.mkfifo(path) if kind == "fifo" else os.symlink("/dev/zero", path)
    line = one_line(*cli([tiny, f"model.init_from={path}", "--dry-run"])[::2])
    assert line.startswith(f"jaxcnn-train: error: model.init_from: {str(path)!r} is ")
    assert "not a regular file" in line


def test_python_runs_the_trainer_from_a_mapping_a_file_or_a_config(tiny, tmp_path):
    """``jaxcnn.train.run``: the run ``jaxcnn-train`` makes, from Python, given a mapping (with a
    run directory), a YAML file or a loaded config; run again on its directory, it resumes."""
    import io

    import jaxcnn.train as T
    from jaxcnn.errors import ConfigError
    with pytest.raises(ConfigError, match="^logging.workdir: a config given as a mapping needs"):
        T.run(TINY)
    a = T.run(TINY, workdir=tmp_path / "a", stream=io.StringIO())
    assert a["step"] == 2 and os.path.isfile(tmp_path / "a" / "config.resolved.yaml")
    b = T.run(tiny, overrides=[f"logging.workdir={tmp_path / 'b'}"], stream=io.StringIO())
    assert b["step"] == 2 and b["loss"] == a["loss"]  # the same config trains the same
    out = io.StringIO()
    again = T.run(T.load_config(tiny), workdir=tmp_path / "a", stream=out)
    assert again["step"] == 2 and "resum" in out.getvalue().lower(), out.getvalue()


def test_jaxcnn_train_run_is_the_function_whatever_is_imported_first():
    """The module jaxcnn/train/run.py shares its name with the function ``jaxcnn.train.run``:
    importing the module by name (first, in a fresh interpreter, or again) leaves the package's
    attribute the function, and the module reachable in ``sys.modules``."""
    code = ("import sys, types\n"
            "import jaxcnn.train.run\n"
            "import jaxcnn.train.run as again\n"
            "import jaxcnn.train as T\n"
            "from jaxcnn.train import run\n"
            "assert isinstance(T.run, types.FunctionType) and run is T.run is again, T.run\n"
            "module = sys.modules['jaxcnn.train.run']\n"
            "assert isinstance(module, types.ModuleType) and module.run is T.run and callable(module.train)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_augmenting_synthetic_batches_made_per_step_is_refused(tiny):
    """Synthetic data too large to hold in memory is noise made per step, which no augmentation
    ever touched: a data.augment key set for it was dropped without a word."""
    per_step = ["data.source=synthetic", "data.image_size=[32,32,3]", "data.num_train=300000"]
    assert _build.build_run(load_config(tiny, per_step)).synthetic is not None
    err = one_line(*cli([tiny, *per_step, "data.augment.hflip=0.5", "--dry-run"])[::2])
    assert err.startswith("jaxcnn-train: error: data.augment: synthetic images made per step"), err
    held = ["data.source=synthetic", "data.image_size=[12,12,1]", "data.num_train=64"]
    assert _build.build_run(load_config(tiny, held + ["data.augment.vflip=1"])).dataset is not None


def test_a_real_run_without_a_run_directory_is_one_line(tiny):
    """``train(cfg)`` from Python without ``workdir`` (only a dry run goes without one): a
    ValueError naming ``workdir`` before anything is read, not a TypeError from deep inside."""
    with pytest.raises(ValueError, match=r"^train: workdir is needed") as err:
        runner.train(load_config(tiny))
    assert "\n" not in str(err.value)
