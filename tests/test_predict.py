"""``jaxcnn-predict`` and ``jaxcnn.predict``: a short MNIST run (in process, on the packaged
digits), a few test digits saved as PNG files, and the predictions of the run directory and
of its ONNX and StableHLO exports checked against the run's own model (applied here to the
dataset's pixels, normalised with the dataset's statistics) and the true labels. Also the
resize rule and the bad-input errors (one line, exit code 2)."""
import json
import os
import pathlib
import shutil

import jax
import numpy as np
import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

import jaxcnn  # noqa: E402
from jaxcnn.data import load_mnist  # noqa: E402
from jaxcnn.export import export, load_source  # noqa: E402
from jaxcnn.predict import PredictError, Resize, load_predictor, main, to_pixels  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_DIGITS = 8
pytestmark = pytest.mark.xdist_group("mnist_run")  # conftest's mnist_run


@pytest.fixture(scope="module")
def run_dir(mnist_run):
    return mnist_run


def test_the_mnist_run_group_holds_under_xdist(request):
    # xdist's loadgroup sends a group to one worker by the "@group" it appends to the test's
    # id; where that suffix is lost (pytest 9.2 with xdist 3.8), each worker trains mnist_run.
    if not (os.environ.get("PYTEST_XDIST_WORKER") and request.config.getvalue("loadgroup")):
        pytest.skip("not under xdist's --dist loadgroup")
    assert request.node.nodeid.endswith("@mnist_run"), request.node.nodeid


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The first test digits as PNG files, their pixels and labels."""
    ds = load_mnist()
    folder = tmp_path_factory.mktemp("digits")
    x, y = ds.x_test[:N_DIGITS], ds.y_test[:N_DIGITS]
    paths = []
    for i, img in enumerate(x):
        paths.append(str(folder / f"digit{i}.png"))
        Image.fromarray(img[..., 0]).save(paths[-1])
    return paths, x, y, ds


@pytest.fixture(scope="module")
def own(run_dir, digits):
    """The run's own model on the digits: logits from model.apply on the dataset's pixels,
    normalised with the dataset's mean and std (what the trainer's evaluation does)."""
    _, x, _, ds = digits
    src = load_source(run_dir)
    normalised = (x.astype(np.float32) / 255 - ds.mean) / ds.std
    logits, _ = src.model.apply(src.params, src.state, normalised, train=False)
    return np.asarray(logits)


def _softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _check(predictions, paths, own_logits, labels, *, atol):
    assert [p.image for p in predictions] == paths
    probs = np.stack([p.probabilities for p in predictions])
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(probs, _softmax(own_logits), rtol=0, atol=atol)
    top1 = [p.top_k[0].index for p in predictions]
    assert top1 == list(np.argmax(own_logits, -1))
    assert np.mean(np.array(top1) == labels) >= 0.75, (top1, labels)
    for p in predictions:
        assert [s.name for s in p.top_k] == [str(s.index) for s in p.top_k]  # MNIST's names
        ps = [s.probability for s in p.top_k]
        assert ps == sorted(ps, reverse=True) and ps[0] == p.probabilities.max()


def test_run_directory(run_dir, digits, own):
    paths, _, labels, _ = digits
    predictions = jaxcnn.predict(run_dir, paths, top_k=3)
    assert all(len(p.top_k) == 3 for p in predictions)
    # The same float32 network and normalisation, one compiled forward pass: near-exact.
    _check(predictions, paths, own, labels, atol=1e-5)


@pytest.mark.parametrize("fmt", ["onnx", "stablehlo"])
def test_exports(run_dir, digits, own, tmp_path, fmt):
    if fmt == "onnx":
        pytest.importorskip("onnxruntime")
    paths, _, labels, _ = digits
    out = str(tmp_path / f"mnist.{fmt}")
    export(run_dir, out, format=fmt, batch="dynamic")
    predictor = load_predictor(out)
    assert predictor.kind == fmt and predictor.preprocessing.pixel_dtype == "uint8"
    _check(predictor.predict(paths, top_k=10), paths, own, labels, atol=1e-4)


def test_export_without_preprocessing_and_fixed_batch(run_dir, digits, own, tmp_path):
    """--no-preprocessing exports take normalised float32: predict normalises as recorded; a
    fixed batch of 3 takes the 8 digits in padded batches of 3."""
    pytest.importorskip("onnxruntime")
    paths, _, labels, _ = digits
    out = str(tmp_path / "bare.onnx")
    export(run_dir, out, format="onnx", batch=3, layout="nchw", preprocessing=False)
    _check(jaxcnn.predict(out, paths, top_k=2), paths, own, labels, atol=1e-4)


def test_command_line(run_dir, digits, own, capsys):
    paths, _, _, _ = digits
    assert main([run_dir, *paths[:2], "--top-k", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == run_dir and [p["image"] for p in report["predictions"]] == paths[:2]
    first = report["predictions"][0]["top_k"]
    assert len(first) == 2 and first[0]["index"] == int(np.argmax(own[0]))
    assert first[0]["name"] == str(first[0]["index"]) and 0 < first[0]["probability"] <= 1
    assert main([run_dir, paths[0], "--top-k", "50"]) == 0   # clipped to the 10 classes
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == paths[0] and len(lines) == 11
    name, prob = lines[1].split()
    assert name == str(int(np.argmax(own[0]))) and 0 < float(prob) <= 1


def test_a_folder_stands_for_the_images_under_it(run_dir, digits, tmp_path, capsys):
    """jaxcnn-predict RUN FOLDER said "FOLDER: is a directory, not an image": it classifies every
    image file under it (sorted, class sub-folders included, other files and OS litter left out)."""
    paths, _, _, _ = digits
    folder = tmp_path / "photos"
    (folder / "b").mkdir(parents=True)
    shutil.copy(paths[0], folder / "z.png")
    shutil.copy(paths[1], folder / "b" / "a.png")
    for name in ("Thumbs.db", ".hidden.png", "labels.csv"):
        (folder / name).write_text("x")
    assert main([run_dir, str(folder), paths[2], "--top-k", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [p["image"] for p in report["predictions"]] == [
        str(folder / "b" / "a.png"), str(folder / "z.png"), paths[2]]
    direct = jaxcnn.predict(run_dir, [paths[1], paths[0]], top_k=1)
    assert [p["top_k"][0]["index"] for p in report["predictions"][:2]] == [p.top_k[0].index for p in direct]


def test_one_image_is_a_list_of_one(run_dir, digits):
    """``jaxcnn.predict(run, "digit.png")`` iterated the path's characters ("d: no such image file")."""
    paths, _, _, _ = digits
    many = jaxcnn.predict(run_dir, paths[:1], top_k=2)
    for one in (paths[0], pathlib.Path(paths[0])):
        got = jaxcnn.predict(run_dir, one, top_k=2)
        assert [p.image for p in got] == [paths[0]]
        np.testing.assert_array_equal(got[0].probabilities, many[0].probabilities)
    with Image.open(paths[0]) as opened:
        got = load_predictor(run_dir).predict(opened, top_k=2)
    assert len(got) == 1 and got[0].top_k == many[0].top_k


