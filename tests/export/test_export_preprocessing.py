"""Exports take raw pixels: a short MNIST run records its input normalisation in
``preprocessing.json``; its ONNX and StableHLO exports normalise raw ``uint8`` pixels
inside and score the accuracy ``jaxcnn-eval`` reports for the run (up to the rounding
of a few of the 2,000 test digits); ``--no-preprocessing`` gives the bare network, with
the normalisation still recorded in its metadata; ``jaxcnn-eval`` normalises with what
the run recorded, and reconstructs it for a run directory written before the file."""
import contextlib
import io
import json
import os
import shutil

import numpy as np
import pytest

from jaxcnn.data import load_mnist
from jaxcnn.data.preprocessing import PREPROCESSING_FILE, read_preprocessing
from jaxcnn.export import load_stablehlo
from jaxcnn.export.cli import main
from jaxcnn.train.cli import eval_main

TOLERANCE = 3 / 2000   # three test digits
pytestmark = pytest.mark.xdist_group("mnist_run")  # conftest's mnist_run


@pytest.fixture(scope="module")
def run_dir(mnist_run):
    return mnist_run


def _eval(run_dir):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert eval_main([run_dir, "--json"]) == 0
    return json.loads(out.getvalue())["top1"]


@pytest.fixture(scope="module")
def eval_top1(run_dir):
    top1 = _eval(run_dir)
    assert top1 > 0.8, "the short run should be far from chance"
    return top1


@pytest.fixture(scope="module")
def digits():
    return load_mnist()


def _accuracy(predict, x, y, batch=500):
    logits = np.concatenate([np.asarray(predict(x[i:i + batch])) for i in range(0, len(x), batch)])
    return float(np.mean(logits.argmax(-1) == y))


def test_the_run_records_its_preprocessing(run_dir, digits):
    with open(os.path.join(run_dir, PREPROCESSING_FILE)) as f:
        d = json.load(f)
    assert (d["layout"], d["image_shape"], d["pixel_dtype"], d["pixel_range"]) == (
        "NHWC", [28, 28, 1], "uint8", [0, 255])
    assert d["class_names"] == [str(i) for i in range(10)] and d["normalize"] is True
    np.testing.assert_array_equal(np.float32(d["mean"]), digits.mean)
    np.testing.assert_array_equal(np.float32(d["std"]), digits.std)


