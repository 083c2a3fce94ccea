"""A resumed run's metrics.jsonl: records after the resume step, and a torn line, are dropped."""
import json

from jaxcnn.train.metrics import MetricsWriter, read_metrics


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
