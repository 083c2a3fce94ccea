"""``jaxcnn-train`` on an image folder and on its record files: a tiny folder of coloured shapes
(three classes, JPEG and PNG, mixed sizes and Pillow modes, one corrupt file) is learnt above
chance, the corrupt file is skipped and counted in metrics.jsonl, the class names reach
preprocessing.json, and records train bit for bit like the folder (with grain workers). Kill -9
and resume: tests/reliability/test_reliability_image_folder.py (with -m slow)."""
import json
import re
import os
import shutil

import numpy as np
import pytest

from jaxcnn.data.cli import main as data_main
from jaxcnn.data.shapes import write_shapes_folder
from jaxcnn.interop import load_npz
from jaxcnn.train.cli import train_main
from jaxcnn.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(ROOT, "configs", "shapes_folder.yaml")
CLASSES = ["blue", "green", "red"]
STEPS = 24


def _args(path, workdir, *extra):
    return [CONFIG, f"data.path={path}", "mesh.data=1", "data.image_size=[16,16]", "data.batch_size=12",
            "data.eval_batch_size=12", "data.workers=0", "data.prefetch=1", "optim.name=adam", "optim.lr=0.003",
            "optim.schedule.name=constant", f"train.steps={STEPS}", "train.epochs=null", "train.eval_every=null",
            "logging.log_every=4", "logging.progress=lines", "checkpoint.every=8", "checkpoint.keep=5",
            *extra, "--workdir", str(workdir)]


def _params(workdir):
    params, state = load_npz(os.path.join(workdir, "params.npz"))
    flat = {}

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}/")
            else:
                flat[prefix + k] = np.asarray(v)
    walk(params, "")
    walk(state, "state/")
    return flat


def _assert_same_params(a, b):
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        np.testing.assert_array_equal(pa[key], pb[key], err_msg=key)


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """The folder, and a finished reference run on it."""
    base = tmp_path_factory.mktemp("imgfolder")
    folder = base / "shapes"
    write_shapes_folder(folder, per_class=(16, 4), classes=CLASSES, size_range=(16, 40))
    corrupt = folder / "train" / "green" / "99999.jpg"
    first_jpeg = sorted((folder / "train" / "green").glob("*.jpg"))[0]
    corrupt.write_bytes(first_jpeg.read_bytes()[:150])  # truncated
    assert train_main(_args(folder, base / "ref", "data.on_bad_image=skip")) == 0
    return folder, base / "ref", corrupt


def test_trains_above_chance_and_counts_the_bad_image(shapes):
    folder, ref, corrupt = shapes
    records = read_metrics(ref)
    train = [r for r in records if r["kind"] == "train"]
    losses = [r["loss"] for r in train]
    assert np.mean(losses[-2:]) < np.mean(losses[:2]), losses
    final = [r for r in records if r["kind"] == "eval"][-1]
    assert final["count"] == 12 and final["top1"] > 0.6, final  # chance is 1/3
    # 49 training files, batch 12: 4 steps an epoch, 6 epochs; the corrupt one is met in some of them.
    counts = [r["bad_images"] for r in train]  # running total of the images skipped so far
    assert counts == sorted(counts) and counts[-1] >= 1, counts
    prep = json.loads((ref / "preprocessing.json").read_text())
    assert prep["class_names"] == CLASSES and prep["image_shape"] == [16, 16, 3]
    assert prep["pixel_dtype"] == "uint8" and prep["dataset"] == "folder"
    assert prep["resize"] == {"shorter_side": 18}  # data.eval_resize's default: 16 / 0.875
    # jaxcnn-predict reads it all: the class names, and resize + centre crop for any image size.
    from jaxcnn.predict import predict
    val = sorted((folder / "val").glob("*/*"))
    found = predict(str(ref), [str(p) for p in val], top_k=1)
    right = sum(f.top_k[0].name == p.parent.name for f, p in zip(found, val))
    assert right / len(val) > 0.6, [(f.top_k[0].name, p.parent.name) for f, p in zip(found, val)]


