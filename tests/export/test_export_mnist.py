"""End to end on MNIST: mnist_cnn trained briefly with the trainer (in process,
on the packaged 10,000-digit sample), then folded, int8-quantised and pruned
with a fine-tune through the trainer; accuracy is measured on the 2,000 test digits (one digit =
0.05 percentage points).  Also the ``jaxcnn-export`` command line and its
bad-input errors (exit code 2, one line on stderr)."""
import hashlib
import json
import os
import shutil

import jax
import numpy as np
import pytest
from export_cases import onnx_run

from jaxcnn import interop
from jaxcnn import layers as L
from jaxcnn.data import load_mnist
from jaxcnn.export import (calibration_batches, fold_batch_norm, load_source, load_stablehlo,
                           magnitude_prune, pipeline, quantize_int8, sparsity_report)
from jaxcnn.export.cli import main
from jaxcnn.models import registry

pytestmark = pytest.mark.xdist_group("mnist_run")  # conftest's mnist_run


@pytest.fixture(scope="module")
def run_dir(mnist_run):
    return mnist_run


def _digest(*trees):
    """A hash of ``trees``' structure and every leaf's dtype, shape and bytes."""
    h = hashlib.sha256(str(jax.tree_util.tree_structure(trees)).encode())
    for leaf in jax.tree_util.tree_leaves(trees):
        leaf = np.asarray(leaf)
        h.update(f"{leaf.dtype}{leaf.shape}".encode() + leaf.tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module", autouse=True)
def each_evaluation_once():
    """``evaluate_model`` (the tests' and the export command's) runs once per distinct program and
    inputs in this module: the same config (data, precision), the same eval-mode jaxpr and the
    same parameters and state give the same accuracy, so a repeat is served from a memo. The
    exports' "original" accuracy of the run, and the int8 model the command calibrates as
    test_fold_and_int8_accuracy does, were each a 2,000-digit evaluation again (~2.5 s each).
    Each caller gets its own copy of the result.  What this module no longer exercises:
    evaluate_model giving the same accuracy twice for the same inputs (a repeat is the memo's)."""
    real, memo = pipeline.evaluate_model, {}

    def evaluate_once(cfg, model, params, state):
        program = jax.make_jaxpr(lambda p, s: model.apply(p, s, np.zeros((1, 28, 28, 1), np.float32),
                                                          train=False))(params, state)
        key = (repr(cfg), str(program), _digest(params, state))
        if key not in memo:
            memo[key] = real(cfg, model, params, state)
        return dict(memo[key])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "evaluate_model", evaluate_once)
        yield


def evaluate_model(cfg, model, params, state):
    return pipeline.evaluate_model(cfg, model, params, state)


@pytest.fixture(scope="module")
def trained(run_dir):
    src = load_source(run_dir)
    acc = evaluate_model(src.cfg, src.model, src.params, src.state)["top1"]
    assert acc > 0.9, "the short training run should reach 90%"
    return src, acc


def test_fold_and_int8_accuracy(trained):
    src, acc = trained
    folded = fold_batch_norm(src.model, src.params, src.state)   # no BatchNorm: unchanged
    assert evaluate_model(src.cfg, *folded)["top1"] == acc
    qmodel, qparams, qstate = quantize_int8(src.model, src.params, src.state,
                                            calibration_batches(src.cfg, 4))
    acc8 = evaluate_model(src.cfg, qmodel, qparams, qstate)["top1"]
    print(f"float {acc:.4f}  int8 {acc8:.4f}")
    assert acc - acc8 <= 0.005