def _ort_session(path):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def test_onnx_on_raw_pixels_scores_the_runs_accuracy(run_dir, eval_top1, digits, tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    out = str(tmp_path / "m.onnx")
    assert main([run_dir, "--format", "onnx", "--out", out]) == 0
    said = capsys.readouterr().out
    assert "input: raw uint8 pixels in [0, 255], NHWC (N, 28, 28, 1)" in said
    assert "--no-preprocessing" in said
    proto = onnx.load(out)
    meta = json.loads({p.key: p.value for p in proto.metadata_props}["jaxcnn.preprocessing"])
    assert meta["in_graph"] is True and meta["input_dtype"] == "uint8"
    recorded = read_preprocessing(os.path.join(run_dir, PREPROCESSING_FILE))
    assert (meta["mean"], meta["std"]) == (list(recorded.mean), list(recorded.std))
    session = _ort_session(out)
    x, y = digits.x_test, digits.y_test
    assert x.dtype == np.uint8
    acc = _accuracy(lambda b: session.run(None, {"input": b})[0], x, y)
    print(f"onnx on raw pixels {acc:.4f}  jaxcnn-eval {eval_top1:.4f}")
    assert abs(acc - eval_top1) <= TOLERANCE
    # NCHW: the same model on the transposed images; a fixed batch is said as such (it said N).
    out_nchw = str(tmp_path / "m_nchw.onnx")
    assert main([run_dir, "--format", "onnx", "--layout", "nchw", "--batch", "64", "--out", out_nchw]) == 0
    assert "input: raw uint8 pixels in [0, 255], NCHW (64, 1, 28, 28)" in capsys.readouterr().out
    nchw = _ort_session(out_nchw).run(None, {"input": x[:64].transpose(0, 3, 1, 2)})[0]
    np.testing.assert_allclose(nchw, session.run(None, {"input": x[:64]})[0], rtol=0, atol=1e-4)


def test_stablehlo_on_raw_pixels_scores_the_runs_accuracy(run_dir, eval_top1, digits, tmp_path,
                                                          capsys):
    out = str(tmp_path / "m.stablehlo")
    assert main([run_dir, "--format", "stablehlo", "--out", out]) == 0
    assert f"recorded in {out}.preprocessing.json" in capsys.readouterr().out
    with open(out + ".preprocessing.json") as f:
        meta = json.load(f)
    assert meta["in_graph"] is True and meta["pixel_dtype"] == "uint8"
    exported = load_stablehlo(out)
    assert str(exported.in_avals[0].dtype) == "uint8"
    acc = _accuracy(exported.call, digits.x_test, digits.y_test)
    print(f"stablehlo on raw pixels {acc:.4f}  jaxcnn-eval {eval_top1:.4f}")
    assert abs(acc - eval_top1) <= TOLERANCE


def test_no_preprocessing_exports_the_bare_network(run_dir, eval_top1, digits, tmp_path, capsys):
    onnx = pytest.importorskip("onnx")
    out = str(tmp_path / "bare.onnx")
    assert main([run_dir, "--format", "onnx", "--no-preprocessing", "--out", out]) == 0
    assert "already normalised" in capsys.readouterr().out
    meta = json.loads({p.key: p.value for p in onnx.load(out).metadata_props}[
        "jaxcnn.preprocessing"])
    assert meta["in_graph"] is False and meta["input_dtype"] == "float32"
    prep = read_preprocessing(os.path.join(run_dir, PREPROCESSING_FILE))
    session = _ort_session(out)
    acc = _accuracy(lambda b: session.run(None, {"input": prep.apply(b)})[0],
                    digits.x_test, digits.y_test)
    assert abs(acc - eval_top1) <= TOLERANCE


def test_eval_normalises_as_the_run_recorded(run_dir, eval_top1, tmp_path):
    copy = str(tmp_path / "run")
    shutil.copytree(run_dir, copy)
    path = os.path.join(copy, PREPROCESSING_FILE)
    with open(path) as f:
        d = json.load(f)
    d["mean"] = [m + 0.5 for m in d["mean"]]   # as if trained on brighter digits
    with open(path, "w") as f:
        json.dump(d, f)
    assert _eval(copy) < eval_top1 - 0.02
    os.remove(path)                            # a run directory from before the file
    assert _eval(copy) == eval_top1
    onnx = pytest.importorskip("onnx")         # export reconstructs the same preprocessing
    out = str(tmp_path / "old.onnx")
    assert main([copy, "--format", "onnx", "--out", out]) == 0
    meta = json.loads({p.key: p.value for p in onnx.load(out).metadata_props}[
        "jaxcnn.preprocessing"])
    recorded = read_preprocessing(os.path.join(run_dir, PREPROCESSING_FILE))
    assert (meta["mean"], meta["std"]) == (list(recorded.mean), list(recorded.std))


def test_raw_image_is_refused_in_one_line_where_it_makes_no_sense(run_dir, tmp_path, capsys):
    """``--raw-image`` builds an image folder's evaluation resize into an ONNX graph: an MNIST
    run resizes nothing, and StableHLO, ``--no-preprocessing``, ``--layout nchw``, a fixed
    batch and opset 17 are refused before any work."""
    out = str(tmp_path / "raw.onnx")
    for extra, said in [
            ([], "--raw-image builds the run's evaluation resize into the graph, but this run's mnist "
                 "images come at the model's size (28, 28, 1)"),
            (["--no-preprocessing"], "leave out --no-preprocessing"),
            (["--layout", "nchw"], "leave out --layout nchw"),
            (["--batch", "4"], "leave out --batch 4"),
            (["--opset", "17"], "needs --opset 18 or later")]:
        assert main([run_dir, "--format", "onnx", "--raw-image", "--out", out] + extra) == 2
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err
    assert main([run_dir, "--format", "stablehlo", "--raw-image", "--out", str(tmp_path / "m.stablehlo")]) == 2
    assert "--raw-image is for --format onnx" in capsys.readouterr().err
    assert not os.path.exists(out)
