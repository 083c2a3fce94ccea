"""The benchmark scripts run end to end on the CPU (tiny sizes) and count work correctly."""
import importlib.util
import json
import os

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "scripts")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_mnist(monkeypatch, module, rows):
    """``module``'s ``mnist`` group as ``rows``: the same ops and channels on a few pixels (an
    interpreted kernel runs each tile in Python, so the real MNIST sizes take most of a test's
    time and exercise nothing more of the script)."""
    monkeypatch.setattr(module, "SHAPES", [r for r in module.SHAPES if r[0] != "mnist"] + rows)


def test_bench_kernels_work_counts():
    bk = _load("bench_kernels")
    # ResNet-50's 56x56x64 3x3 layer at batch 2: 2 * N * H * W * C_out * 9 * C_in FLOPs.
    flops, nbytes = bk.work("conv2d", (2, 56, 56, 64), dict(padding=1), (3, 3, 64, 64), 2)
    assert flops == 2 * 2 * 56 * 56 * 64 * 9 * 64
    assert nbytes == 2 * (2 * 56 * 56 * 64 + 9 * 64 * 64 + 2 * 56 * 56 * 64)
    # The 7x7/2 stem: 224 -> 112; the 3x3/2 max-pool: 112 -> 56, no FLOPs.
    assert bk.out_hw((1, 224, 224, 3), dict(stride=2, padding=3), (7, 7, 3, 64)) == (112, 112)
    flops, nbytes = bk.work("max_pool2d", (1, 112, 112, 64),
                            dict(kernel_size=3, stride=2, padding=1), None, 2)
    assert flops == 0 and nbytes == 2 * (112 * 112 * 64 + 56 * 56 * 64)