def test_fail_stops_with_the_file_name(shapes, tmp_path, capsys):
    folder, _, corrupt = shapes
    code = train_main(_args(folder, tmp_path / "w", "data.on_bad_image=fail", "checkpoint.enabled=false"))
    err = capsys.readouterr().err
    assert code == 2 and str(corrupt) in err and err.count("\n") == 1, err


def test_bad_folder_is_one_line_exit_2(tmp_path, capsys):
    os.makedirs(tmp_path / "f" / "train" / "a")
    assert train_main(_args(tmp_path / "f", tmp_path / "w")) == 2
    err = capsys.readouterr().err
    assert "empty class folder" in err and str(tmp_path / "f" / "train" / "a") in err and err.count("\n") == 1
    assert train_main(_args(tmp_path / "f", tmp_path / "w", "data.workers=2147483647", "--dry-run")) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxcnn-train: error: data.workers: 2147483647 worker processes is more than")
    assert train_main(_args(tmp_path / "f", tmp_path / "w", "data.eval_resize=2147483647", "--dry-run")) == 2
    assert "data.eval_resize: 2147483647 must be from the crop's longer side 16" in capsys.readouterr().err


def test_records_train_bit_for_bit_like_the_folder(shapes, tmp_path):
    """The same images, so the same training, bit for bit (the corrupt file is left out by the
    converter, so a copy of the folder without it is the reference). Kill and resume with
    workers: tests/reliability/test_reliability_image_folder.py (with -m slow)."""
    folder = shapes[0]
    clean = tmp_path / "clean"
    shutil.copytree(folder, clean)
    os.remove(clean / "train" / "green" / "99999.jpg")
    assert data_main(["convert", str(clean), str(tmp_path / "rec"), "--no-progress"]) == 0
    assert train_main(_args(clean, tmp_path / "a", "checkpoint.enabled=false")) == 0
    assert train_main(_args(tmp_path / "rec", tmp_path / "b", "data.source=records", "data.workers=2",
                            "checkpoint.enabled=false")) == 0
    _assert_same_params(tmp_path / "a", tmp_path / "b")