def _one_line(capsys, code):
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("jaxcnn-predict: error: "), err
    return lines[0]


def test_bad_input_is_one_line(run_dir, digits, tmp_path, capsys):
    paths, _, _, _ = digits
    missing = str(tmp_path / "nope.png")
    assert missing in _one_line(capsys, main([run_dir, paths[0], missing]))
    text = tmp_path / "notes.png"
    text.write_text("not an image at all")
    line = _one_line(capsys, main([run_dir, str(text)]))
    assert f"{text}: not an image (Pillow cannot identify it)" in line
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(open(paths[0], "rb").read()[:60])   # the header, then nothing
    assert f"{corrupt}: corrupt or truncated image" in _one_line(capsys, main([run_dir, str(corrupt)]))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "Thumbs.db").write_text("x")
    line = _one_line(capsys, main([run_dir, str(tmp_path / "empty")]))
    assert f"{tmp_path / 'empty'}: a directory with no image files (.jpg" in line
    with pytest.raises(PredictError, match="is a directory, not an image"):
        jaxcnn.predict(run_dir, [str(tmp_path)])
    empty_run = tmp_path / "no_params"
    shutil.copytree(run_dir, empty_run, ignore=shutil.ignore_patterns("params.*"))
    line = _one_line(capsys, main([str(empty_run), paths[0]]))
    assert str(empty_run) in line and "has no parameters" in line
    line = _one_line(capsys, main([str(tmp_path), paths[0]]))
    assert "not a jaxcnn run directory" in line
    line = _one_line(capsys, main([paths[0], paths[0]]))
    assert f"{paths[0]}: not a run directory, an .onnx export or a StableHLO export" in line
    bad_onnx = tmp_path / "bad.onnx"
    bad_onnx.write_bytes(b"\x00garbage")
    assert f"{bad_onnx}: not a readable ONNX model" in _one_line(capsys, main([str(bad_onnx), paths[0]]))
    assert "--top-k" in _one_line(capsys, _exit_code(lambda: main([run_dir, paths[0], "--top-k", "0"])))
    with pytest.raises(PredictError, match="top_k must be a positive int"):
        jaxcnn.predict(run_dir, paths[:1], top_k=0)


