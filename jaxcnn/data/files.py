"""Checks on the files a run reads (only regular files are data), and writing a file whole.

``/dev/zero`` given as an ``.npz`` dataset was read until the process was killed for memory
(15 GB), and a FIFO blocked the run forever: a loader must refuse anything that is not a
regular file (after following symlinks) before opening it. A file written over a full disk
must leave the one it replaces as it was: :func:`write_whole`.
"""
import os
import stat

from jaxcnn.data.dataset import DataError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISSOCK, "a socket"))


def file_kind(mode: int) -> str:
    """``"a directory"``, ``"a FIFO (named pipe)"``, ... for an ``st_mode`` that is not a regular file."""
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def check_regular_file(path, what=None) -> str:
    """Check that ``path`` is (a symlink to) an existing regular file, without opening it.

    Arguments:
        path: the file.
        what: what names it in the message, e.g. the config key ``"data.path"``; None
            starts the message with the path alone.

    Returns:
        ``path`` as a string (``os.fspath``).

    Raises:
        DataError: one line naming ``what`` and the path: it does not exist, cannot be
            examined, or is a directory, device, FIFO or socket.
    """
    path = os.fspath(path)
    where = f"{what}: {path!r}" if what else f"{path}:"
    try:
        mode = os.stat(path).st_mode  # follows symlinks: a link to /dev/zero is /dev/zero
    except FileNotFoundError:
        raise DataError(f"{where} does not exist" if what else f"{path}: file not found") from None
    except OSError as err:
        raise DataError(f"{where} cannot be examined ({err.strerror or err})") from None
    if not stat.S_ISREG(mode):
        raise DataError(f"{where} is {file_kind(mode)}, not a regular file")
    return path


def write_whole(path, write) -> None:
    """Writes ``path`` whole or not at all: ``write(partial)`` writes ``path + ".partial"``, which
    is flushed to the disk (``fsync``: renamed unflushed, a power cut can leave an empty file
    under the name) and then renamed to ``path``. When ``write``, the flush or the rename fails
    (a full disk: ``OSError``), the partial file is removed, a file already at ``path`` is left
    as it was, and the error is raised again."""
    path = os.fspath(path)
    partial = path + ".partial"
    try:
        write(partial)
        fd = os.open(partial, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial, path)
    except BaseException:
        try:
            os.remove(partial)
        except OSError:
            pass
        raise


def write_bytes_whole(path, data: bytes) -> None:
    """:func:`write_whole` of ``data``, the file's whole content."""
    def write(partial):
        with open(partial, "wb") as f:
            f.write(data)
    write_whole(path, write)