def test_prune_and_fine_tune_through_the_trainer(trained, run_dir, tmp_path, capsys):
    # Half the channels: this short run shrugs off even 90% of its single weights, but not
    # that, so the fine-tune has accuracy to win back.
    src, acc = trained
    pruned, masks = magnitude_prune(src.model, src.params, 0.5, structure="channel")
    out = str(tmp_path / "p.npz")
    assert main([run_dir, "--format", "npz", "--prune", "0.5", "--prune-structure", "channel",
                 "--fine-tune-steps", "20", "--fine-tune-lr", "0.002", "--out", out, "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)          # the trainer wrote its lines to stderr
    assert "[jaxcnn] prune 0.5 (global, channel)" in captured.err
    workdir = str(tmp_path / "p_finetune")
    assert report["fine_tune"] == {"workdir": workdir, "steps": 20}
    cfg = load_source(workdir).cfg                # a normal run directory, its config recorded
    assert (cfg.model.init_from, cfg.prune.amount, cfg.train.steps) == (run_dir, 0.5, 20)
    params, state = interop.load_npz(out)
    assert set(masks) == {"conv1.w", "conv1.b", "conv2.w", "conv2.b", "fc1.w", "fc1.b"}
    for key, keep in masks.items():               # exactly the masks of magnitude_prune, held
        layer, leaf = key.split(".")
        np.testing.assert_array_equal(params[layer][leaf][~keep], 0)
        assert np.mean(params[layer][leaf][keep] != pruned[layer][leaf][keep]) > 0.5  # trained
    assert report["sparsity"]["prunable_sparsity"] == pytest.approx(
        sparsity_report(src.model, pruned)["prunable_sparsity"])
    accs = report["accuracy"]
    assert accs["original"] == acc
    assert accs["fine_tuned"] == evaluate_model(cfg, src.model, params, state)["top1"]
    print(accs)
    assert accs["pruned"] < acc - 0.05 and accs["fine_tuned"] > accs["pruned"] + 0.05
    # Another fine-tune into the same directory is refused before any compute.
    _fails([run_dir, "--format", "npz", "--prune", "0.6", "--fine-tune-steps", "20",
            "--fine-tune-dir", workdir, "--out", out], capsys,
           "does not hold this fine-tune; remove it or give another directory (--fine-tune-dir DIR)")


def test_cli_onnx_and_int8_stablehlo(trained, run_dir, tmp_path, capsys):
    src, _ = trained
    x = np.concatenate(calibration_batches(src.cfg, 1, batch_size=64))
    raw = load_mnist().x_train[:64]               # what the calibration batch was made from
    np.testing.assert_array_equal(src.preprocessing.apply(raw), x)
    out = str(tmp_path / "m.onnx")                # the bare network: normalised input
    assert main([run_dir, "--format", "onnx", "--no-preprocessing", "--out", out]) == 0
    import onnx
    ref = np.asarray(jax.jit(src.model.apply)(src.params, src.state, x)[0])   # eager: 6 s
    got = onnx_run(onnx.load(out), x)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
    out = str(tmp_path / "q.stablehlo")           # raw pixels, normalised inside
    assert main([run_dir, "--format", "stablehlo", "--quantize", "int8", "--out", out]) == 0
    assert "top-1 int8" in capsys.readouterr().out
    q = np.asarray(load_stablehlo(out).call(raw))
    assert np.mean(q.argmax(-1) == ref.argmax(-1)) >= 0.95


def test_cli_pruned_safetensors(run_dir, tmp_path):
    out = str(tmp_path / "p.safetensors")
    assert main([run_dir, "--format", "safetensors", "--prune", "0.5", "--prune-scope", "layer",
                 "--out", out, "--json"]) == 0
    params, _ = interop.load_safetensors(out)
    for layer in ("conv1", "conv2", "fc1", "fc2"):
        assert np.mean(params[layer]["w"] == 0) == pytest.approx(0.5, abs=1e-3)


def _fails(argv, capsys, match):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("jaxcnn-export: error:"), err
    assert match in err, err


def test_a_fine_tune_stopped_by_a_signal_says_so(run_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C in the fine-tune: the trainer saves and stops; the export then failed on the
    fine-tune directory's missing params.npz (exit 2) instead of saying it stopped."""
    import sys
    monkeypatch.setattr(sys.modules["jaxcnn.train.run"], "train", lambda cfg, workdir, stream=None: {"step": 3, "stopped_by": "SIGINT"})
    out = tmp_path / "p.onnx"
    assert main([run_dir, "--format", "onnx", "--prune", "0.5", "--fine-tune-steps", "10", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err == (f"jaxcnn-export: stopped: fine-tuning in {tmp_path / 'p_finetune'} stopped by SIGINT at step 3 "
                   "(checkpoint saved); the same command resumes it\n")
    assert not out.exists()


def test_bad_inputs(run_dir, tmp_path, capsys, monkeypatch):
    empty = tmp_path / "no_params"
    empty.mkdir()
    shutil.copy(os.path.join(run_dir, "config.resolved.yaml"), empty)
    _fails([str(empty), "--format", "onnx", "--out", str(tmp_path / "a.onnx")], capsys,
           "no parameters (params.npz or params.safetensors); has training finished?")
    (empty / "checkpoints" / "13").mkdir(parents=True)  # a run stopped by Ctrl-C: it says so, and what to do
    _fails([str(empty), "--format", "onnx", "--out", str(tmp_path / "a.onnx")], capsys,
           "no parameters (params.npz or params.safetensors); it stopped at a checkpoint (step 13): run its "
           "jaxcnn-train command again to finish it (jaxcnn-eval evaluates the checkpoint as it is)")
    _fails([str(tmp_path), "--format", "onnx", "--out", str(tmp_path / "a.onnx")], capsys,
           "not a jaxcnn run directory")
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(b"PK\x03\x04 this is not a zip archive")
    _fails([str(corrupt), "--model", "mnist_cnn", "--format", "onnx", "--out",
            str(tmp_path / "a.onnx")], capsys, "corrupt.npz")
    _fails([os.path.join(run_dir, "params.npz"), "--format", "onnx", "--out",
            str(tmp_path / "a.onnx")], capsys, "--model")
    _fails([os.path.join(run_dir, "params.npz"), "--model", "lenet5", "--format", "onnx",
            "--out", str(tmp_path / "a.onnx")], capsys, "params/")
    # a model with a layer ONNX export does not know
    def gn_net(*, num_classes=3):
        return L.serial(("conv", L.Conv2D(4, 3)), ("norm", L.GroupNorm(2)), L.Flatten(),
                        ("fc", L.Linear(num_classes)))
    monkeypatch.setitem(registry._MODELS, "gn_net", registry._Entry(gn_net, (1, 6, 6, 1)))
    model = gn_net()
    params, state, _ = model.init(__import__("jax").random.PRNGKey(0), (1, 6, 6, 1))
    interop.save_npz(tmp_path / "gn.npz", params, state)
    _fails([str(tmp_path / "gn.npz"), "--model", "gn_net", "--format", "onnx", "--out",
            str(tmp_path / "gn.onnx")], capsys, "'norm' of kind 'group_norm'")
    _fails([str(tmp_path / "gn.npz"), "--model", "gn_net", "--format", "onnx", "--quantize",
            "int8", "--out", str(tmp_path / "gn.onnx")], capsys, "run directory")