def test_export_measures_and_calibrates_on_the_image_folder(shapes, tmp_path, capsys, monkeypatch):
    """--quantize, --prune and --fold-bn of a run on an image folder ended on "the run's data is
    generated per step; calibration and accuracy need a dataset": the accuracy is now measured on
    the val split (as jaxcnn-eval does) and int8 calibrated on training images spread over the
    classes, resized and centre-cropped as in evaluation."""
    from jaxcnn.data import loader
    from jaxcnn.export.cli import main as export_main
    from jaxcnn.export.pipeline import calibration_batches
    from jaxcnn.train.config import load_config
    _, ref, _ = shapes
    out = tmp_path / "q.shlo"
    capsys.readouterr()
    assert export_main([str(ref), "--format", "stablehlo", "--quantize", "int8", "--calibration-batches", "2",
                        "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    final = [r for r in read_metrics(ref) if r["kind"] == "eval"][-1]
    assert report["accuracy"]["original"] == pytest.approx(final["top1"])  # the val split, as in training
    assert export_main([str(ref), "--format", "onnx", "--out", str(tmp_path / "m.onnx")]) == 0
    # The resize and crop were only in the file's metadata: images resized straight to the
    # crop shifted probabilities by up to 0.21.
    assert ("input: raw uint8 pixels in [0, 255], NHWC (N, 16, 16, 3), each image first resized "
            "(bilinear) so that its shorter side is 18 px and centre-cropped to 16x16, as "
            "evaluation does (jaxcnn-predict does it); the model normalises") in capsys.readouterr().out
    assert 0.0 <= report["accuracy"]["int8"] <= 1.0 and out.exists()
    picked, load_rgb = [], loader.load_rgb
    monkeypatch.setattr(loader, "load_rgb", lambda source, index: picked.append(index) or load_rgb(source, index))
    batches = calibration_batches(load_config(ref / "config.resolved.yaml"), 2, batch_size=6)
    assert [b.shape for b in batches] == [(6, 16, 16, 3)] * 2 and all(b.dtype == np.float32 for b in batches)
    pixels = np.concatenate(batches)  # normalised with the ImageNet statistics the run trained with
    assert -2.2 < pixels.min() and pixels.max() < 2.7 and abs(float(pixels.mean())) < 1.5
    # The split is ordered by class (49 files, 16-17 a class): the picks span all of it.
    assert len(picked) == 12 and min(picked) == 0 and max(picked) == 48, picked


def _tree(path):
    """Every file under ``path`` with its bytes' hash and modification time."""
    import hashlib
    return {str(p.relative_to(path)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(path.rglob("*")) if p.is_file()}


def test_a_resume_on_changed_data_is_refused_unless_asked(tmp_path, capsys):
    """Images added to, removed from or renamed in the folder (or a class added) between a run and
    its resume went unnoticed: the resumed run trained on other batches under the same config.
    The run records its data's fingerprint (run_meta.json), and a resume on other data stops with
    one line, changing nothing, unless checkpoint.on_config_change=continue."""
    folder = tmp_path / "f"
    write_shapes_folder(folder, per_class=(6, 2), classes=CLASSES[:2], size_range=(16, 20))
    args = _args(folder, tmp_path / "w", "train.steps=2", "optim.schedule.warmup=0", "checkpoint.every=2",
                 "data.batch_size=4", "data.eval_batch_size=4")
    assert train_main(args) == 0
    meta = json.loads((tmp_path / "w" / "run_meta.json").read_text())
    assert meta["data"]["train"]["images"] == 12 and meta["data"]["classes"] == 2
    assert train_main(args) == 0  # the same data: the finished run is resumed
    capsys.readouterr()
    before = _tree(tmp_path / "w")

    def refused(needle):
        assert train_main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{tmp_path / 'w'} was trained on other data than {folder} holds" in err, err
        assert needle in err and "checkpoint.on_config_change=continue" in err, err
        assert _tree(tmp_path / "w") == before

    first = sorted((folder / "train" / "blue").iterdir())[0]
    os.rename(first, first.with_name("renamed" + first.suffix))
    refused("train: 12 images as before, but other file names")
    os.remove(first.with_name("renamed" + first.suffix))
    refused("train: 11 images, the run's had 12")
    shutil.copytree(folder / "train" / "green", folder / "train" / "red")
    shutil.copytree(folder / "val" / "green", folder / "val" / "red")
    refused("3 classes, the run's had 2")
    shutil.rmtree(folder / "train" / "red")
    shutil.rmtree(folder / "val" / "red")
    # Asked to go on: it does, says so, and records the data as they are now.
    assert train_main(args + ["checkpoint.on_config_change=continue"]) == 0
    assert "continuing under changes (checkpoint.on_config_change=continue): data: train: 11 images" in \
        capsys.readouterr().out
    assert json.loads((tmp_path / "w" / "run_meta.json").read_text())["data"]["train"]["images"] == 11
    assert train_main(args) == 0


def test_record_fingerprints_tell_converted_folders_apart(tmp_path):
    """Records converted again from a changed folder have another fingerprint, a same one as
    long as the folder is the same."""
    from jaxcnn.data.images import ImageData, data_changes
    folder = tmp_path / "f"
    write_shapes_folder(folder, per_class=(3, 1), classes=CLASSES[:2], size_range=(16, 20))

    def converted(out):
        assert data_main(["convert", str(folder), str(tmp_path / out), "--no-progress"]) == 0
        return ImageData("records", tmp_path / out, image_size=(16, 16)).fingerprint()

    a, b = converted("a"), converted("b")
    assert {k: v for k, v in a.items() if k != "path"} == {k: v for k, v in b.items() if k != "path"}
    assert data_changes(a, b) == []
    os.remove(sorted((folder / "val" / "blue").iterdir())[0])
    write_shapes_folder(tmp_path / "g", per_class=(1, 1), classes=CLASSES[:1], size_range=(16, 20))
    shutil.copy(next((tmp_path / "g" / "val" / "blue").iterdir()), folder / "val" / "blue" / "new.png")
    c = converted("c")
    assert c["val"]["images"] == a["val"]["images"] and data_changes(a, c) == [
        "val: 2 images as before, but other records"]


def test_folder_and_record_fingerprints_are_the_recorded_hashes(tmp_path):
    """The fingerprints runs record in run_meta.json stay what they were (a change would refuse
    every resume): SHA-256 over the class names, each NUL-terminated, then for a folder a NUL and
    each "<class>/<file>" NUL-terminated; for its records a NUL, the count, a NUL and the
    folder's hash (which jaxcnn-data convert records); computed here by hand, with a non-ASCII
    class name."""
    import hashlib

    from jaxcnn.data.images import ImageData
    folder = tmp_path / "f"
    write_shapes_folder(folder, per_class=(2, 1), classes=CLASSES[:2], size_range=(16, 20))
    for split in ("train", "val"):
        os.rename(folder / split / "green", folder / split / "grün")
    names = ["blue", "grün"]
    assert data_main(["convert", str(folder), str(tmp_path / "r"), "--no-progress"]) == 0
    of_folder = ImageData("folder", folder, image_size=(16, 16)).fingerprint()
    of_records = ImageData("records", tmp_path / "r", image_size=(16, 16)).fingerprint()
    for split, count in [("train", 4), ("val", 2)]:
        classes = b"".join(n.encode() + b"\0" for n in names)
        files = sorted(f"{c}/{f}" for c in names for f in os.listdir(folder / split / c))
        by_hand = hashlib.sha256(classes + b"\0" + b"".join(f.encode() + b"\0" for f in files)).hexdigest()
        assert of_folder[split] == {"images": count, "sha256": by_hand}, split
        by_hand = hashlib.sha256(classes + f"\0{count}\0{by_hand}".encode()).hexdigest()
        assert of_records[split] == {"images": count, "sha256": by_hand}, split


def test_eval_on_changed_or_other_data_warns_and_goes_on(tmp_path, capsys):
    """jaxcnn-eval on a folder that changed since training (the fingerprint run_meta.json recorded
    differs) said nothing; now one warning line naming the folder and what differs, as a resume's
    refusal does, and the evaluation goes on (another folder is a legitimate thing to evaluate)."""
    import yaml

    from jaxcnn.interop import save_npz
    from jaxcnn.train.cli import eval_main
    from jaxcnn.train.config import load_config, to_dict
    from jaxcnn.train.rundir import RunDir
    from jaxcnn.train._build import build_run, init_state
    folder, work = tmp_path / "f", tmp_path / "w"
    write_shapes_folder(folder, per_class=(4, 2), classes=CLASSES[:2], size_range=(16, 20))
    # A finished run directory as the trainer leaves it, without the training (its final
    # parameters: the initial ones; run_meta.json: the folder's fingerprint).
    cfg = load_config(CONFIG, _args(folder, work, "checkpoint.enabled=false", "data.batch_size=4",
                                    "data.eval_batch_size=4")[1:-2])
    run = build_run(cfg)
    state = init_state(run)
    work.mkdir()
    save_npz(str(work / "params.npz"), state.params, state.state)
    (work / "config.resolved.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
    RunDir(str(work)).write_meta([], CONFIG, data=run.images.fingerprint())

    def evaluated(*overrides):
        assert eval_main([str(work), "--json", *overrides]) == 0
        out, err = capsys.readouterr()
        assert json.loads(out)["count"] == 4, out  # it went on: every val image evaluated
        return err

    assert evaluated() == ""  # the same data: no warning
    first = sorted((folder / "val" / "blue").iterdir())[0]
    os.rename(first, first.with_name("renamed" + first.suffix))
    assert evaluated() == (f"jaxcnn-eval: warning: {folder} does not hold the data {work} was trained on "
                           "(val: 4 images as before, but other file names); evaluating on them as they "
                           "are now\n")
    other = tmp_path / "g"
    write_shapes_folder(other, per_class=(5, 2), classes=CLASSES[:2], size_range=(16, 20))
    err = evaluated(f"data.path={other}")
    assert err.count("\n") == 1 and err.startswith(f"jaxcnn-eval: warning: {other} does not hold the data "), err
    assert "(train: 10 images, the run's had 8" in err and err.endswith("evaluating on them as they are now\n"), err


def test_a_head_larger_than_the_folders_classes_is_refused_unless_on_purpose(shapes, tmp_path, capsys,
                                                                            monkeypatch):
    """model.num_classes=10 on a 3-class folder trained without a word, and predictions then
    named phantom classes."""
    from jaxcnn.train import _plan
    # The dry runs' steps traced and lowered, not compiled by XLA (their memory check is
    # tests/train/test_dry_run.py's): what is checked here is whether the config is accepted.
    monkeypatch.setattr(_plan, "_compile", lambda lowered: None)
    folder = shapes[0]
    assert train_main(_args(folder, tmp_path / "w", "model.num_classes=10", "--dry-run")) == 2
    assert capsys.readouterr().err == (
        f"jaxcnn-train: error: model.num_classes: 10 is more than the 3 classes of {folder} "
        "(['blue', 'green', 'red']): outputs 3-9 would be classes no image has, which predictions "
        "could name; leave it null (the data's count), or set model.extra_outputs=true if the larger "
        "head is on purpose\n")
    assert train_main(_args(folder, tmp_path / "w", "model.num_classes=10", "model.extra_outputs=true",
                            "--dry-run")) == 0


def test_eval_on_other_classes_is_refused_naming_both_unless_asked(shapes, tmp_path, capsys):
    """jaxcnn-eval on a folder of other classes only warned of "other file names", then scored
    the model's outputs against labels of other classes."""
    from jaxcnn.train.cli import eval_main
    _, ref, _ = shapes
    other = tmp_path / "g"
    write_shapes_folder(other, per_class=(6, 2), classes=CLASSES[:2], size_range=(16, 20))
    capsys.readouterr()
    assert eval_main([str(ref), f"data.path={other}"]) == 2
    assert capsys.readouterr().err == (
        f"jaxcnn-eval: error: data.path: {other} names the classes ['blue', 'green'], but {ref} was "
        "trained on ['blue', 'green', 'red']; --other-classes evaluates anyway\n")
    assert eval_main([str(ref), f"data.path={other}", "--other-classes", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["count"] == 4 and err.startswith("jaxcnn-eval: warning: "), err
    assert eval_main([str(ref), f"data.path={other}", "--other-classes", "--per-class"]) == 2
    assert "--per-class with --other-classes: the confusion matrix's rows" in capsys.readouterr().err
    more = tmp_path / "more"  # a class the model has no output for: refused even when asked
    write_shapes_folder(more, per_class=(4, 1), classes=CLASSES + ["yellow"], size_range=(16, 20))
    assert eval_main([str(ref), f"data.path={more}", "--other-classes"]) == 2
    assert capsys.readouterr().err == (
        f"jaxcnn-eval: error: data.path: {more} holds more classes than the 3 {ref} was trained on "
        "(['blue', 'green', 'red']): the labels past them have no output to score\n")


def test_per_class_results_of_the_final_eval_jaxcnn_eval_and_the_plot(shapes, tmp_path, capsys):
    """Evaluation gave top-1 and top-5 only: no per-class accuracy, no confusion matrix."""
    from jaxcnn.train.cli import eval_main
    from jaxcnn.train.plot import main as plot_main
    _, ref, _ = shapes
    records = read_metrics(ref)
    [final] = [r for r in records if r["kind"] == "eval"]
    [report] = [r for r in records if r["kind"] == "per_class"]
    assert report["step"] == final["step"] == STEPS and report["classes"] == CLASSES
    confusion = np.asarray(report["confusion"])
    assert confusion.sum() == final["count"] == 12 and report["images"] == [4, 4, 4]
    assert np.trace(confusion) / 12 == pytest.approx(final["top1"])
    assert report["recall"] == [confusion[i, i] / 4 for i in range(3)]
    capsys.readouterr()
    assert eval_main([str(ref), "--per-class"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].split() == ["class", "images", "recall", "precision"]
    assert [line.split()[:2] for line in out[2:5]] == [[c, "4"] for c in CLASSES]
    assert out[5].startswith("confusion (rows: true class") and len(out) == 9
    assert "top-5" not in out[0]  # 3 classes: top-5 is always 1
    assert eval_main([str(ref), "--per-class", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["per_class"]["confusion"] == report["confusion"]
    assert plot_main([str(ref), "--out", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 0


def test_evaluation_normalises_uint8_batches_on_the_device_as_predict_does_on_the_host(shapes, capsys):
    """Evaluation batches reach the eval step as ``uint8`` (they were normalised on the host, in
    the trainer's process); ``jaxcnn-eval``'s loss and top-1 are those of ``jaxcnn-predict``'s
    probabilities, which decodes and normalises each image on the host."""
    from jaxcnn.data.images import ImageData
    from jaxcnn.predict import predict
    from jaxcnn.train.cli import eval_main
    from jaxcnn.train._data import eval_image_batches
    folder, ref, _ = shapes
    images = ImageData("folder", str(folder), image_size=(16, 16))
    (batch, _), *_ = list(eval_image_batches(images, 8, workers=0))
    assert batch["image"].dtype == np.uint8
    capsys.readouterr()
    assert eval_main([str(ref), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    val = sorted((folder / "val").glob("*/*"))
    found = predict(str(ref), [str(p) for p in val], top_k=1)
    labels = [CLASSES.index(p.parent.name) for p in val]
    loss = np.mean([-np.log(f.probabilities[y]) for f, y in zip(found, labels)])
    top1 = np.mean([np.argmax(f.probabilities) == y for f, y in zip(found, labels)])
    assert result["count"] == len(val) == 12
    assert result["top1"] == top1 and result["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-7)


def test_too_few_open_files_for_the_workers_is_one_line(tmp_path):
    """``ulimit -n 32`` with 2 data workers ended in a 116-line traceback from grain's start-up
    (os.pipe: Too many open files); the trainer now refuses before it trains, naming the limit,
    and a loader asked for workers the limit cannot hold refuses likewise."""
    import resource
    import subprocess
    import sys

    folder = tmp_path / "shapes"
    write_shapes_folder(folder, per_class=(4, 2), classes=CLASSES, size_range=(16, 20))
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, (32, resource.getrlimit("
            "resource.RLIMIT_NOFILE)[1])); from jaxcnn.train.cli import train_main; sys.exit(train_main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", code, *_args(folder, tmp_path / "run", "data.workers=2"),
                          "--dry-run"], capture_output=True, text=True, timeout=300)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert lines[0].startswith("jaxcnn-train: error: data.workers: 2 data worker processes for each of "
                               "training and evaluation need about ") and "ulimit -n allows 32" in lines[0]
    from jaxcnn.data.loader import Loader
    from jaxcnn.errors import DataError
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        with pytest.raises(DataError, match=r"4 data worker processes need about \d+ open files"):
            Loader(lambda step: {"x": np.zeros(1)}, 0, 4, workers=4)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_records_converted_again_mid_run_stop_it_at_its_next_evaluation(tmp_path, capsys, monkeypatch):
    """jaxcnn-data convert into a running trainer's record directory changed its validation data
    silently; the trainer now asks before each evaluation and stops with one line naming the
    change (the records themselves: tests/data/test_image_loader.py)."""
    from jaxcnn.data.images import ImageData
    folder, records = tmp_path / "f", tmp_path / "rec"
    write_shapes_folder(folder, per_class=(6, 2), classes=CLASSES[:2], size_range=(16, 20))
    assert data_main(["convert", str(folder), str(records), "--no-progress"]) == 0
    asked = []

    def changed_at_the_second_evaluation(self):
        asked.append(1)
        return ["val: 5 images, the run's had 4"] if len(asked) > 1 else []
    monkeypatch.setattr(ImageData, "changes_since_opened", changed_at_the_second_evaluation)
    args = _args(records, tmp_path / "w", "data.source=records", "train.steps=4", "train.eval_every=2",
                 "optim.schedule.warmup=0", "checkpoint.every=2", "data.batch_size=4", "data.eval_batch_size=4")
    capsys.readouterr()
    assert train_main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"jaxcnn-train: error: {records}: the data changed while the run trained (val: 5 images, "
                   "the run's had 4); stopped before evaluating on them; the checkpoints are kept"]
    assert "2" in os.listdir(tmp_path / "w" / "checkpoints")


def test_a_data_change_one_process_saw_stops_every_process(monkeypatch):
    """In a multi-process run a process that saw its data change stopped alone, and the others
    waited in the evaluation's collectives until they took it for a lost peer: each process
    now learns whether any saw a change (an allgather of one flag)."""
    import jax
    from jax.experimental import multihost_utils

    from jaxcnn.train._loop import changes_on_any_process
    assert changes_on_any_process(["val: 5 images, the run's had 4"]) == ["val: 5 images, the run's had 4"]
    assert changes_on_any_process([]) == []  # one process: no collective
    gathered = []

    def allgather(flag):
        gathered.append(int(flag))
        return np.array([0, 0, 1, 0], np.int32)
    monkeypatch.setattr(jax, "process_count", lambda: 4)
    monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
    assert changes_on_any_process([]) == ["process 2 of 4 saw them change"]
    assert changes_on_any_process(["val: 5 images, the run's had 4"]) == ["val: 5 images, the run's had 4"]
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda flag: np.zeros(4, np.int32))
    assert changes_on_any_process([]) == [] and gathered == [0, 1]


class _KilledAtStep:
    """A training batch maker whose worker process is killed with SIGKILL (as the out-of-memory
    killer does) while it makes the batch for ``step``."""

    def __init__(self, maker, step):
        self.maker, self.step, self.parent = maker, step, os.getpid()

    def __len__(self):
        return len(self.maker)

    def __call__(self, step):
        if step == self.step and os.getpid() != self.parent:
            import signal
            os.kill(os.getpid(), signal.SIGKILL)
        return self.maker(step)


def test_a_data_worker_killed_mid_run_is_one_line_and_a_checkpoint(shapes, tmp_path, capsys, monkeypatch):
    """A grain worker killed by the OOM killer left jaxcnn-train asleep at 0% CPU, deaf to
    SIGTERM, in 3 runs of 3. Now: one line naming the worker, its signal and the step, exit 1,
    the state saved; the resumed run ends bitwise where an uninterrupted run ends."""
    from jaxcnn.data.images import ImageData
    folder, ref, _ = shapes
    made = ImageData.train_batches
    monkeypatch.setattr(ImageData, "train_batches", lambda self, **kw: _KilledAtStep(made(self, **kw), 13))
    args = _args(folder, tmp_path / "w", "data.on_bad_image=skip", "data.workers=2")
    assert train_main(args) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    step = int(err.rsplit("checkpoint saved at step ", 1)[1])
    assert 1 <= step <= 13, err
    assert re.fullmatch(r"jaxcnn-train: error: data worker [12] of 2 \(pid \d+\) was killed by SIGKILL \(.*\) "
                        r"while the loader waited for batch \d+; checkpoint saved at step \d+\n", err), err
    assert str(step) in os.listdir(tmp_path / "w" / "checkpoints")
    monkeypatch.undo()
    assert train_main(_args(folder, tmp_path / "w", "data.on_bad_image=skip")) == 0
    assert f"resumed from step {step}" in capsys.readouterr().out
    _assert_same_params(ref, tmp_path / "w")


def test_a_val_split_run_records_resumes_refuses_another_split_and_evaluates_the_held_out_images(tmp_path, capsys):
    """data.val_split on a folder of class folders (ImageFolder's layout, no train/ or val/): the
    start-up says the split, run_meta.json records it (fraction, seed, counts per class, the hash
    of the held-out files), the same command resumes, another val_split is refused in one line,
    and jaxcnn-eval evaluates the images the run held out."""
    import hashlib

    from jaxcnn.train.cli import eval_main
    write_shapes_folder(tmp_path / "s", per_class=(8, 1), classes=CLASSES[:2], size_range=(16, 20))
    folder, work = tmp_path / "f", tmp_path / "w"
    shutil.move(tmp_path / "s" / "train", folder)
    args = _args(folder, work, "data.val_split=0.25", "train.steps=2", "optim.schedule.warmup=0",
                 "checkpoint.every=2", "data.batch_size=4", "data.eval_batch_size=4")
    assert train_main(args) == 0
    out = capsys.readouterr().out
    assert f"data: folder {folder}, 2 classes, 12 train / 4 val (val_split 0.25, stratified, seed 0)\n" in out, out
    split = json.loads((work / "run_meta.json").read_text())["data"]["split"]
    assert {k: v for k, v in split.items() if k != "val_sha256"} == {
        "val_split": 0.25, "seed": 0, "stratified": True, "per_class": {"blue": [6, 2], "green": [6, 2]}}
    from jaxcnn.data.images import ImageData
    held = ImageData("folder", folder, image_size=(16, 16), val_split=0.25, seed=0).val.index.paths
    names = b"".join(n.encode() + b"\0" for n in CLASSES[:2])
    assert split["val_sha256"] == hashlib.sha256(names + b"\0" + b"".join(p.encode() + b"\0" for p in held)).hexdigest()
    assert train_main(args) == 0  # the same command: the finished run is resumed
    capsys.readouterr()
    assert train_main(args[:-2] + ["data.val_split=0.5"] + args[-2:]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.val_split" in err, err
    assert eval_main([str(work), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["count"] == len(held) == 4 and err == "", (out, err)
    # an image added to a class draws that class's split anew: the data fingerprint refuses it
    added = folder / "blue" / "zz-added.png"
    shutil.copy(sorted((folder / "blue").iterdir())[0], added)
    assert train_main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{work} was trained on other data than {folder} holds now (" in err, err
    assert "train: 13 images, the run's had 12" in err, err


def test_augment_keys_reach_the_trainers_batches_and_preprocessing(shapes, tmp_path):
    """``data.augment`` as the trainer reads it for an image folder: no augmentation trains on
    evaluation's resize (crop_pct's, with the interpolation) and centre crop, which
    preprocessing.json records for jaxcnn-predict and the export."""
    from jaxcnn.data.loader import load_rgb
    from jaxcnn.data.preprocessing import from_run
    from jaxcnn.data.transforms import eval_transform
    from jaxcnn.train.config import load_config
    from jaxcnn.train._data import batch_fn
    from jaxcnn.train._build import build_run

    overrides = _args(shapes[0], tmp_path / "w")[1:-2] + ["data.on_bad_image=skip"]
    cfg = load_config(CONFIG, overrides + ["data.augment.no_aug=true", "data.augment.interpolation=bicubic",
                                           "data.augment.crop_pct=0.5"])
    run = build_run(cfg)
    assert run.images.eval_resize == 32 and run.images.eval_batches(batch_size=12).interpolation == "bicubic"
    prep = from_run(run).to_dict()
    assert prep["resize"] == {"shorter_side": 32, "interpolation": "bicubic"}
    maker = run.images.train_batches(seed=run.data_seed, batch_size=12)
    batch = maker(3)
    for k, index in enumerate(batch["index"]):
        want = eval_transform(load_rgb(run.images.train, int(index))[0], (16, 16), 32, "bicubic")
        np.testing.assert_array_equal(batch["image"][k], want)
    default = build_run(load_config(CONFIG, overrides))
    assert default.images.augment.hflip == 0.5 and default.images.augment.scale == (0.08, 1.0)
    flipped = build_run(load_config(CONFIG, overrides + ["data.augment.hflip=0", "data.augment.vflip=1"]))
    assert not np.array_equal(batch_fn(flipped)(0)["image"], batch_fn(default)(0)["image"])
