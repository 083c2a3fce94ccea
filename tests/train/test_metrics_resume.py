"""A resumed run's metrics.jsonl: records after the resume step, and a torn line, are dropped;
a full disk never tears a line."""
import json
import os

import pytest

from jaxcnn.errors import WorkdirError
from jaxcnn.train import metrics
from jaxcnn.train.metrics import MetricsWriter, read_metrics
from full_disk import FullDisk


def _write(path, steps, torn=False):
    with open(path, "w", encoding="utf-8") as f:
        for step, kind in steps:
            f.write(json.dumps({"step": step, "kind": kind, "loss": 1.0 / step}) + "\n")
        if torn:
            f.write('{"step": 9, "kind": "tra')  # a kill in the middle of a write


def test_resumed_writer_drops_later_records_and_a_torn_line(tmp_path):
    _write(tmp_path / "metrics.jsonl", [(2, "train"), (4, "train"), (4, "eval"), (6, "train"),
                                        (8, "train")], torn=True)
    writer = MetricsWriter(str(tmp_path), resumed_at=4)
    writer.write(6, "train", {"loss": 0.5})
    writer.close()
    got = [(r["step"], r["kind"]) for r in read_metrics(str(tmp_path))]
    assert got == [(2, "train"), (4, "train"), (4, "eval"), (6, "train")]
    assert read_metrics(str(tmp_path))[-1]["loss"] == 0.5
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temporary left


def test_fresh_writer_appends_and_keeps_everything(tmp_path):
    _write(tmp_path / "metrics.jsonl", [(2, "train"), (4, "train")])
    writer = MetricsWriter(str(tmp_path))
    writer.write(2, "train", {"loss": 0.1})
    writer.close()
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [2, 4, 2]


def test_a_fresh_start_over_a_run_killed_before_its_first_checkpoint_drops_its_records(tmp_path):
    """A kill before the first checkpoint left the re-run's first steps twice in metrics.jsonl:
    the trainer starts its writer at step 0, which drops every later record of the killed run."""
    _write(tmp_path / "metrics.jsonl", [(1, "train"), (2, "train")], torn=True)
    writer = MetricsWriter(str(tmp_path), resumed_at=0)
    writer.write(1, "train", {"loss": 0.25})
    writer.close()
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path))] == [(1, 0.25)]


def test_a_full_disk_never_tears_a_line(tmp_path, monkeypatch):
    """A disk filling between checkpoints gave a 44-line traceback and left a torn line in
    metrics.jsonl for good: the write is cut back to the last whole line and the run stops
    with one WorkdirError line."""
    _write(tmp_path / "metrics.jsonl", [(1, "train")])
    monkeypatch.setattr(metrics, "open", lambda path, mode="r", **k: FullDisk(open(path, mode, **k), 2)
                        if mode == "a" else open(path, mode, **k), raising=False)
    writer = MetricsWriter(str(tmp_path), resumed_at=1)
    writer.write(2, "train", {"loss": 0.5})
    with pytest.raises(WorkdirError, match=r"cannot write .*metrics.jsonl \(No space left on device\) at "
                                           r"step 3; its earlier records and the checkpoints are kept"):
        writer.write(3, "train", {"loss": 0.25})
    writer.close()
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in read_metrics(str(tmp_path))] == [1, 2]
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


def test_resumed_writer_knows_what_is_recorded_at_its_step(tmp_path):
    """A finished run run again resumes at its last step: its final eval is there already."""
    _write(tmp_path / "metrics.jsonl", [(2, "train"), (4, "train"), (4, "eval")])
    writer = MetricsWriter(str(tmp_path), resumed_at=4)
    assert writer.recorded(4, "eval") and writer.recorded(4, "train")
    assert not writer.recorded(2, "train") and not writer.recorded(4, "other")
    writer.close()
    _write(tmp_path / "metrics.jsonl", [(2, "train"), (4, "train"), (6, "eval")])
    writer = MetricsWriter(str(tmp_path), resumed_at=4)
    assert not writer.recorded(4, "eval") and not writer.recorded(6, "eval")  # 6 was dropped
    writer.close()
    assert not MetricsWriter(str(tmp_path / "fresh"), enabled=False).recorded(4, "eval")


def test_read_metrics_leaves_out_a_torn_last_line_and_names_a_bad_one(tmp_path):
    """A run killed (or still running) mid-write: jaxcnn-plot read it with a JSONDecodeError traceback."""
    path = tmp_path / "metrics.jsonl"
    _write(path, [(2, "train"), (4, "eval")], torn=True)
    assert [(r["step"], r["kind"]) for r in read_metrics(str(tmp_path))] == [(2, "train"), (4, "eval")]
    path.write_text('{"step": 2}\n{"step": 9, "kind": "tra\n{"step": 4}\n')  # torn, then appended to
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not a JSON record"):
        read_metrics(str(path))
    path.write_text('{"step": 2}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"line 2 is not a JSON record"):
        read_metrics(str(path))


def _plot(argv, capsys):
    from jaxcnn.train.plot import main as plot_main
    try:
        code = plot_main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr()


def test_plot_cli_reads_a_torn_file_and_bad_input_is_one_line_exit_2(tmp_path, capsys):
    """Each case was a traceback (FileNotFoundError, matplotlib's ValueError, JSONDecodeError)
    or, for a run with no records yet, an empty plot."""
    pytest.importorskip("matplotlib")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")  # a run stopped before its first log line
    code, out = _plot([str(run)], capsys)
    assert code == 2 and out.err.count("\n") == 1, out.err
    assert out.err.startswith("jaxcnn-plot: error: ") and "holds no training or evaluation records" in out.err
    with open(run / "metrics.jsonl", "w", encoding="utf-8") as f:  # as the trainer writes them
        f.write(json.dumps({"step": 2, "kind": "train", "loss": 1.0, "top1": 0.5}) + "\n")
        f.write(json.dumps({"step": 2, "kind": "eval", "loss": 0.9, "top1": 0.6}) + "\n")
        f.write('{"step": 4, "kind": "tra')  # killed mid-write, or still running
    for argv, needle in [([], "the following arguments are required: run_dir"),
                         ([str(tmp_path / "none")], "none/metrics.jsonl does not exist"),
                         ([str(run), "--out", str(tmp_path / "no" / "c.png")], "directory"),
                         ([str(run), "--out", str(tmp_path / "c.xyz")], "unknown image type '.xyz'"),
                         ([str(run), "--out", str(tmp_path / "c")], "no file extension")]:
        code, out = _plot(argv, capsys)
        assert code == 2 and out.err.count("\n") == 1, (argv, out.err)
        assert out.err.startswith("jaxcnn-plot: error: ") and needle in out.err, (argv, out.err)
    assert not (tmp_path / "no").exists()
    code, out = _plot([str(run), "--out", str(tmp_path / "c.svg")], capsys)
    assert code == 0 and out.out.strip() == str(tmp_path / "c.svg"), out.err
    assert (tmp_path / "c.svg").stat().st_size > 1000


@pytest.mark.parametrize("classes, text", [
    (10, "loss 0.5000  top-1 0.7500  top-5 0.9500  (40 images)"),
    (5, "loss 0.5000  top-1 0.7500  (40 images)")])  # top-5 of 5 classes is always 1
def test_eval_line_shows_top5_only_where_it_says_something(classes, text):
    result = {"loss": 0.5, "top1": 0.75, "top5": 0.95, "count": 40}
    assert metrics.eval_line(result, classes) == text
