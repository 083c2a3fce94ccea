"""What a checkpoint's files hold, for :mod:`jaxcnn.train.checkpoint`: each leaf's manifest entry
(name, shape, dtype, sha256 of its host copy), the metrics as JSON, and the check that every
value of a checkpoint's OCDBT database can be read (a missing or truncated data file) before
orbax is asked to restore it.
"""
from __future__ import annotations

import hashlib
import math
import re
from pathlib import Path
from typing import Any, Mapping

import jax
import numpy as np


class DataFileError(Exception):
    """A data file of a checkpoint's database is missing or shorter than a value it holds."""


def unreadable_value(directory: Path, batch: int = 16) -> tuple[str, Exception] | None:
    """The first value of an OCDBT checkpoint directory that cannot be read (a truncated or
    missing data file), as ``(key, error)``, or None when every value can be read.

    Found before orbax reads the same values: orbax gives up at the first failed read while the
    others are still in flight, and their completions then print "Event loop is closed"
    tracebacks from TensorStore's threads long after the damage was reported (nothing in Python
    can catch those). The check reads only the database's index (its manifest and b-tree nodes,
    a few KB for a model's state): each value it lists lies at a byte range of a data file,
    and the file must be there and reach that far (`_short_data_file`), which ``stat`` tells
    without reading the arrays (it read every value, in every process, before). An index this
    does not understand falls back to reading every value (`unreadable_by_reading`). A
    directory that is not an OCDBT database, or whose manifest cannot be opened, is left to
    orbax (which reports it in one line: it has not started any read then).
    """
    if not (directory / "manifest.ocdbt").is_file():
        return None
    import tensorstore as ts

    try:
        base = ts.KvStore.open(f"file://{directory.resolve()}/").result()
        manifest = ts.ocdbt.dump(base).result()
    except Exception:  # noqa: BLE001 - orbax reports an unreadable index in its own words
        return None
    try:
        return _short_data_file(directory, base, manifest)
    except (KeyError, TypeError, ValueError, AttributeError):  # an index of another form
        return unreadable_by_reading(directory, batch)


def _data_ref(text: str) -> tuple[str, int]:
    """``("BASE/REL", end)`` of an OCDBT reference ``"value:BASE:REL:OFFSET:LENGTH"`` (a value)
    or ``"btreenode:BASE:REL:OFFSET:LENGTH"`` (an index node): the file, relative to the
    database, and the byte just past the range."""
    head, offset, length = text.rsplit(":", 2)
    _, base, rel = head.split(":", 2)
    if not rel or int(offset) < 0 or int(length) < 0:
        raise ValueError(f"not a data reference: {text!r}")
    return base + rel, int(offset) + int(length)


def _key_text(key) -> str:
    """A key of the index dump (bytes), as text."""
    return key.decode(errors="replace") if isinstance(key, bytes) else str(key)


def _short_data_file(directory: Path, base, manifest: dict) -> tuple[str, Exception] | None:
    """`unreadable_value` from the index alone: walks the newest version's b-tree (dumping each
    node, which reads it) and checks every referenced data file's size with ``stat``."""
    import tensorstore as ts

    versions = manifest["versions"]
    if not versions:
        return None
    root = versions[-1]["root"].get("location")
    pending = [("the database index", root)] if root else []
    sizes = {}
    while pending:
        key, ref = pending.pop()
        rel, end = _data_ref(ref)
        if rel not in sizes:
            path = directory / rel
            sizes[rel] = path.stat().st_size if path.is_file() else None
        if sizes[rel] is None:
            return key, DataFileError(f"data file {directory / rel} is missing")
        if sizes[rel] < end:
            return key, DataFileError(f"data file {directory / rel} holds {sizes[rel]} bytes; "
                                      f"{key} ends at byte {end} (truncated)")
        if ref.startswith("btreenode:"):
            try:
                node = ts.ocdbt.dump(base, ref).result()
            except Exception as e:  # noqa: BLE001 - a damaged index node
                return key, e
            for entry in node["entries"]:
                name = _key_text(entry.get("key", entry.get("key_prefix", "")))
                pending.extend((name, v) for v in entry.values()
                               if isinstance(v, str) and v.startswith(("value:", "btreenode:")))
    return None


