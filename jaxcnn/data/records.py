"""Image folders as ArrayRecord files, read by index through grain's ``ArrayRecordDataSource``.

``jaxcnn-data convert ROOT OUT`` writes ``OUT/train-<token>.array_record`` and
``OUT/val-<token>.array_record`` (one record per image, in the image folder's order, new names
for each conversion) and then ``OUT/dataset.json``, which names the classes, the files and their
record counts: its rename switches readers from one conversion to the next, so a reader that
opens the directory never sees half of one and half of another. A record is a fixed header followed by the image file's
bytes, exactly as they were on disk::

    b"JXIR" | version (1 byte) | label (uint32, little-endian) | sha256(label bytes + image bytes) | image bytes

Reading a record checks the magic, the version and the SHA-256 before anything is decoded:
a damaged record is a :class:`BadImageError` naming the file and the index, handled like a
bad image (``data.on_bad_image``). Nothing in these files is ever unpickled; the sidecar is
plain JSON.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct

from jaxcnn.data.files import write_bytes_whole
from jaxcnn.data.folder import class_names_digest
from jaxcnn.errors import BadImageError, DataError

MAGIC = b"JXIR"
VERSION = 1
_HEADER = struct.Struct("<4sBI32s")  # magic, version, label, sha256
HEADER_BYTES = _HEADER.size
SIDECAR = "dataset.json"
FORMAT = "jaxcnn-image-records"
SIDECAR_MAX_BYTES = 64 << 20
# One record per chunk: random access reads only the record asked for.
WRITER_OPTIONS = "group_size:1"


def record_file(split: str, token: str) -> str:
    """The file name of one conversion's records of a split, ``train-<token>.array_record``:
    each conversion writes files of new names and switches a reader to them in one step, the
    rename of ``dataset.json`` (`write_sidecar`); a record file is never rewritten."""
    return f"{split}-{token}.array_record"


def _first_line(err) -> str:
    """The first non-empty line of an exception's message (the reader's are multi-line)."""
    return next((line.strip() for line in str(err).splitlines() if line.strip()),
                "no detail from the reader: truncated, or not an ArrayRecord file")


def _digest(label: int, payload: bytes) -> bytes:
    return hashlib.sha256(struct.pack("<I", label) + payload).digest()


def encode_record(payload: bytes, label: int) -> bytes:
    """One record: header (magic, version, label, SHA-256) then the encoded image bytes."""
    if not 0 <= label < 1 << 32:
        raise ValueError(f"label {label} does not fit a uint32")
    return _HEADER.pack(MAGIC, VERSION, label, _digest(label, payload)) + payload


def decode_record(record: bytes, name: str):
    """``(payload, label)`` of a record, checked; a damaged one is a :class:`BadImageError` naming ``name``."""
    if not isinstance(record, (bytes, bytearray, memoryview)) or len(record) < HEADER_BYTES:
        raise BadImageError(f"{name}: damaged record (shorter than its {HEADER_BYTES}-byte header)")
    magic, version, label, digest = _HEADER.unpack_from(record)
    if magic != MAGIC:
        raise BadImageError(f"{name}: damaged record (bad magic {magic!r}; not written by jaxcnn-data convert)")
    if version != VERSION:
        raise BadImageError(f"{name}: record format version {version}, expected {VERSION}")
    payload = bytes(record[HEADER_BYTES:])
    if _digest(label, payload) != digest:
        raise BadImageError(f"{name}: damaged record (SHA-256 checksum mismatch)")
    return payload, int(label)


def read_sidecar(out_dir) -> dict:
    """The checked ``dataset.json`` of a record directory; a problem is a :class:`DataError` naming it."""
    path = os.path.join(os.fspath(out_dir), SIDECAR)
    if not os.path.isdir(os.fspath(out_dir)):
        raise DataError(f"{os.fspath(out_dir)}: record directory does not exist or is not a directory")
    try:
        if os.path.getsize(path) > SIDECAR_MAX_BYTES:
            raise DataError(f"{path}: larger than {SIDECAR_MAX_BYTES >> 20} MiB")
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: missing (write the records with `jaxcnn-data convert ROOT OUT`)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: cannot read ({err})") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise DataError(f"{path}: not a jaxcnn record sidecar (expected format {FORMAT!r} version {VERSION})")
    names = meta.get("class_names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise DataError(f"{path}: key 'class_names' must be a non-empty list of strings")
    splits = meta.get("splits")
    if not isinstance(splits, dict):
        raise DataError(f"{path}: key 'splits' must be an object")
    for split, info in splits.items():
        if (not isinstance(info, dict) or not isinstance(info.get("count"), int) or info["count"] < 0
                or not isinstance(info.get("file"), str) or os.path.basename(info["file"]) != info["file"]
                or not info["file"].endswith(".array_record")):
            raise DataError(f"{path}: key 'splits.{split}' must be {{'file': the name of an .array_record "
                            f"file beside it, 'count': an int}}")
        counts = info.get("per_class")
        if counts is not None and (not isinstance(counts, list) or len(counts) != len(names) or not all(
                isinstance(n, int) and n >= 0 for n in counts) or sum(counts) != info["count"]):
            raise DataError(f"{path}: key 'splits.{split}.per_class' must be {len(names)} counts, one per "
                            f"class, that add up to its count {info['count']}")
    return meta


class RecordSource:
    """Random access to one split's records: ``source[i]`` is ``(encoded bytes, label, name)``.

    Arguments:
        out_dir: the directory ``jaxcnn-data convert`` wrote.
        split: ``"train"`` or ``"val"``.
        meta: its ``dataset.json`` as :func:`read_sidecar` read it (None: read now). The splits
            of one reader come from one reading: a conversion that switched between two
            readings gave one split of each.

    Raises:
        DataError: naming the file: missing sidecar or split, a record count that differs from
            the sidecar's, a file grain cannot open.
    """

    def __init__(self, out_dir, split: str, meta: dict | None = None):
        meta = read_sidecar(out_dir) if meta is None else meta
        self.class_names = tuple(meta["class_names"])
        info = meta["splits"].get(split)
        if info is None:
            raise DataError(f"{os.path.join(os.fspath(out_dir), SIDECAR)}: missing split {split!r} "
                            f"(has {sorted(meta['splits'])})")
        self.path = os.path.join(os.fspath(out_dir), info["file"])
        if not os.path.isfile(self.path):
            raise DataError(f"{self.path}: record file missing")
        self.skipped = int(info.get("skipped", 0))
        # records of each class, in order (None: converted before jaxcnn-data convert recorded it)
        self.per_class = info.get("per_class")
        self._listing = info.get("sha256")
        from grain.sources import ArrayRecordDataSource

        try:
            self._records = ArrayRecordDataSource([self.path])
            count = len(self._records)
        except Exception as err:  # noqa: BLE001 - the reader's errors are C++ status strings
            raise DataError(f"{self.path}: cannot open as an ArrayRecord file "
                            f"({type(err).__name__}: {_first_line(err)})") from None
        if count != info["count"]:
            raise DataError(f"{self.path}: holds {count} records but {SIDECAR} says {info['count']}")

    def __len__(self):
        return len(self._records)

    def __getitem__(self, i: int):
        name = f"{self.path}[{i}]"
        try:
            record = self._records[i]
        except Exception as err:  # noqa: BLE001 - a damaged chunk fails in the reader
            if not os.path.exists(self.path):  # a reader opened anew (a worker) after a conversion
                raise DataError(f"{self.path}: record file removed while the run read it (jaxcnn-data "
                                f"convert wrote {os.path.dirname(self.path)} again)") from None
            raise BadImageError(f"{name}: damaged record ({type(err).__name__}: {_first_line(err)})") from None
        payload, label = decode_record(record, name)
        if label >= len(self.class_names):
            raise BadImageError(f"{name}: label {label} is not below the {len(self.class_names)} classes")
        return payload, label, name

    @property
    def name(self) -> str:
        return self.path

    def fingerprint(self) -> dict:
        """What identifies this split's examples, cheaply: ``{"images": N, "sha256": ...}`` over
        the class names, the record count and the converted folder's listing that
        ``jaxcnn-data convert`` recorded in ``dataset.json`` (for records written before it did,
        the record file's size), so a folder converted again after a change gives another."""
        digest = class_names_digest(self.class_names)
        listing = self._listing if isinstance(self._listing, str) else f"size {os.path.getsize(self.path)}"
        digest.update(f"\0{len(self)}\0{listing}".encode())
        return {"images": len(self), "sha256": digest.hexdigest()}


def write_split(index, path, *, on_bad_image: str = "skip", workers: int = 0, progress=None):
    """Writes one split of an image folder to an ArrayRecord file.

    Arguments:
        index: the split's `jaxcnn.data.folder.FolderIndex`.
        path: the ``.array_record`` file to write (written to ``path + ".partial"`` and renamed).
        on_bad_image: ``"skip"``: a file that does not decode is left out and listed;
            ``"fail"``: it raises :class:`BadImageError`.
        workers: processes that read and verify images (0: this process).
        progress: called with the number of images done after each image, or None.

    Returns:
        ``(written, bad, per_class)``: the record count, the list of bad images' messages and
        the records written of each class (in class order, as the records are).
    """
    from array_record.python.array_record_module import ArrayRecordWriter

    partial = os.fspath(path) + ".partial"
    writer = ArrayRecordWriter(partial, WRITER_OPTIONS)
    bad, written, per_class = [], 0, [0] * len(index.class_names)
    items = [(os.path.join(index.root, p), int(label)) for p, label in zip(index.paths, index.labels)]
    pool = None
    try:
        if workers > 0:
            import multiprocessing
            import signal

            from jaxcnn.data.workers import held_signals, ignore_interrupts
            # A terminal's Ctrl-C reaches the workers too: while one still imported, it died of it
            # with its own traceback. They start with SIGINT held back, then ignore it; this
            # process stops them (terminate) when it takes the interrupt.
            with held_signals(True, [signal.SIGINT]):
                pool = multiprocessing.get_context("spawn").Pool(workers, initializer=ignore_interrupts)
            results = pool.imap(_verified, items, chunksize=16)
        else:
            results = map(_verified, items)
        for payload, label, error in results:
            if error is not None:
                if on_bad_image == "fail":
                    raise BadImageError(error)
                bad.append(error)
            else:
                with _writing(partial, path):
                    writer.write(encode_record(payload, label))
                written += 1
                per_class[label] += 1
            if progress is not None:
                progress(1)
        with _writing(partial, path):
            writer.close()
        writer = None
        os.replace(partial, path)
    finally:
        if pool is not None:
            pool.terminate()
        if writer is not None:  # failed before the rename: nothing partial is left behind
            with contextlib.suppress(Exception):
                writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
    return written, bad, per_class


@contextlib.contextmanager
def _writing(partial: str, path):
    """The ArrayRecord writer's failures (a full disk: a ``RuntimeError`` holding the C++
    status, at a write or at close) as one :class:`DataError` line naming ``path``."""
    try:
        yield
    except RuntimeError as err:
        text = _first_line(err).replace(partial, os.fspath(path))
        raise DataError(f"{os.fspath(path)}: cannot write the records ({text}); the partial file "
                        f"is removed") from None


def _verified(item):
    """``(bytes, label, None)`` for an image that decodes, ``(None, label, message)`` otherwise."""
    from jaxcnn.data.folder import decode_image, read_file

    path, label = item
    try:
        payload = read_file(path)
        decode_image(payload, path)
    except BadImageError as err:
        return None, label, str(err)
    return payload, label, None


def write_sidecar(out_dir, class_names, splits: dict) -> None:
    """Writes ``dataset.json`` whole or not at all (`write_bytes_whole`):
    ``splits = {split: {"file", "count", "skipped", "sha256", "per_class"}}`` (``per_class``: the
    records of each class, which `jaxcnn.data.split` needs to split a split by class)."""
    meta = {"format": FORMAT, "version": VERSION, "class_names": list(class_names), "splits": splits}
    write_bytes_whole(os.path.join(os.fspath(out_dir), SIDECAR), (json.dumps(meta, indent=2) + "\n").encode())
