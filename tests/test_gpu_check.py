"""``scripts/gpu_check.py``: the budget and its stage limits, the records and the summary, the
kept tile plan, and a dry run of every stage on the CPU (tiny shapes, interpret mode)."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

import xla_cache

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "scripts")


def _load(name):
    sys.path.insert(0, SCRIPTS)
    try:
        spec = importlib.util.spec_from_file_location(name, os.path.join(SCRIPTS, f"{name}.py"))
        module = sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(SCRIPTS)
    return module


gc = _load("gpu_check")
report = _load("_gpu_check_report")


def _records(out, kind):
    return [r for r in report.read_records(os.path.join(out, report.JSONL))
            if r["kind"] == kind]


def test_default_stage_limits_add_up_to_the_default_budget():
    assert sum(share for _, share in gc.STAGES) == gc.DEFAULT_BUDGET == 480
    # Stages that each use their whole limit: the limits are the shares, summing to the budget.
    remaining, limits = gc.DEFAULT_BUDGET, []
    for i, (_, share) in enumerate(gc.STAGES):
        limits.append(gc.stage_limit(remaining, share, sum(s for _, s in gc.STAGES[i:])))
        remaining -= limits[-1]
    assert sum(limits) == pytest.approx(gc.DEFAULT_BUDGET)
    assert limits == pytest.approx([share for _, share in gc.STAGES])
    # A stage that finishes early leaves its time to the ones after it.
    assert gc.stage_limit(400, 85, 400) == pytest.approx(85)
    assert gc.stage_limit(440, 85, 400) > 85


def test_budget_kills_an_overrunning_stage_and_the_next_stage_runs(tmp_path):
    out = str(tmp_path)
    pid_file, ran = tmp_path / "grandchild.pid", tmp_path / "fast.ran"
    # The slow stage leaves a grandchild behind: the whole process group must go.
    slow = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(120)")

    def command_for(name):
        if name == "slow":
            return [sys.executable, "-c", slow]
        return [sys.executable, "-c", f"open({str(ran)!r}, 'w').write('ok')"]

    t0 = time.monotonic()
    gc.run_stages(out, [("slow", 1), ("fast", 1)], 8 + gc.RESERVE, command_for)
    assert time.monotonic() - t0 < 12
    stages = {r["stage"]: r for r in _records(out, "stage")}
    assert stages["slow"]["status"] == "timeout"
    assert stages["slow"]["limit_s"] == pytest.approx(4, abs=0.5)
    assert stages["fast"]["status"] == "ok" and ran.read_text() == "ok"
    grandchild = int(pid_file.read_text())
    try:
        with open(f"/proc/{grandchild}/status") as f:
            state = next(line for line in f if line.startswith("State:"))
        assert "Z" in state, f"the stage's grandchild still runs: {state}"
    except FileNotFoundError:
        pass  # gone


def test_a_stage_that_asks_is_started_again_and_a_failed_one_is_recorded(tmp_path):
    out, count = str(tmp_path), tmp_path / "count"
    again = (f"import os, sys; p = {str(count)!r}; "
             "n = int(open(p).read()) if os.path.exists(p) else 0; open(p, 'w').write(str(n + 1)); "
             f"sys.exit({report.RELAUNCH} if n == 0 else 0)")
    commands = {"again": [sys.executable, "-c", again],
                "broken": [sys.executable, "-c", "print('the cause'); raise SystemExit(1)"]}
    gc.run_stages(out, [("again", 1), ("broken", 1)], 60, commands.get)
    stages = {r["stage"]: r for r in _records(out, "stage")}
    assert stages["again"]["status"] == "ok" and stages["again"]["launches"] == 2
    assert stages["broken"]["status"] == "failed" and stages["broken"]["rc"] == 1
    assert "the cause" in stages["broken"]["tail"]


def test_a_torn_last_line_is_left_out_and_the_summary_shows_every_kind(tmp_path):
    path = tmp_path / report.JSONL
    rows = [
        {"stage": "run", "kind": "run", "command": "python scripts/gpu_check.py"},
        {"stage": "env", "kind": "env", "device_kind": "NVIDIA H200", "jax": "0.11.2"},
        {"stage": "correct", "kind": "correct", "family": "mosaic_dense", "ok": False,
         "fwd_err": 0.5, "grad_errs": [0.1, 0.2]},
        {"stage": "resnet50", "kind": "step", "model": "resnet50", "framework": "jaxcnn",
         "batch": 256, "step_ms": 50.0, "img_s": 5120.0, "mfu": 0.128, "impl": "xla",
         "bn_grad": "autodiff", "conv_bn": "off"},
        {"stage": "torch", "kind": "step", "model": "resnet50", "framework": "torch.compile",
         "batch": 256, "step_ms": 45.0, "img_s": 5689.0, "mfu": 0.139},
        {"stage": "dense", "kind": "skip", "unit": "dense", "reason": "failed `correct`"},
        {"stage": "batchnorm", "kind": "batchnorm", "name": "56x56x256", "mosaic_ms": 0.1,
         "xla_ms": 0.2, "fwd_ratio": 2.0, "mosaic_grad_ms": 0.3, "xla_grad_ms": 0.3,
         "grad_ratio": 1.0, "mosaic_gb_s": 4000.0, "mosaic_grad_gb_s": 3000.0,
         "tiles": {"mgpu_bn_stats": "c128s4"}},
        {"stage": "torch", "kind": "stage", "status": "timeout", "seconds": 85, "limit_s": 85},
        {"stage": "resnet50_more", "kind": "unit", "unit": "x", "status": "failed",
         "error": "XlaRuntimeError: out of memory\nmore"},
    ]
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + '{"stage": "win')
    records = report.read_records(str(path))
    assert len(records) == len(rows)
    md = report.summary(records, date="2026-11-29")
    assert md.startswith("## NVIDIA H200 (scripts/gpu_check.py, 2026-11-29)")
    assert "| mosaic_dense | **WRONG** | 5.0e-01 | 1.0e-01, 2.0e-01 |" in md
    assert "| torch.compile | 45.00 | 5,689 | 13.9% | 0.90 |" in md
    assert "- dense / dense: skipped: failed `correct`" in md
    assert ("| 56x56x256 | 0.100 | 0.200 | 2.00 | 0.300 | 0.300 | 1.00 | 4,000 / 3,000 | "
            "mgpu_bn_stats c128s4 |") in md
    assert "- stage torch: timeout" in md
    assert "- resnet50_more / x: failed: XlaRuntimeError: out of memory" in md


def _write(path, rows):
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))


H200 = {"stage": "env", "kind": "env", "device_kind": "NVIDIA H200", "compute_capability": "9.0",
        "jax": "0.11.2", "jaxlib": "0.11.2", "triton": "3.6.0", "torch": "2.11.0"}


def test_resume_carries_what_an_earlier_check_finished_and_runs_the_rest(tmp_path):
    earlier = tmp_path / "earlier.jsonl"
    step = {"stage": "resnet50", "kind": "step", "model": "resnet50", "framework": "jaxcnn",
            "batch": 256, "step_ms": 40.0, "img_s": 6400.0, "mfu": 0.16, "impl": "xla",
            "bn_grad": "explicit", "conv_bn": "off"}
    _write(earlier, [
        {"stage": "run", "kind": "run", "command": "python scripts/gpu_check.py",
         "time": 1795993545.0},  # 2026-11-29
        H200,
        {"stage": "resnet50", "kind": "unit", "unit": "finished", "status": "started"}, step,
        {"stage": "resnet50", "kind": "unit", "unit": "finished", "status": "done"},
        {"stage": "resnet50", "kind": "unit", "unit": "cut short", "status": "started"},
        {"stage": "resnet50", "kind": "stage", "status": "timeout", "seconds": 70}])
    out = tmp_path / "now"
    out.mkdir()
    _write(out / report.JSONL, [{"stage": "run", "kind": "run", "command": "c"}, H200])
    assert gc.carry_over(str(out), str(earlier)) == 2
    # The stage runs only the unit the earlier check did not finish.
    stages = _load("_gpu_check_stages")
    ran = []
    ctx = stages.Context("resnet50", str(out), dry=True)
    assert stages.run_units(ctx, [(u, lambda u=u: ran.append(u))
                                  for u in ("finished", "cut short")]) == 0
    assert ran == ["cut short"]
    md = report.summary(report.read_records(str(out / report.JSONL)), date="2026-12-01")
    assert "| jaxcnn impl=xla bn_grad=explicit conv_bn=off (2026-11-29) | 40.00 | 6,400 |" in md
    assert "carried over (`--resume`)" in md
    # Another jax: nothing is carried, and the record says why.
    other = tmp_path / "other"
    other.mkdir()
    _write(other / report.JSONL, [{**H200, "jax": "0.12.0.1"}])
    assert gc.carry_over(str(other), str(earlier)) == 0
    [skip] = _records(str(other), "skip")
    assert "jax 0.11.2 there, 0.12.0.1 here" in skip["reason"]


def test_unknown_stage_is_a_usage_error(tmp_path, capsys):
    assert gc.main(["--stages", "env,warp", "--out", str(tmp_path)]) == 2
    assert "unknown stage(s) ['warp']" in capsys.readouterr().err
    assert gc.main(["--stages", "dense", "--resume", "x.jsonl", "--out", str(tmp_path)]) == 2
    assert "--resume needs the env stage" in capsys.readouterr().err


def _mosaic_reason():
    from pallas_kernels import mgpu_conv as mc
    return mc.unavailable_reason()


def test_kept_tile_plan_is_the_models_and_within_three_per_launch():
    reason = _mosaic_reason()
    if reason is not None:
        pytest.skip(f"Mosaic GPU: {reason}")
    stages, tiles = _load("_gpu_check_stages"), _load("_gpu_check_tiles")
    from pallas_kernels import mgpu_conv as mc
    from pallas_kernels import mgpu_window as mw
    calls = stages.tile_plan_calls()
    kept = tiles.load()
    assert kept == tiles.plan(calls), ("scripts/gpu_check_tiles.json is stale: run "
                                       "`python scripts/gpu_check.py --plan-tiles`")
    for call in calls:
        configs = kept[call.key]
        assert 1 <= len(configs) <= tiles.PER_LAUNCH, call.key
        cls = mc.MgpuConfig if isinstance(call, mc.DenseCall) else mw.WindowConfig
        fitted = [cls.from_dict(c) for c in configs]
        assert fitted[0] == call.candidates()[0], "the default tiles come first"
        assert len(set(fitted)) == len(fitted)
        assert all(call.smem_bytes(c) <= mc.MAX_SMEM for c in fitted)
        assert all(c in call.candidates() for c in fitted)


def test_dry_run_goes_through_every_stage(tmp_path):
    """Every stage where Mosaic GPU lowers (jax >= 0.11, as on the lent GPU machines, whose jax
    the check runs on).  Without it (jax 0.10.2) only what such an environment adds: the
    torch.compile stage where torch imports (CI's jax 0.11.2 environment has no torch)."""
    out = str(tmp_path)
    mosaic = _mosaic_reason() is None
    names = [s for s, _ in gc.STAGES] if mosaic else ["env", "torch"]
    # The suite's compilation cache: the stages that time the same step again (resnet50_more,
    # resnet50_auto) load its programs instead of compiling them (a fifth of the dry run).
    # LLVM level 0, as the interpreted-kernel tests compile (tests/xla_cache.py): every check
    # of the dry run compares within a tolerance or times, and its stages compile a fifth faster.
    env = xla_cache.subprocess_env({**os.environ, "PYTHONPATH": ROOT,
                                    "XLA_FLAGS": xla_cache.at_level(0)})
    done = subprocess.run([sys.executable, os.path.join(SCRIPTS, "gpu_check.py"), "--dry-run",
                           "--out", out, "--budget", "900", "--stages", ",".join(names)],
                          env=env, capture_output=True, text=True, timeout=1200, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    stages = {r["stage"]: r for r in _records(out, "stage")}
    assert names == list(stages)
    bad = {s: r for s, r in stages.items() if r["status"] != "ok"}
    assert not bad, bad
    failed = [r for r in _records(out, "unit") if r["status"] != "started" and
              r["status"] != "done"]
    assert not failed, failed
    steps, skipped = _records(out, "step"), {r["unit"] for r in _records(out, "skip")}
    frameworks = {r["framework"] for r in steps}
    assert all(r["step_ms"] > 0 for r in steps)
    if importlib.util.find_spec("torch") is not None:
        assert "torch.compile" in frameworks
    else:
        assert "torch.compile" in skipped
    md = open(os.path.join(out, "gpu_check.md")).read()
    assert "### Training step" in md and "--dry-run" in md
    # A lent machine sends back at most 8 files: every stage logs into one.
    assert sorted(os.listdir(out)) == ["autotune.json", "gpu_check.jsonl", "gpu_check.log",
                                       "gpu_check.md"]
    assert f"=== stage {names[-1]}, process 1" in open(os.path.join(out, "gpu_check.log")).read()
    devices = json.load(open(os.path.join(out, "autotune.json")))["devices"]
    assert bool(devices) == mosaic  # the verdicts come from the Mosaic stages
    if not mosaic:
        return
    families = {r["family"]: r for r in _records(out, "correct")}
    assert all(r["ok"] for r in families.values()), families
    assert {f for f in families if f.startswith("triton")} == {
        "triton_dense", "triton_dense_stride2", "triton_depthwise", "triton_max_pool2d",
        "triton_avg_pool2d", "triton_bn_relu_conv"}
    assert len([f for f in families if f.startswith("mosaic")]) == 8
    assert "jaxcnn" in frameworks
    for kind in ("conv", "fused", "window", "batchnorm"):
        assert _records(out, kind), kind