def test_a_fifo_or_a_file_that_is_no_source_is_named(run_dir, digits, tmp_path, capsys):
    """A FIFO named like an image blocked in Pillow's open for good (the image folder loader
    never opens one); a run's params.npz or a StableHLO export's .preprocessing.json given as the
    source was told to have a "params.npz.preprocessing.json" beside it."""
    import threading
    paths, _, _, _ = digits
    fifo = tmp_path / "camera.png"
    os.mkfifo(fifo)
    codes = []
    worker = threading.Thread(target=lambda: codes.append(main([run_dir, str(fifo)])), daemon=True)
    worker.start()
    worker.join(30)
    if worker.is_alive():  # let the blocked open go, then fail
        with open(fifo, "wb"):
            pass
        worker.join(10)
        pytest.fail("jaxcnn-predict blocked on a FIFO")
    assert codes == [2] and f"{fifo}: is a FIFO (named pipe), not an image file" in _one_line(capsys, 2)
    params = os.path.join(run_dir, "params.npz")
    line = _one_line(capsys, main([params, paths[0]]))
    assert f"{params}: a parameter file holds neither the preprocessing nor the class names; give its run " \
           f"directory, {run_dir}" in line, line
    sidecar = tmp_path / "m.shlo.preprocessing.json"
    sidecar.write_text("{}")
    line = _one_line(capsys, main([str(sidecar), paths[0]]))
    assert f"the preprocessing record of a StableHLO export; give the export, {tmp_path / 'm.shlo'}" in line, line


def _exit_code(call):
    with pytest.raises(SystemExit) as e:
        call()
    return e.value.code