def unreadable_by_reading(directory: Path, batch: int = 16) -> tuple[str, Exception] | None:
    """`unreadable_value` by reading every value, synchronously and waiting for every read it
    started, `batch` at a time (dropped at once, so memory holds a few arrays at most)."""
    import tensorstore as ts

    try:
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{directory.resolve()}/"}).result()
        keys = list(kv.list().result())
    except Exception:  # noqa: BLE001 - orbax reports an unreadable index in its own words
        return None
    first = None
    for start in range(0, len(keys), batch):
        reads = [(key, kv.read(key)) for key in keys[start:start + batch]]
        for key, read in reads:  # wait for every read started, failed or not
            try:
                read.result()
            except Exception as e:  # noqa: BLE001 - any failed read of a committed value is damage
                if first is None:
                    first = (key.decode(errors="replace"), e)
        if first is not None:
            return first
    return None


def _path_name(keypath) -> str:
    return jax.tree_util.keystr(keypath, simple=True, separator="/") or "<root>"


def as_array(name: str, x):
    """Leaves are stored as arrays; Python and NumPy scalars become 0-d NumPy arrays."""
    if isinstance(x, jax.Array):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            raise TypeError(
                f"checkpoint leaf {name!r} is a typed PRNG key ({x.dtype}); store "
                "jax.random.key_data(key) (a uint32 array) instead")
        return x
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, (np.generic, bool, int, float)):
        return np.asarray(x)
    raise TypeError(f"checkpoint leaf {name!r} has unsupported type {type(x).__name__}; "
                    "expected a jax.Array, numpy array or scalar")


def named_leaves(tree) -> tuple[list[tuple[str, Any]], Any]:
    pairs, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return [(_path_name(kp), x) for kp, x in pairs], treedef


def sha256(x) -> str | None:
    """sha256 of the array's bytes (C order) from a host copy; None when this process cannot see all of it."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    host = np.ascontiguousarray(np.asarray(jax.device_get(x)))
    return hashlib.sha256(host.reshape(-1).view(np.uint8)).hexdigest()


def to_host(arrays: list) -> list:
    """NumPy copies of the arrays this process sees whole (what is hashed and written); others as they are.

    Writing host copies rather than `jax.Array`s keeps orbax off its device path, which
    splits each replicated array into one slice per device with a jitted slice program:
    the first save compiled a program per leaf and device, which then held host memory for
    the life of the process.
    """
    whole = [i for i, x in enumerate(arrays) if isinstance(x, jax.Array) and x.is_fully_addressable]
    out = list(arrays)
    for i, host in zip(whole, jax.device_get([arrays[i] for i in whole])):  # one batched transfer
        out[i] = np.asarray(host)
    return out


def describe(name: str, x) -> dict:
    return {"path": name, "shape": list(x.shape), "dtype": str(np.dtype(x.dtype)), "sha256": sha256(x)}


def abstract(name: str, x):
    """Restore target for one leaf: NumPy leaves come back as NumPy, everything else as jax.Array."""
    if isinstance(x, jax.ShapeDtypeStruct):
        # Without a sharding orbax falls back to the one saved in the checkpoint (or to
        # NumPy when that file is gone); the default device keeps the result predictable.
        if x.sharding is None:
            x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        return x
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return as_array(name, x)  # orbax reads only the shape and dtype of a NumPy target


def metric_value(metrics: Mapping | None, key: str) -> float | None:
    if not metrics or key not in metrics:
        return None
    value = float(metrics[key])
    return value if math.isfinite(value) else None


def jsonable(metrics: Mapping | None) -> dict | None:
    if metrics is None:
        return None
    out = {}
    for k, v in metrics.items():
        try:
            value = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"metric {k!r} is not a number: {v!r}") from None
        # Strict JSON has no NaN/inf; "nan", "inf" and "-inf" read back through float().
        out[str(k)] = value if math.isfinite(value) else repr(value)
    return out


# tensorstore (which writes the arrays) reports OS errors as ValueError with this tag.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def errno_of(exc: BaseException) -> int | None:
    """The OS error number behind a failed write: from an OSError in the chain or tensorstore's message."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc.errno
        if match := _OS_ERROR_CODE.search(str(exc)):
            return int(match.group(1))
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
