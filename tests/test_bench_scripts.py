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


def test_bench_kernels_runs_in_the_interpreter(tmp_path, capsys):
    bk = _load("bench_kernels")
    assert bk.main([]) == 0 and "not a benchmark" in capsys.readouterr().out  # CPU: refuses
    out = tmp_path / "k.json"
    assert bk.main(["--force", "--batch", "1", "--groups", "mnist", "--repeats", "1",
                    "--bandwidth-mib", "4", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["mnist conv1", "mnist conv2"]
    for r in rows:
        assert "error" not in r and r["pallas_ms"] > 0 and r["xla_ms"] > 0
        assert r["pallas_grad_ms"] > 0 and 0 < r["roofline"]
    with pytest.raises(SystemExit):
        bk.main(["--force", "--groups", "nope"])
