"""``jaxcnn.data.files.write_whole``: a file is written whole, flushed, then renamed, or not at all."""
import errno
import os

import pytest

from jaxcnn.data import files


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def test_the_partial_file_is_flushed_before_it_is_renamed(tmp_path, monkeypatch):
    """Renamed unflushed, a power cut can leave an empty file under the name."""
    path, events = tmp_path / "f.json", []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
                        or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(a))) or replace(a, b))
    files.write_whole(path, lambda partial: _write(partial, "whole"))
    assert events == [("fsync", f"{path}.partial"), ("replace", f"{path}.partial")]
    assert path.read_text() == "whole" and os.listdir(tmp_path) == ["f.json"]


def test_a_failed_write_keeps_the_earlier_file_and_removes_the_partial_one(tmp_path):
    path = tmp_path / "f.json"
    path.write_text("earlier")

    def half_then_full(partial):
        _write(partial, "hal")
        raise OSError(errno.ENOSPC, "No space left on device", partial)
    with pytest.raises(OSError, match="No space left on device"):
        files.write_whole(path, half_then_full)
    assert path.read_text() == "earlier" and os.listdir(tmp_path) == ["f.json"]