def _bars(h, w):
    """A (h, w) image: black, with a white band over the middle third of the columns."""
    img = np.zeros((h, w), np.uint8)
    img[:, w // 3: 2 * w // 3] = 255
    return img


def test_resize_rules():
    """Resize to H x W (the default), or shorter side then centre crop; channels converted."""
    img = Image.fromarray(_bars(30, 60))
    # Stretched: the band's columns 20..40 of 60 land on 9.3..18.7 of 28.
    x = to_pixels(img, (28, 28, 1))
    assert x.shape == (28, 28, 1) and x.dtype == np.uint8
    assert (x[:, 11:17] == 255).all() and (x[:, :8] == 0).all() and (x[:, 21:] == 0).all()
    # Shorter side 28: 56 wide, band at 18.7..37.3; the centre 28 columns start at 14,
    # so the band lies on 4.7..23.3 of the crop.
    y = to_pixels(img, (28, 28, 3), Resize(shorter_side=28))
    assert y.shape == (28, 28, 3) and (y[..., 0] == y[..., 2]).all()
    assert (y[:, 6:22] == 255).all() and (y[:, :3] == 0).all() and (y[:, 26:] == 0).all()
    # An image already H x W is left as it is; RGB -> L is Pillow's luma (ITU-R 601-2).
    rgb = np.random.default_rng(0).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    grey = to_pixels(Image.fromarray(rgb), (28, 28, 1))[..., 0].astype(np.int64)
    r, g, b = (rgb[..., i].astype(np.int64) for i in range(3))
    want = (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16
    assert np.abs(grey - want).max() <= 1
    np.testing.assert_array_equal(to_pixels(Image.fromarray(rgb), (28, 28, 3)), rgb)
    # A raw-image export resizes in the model: the image's own pixels at its own size.
    raw = to_pixels(Image.fromarray(_bars(30, 60)), (28, 28, 3), Resize(28, in_model=True))
    np.testing.assert_array_equal(raw, np.repeat(_bars(30, 60)[..., None], 3, -1))


def test_a_raw_image_record_is_read_only_whole():
    """An export record with ``"raw_image": true`` is HWC with a resize, normalised in the graph;
    anything else is refused naming the record."""
    from jaxcnn.predict import _export_record
    base = {"image_shape": [16, 16, 3], "pixel_dtype": "uint8", "mean": [0.5] * 3, "std": [0.25] * 3,
            "resize": {"shorter_side": 18}, "in_graph": True, "input_layout": "HWC", "raw_image": True}
    prep, resize, in_graph, layout = _export_record(base, "m.onnx")
    assert (resize, in_graph, layout) == (Resize(18, in_model=True), True, "HWC")
    for change, said in [({"input_layout": "NHWC"}, "input_layout must be HWC with raw_image"),
                         ({"raw_image": False}, "input_layout must be NHWC or NCHW, got 'HWC'"),
                         ({"resize": None}, "raw_image needs a 'resize' and in_graph: true"),
                         ({"in_graph": False}, "raw_image needs a 'resize' and in_graph: true")]:
        with pytest.raises(PredictError, match=said):
            _export_record({**base, **change}, "m.onnx")



def test_the_recorded_interpolation_is_the_resize_filter():
    """A run trained with data.augment.interpolation=bicubic records it with its resize, and
    jaxcnn-predict resizes with it (evaluation's own transform)."""
    from jaxcnn.data.transforms import eval_transform
    from jaxcnn.predict import PredictError, resize_rule
    assert resize_rule({"resize": {"shorter_side": 20}}, "p") == Resize(20, "bilinear")
    rule = resize_rule({"resize": {"shorter_side": 20, "interpolation": "bicubic"}}, "p")
    assert rule == Resize(20, "bicubic") and resize_rule({}, "p") == Resize()
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (30, 50, 3), dtype=np.uint8))
    np.testing.assert_array_equal(to_pixels(img, (16, 16, 3), rule), eval_transform(img, (16, 16), 20, "bicubic"))
    assert not np.array_equal(to_pixels(img, (16, 16, 3), rule), to_pixels(img, (16, 16, 3), Resize(20)))
    with pytest.raises(PredictError, match="key 'resize' must be"):
        resize_rule({"resize": {"shorter_side": 20, "interpolation": "area"}}, "p")

def test_predict_decodes_a_chunk_at_a_time_in_bounded_memory(run_dir, tmp_path):
    """Every image was decoded before the model ran: 2.0 GB for 200 photos, OOM-killed under
    1.2 GB. 64 copies of a 3-megapixel JPEG (9 MB each, decoded) now add a fraction of what
    holding them all takes to the peak memory of a fresh process."""
    import subprocess
    import sys
    photo = tmp_path / "photo.jpg"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (1500, 2000, 3), dtype=np.uint8)).save(photo, quality=90)
    code = f"""
from jaxcnn.predict import load_predictor
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
predictor = load_predictor({run_dir!r})
predictor.predict([{str(photo)!r}])  # compiled and warm
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS:")
got = predictor.predict([{str(photo)!r}] * 64)
print(len(got), status("VmHWM:") - before)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    count, grown = map(int, out.stdout.split())
    assert count == 64 and grown < 64 * 1500 * 2000 * 3 // 4, grown  # all of them: 576 MB


def test_predict_gives_free_memory_back_after_each_chunk(run_dir, digits, monkeypatch):
    """Under jaxcnn.cpu.configure's malloc policy (a heap that is kept), photos decoded between
    forward passes fragmented it: 1,000 12-megapixel JPEGs took jaxcnn-predict to 1.26 GB, 10
    to 0.52 GB. Each chunk now gives the free pages back (a no-op without the policy: the
    suite runs with JAXCNN_CPU_MALLOC=0); measured by hand, 1,000 then peaked at 0.59 GB."""
    from jaxcnn import _host_memory
    from jaxcnn.predict import _CHUNK
    calls, seen = [], []
    monkeypatch.setattr(_host_memory, "give_back_free_memory", lambda: calls.append(len(seen)))
    paths = digits[0] * (_CHUNK // len(digits[0]) + 1)
    for prediction in load_predictor(run_dir).predictions(paths):
        seen.append(prediction)
    assert len(seen) == len(paths) > _CHUNK and calls == [0, _CHUNK]  # before each chunk is handed out