def test_bench_kernels_runs_in_the_interpreter(tmp_path, capsys, monkeypatch):
    bk = _load("bench_kernels")
    _tiny_mnist(monkeypatch, bk, [
        ("mnist", "conv1 8x8", "conv2d", (8, 8, 1), {}, (3, 3, 1, 32), 128),
        ("mnist", "conv2 6x6", "conv2d", (6, 6, 32), {}, (3, 3, 32, 64), 128)])
    assert bk.main([]) == 0 and "not a benchmark" in capsys.readouterr().out  # CPU: refuses
    out = tmp_path / "k.json"
    assert bk.main(["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1",
                    "--bandwidth-mib", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["conv1 8x8", "conv2 6x6"]
    for r in rows:
        assert "error" not in r and r["pallas_ms"] > 0 and r["xla_ms"] > 0
        assert r["pallas_grad_ms"] > 0 and 0 < r["roofline"]
    with pytest.raises(SystemExit):
        bk.main(["--force", "--groups", "nope"])


MGPU_TINY = [("mnist", "conv2 6x6", (6, 6, 32), {}, (3, 3, 32, 64), 128)]


def test_bench_mgpu_runs_in_interpret_mode(tmp_path, capsys, monkeypatch):
    """The Mosaic GPU benchmark refuses the CPU, or runs its kernels in interpret mode with
    --force and records how far the Mosaic forward is from XLA's (a bfloat16 rounding)."""
    bm = _load("bench_mgpu")
    _tiny_mnist(monkeypatch, bm, MGPU_TINY)
    reason = bm.mc.unavailable_reason()
    if reason is not None:  # jax < 0.11: one line, exit 2
        assert bm.main([]) == 2 and reason in capsys.readouterr().err
        return
    assert bm.main([]) == 0 and "not a benchmark" in capsys.readouterr().out
    out = tmp_path / "m.json"
    assert bm.main(["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1",
                    "--no-grad", "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["mosaic_ms"] > 0 and row["xla_ms"] > 0
    assert row["max_rel_err"] <= 2.0 ** -8
    with pytest.raises(SystemExit):
        bm.main(["--force", "--groups", "nope"])


def test_bench_mgpu_fused_stores_the_verdicts_conv_bn_auto_reads(tmp_path, monkeypatch, capsys):
    """--fused runs both fused forms (interpret mode here, values checked against XLA's
    chain) and with --tune stores each form's race under the key that
    Choices(conv_bn="auto") looks up: a measured win there makes "auto" fuse that call (on
    a Hopper GPU, mocked), and nothing else.  The timer is faked: nothing is measured."""
    bm = _load("bench_mgpu")
    if bm.mc.unavailable_reason() is not None:
        pytest.skip(f"Mosaic GPU: {bm.mc.unavailable_reason()}")
    import jax
    import jax.numpy as jnp

    from jaxcnn.functional import _dispatch
    from jaxcnn.functional import conv_bn as fcb
    from pallas_kernels import autotune
    _tiny_mnist(monkeypatch, bm, MGPU_TINY)
    monkeypatch.setenv("JAXCNN_AUTOTUNE_CACHE", str(tmp_path / "cache.json"))
    monkeypatch.setattr(bm, "_time_fused",
                        lambda fn, args, repeats, grad: 1.0 if fn.__name__ == "fused" else 2.0)
    out = tmp_path / "f.json"
    assert bm.main(["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1",
                    "--fused", "--tune", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["form"] for r in rows] == ["stats", "bnrelu+stats"]
    for r in rows:
        assert "error" not in r and r["max_rel_err"] <= 2.0 ** -7, r
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(bm.mc, "device_capability", lambda: "9.0")
    x = jax.ShapeDtypeStruct((1, 6, 6, 32), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 3, 32, 64), jnp.bfloat16)
    kw = dict(stride=1, padding=0, dilation=1, groups=1, stats=True)
    assert fcb.use_fusion("auto", x, w, prologue=False, **kw)
    assert fcb.use_fusion("auto", x, w, prologue=True, **kw)
    other = jax.ShapeDtypeStruct((2, 6, 6, 32), jnp.bfloat16)  # never measured
    assert not fcb.use_fusion("auto", other, w, prologue=True, **kw)
    assert autotune.device_kind() in autotune.load_cache()
    with pytest.raises(SystemExit):
        bm.main(["--force", "--fused", "--sweep"])


def test_bench_mgpu_window_runs_in_interpret_mode(tmp_path, capsys):
    """The Mosaic pooling/depthwise benchmark: refuses the CPU, or runs its kernels in
    interpret mode with --force and records their forward's distance from XLA's."""
    bw = _load("bench_mgpu_window")
    reason = bw.mc.unavailable_reason()
    if reason is not None:  # jax < 0.11: one line, exit 2
        assert bw.main([]) == 2 and reason in capsys.readouterr().err
        return
    assert bw.main([]) == 0 and "not a benchmark" in capsys.readouterr().out
    out = tmp_path / "w.json"
    assert bw.main(["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1",
                    "--no-grad", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["max_pool2d", "conv2d"]
    for row in rows:
        assert "error" not in row and row["mosaic_ms"] > 0 and row["xla_ms"] > 0
        assert row["max_rel_err"] <= 2.0 ** -8
    with pytest.raises(SystemExit):
        bw.main(["--force", "--groups", "nope"])


def test_profile_step_sums_device_kernels_per_step(tmp_path):
    ps = _load("profile_step")
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 9, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_fprop_implicit_gemm_bf16", "dur": 300},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_fprop_implicit_gemm_bf16", "dur": 100},
        {"ph": "X", "pid": 1, "name": "input_reduce_fusion_3", "dur": 50},
        {"ph": "X", "pid": 1, "name": "jaxcnn_max_pool_bwd", "dur": 20},
        {"ph": "X", "pid": 9, "name": "PjitFunction(step)", "dur": 5000},  # host: not counted
    ]
    path = tmp_path / "t.json.gz"
    import gzip
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    totals = ps.device_kernel_times(str(path), steps=2)
    assert totals == {"sm90_xmma_fprop_implicit_gemm_bf16": 200, "input_reduce_fusion_3": 25,
                      "jaxcnn_max_pool_bwd": 10}
    assert [ps.kind_of(n) for n in totals] == ["convolution", "reduction fusion", "pallas"]
    assert ps.kind_of("nvjet_sm90_tst_256x128") == "gemm"
    assert ps.kind_of("loop_maximum_fusion_1") == "other fusion"
    assert ps.kind_of("jaxcnn_conv_fwd") == "pallas"


def _tiny_bn_case(monkeypatch, bt):
    """A case ``tiny_bn`` in ``bt``'s CASES: convolution, BatchNorm, ReLU, a strided convolution,
    BatchNorm, pooling, fc on 8x8x3 images, registered in the zoo for this test only. The
    script's jaxcnn path (zoo model, train state, jitted step under the chosen Choices) is the
    same for every case; ResNet-18's 20 BatchNorms compiled twice took most of the test's time
    and exercised no more of the script."""
    from jaxcnn import layers as L
    from jaxcnn.models import registry

    def tiny_bn(*, num_classes=10):
        return L.serial(("conv1", L.Conv2D(8, 3, padding=1, use_bias=False)), ("bn1", L.BatchNorm()),
                        ("relu1", L.Relu()), ("conv2", L.Conv2D(8, 3, stride=2, padding=1, use_bias=False)),
                        ("bn2", L.BatchNorm()), ("relu2", L.Relu()), ("pool", L.GlobalAvgPool2D()),
                        ("fc", L.Linear(num_classes)))

    monkeypatch.setitem(registry._MODELS, "tiny_bn", registry._Entry(tiny_bn, (1, 8, 8, 3)))
    monkeypatch.setitem(bt.CASES, "tiny_bn", ("tiny_bn", {}, 2, (8, 8, 3), 10, False))


def test_bench_train_times_each_batch_norm_form(tmp_path, monkeypatch):
    """``--bn-grads`` times the same step with each BatchNorm backward, the first as the
    reference row; ``--batch`` shrinks the case for a smoke run."""
    bt = _load("bench_train")
    _tiny_bn_case(monkeypatch, bt)
    out = tmp_path / "t.json"
    bt.main(["--models", "tiny_bn", "--batch", "2", "--frameworks", "jaxcnn",
             "--bn-grads", "autodiff,closed_form", "--steps", "1", "--reps", "1",
             "--warmup", "0", "--pipeline-seconds", "0.01", "--json", str(out)])
    result = json.loads(out.read_text())
    rows = result["steps"]
    assert [r["framework"] for r in rows] == ["jaxcnn", "jaxcnn bn=closed_form"]
    for r in rows:
        assert r["batch"] == 2 and r["step_ms"] > 0 and r["img_s"] == pytest.approx(
            2e3 / r["step_ms"])
    assert rows[0]["vs_jaxcnn"] == 1.0
    assert [(r["impl"], r["bn_grad"]) for r in rows] == [("auto", "autodiff"),
                                                          ("auto", "closed_form")]
    assert {p["pipeline"].split()[0] for p in result["pipelines"]} == {"mnist", "synthetic_batch"}
    with pytest.raises(SystemExit):
        bt.main(["--bn-grads", "fused"])
    with pytest.raises(SystemExit):
        bt.main(["--conv-bn", "fused"])


@pytest.mark.parametrize("configured", [True, False])
def test_bench_train_times_torch_with_and_without_jaxcnn_malloc(tmp_path, monkeypatch, configured):
    """Where jaxcnn's malloc settings are on (they apply to the whole process), PyTorch eager
    is also timed in a fresh process with glibc's defaults, and each row says which."""
    pytest.importorskip("torch")
    bt = _load("bench_train")
    monkeypatch.setattr(bt._host_memory, "_configured", configured)
    out = tmp_path / "t.json"
    bt.main(["--models", "mnist_cnn", "--batch", "2", "--frameworks", "jaxcnn,torch",
             "--steps", "1", "--reps", "1", "--warmup", "0", "--pipeline-seconds", "0.01",
             "--json", str(out)])
    rows = json.loads(out.read_text())["steps"]
    if configured:
        assert [(r["framework"], r["malloc"]) for r in rows] == [
            ("jaxcnn", "jaxcnn"), ("torch eager", "default"),
            ("torch eager +jaxcnn malloc", "jaxcnn")]
    else:
        assert [(r["framework"], r["malloc"]) for r in rows] == [
            ("jaxcnn", "default"), ("torch eager", "default")]
    for r in rows:
        assert r["step_ms"] > 0 and r["vs_jaxcnn"] == pytest.approx(r["step_ms"] / rows[0]["step_ms"])


def test_gpu_session_script_stages_and_resume(tmp_path):
    """scripts/gpu_session.sh: an unknown stage exits 2; RESUME_CACHE seeds $OUT's tuner cache
    (and never overwrites one already there); on a CPU the kernels stage runs its script,
    which declines to time the interpreter, and logs to $OUT."""
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(__file__), "..")
    script = os.path.join(root, "scripts", "gpu_session.sh")
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    bad = subprocess.run(["bash", script, "nope"], env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown stage 'nope'" in bad.stderr
    resume = tmp_path / "prev.json"
    resume.write_text('{"version": 1, "devices": {}}')
    bin_dir = tmp_path / "bin"  # `python3` on PATH is this test's interpreter
    bin_dir.mkdir()
    wrapper = bin_dir / "python3"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    wrapper.chmod(0o755)
    env.update(RESUME_CACHE=str(resume), PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    run = subprocess.run(["bash", script, "kernels", "--groups", "pool"], env=env,
                         capture_output=True, text=True, cwd=root)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "out"
    assert (out / "autotune.json").read_text() == resume.read_text()
    assert "not a benchmark" in (out / "kernels.log").read_text()
    resume.write_text("{}")  # a second call keeps the cache the first one left
    subprocess.run(["bash", script, "kernels", "--groups", "pool"], env=env, check=True,
                   capture_output=True, cwd=root)
    assert (out / "autotune.json").read_text() == '{"version": 1, "devices": {}}'


def test_bench_data_times_the_pipeline_against_a_plain_loop(tmp_path, capsys):
    bd = _load("bench_data")
    out = tmp_path / "d.json"
    assert bd.main(["--images", "12", "--size", "40", "--crop", "24", "--batch", "4", "--steps", "2",
                    "--workers", "0", "--repeats", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["plain loop", "jaxcnn workers=0"]
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["vs_plain"] == 1.0
    assert "vs plain" in capsys.readouterr().out
