"""End-to-end tests of the trainer: tiny real runs of the CLI on every data source."""
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml

import xla_cache
from jaxcnn.interop import load_npz
from jaxcnn.train.cli import eval_main, train_main
from jaxcnn.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(ROOT, "configs")

# A small, fast run on the packaged MNIST digits: lenet5 at batch 32.
# One device: these tests are about the trainer, tests/parallel covers meshes.
FAST = ["mesh.data=1", "model.name=lenet5", "data.batch_size=32", "data.eval_batch_size=500", "data.prefetch=1",
        "logging.log_every=1", "logging.progress=lines", "optim.name=adam", "optim.lr=0.002",
        "optim.schedule.name=constant", "train.eval_every=null"]


def _write_cifar(directory, rng, n_train=640, n_test=32):
    """CIFAR-10 binary files (label byte + 3x32x32 CHW bytes per record) whose images carry
    their label as a brightness level, so a model can learn them."""
    os.makedirs(directory, exist_ok=True)

    def records(count):
        labels = rng.integers(0, 10, count).astype(np.uint8)
        pixels = rng.integers(0, 40, (count, 3, 32, 32)) + labels[:, None, None, None] * 20
        rows = np.concatenate([labels[:, None], pixels.reshape(count, -1).astype(np.uint8)], axis=1)
        return rows.tobytes()

    for i in range(1, 6):
        with open(os.path.join(directory, f"data_batch_{i}.bin"), "wb") as f:
            f.write(records(n_train // 5))
    with open(os.path.join(directory, "test_batch.bin"), "wb") as f:
        f.write(records(n_test))
    return directory


def _losses(workdir):
    return [r["loss"] for r in read_metrics(workdir) if r["kind"] == "train"]


# A 24-step run without checkpoints, shared (read only) by the two tests below (one xdist group):
# the first run of the same-seed pair and the uninterrupted reference of the SIGTERM test.
UNINTERRUPTED = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=24", "checkpoint.enabled=false"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    work = tmp_path_factory.mktemp("uninterrupted") / "a"
    with contextlib.redirect_stdout(io.StringIO()):
        assert train_main(UNINTERRUPTED + ["--workdir", str(work)]) == 0
    return work


@pytest.mark.xdist_group("trainer_uninterrupted")
def test_same_seed_same_losses_and_loss_falls(uninterrupted, tmp_path, capsys):
    assert train_main(UNINTERRUPTED + ["--workdir", str(tmp_path / "b")]) == 0
    a, b = _losses(uninterrupted), _losses(tmp_path / "b")
    assert len(a) == 24 and a == b
    assert np.mean(a[-4:]) < np.mean(a[:4]) - 0.25  # from ~2.30 (chance) after 24 small steps
    out = capsys.readouterr().out
    assert "final eval at step 24" in out and "img/s" in out and "  train_acc 0." in out
    assert "top-5" in out  # 10 classes
    # Start-up lines in the config's words, not internals (they said 'loss scale NoOpLossScale').
    assert "[jaxcnn] precision fp32  loss scaling off  optimiser " in out and "[jaxcnn] devices " in out
    assert not any(word in out for word in ("NoOpLossScale", "p=f32", "fsdp", "False")), out
    for name in ("config.resolved.yaml", "run_meta.json", "metrics.jsonl", "params.npz"):
        assert (tmp_path / "b" / name).is_file()
    meta = json.loads((tmp_path / "b" / "run_meta.json").read_text())
    assert meta["versions"]["jax"] and meta["devices"]
    # The suite keeps glibc's defaults (tests/conftest.py), and the run says so.
    assert meta["host_malloc"] == "JAXCNN_CPU_MALLOC=0"
    final = [r for r in read_metrics(tmp_path / "b") if r["kind"] == "eval"][-1]
    assert final["count"] == 2000 and final["top1"] > 0.3  # chance is 0.1


@pytest.mark.xdist_group("trainer_uninterrupted")
def test_sigterm_then_resume_is_bitwise_equal_to_uninterrupted(uninterrupted, tmp_path):
    common = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=24",
              "checkpoint.every=4", "checkpoint.keep=2"]
    # A checkpoint every 4 steps (about 0.3 s a save): the SIGTERM comes once the first, step
    # 4's, exists; keep=2 deletes the older ones in the resumed run.
    # The uninterrupted reference is the module's `uninterrupted` run: this config without
    # checkpoints (they change no step), in process.

    # The same run in a subprocess, stopped by SIGTERM once a checkpoint exists (it loads the
    # reference's compiled programs from the suite's compilation cache: the same executables).
    work = tmp_path / "run"
    cmd = [sys.executable, "-m", "jaxcnn.train.cli", *common, "--workdir", str(work)]
    env = xla_cache.subprocess_env(dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if (work / "checkpoints" / "4").is_dir():
            proc.send_signal(signal.SIGTERM)
            break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "SIGTERM received: checkpoint saved" in out
    assert not (work / "params.npz").exists()

    # Resume (checkpoint.resume=must) and finish in process.
    assert train_main(common + ["checkpoint.resume=must", "--workdir", str(work)]) == 0
    ref_params, ref_state = load_npz(uninterrupted / "params.npz")
    params, state = load_npz(work / "params.npz")
    flat_ref = dict(_flatten(ref_params))
    flat = dict(_flatten(params))
    assert flat_ref.keys() == flat.keys()
    for k in flat_ref:
        np.testing.assert_array_equal(flat[k], flat_ref[k], err_msg=k)
    steps = [r["step"] for r in read_metrics(work) if r["kind"] == "train"]
    assert steps[-1] == 24


def _flatten(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}{k}.")
        else:
            yield prefix + k, np.asarray(v)


_INTERRUPTED_COMPILE = """
import os, signal, sys, threading
from jaxcnn.train import _plan
real = _plan._compile
def compile_interrupted(lowered):  # Ctrl-C a moment into XLA's compilation of the train step
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
    return real(lowered)
_plan._compile = compile_interrupted
from jaxcnn.train.cli import train_main
sys.argv[0] = "jaxcnn-train"
sys.exit(train_main())
"""


def test_ctrl_c_while_compiling_is_one_line_and_exit_130(tmp_path):
    """Ctrl-C before the first step (the loop's own handler is not yet in place): the command's
    line came, then the interpreter's exit crashed under XLA's still-running compilation
    (SIGSEGV, exit 139).  Without the compilation cache (the CLI's default one, in HOME, may
    hold this program from an earlier run: then the compile ends before the Ctrl-C)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", _INTERRUPTED_COMPILE, os.path.join(CONFIGS, "mnist_cnn.yaml"),
                           "model.name=mnist_cnn", "train.steps=2", "train.compilation_cache=null",
                           "--workdir", str(tmp_path / "w")],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    assert proc.stderr.strip().splitlines() == ["jaxcnn-train: interrupted"], proc.stderr[-2000:]


@pytest.mark.parametrize("where", ["eval", "batch"])
def test_a_data_worker_killed_by_the_stop_signal_is_that_stop(tmp_path, capsys, monkeypatch, where):
    """Ctrl-C in a terminal reaches the image loader's worker processes too; one still starting
    (an evaluation's, or the training batches') dies of it. The run stopped on grain's
    RuntimeError with a traceback; it now saves and stops as the signal asked."""
    from jaxcnn.train import _loop

    def signal_then_dead_worker():
        signal.raise_signal(signal.SIGINT)  # the trainer's handler takes it: a stop at the next boundary
        raise RuntimeError("Worker process was terminated unexpectedly with exit code -2.")

    if where == "eval":
        monkeypatch.setattr(_loop, "evaluate_state", lambda *args, **kwargs: signal_then_dead_worker())
    else:
        batches = _loop.train_batches

        def dying_batches(cfg, run, plan, start):
            made, close = batches(cfg, run, plan, start)

            def gen():
                for step in range(start, start + 3):
                    yield next(made)
                signal_then_dead_worker()
            return gen(), close
        monkeypatch.setattr(_loop, "train_batches", dying_batches)
    work = tmp_path / "w"
    code = train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=6", "train.eval_every=3",
                       "checkpoint.every=10", "--workdir", str(work)])
    out = capsys.readouterr()
    assert code == 128 + signal.SIGINT, out.err
    assert "SIGINT received: checkpoint saved at step 3, stopping" in out.out and "Traceback" not in out.err
    assert sorted(os.listdir(work / "checkpoints")) == ["3"] and not (work / "params.npz").exists()
    monkeypatch.undo()
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=6", "train.eval_every=3",
                       "checkpoint.every=10", "--workdir", str(work)]) == 0
    assert "resumed from step 3" in capsys.readouterr().out


def test_resuming_a_finished_run_changes_nothing_and_warns_nothing(tmp_path, capsys):
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "model.name=lenet5", "train.steps=2",
            "checkpoint.every=1", "--workdir", str(tmp_path / "w")]
    assert train_main(args) == 0
    first = dict(_flatten(load_npz(tmp_path / "w" / "params.npz")[0]))
    capsys.readouterr()
    assert train_main(args) == 0
    out = capsys.readouterr()
    assert "warning" not in out.out + out.err, out
    again = dict(_flatten(load_npz(tmp_path / "w" / "params.npz")[0]))
    assert first.keys() == again.keys()
    for k in first:
        np.testing.assert_array_equal(again[k], first[k], err_msg=k)


def test_resume_must_without_checkpoint_fails_cleanly(tmp_path, capsys, monkeypatch):
    # The refused resume closes its checkpoint manager, which waits for the clean-up of old
    # temporary directories orbax starts on a thread: one still running at interpreter shutdown
    # printed a 40-line traceback after the error line (1 run in 6). The clean-up is slowed here
    # so that a manager left open, or closed without waiting, leaves the thread running.
    import time

    from orbax.checkpoint import checkpoint_manager as orbax_manager
    cleanup, done = orbax_manager.temporary_paths.cleanup_temporary_paths, []

    async def slow_cleanup(*args, **kwargs):
        time.sleep(0.5)
        result = await cleanup(*args, **kwargs)
        done.append(True)
        return result

    monkeypatch.setattr(orbax_manager.temporary_paths, "cleanup_temporary_paths", slow_cleanup)
    code = train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=2",
                       "checkpoint.resume=must", "--workdir", str(tmp_path / "w")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint" in err[0].lower()
    assert len(done) == 1  # finished before train_main returned


def test_resume_never_over_an_earlier_runs_checkpoints_is_refused(tmp_path, capsys):
    """It trained on beside them: no checkpoint saved until their newest step was passed (a
    warning each time), its metrics appended to theirs, config and params.npz replaced."""
    work = tmp_path / "w"
    for step in (558, 620):
        (work / "checkpoints" / str(step)).mkdir(parents=True)
    (work / "metrics.jsonl").write_text('{"step": 620, "kind": "train"}\n')
    code = train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=2",
                       "checkpoint.resume=never", "--workdir", str(work)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"jaxcnn-train: error: checkpoint.resume=never, but {work / 'checkpoints'} holds the checkpoints "
                   f"of an earlier run (steps 558, 620): a new run would mix with them; give it a new --workdir, "
                   f"or remove {work / 'checkpoints'} to start over\n")
    assert sorted(p.name for p in work.iterdir()) == ["checkpoints", "metrics.jsonl"]  # nothing written


def test_a_run_without_checkpoints_never_replaces_another_runs_results(tmp_path, capsys):
    """checkpoint.enabled=false over a run directory trained its own run beside the earlier one:
    params.npz and config.resolved.yaml replaced (the earlier run's parameters lost), its metrics
    appended to theirs, their checkpoints left for another config."""
    work = tmp_path / "w"
    base = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=2", "--workdir", str(work)]
    assert train_main([*base, "checkpoint.enabled=false"]) == 0
    before = {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()}
    capsys.readouterr()
    assert train_main([*base, "checkpoint.enabled=false", "optim.lr=0.01"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{work} holds the final parameters ({work / 'params.npz'}) of a run under " \
        "another config (optim.lr: 0.002 -> 0.01); with checkpoint.enabled=false this run starts afresh" in err, err
    assert {p.name: p.read_bytes() for p in work.iterdir() if p.is_file()} == before
    assert train_main([*base, "checkpoint.enabled=false"]) == 0  # the same run again: the same parameters
    # Checkpoints of an earlier run, whatever its config, as with checkpoint.resume=never.
    other = tmp_path / "o"
    (other / "checkpoints" / "4").mkdir(parents=True)
    capsys.readouterr()
    assert train_main([*base[:-1], str(other), "checkpoint.enabled=false"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"jaxcnn-train: error: checkpoint.enabled=false, but {other / 'checkpoints'} holds the "
                          "checkpoints of an earlier run (steps 4)"), err


def test_a_runs_own_config_resumes_that_run(tmp_path, capsys, monkeypatch):
    """``jaxcnn-train runs/x/config.resolved.yaml`` trained a new run from scratch in
    runs/config.resolved; ``jaxcnn-train runs/x`` said only "cannot read config file ...: it is a
    directory"."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "x"
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=4", "checkpoint.every=2"]
    assert train_main([*args, "--workdir", str(run)]) == 0
    shutil.rmtree(run / "checkpoints" / "4")
    (run / "params.npz").unlink()
    capsys.readouterr()
    assert train_main([str(run / "config.resolved.yaml")]) == 0
    assert "resumed from step 2" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "runs")) == ["x"] and (run / "params.npz").exists()
    assert train_main([str(run)]) == 2
    assert capsys.readouterr().err == (
        f"jaxcnn-train: error: {run} is a run directory, not a config file: to resume it, jaxcnn-train "
        f"{run / 'config.resolved.yaml'} (its run directory is then the default --workdir); to evaluate it, "
        f"jaxcnn-eval {run}\n")


def test_missing_cifar_data_says_what_to_fetch(tmp_path, capsys):
    """configs/resnet18_cifar10.yaml on a new machine said only "data.path: ... does not exist"."""
    assert train_main([os.path.join(CONFIGS, "resnet18_cifar10.yaml"), f"data.path={tmp_path / 'cifar'}",
                       "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"data.path: '{tmp_path / 'cifar'}' does not exist; CIFAR-10's binary " \
        "version (data_batch_1.bin ... test_batch.bin) is cifar-10-binary.tar.gz from " \
        "https://www.cs.toronto.edu/~kriz/cifar.html, extracted" in err, err


@pytest.mark.parametrize("source, make", [
    ("folder", "an image folder (PATH/train/<class>/<image>, PATH/val/<class>/<image>; or "
               "PATH/<class>/<image> with data.val_split); "
               "jaxcnn-data shapes data/shapes writes an example one"),
    ("records", "a record directory; jaxcnn-data convert IMAGE_FOLDER data/shapes writes one")])
def test_a_missing_image_folder_says_how_to_make_one(tmp_path, monkeypatch, capsys, source, make):
    """configs/shapes_folder.yaml before `jaxcnn-data shapes data/shapes` said only "does not exist"."""
    monkeypatch.chdir(tmp_path)
    assert train_main([os.path.join(CONFIGS, "shapes_folder.yaml"), f"data.source={source}",
                       "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == f"jaxcnn-train: error: data.path: 'data/shapes' does not exist; it should be {make}\n"


@pytest.mark.parametrize("override, needle", [
    ("optim.lr=-1", "optim.lr"),
    ("optim.lrr=0.1", "did you mean 'optim.lr'"),
    ("train.steps=abc", "train.steps"),
    ("data.source=imagenet", "data.source"),
    ("model.name=resnet19", "resnet18"),
    ("data.path=/nonexistent/dir", "/nonexistent/dir"),
    ("precision.policy=p=f99", "precision.policy"),
    ("mesh.model=3", "mesh.model: 3 does not divide"),         # raised in jaxcnn.parallel
    ("parallel.rules.channels=model", "parallel.rules.channels"),
])
def test_config_errors_exit_2_with_one_line(tmp_path, capsys, override, needle):
    code = train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), override,
                       "--workdir", str(tmp_path / "w")])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in captured.err


@pytest.mark.parametrize("damage, needle", [
    ("magic", "magic"),
    ("truncate", "train-images"),
    ("labels", "label"),
])
def test_corrupt_mnist_files_exit_2(tmp_path, capsys, damage, needle):
    import gzip
    import shutil

    from jaxcnn.data import packaged_mnist_dir
    data = tmp_path / "mnist"
    data.mkdir()
    with packaged_mnist_dir() as src:
        for name in os.listdir(src):
            if name.endswith(".gz"):
                shutil.copy(os.path.join(src, name), data / name)
    images = data / "train-images-idx3-ubyte.gz"
    labels = data / "train-labels-idx1-ubyte.gz"
    if damage == "magic":
        raw = bytearray(gzip.decompress(images.read_bytes()))
        raw[3] = 0x02
        images.write_bytes(gzip.compress(bytes(raw)))
    elif damage == "truncate":
        raw = gzip.decompress(images.read_bytes())
        images.write_bytes(gzip.compress(raw[: len(raw) // 2]))
    else:
        raw = bytearray(gzip.decompress(labels.read_bytes()))
        raw[8] = 42
        labels.write_bytes(gzip.compress(bytes(raw)))
    code = train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), f"data.path={data}",
                       "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert code == 2 and needle in err.lower() and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_print_config_round_trips(tmp_path, capsys):
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), "optim.lr=0.01", "--print-config"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["optim"]["lr"] == 0.01 and resolved["model"]["name"] == "mnist_cnn"


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory):
    return _write_cifar(str(tmp_path_factory.mktemp("cifar")), np.random.default_rng(0))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    from jaxcnn.data.shapes import write_shapes_folder
    root = tmp_path_factory.mktemp("shapes")
    write_shapes_folder(root, per_class=(2, 1), size_range=(16, 24))
    return str(root)


@pytest.mark.parametrize("config", sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml")))
def test_every_shipped_config_dry_runs(config, cifar_dir, image_folder, capsys, monkeypatch):
    # Traced and lowered as the real run would (the same wrapped steps), but not compiled by
    # XLA: that takes minutes for the ImageNet models on a 2-core CPU, and their memory depends
    # on the machine (tests/train/test_dry_run.py checks the compiled memory check).
    from jaxcnn.train import _plan
    monkeypatch.setattr(_plan, "_compile", lambda lowered: None)
    args = [os.path.join(CONFIGS, config), "--dry-run"]
    if "cifar10" in config:
        args.append(f"data.path={cifar_dir}")
    if (yaml.safe_load(open(os.path.join(CONFIGS, config))).get("data") or {}).get("source") == "folder":
        # a tiny folder of 8 training images: one step an epoch, too short for a warm-up in steps
        args += [f"data.path={image_folder}", "data.batch_size=8", "optim.schedule.warmup=0"]
    assert train_main(args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "dry run ok" in out and "Total MACs" in out


def test_the_cli_keeps_its_compiled_programs_in_a_cache_by_default(tmp_path):
    """A repeated jaxcnn-train compiled every program again (no persistent cache was set)."""
    data = _tiny_npz(tmp_path / "d.npz", np.random.default_rng(0))
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(PYTHONPATH=ROOT, HOME=str(tmp_path / "home"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    cache = tmp_path / "home" / ".cache" / "jaxcnn" / "xla"  # train.compilation_cache's default

    def run(name, *extra):
        done = subprocess.run(
            [sys.executable, "-m", "jaxcnn.train.cli", os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST,
             "model.name=mnist_cnn", "data.source=npz", f"data.path={data}", "train.steps=1",
             "checkpoint.enabled=false", "data.batch_size=8", *extra, "--workdir", str(tmp_path / name)],
            env=env, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr

    run("off", "train.compilation_cache=null")
    assert not cache.exists()
    run("default")
    assert len(os.listdir(cache)) >= 2  # the train and the eval step, at least


@pytest.mark.parametrize("overrides, workdir", [
    ((), "runs/shapes_folder"),
    (("data.path=/home/me/photos",), "runs/shapes_folder-photos"),
    (("data.path=data/shapes/", "data.path=~/pics"), "runs/shapes_folder-pics"),  # the last one counts
    (("data.path=d.npz", "train.steps=3"), "runs/shapes_folder-d"),
    (("data.path=~/photos.v2",), "runs/shapes_folder-photos.v2"),  # a folder keeps its dots
    (("data.path=null",), "runs/shapes_folder")])
def test_the_default_run_directory_names_data_given_on_the_command_line(overrides, workdir):
    """The README's shapes demo and "your own photos" (the same config, data.path=...) both
    trained in runs/shapes_folder: the second resumed the first's checkpoints."""
    from jaxcnn.train.rundir import default_workdir
    assert default_workdir(os.path.join(CONFIGS, "shapes_folder.yaml"), overrides) == workdir


def _tiny_npz(path, rng):
    labels = rng.integers(0, 4, 96)
    x = (rng.random((96, 10, 10)) * 60 + labels[:, None, None] * 50).astype(np.uint8)
    np.savez(path, x_train=x[:64], y_train=labels[:64], x_test=x[64:], y_test=labels[64:])
    return path


@pytest.mark.parametrize("source", ["cifar10", "npz", "synthetic"])
def test_each_data_source_trains(tmp_path, cifar_dir, source):
    rng = np.random.default_rng(1)
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "model.name=mnist_cnn", "train.steps=16",
            "checkpoint.enabled=false", f"data.source={source}"]
    # The npz and synthetic runs take _tiny_npz's shapes (10x10x1 images, 4 classes, batch 32,
    # 32 test images), as the npz runs of the tests below do: the same initialisation, train and
    # eval programs, which the suite's compilation cache serves after the first of them.
    if source == "cifar10":
        args += [f"data.path={cifar_dir}", "data.batch_size=16", "model.num_classes=10"]
    elif source == "npz":
        args += [f"data.path={_tiny_npz(tmp_path / 'd.npz', rng)}", "model.num_classes=4"]
    else:
        args += ["data.image_size=[10,10,1]", "data.num_train=64", "data.num_eval=32",
                 "data.num_classes=4", "model.num_classes=4"]
    assert train_main(args + ["--workdir", str(tmp_path / "w")]) == 0
    losses = _losses(tmp_path / "w")
    assert np.mean(losses[-4:]) < np.mean(losses[:4]), losses


def test_eval_cli_and_plot(tmp_path, capsys):
    work = tmp_path / "w"
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=4",
                       "checkpoint.every=2", "--workdir", str(work)]) == 0
    final = [r for r in read_metrics(work) if r["kind"] == "eval"][-1]
    capsys.readouterr()
    assert eval_main([str(work), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 4 and result["count"] == 2000
    assert result["top1"] == pytest.approx(final["top1"]) and result["loss"] == pytest.approx(final["loss"], rel=1e-5)
    assert eval_main([str(tmp_path / "nothing")]) == 2
    # A negative step is not a step (it said "checkpoints/-1 does not exist").
    capsys.readouterr()
    assert eval_main([str(work), "--step", "-1"]) == 2
    assert capsys.readouterr().err == (f"jaxcnn-eval: error: --step -1 is not a valid step (steps count "
                                       f"from 0); steps saved in {work / 'checkpoints'}: 2, 4\n")
    pytest.importorskip("matplotlib")
    from jaxcnn.train.plot import main as plot_main
    assert plot_main([str(work)]) == 0
    assert (work / "curves.png").stat().st_size > 1000


def test_eval_of_something_that_is_no_run_directory_says_what_it_is(tmp_path, capsys):
    """A config file given to jaxcnn-eval (as to jaxcnn-train) read 'configs/x.yaml/config.resolved.yaml
    does not exist'."""
    (tmp_path / "params.npz").write_bytes(b"")
    (tmp_path / "empty").mkdir()
    for arg, needle in [(os.path.join(CONFIGS, "mnist_cnn.yaml"),
                         "mnist_cnn.yaml is a file, not a run directory: give the directory jaxcnn-train "
                         "wrote (this config's run is in runs/mnist_cnn unless --workdir said otherwise)"),
                        (str(tmp_path / "params.npz"), "params.npz is a file, not a run directory"),
                        (str(tmp_path / "typo"), "typo: no such run directory"),
                        (str(tmp_path / "empty"), "config.resolved.yaml does not exist: not a jaxcnn run")]:
        assert eval_main([arg]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("jaxcnn-eval: error: ") and needle in err, err


def test_eval_from_another_directory_says_where_a_relative_data_path_was(tmp_path, capsys, monkeypatch):
    """``jaxcnn-eval runs/x`` from elsewhere than the training: it said only "data.path: 'd.npz' does
    not exist"."""
    project = tmp_path / "project"
    project.mkdir()
    _tiny_npz(project / "d.npz", np.random.default_rng(0))
    monkeypatch.chdir(project)
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "model.name=mnist_cnn", "train.steps=2",
                       "data.source=npz", "data.path=d.npz", "model.num_classes=4", "--workdir", "run"]) == 0
    assert json.loads((project / "run" / "run_meta.json").read_text())["cwd"] == str(project)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert eval_main(["project/run"]) == 2
    assert capsys.readouterr().err == (
        f"jaxcnn-eval: error: data.path: 'd.npz' does not exist (relative to the current directory, {tmp_path}; "
        f"the run was started in {project}: run from there, or give data.path=...)\n")
    assert eval_main(["project/run", "data.path=project/d.npz", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 2


def test_every_command_says_where_a_saved_runs_relative_path_was(tmp_path, capsys, monkeypatch):
    """Only jaxcnn-eval said where a run with relative paths was started; jaxcnn-export (which
    needs the data to calibrate or to measure a pruning), jaxcnn-predict (an older run without
    preprocessing.json) and jaxcnn-train resuming the run said only "... does not exist"."""
    import jax

    from jaxcnn import models
    from jaxcnn.export.cli import main as export_main
    from jaxcnn.interop import save_npz
    from jaxcnn.predict import main as predict_main
    from PIL import Image

    project = tmp_path / "project"
    project.mkdir()
    rng = np.random.default_rng(0)
    _tiny_npz(project / "d.npz", rng)
    params, state, _ = models.get("mnist_cnn", num_classes=4).init(jax.random.PRNGKey(1), (1, 10, 10, 1))
    save_npz(project / "init.npz", params, state)
    Image.fromarray(rng.integers(0, 255, (10, 10), dtype=np.uint8)).save(tmp_path / "digit.png")
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "model.name=mnist_cnn", "train.steps=2",
            "data.source=npz", "data.path=d.npz", "model.num_classes=4", "model.init_from=init.npz",
            "checkpoint.every=1"]
    monkeypatch.chdir(project)
    assert train_main([*args, "--workdir", "run"]) == 0
    (project / "run" / "preprocessing.json").unlink()  # as runs written before it existed
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()

    def hint(key, value):
        return (f"{key}: {value!r} does not exist (relative to the current directory, {tmp_path}; the run "
                f"was started in {project}: run from there, or give {key}=...)")
    for command, argv, key, value in [
            (export_main, ["project/run", "--format", "npz", "--prune", "0.5", "--out", "p.npz"], "data.path", "d.npz"),
            (predict_main, ["project/run", "digit.png"], "data.path", "d.npz"),
            (train_main, [*args, "--workdir", "project/run"], "data.path", "d.npz")]:
        assert command(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and hint(key, value) in err, err
    # Resuming with the data here too: the parameters it started from are still looked for.
    _tiny_npz(tmp_path / "d.npz", np.random.default_rng(0))
    assert train_main([*args, "--workdir", "project/run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and hint("model.init_from", "init.npz") in err, err


def test_a_log_right_after_the_first_step_has_a_throughput(tmp_path, capsys):
    """A one-step run (an export's --fine-tune-steps 1) or logging.log_every=1 logged the first
    step as "img/s nan  step nan ms", and metrics.jsonl held the strings "nan"."""
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=1",
                       "checkpoint.enabled=false", "--workdir", str(tmp_path / "w")]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("step 1/1"))
    assert "nan" not in line.lower(), line
    record = next(r for r in read_metrics(str(tmp_path / "w")) if r["kind"] == "train")
    assert isinstance(record["img_per_s"], float) and record["img_per_s"] > 0, record
    assert isinstance(record["step_time_ms"], float) and record["step_time_ms"] > 0, record


def test_settings_the_config_leaves_unused_are_named(tmp_path, capsys):
    """data.image_size on npz data, or optim.b1 under sgd, were dropped without a word (the run
    trained at the stored image size); the shipped configs set none."""
    import glob

    from jaxcnn.train.config import load_config, set_but_unused
    _tiny_npz(tmp_path / "d.npz", np.random.default_rng(0))
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "model.name=mnist_cnn", "data.source=npz",
            f"data.path={tmp_path / 'd.npz'}", "model.num_classes=4", "train.steps=1", "data.image_size=[28,28,1]",
            "optim.name=sgd", "optim.b1=0.8"]
    note = ("not applied: data.image_size=[28, 28, 1] (not used by data.source=npz); optim.b1=0.8 "
            "(not used by optim.name=sgd)")
    assert train_main([*args, "--dry-run"]) == 0
    assert note + "\n" in capsys.readouterr().out
    assert train_main([*args, "checkpoint.enabled=false", "--workdir", str(tmp_path / "w")]) == 0
    assert f"[jaxcnn] {note}\n" in capsys.readouterr().out
    for path in glob.glob(os.path.join(CONFIGS, "*.yaml")):
        assert set_but_unused(load_config(path)) == [], path


def test_eval_of_a_run_without_checkpoints_uses_its_final_parameters(tmp_path, capsys):
    """A run with checkpoint.enabled=false writes params.npz (which jaxcnn-export and -predict
    use), but jaxcnn-eval said "checkpoints does not exist: no checkpoints"."""
    work = tmp_path / "w"
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=2", "checkpoint.enabled=false",
                       "--workdir", str(work)]) == 0
    final = [r for r in read_metrics(str(work)) if r["kind"] == "eval"][-1]
    capsys.readouterr()
    assert eval_main([str(work), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 2 and result["count"] == final["count"]
    assert result["top1"] == final["top1"] and result["loss"] == pytest.approx(final["loss"], rel=1e-6)
    assert eval_main([str(work), "--step", "2"]) == 2  # a step names a checkpoint: there is none
    assert "no checkpoints" in capsys.readouterr().err


def test_tensorboard_events_and_progress_bar(tmp_path, capsys):
    pytest.importorskip("tensorboardX")
    work = tmp_path / "tb"
    assert train_main([os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=3",
                       "checkpoint.enabled=false", "logging.tensorboard=true", "logging.progress=bar",
                       "--workdir", str(work)]) == 0
    events = [f for f in os.listdir(work / "tb") if f.startswith("events.out.tfevents")]
    assert events and (work / "tb" / events[0]).stat().st_size > 100
    out = capsys.readouterr()
    assert "3/3" in out.out + out.err  # tqdm's bar


@pytest.mark.parametrize("argv", [["--bogus"], ["-\n0"], ["-\x0c"], []])
def test_command_line_errors_are_one_line_exit_2(tmp_path, capsys, argv):
    """argparse's own errors too: no usage block, the offending argument's newlines escaped."""
    with pytest.raises(SystemExit) as e:
        train_main(([os.path.join(CONFIGS, "mnist_cnn.yaml")] if argv else []) + argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("jaxcnn-train: error: ") and "--help" in err, err
    with pytest.raises(SystemExit) as e:
        eval_main([str(tmp_path), "--step", "x"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("jaxcnn-eval: error:"), err


def test_a_second_trainer_on_the_same_run_directory_is_refused(tmp_path, capsys):
    """The same command run twice at once (two terminals, a job resubmitted) trained both into one
    directory, each writing its checkpoints, metrics and params.npz over the other's. A trainer
    holds the directory (an flock, released when it ends); a second is one line, exit 2."""
    import fcntl
    work = tmp_path / "w"
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "train.steps=2", "checkpoint.every=2",
            "--workdir", str(work)]
    assert train_main(args) == 0
    lock = work / ".jaxcnn-train.lock"
    assert lock.is_file() and lock.stat().st_size == 0
    before = {p.name: p.stat().st_mtime_ns for p in work.rglob("*")}
    capsys.readouterr()
    with open(lock) as other:  # another trainer, as far as flock can tell
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert train_main(args) == 2
        err = capsys.readouterr().err
        assert err == (f"jaxcnn-train: error: {work} is in use by another jaxcnn-train (it holds {lock}); "
                       "wait for it to end, or give another --workdir\n"), err
    assert {p.name: p.stat().st_mtime_ns for p in work.rglob("*")} == before
    assert train_main(args) == 0  # released: the run is resumed (finished) as usual


def test_a_run_recorded_with_the_old_flip_key_resumes_and_evaluates(tmp_path, capsys):
    """Run directories record their config, and before data.augment.hflip they held ``flip: true``
    and none of the new keys, in config.resolved.yaml and in every checkpoint. Such a run resumes
    (flip: true is hflip 0.5: the same training) and jaxcnn-eval reads it."""
    import json

    import yaml
    work = tmp_path / "w"
    args = [os.path.join(CONFIGS, "mnist_cnn.yaml"), *FAST, "checkpoint.every=1", "--workdir", str(work)]
    assert train_main(args + ["train.steps=2", "data.augment.flip=true"]) == 0  # the old key still loads

    def as_recorded_before(config):
        augment = config["data"]["augment"]
        config["data"]["augment"] = {"crop_padding": augment["crop_padding"], "flip": True,
                                     "mixup": augment["mixup"], "cutmix": augment["cutmix"]}
        return config

    recorded = work / "config.resolved.yaml"
    recorded.write_text(yaml.safe_dump(as_recorded_before(yaml.safe_load(recorded.read_text())), sort_keys=False))
    for meta in work.glob("checkpoints/*/meta/metadata"):
        manifest = json.loads(meta.read_text())
        manifest["config"] = as_recorded_before(manifest["config"])
        manifest["config_digest"] = "0" * 64  # a digest of the old keys: compared key by key instead
        meta.write_text(json.dumps(manifest))
    capsys.readouterr()
    assert train_main(args + ["train.steps=2", "data.augment.hflip=0.5"]) == 0
    out = capsys.readouterr()
    assert "resumed from step 2" in out.out and "warning" not in out.out + out.err, out
    assert eval_main([str(work)]) == 0
    assert train_main(args + ["train.steps=2", "data.augment.hflip=0"]) == 2  # a real change is still one
    assert "data.augment.hflip: 0.5 -> 0.0" in capsys.readouterr().err
