"""Training, ``jaxcnn-eval``, ``jaxcnn-predict`` and the run's ONNX export give the same top-1 on
phone photos (JPEGs stored turned, with an EXIF Orientation) and 16-bit greyscale PNGs.

The two classes are a horizontal and a vertical bar, so an image seen unturned is the other
class: before one decode served every path, a model at 100% in evaluation scored 0/20 in
``jaxcnn-predict`` on such photos, and 16-bit images that training scaled were clipped to
white in predict (10/20)."""
import contextlib
import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from jaxcnn.export.cli import main as export_main
from jaxcnn.predict import image_files, load_predictor
from jaxcnn.train.cli import eval_main, train_main

pytest.importorskip("onnxruntime")
CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs",
                      "shapes_folder.yaml")
_ORIENTATION = 0x0112


def _bar(kind, rng, size=24):
    """A bright bar across a dark noisy square: ``kind`` "h" (a row band) or "v" (a column band)."""
    a = rng.integers(0, 60, (size, size)).astype(np.float64)
    width = int(rng.integers(4, 7))
    at = int(rng.integers(3, size - width - 3))
    if kind == "h":
        a[at:at + width, :] = rng.uniform(190, 255)
    else:
        a[:, at:at + width] = rng.uniform(190, 255)
    return a / 255.0


def _save(a, path, how):
    """Write the upright picture ``a`` (values in [0, 1]) as a turned phone JPEG, a 16-bit grey
    PNG (full scale) or a plain 8-bit RGB PNG."""
    grey8 = np.round(a * 255).astype(np.uint8)
    if how == "phone":  # stored a quarter turn left, Orientation 6 says "turn right to view"
        exif = Image.Exif()
        exif[_ORIENTATION] = 6
        Image.fromarray(np.stack([grey8] * 3, -1)).transpose(Image.Transpose.ROTATE_90).save(
            path.with_suffix(".jpg"), exif=exif, quality=95)
    elif how == "grey16":
        Image.fromarray(np.round(a * 65535).astype(np.uint16)).save(path.with_suffix(".png"))
    else:
        Image.fromarray(np.stack([grey8] * 3, -1)).save(path.with_suffix(".png"))


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A folder of bars (a third of them phone photos, a third 16-bit), a run trained on it, and
    the run's ONNX export."""
    root = tmp_path_factory.mktemp("bars")
    rng = np.random.default_rng(0)
    for split, count in (("train", 48), ("val", 12)):
        for kind in ("h", "v"):
            (root / "data" / split / kind).mkdir(parents=True)
            for i in range(count):
                _save(_bar(kind, rng), root / "data" / split / kind / f"{i:03d}",
                      ("phone", "grey16", "rgb")[i % 3])
    work = root / "run"
    assert train_main([CONFIG, f"data.path={root / 'data'}", "data.image_size=[16,16]", "data.batch_size=16",
                       "data.eval_batch_size=24", "data.workers=0", "train.epochs=null", "train.steps=60",
                       "train.eval_every=null", "optim.schedule.warmup=5", "checkpoint.enabled=false",
                       "logging.progress=none", "mesh.data=1", "--workdir", str(work)]) == 0
    onnx = root / "bars.onnx"
    assert export_main([str(work), "--format", "onnx", "--out", str(onnx)]) == 0
    return root / "data", work, onnx


def test_eval_predict_and_onnx_give_the_same_top1_on_phone_photos_and_16_bit_images(run):
    data, work, onnx = run
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert eval_main([str(work), "--json"]) == 0
    eval_top1 = json.loads(out.getvalue())["top1"]
    assert eval_top1 >= 0.9, eval_top1  # learnt: an image seen unturned would be the other class

    files = image_files([str(data / "val")])
    truth = [p.rsplit("/", 2)[-2] for p in files]
    tops = {}
    for name, source in (("run", work), ("onnx", onnx)):
        predictor = load_predictor(str(source))
        tops[name] = [p.top_k[0].name for p in predictor.predictions(files, top_k=1)]
    assert tops["run"] == tops["onnx"]
    for how in ("phone", "grey16"):
        picked = [i for i, p in enumerate(files) if (p.endswith(".jpg") if how == "phone" else
                                                    int(p[-7:-4]) % 3 == 1)]
        right = sum(tops["run"][i] == truth[i] for i in picked)
        assert right >= len(picked) - 1, (how, right, len(picked))
    predict_top1 = np.mean([t == y for t, y in zip(tops["run"], truth)])
    assert predict_top1 == pytest.approx(eval_top1), (predict_top1, eval_top1)


def test_a_raw_image_onnx_export_gives_the_runs_predictions_on_images_of_any_size(run, tmp_path, capsys):
    """``--raw-image``: the export takes each decoded image at its own size and resizes, crops
    and normalises it inside; ``jaxcnn-predict`` feeds it so and gives the run's top-1 (and its
    probabilities within 1e-3: onnxruntime's resize is within one uint8 step of Pillow's)."""
    onnx = pytest.importorskip("onnx")
    data, work, _ = run
    raw = tmp_path / "raw.onnx"
    assert export_main([str(work), "--format", "onnx", "--raw-image", "--out", str(raw)]) == 0
    assert ("input: raw uint8 image of any size (H, W, 3): resized (shorter side 18, bilinear "
            "antialiased), centre-cropped to 16x16 and normalised inside") in capsys.readouterr().out
    meta = json.loads({p.key: p.value for p in onnx.load(str(raw)).metadata_props}["jaxcnn.preprocessing"])
    assert (meta["raw_image"], meta["input_layout"], meta["resize"]) == (True, "HWC", {"shorter_side": 18})
    files = image_files([str(data / "val")])[::4]  # phone JPEGs, 16-bit and RGB PNGs, 24x24
    rng = np.random.default_rng(1)
    for i, (h, w) in enumerate([(16, 16), (18, 18), (40, 31), (17, 50), (90, 120), (1, 30)]):
        path = tmp_path / f"sized{i}.png"  # a bar picture of another size and aspect
        Image.fromarray(np.round(_bar("hv"[i % 2], rng) * 255).astype(np.uint8)).resize((w, h)).save(path)
        files.append(str(path))
    by = {name: list(load_predictor(str(source)).predictions(files, top_k=1))
          for name, source in (("run", work), ("raw", raw))}
    assert [p.top_k[0].name for p in by["raw"]] == [p.top_k[0].name for p in by["run"]]
    gap = np.abs(np.stack([p.probabilities for p in by["raw"]]) - np.stack([p.probabilities for p in by["run"]]))
    print(f"raw-image ONNX vs the run: probabilities within {gap.max():.2e}")
    assert gap.max() <= 1e-3
