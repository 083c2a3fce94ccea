"""scripts/bench_batch_norm.py runs end to end on the CPU (tiny sizes) and writes its rows."""
import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "bench_batch_norm.py")


def _load():
    spec = importlib.util.spec_from_file_location("bench_batch_norm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_batch_norm_times_each_form_with_and_without_the_relu(tmp_path, capsys):
    bench = _load()
    out = tmp_path / "bn.json"
    assert bench.main(["--batch", "2", "--reps", "1", "--shapes", "4x4x8",
                       "--grads", "explicit,autodiff", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    impls = {(r["relu"], r["impl"]) for r in rows}
    assert {(False, "jaxcnn explicit"), (True, "jaxcnn autodiff")} <= impls
    assert all(r["ms"] > 0 and r["shape"] == [2, 4, 4, 8] for r in rows)
    try:
        import torch  # noqa: F401
        assert (True, "torch NCHW") in impls and all(
            r["vs_torch"] is not None for r in rows)
    except ImportError:
        assert not any(i.startswith("torch") for _, i in impls)
    assert "BN+ReLU" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--grads", "fast"])
