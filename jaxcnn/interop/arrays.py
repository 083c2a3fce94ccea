"""Save and load ``(params, state)`` as ``.npz`` or ``.safetensors`` files.

Both formats store one array per leaf under a flat key: the collection
(``params`` or ``state``), a slash, then the dotted path of the leaf::

    params/layer1.0.conv1.w     state/layer1.0.bn1.mean

Dtypes NumPy has no native code for (``bfloat16``, the float8 types) are
stored as their raw bits (an unsigned integer view) and their names kept in
the file's metadata, so they round-trip exactly.  Loading never unpickles
(``np.load(allow_pickle=False)``) and every error names the file.
"""
from __future__ import annotations

import json
import os
import zipfile
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import safetensors
import safetensors.numpy

from jaxcnn.data.files import write_bytes_whole, write_whole
from jaxcnn.data.npz import npz_headers

COLLECTIONS = ("params", "state")
_META_KEY = "__jaxcnn__"        # npz member / safetensors metadata entry: JSON
_FORMAT_VERSION = 1


def flatten(tree, prefix: str = "") -> dict[str, np.ndarray]:
    """A nested dict of arrays as ``{"a.b.c": array}``.

    Arguments:
        tree: nested dicts with string keys (no ``"."`` in them) and array leaves.
        prefix: dotted path of ``tree`` itself, used in keys and error messages.

    Returns:
        A flat dict of NumPy arrays, in the tree's iteration order.
    """
    flat = {}
    if not isinstance(tree, dict):
        raise TypeError(f"expected a nested dict of arrays, got {type(tree).__name__} "
                        f"at {prefix or 'the root'!r}")
    for key, value in tree.items():
        if not isinstance(key, str) or not key or "." in key or "/" in key:
            raise ValueError(f"key {key!r} under {prefix or 'the root'!r} must be a non-empty "
                             f"string without '.' or '/' to be stored in a flat file")
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(flatten(value, path))
        elif isinstance(value, (jax.Array, np.ndarray, np.generic)):
            flat[path] = np.asarray(value)
        else:
            raise TypeError(f"leaf {path!r} is a {type(value).__name__}, not an array")
    return flat


def unflatten(flat: dict) -> dict:
    """Inverse of :func:`flatten`: ``{"a.b.c": x}`` -> ``{"a": {"b": {"c": x}}}``."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def _encode(params, state):
    """Flat ``{"params/...": array}`` with exotic dtypes replaced by their bits."""
    arrays, dtypes = {}, {}
    for collection, tree in zip(COLLECTIONS, (params, state)):
        for path, array in flatten(tree if tree is not None else {}).items():
            key = f"{collection}/{path}"
            if array.dtype.kind == "V":      # ml_dtypes types: bfloat16, float8_*, int4...
                dtypes[key] = array.dtype.name
                array = array.view(f"u{array.dtype.itemsize}")
            arrays[key] = np.array(array, order="C")      # (ascontiguousarray makes 0-d arrays 1-d)
    return arrays, {"format": _FORMAT_VERSION, "dtypes": dtypes}


def _parse_meta(path, text):
    """The JSON metadata written by :func:`_encode`; files from elsewhere have
    none, which is fine as long as they use only native dtypes."""
    if text is None:
        return {}
    try:
        meta = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: unreadable {_META_KEY!r} metadata ({e})") from e
    if not isinstance(meta, dict) or not isinstance(meta.get("dtypes", {}), dict):
        raise ValueError(f"{path}: {_META_KEY!r} metadata must be a JSON object with a "
                         f"'dtypes' object, got {text[:80]!r}")
    return meta


def _under(leaf_path: str, skip) -> bool:
    """Whether dotted ``leaf_path`` is one of the ``skip`` prefixes or lies under one."""
    return any(leaf_path == p or leaf_path.startswith(p + ".") for p in skip)


def _decode(path, arrays: dict, meta: dict, like, skip=()):
    dtypes = meta.get("dtypes", {})
    trees = {c: {} for c in COLLECTIONS}
    for key, array in arrays.items():
        collection, _, leaf_path = key.partition("/")
        if collection not in trees or not leaf_path:
            raise ValueError(f"{path}: unexpected key {key!r}; keys must start with "
                             f"'params/' or 'state/'")
        if _under(leaf_path, skip):
            continue
        if key in dtypes:
            try:
                array = array.view(jnp.dtype(dtypes[key]))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}: key {key!r} cannot be read as dtype "
                                 f"{dtypes[key]!r} ({e})") from e
        trees[collection][leaf_path] = array
    if like is not None:
        _check_against(path, trees, like, skip)
    return unflatten(trees["params"]), unflatten(trees["state"])


def _declared(path, shapes: dict, like, skip=()):
    """Check the shapes a file declares (``{key: shape}``, read from its headers) against the
    ``(params, state)`` template before any array is read: a header is free to claim a
    shape of 10**12 floats, and reading it would try to allocate that."""
    trees = {c: {} for c in COLLECTIONS}
    for key, shape in shapes.items():
        collection, _, leaf_path = key.partition("/")
        if collection in trees and leaf_path:
            trees[collection][leaf_path] = SimpleNamespace(shape=tuple(shape))
    _check_against(path, trees, like, skip)


SHOWN = 3  # problems of one sort named in a mismatch message; the rest are counted


def first_few(problems: list[str], what: str) -> list[str]:
    """The first :data:`SHOWN` of ``problems``, then ``"and N more <what>"``: a file or state
    dict of another model mismatches in hundreds of keys, which named one by one made a
    13 KB message."""
    if len(problems) <= SHOWN:
        return problems
    return problems[:SHOWN] + [f"and {len(problems) - SHOWN} more {what}"]


def _check_against(path, trees, like, skip=()):
    """Compare the file's keys and shapes with the ``(params, state)`` template; keys under
    a ``skip`` prefix are left out on both sides."""
    problems = []
    for collection, template in zip(COLLECTIONS, like):
        expected = {k: tuple(v.shape) for k, v in tree_items(template) if not _under(k, skip)}
        found = {k: v for k, v in trees[collection].items() if not _under(k, skip)}
        problems += first_few([f"missing key '{collection}/{k}' (expected shape {expected[k]})"
                               for k in sorted(set(expected) - set(found))], f"missing {collection} keys")
        problems += first_few([f"unexpected key '{collection}/{k}' (shape {found[k].shape})"
                               for k in sorted(set(found) - set(expected))], f"unexpected {collection} keys")
        problems += first_few([f"key '{collection}/{k}' has shape {found[k].shape}, expected {expected[k]}"
                               for k in sorted(set(found) & set(expected))
                               if tuple(found[k].shape) != expected[k]], f"mis-shaped {collection} keys")
    if problems:
        raise ValueError(f"{path}: does not match the expected parameters:\n  "
                         + "\n  ".join(problems))


def tree_items(tree, prefix: str = "") -> list:
    """``[(dotted path, leaf)]`` of a nested dict, in iteration order; leaves
    may be anything (arrays, ``jax.ShapeDtypeStruct``)."""
    out = []
    for key, value in (tree or {}).items():
        path = f"{prefix}.{key}" if prefix else key
        out += tree_items(value, path) if isinstance(value, dict) else [(path, value)]
    return out


PARAMETER_FILE_TYPES = (".npz", ".safetensors")
# What PyTorch writes with torch.save: a pickle, which jaxcnn never loads.
TORCH_PICKLE_TYPES = (".pt", ".pth", ".bin", ".ckpt", ".tar")


def unknown_file_type(path, *, or_run_dir: bool = False) -> str:
    """Why ``path``, whose name has none of `PARAMETER_FILE_TYPES`, is not read (one phrase;
    ``or_run_dir``: a run directory would have done too)."""
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext in TORCH_PICKLE_TYPES:
        stem = os.path.splitext(os.path.basename(os.fspath(path)))[0]
        return (f"a PyTorch {ext} file is a pickle, which jaxcnn never loads; convert it once where torch "
                f"is installed: safetensors.torch.save_file(torch.load({os.fspath(path)!r}), "
                f"'{stem}.safetensors')")
    return (f"unknown parameter file type {ext or '(no extension)'!r}; expected a .npz or .safetensors "
            f"file{' or a run directory' if or_run_dir else ''}")


def _check_exists(path):
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file")


def save_npz(path, params, state=None) -> str:
    """Write ``params`` and ``state`` to an uncompressed ``.npz`` file, whole or not at all.

    Arguments:
        path: file to write (``.npz`` is added if the name lacks it, as NumPy does).
        params: nested dict of arrays (e.g. a model's parameters).
        state: nested dict of arrays (BatchNorm statistics), or None for ``{}``.

    Returns:
        The path written.

    Raises:
        OSError: (a full disk) a file already at the path is left as it was and no partial
            file is left behind (`jaxcnn.data.files.write_whole`).
    """
    path = os.fspath(path)
    path = path if path.endswith(".npz") else path + ".npz"
    arrays, meta = _encode(params, state)

    def write(partial):
        with open(partial, "wb") as f:  # a file object: NumPy adds no suffix to the partial name
            np.savez(f, **arrays, **{_META_KEY: np.array(json.dumps(meta))})
    write_whole(path, write)
    return path


def load_npz(path, *, like=None, skip=()):
    """Read a file written by :func:`save_npz`.

    Arguments:
        path: the ``.npz`` file.
        like: optional ``(params, state)`` template (arrays or
            ``jax.ShapeDtypeStruct``, e.g. from ``jax.eval_shape`` of a model's
            init); a missing, unexpected or mis-shaped key is then a ValueError.
        skip: dotted path prefixes (``"fc"``, ``"layer4.1"``) left out: neither read
            nor required by ``like``; the result lacks them.

    Returns:
        ``(params, state)`` as nested dicts of NumPy arrays.
    """
    path = os.fspath(path)
    _check_exists(path)
    # The .npy headers first, bounded by the file's size (and by the template's shapes when
    # given): NumPy allocates whatever a header declares before it finds the data missing.
    headers = npz_headers(path)
    if like is not None:
        _declared(path, {k: shape for k, (shape, _, _) in headers.items()}, like, skip)
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise ValueError(f"{path}: not a readable .npz file ({type(e).__name__}: {e})") from e
    meta = arrays.pop(_META_KEY, None)
    return _decode(path, arrays, _parse_meta(path, None if meta is None else str(meta)), like,
                   skip)


def save_safetensors(path, params, state=None) -> str:
    """Write ``params`` and ``state`` to a ``.safetensors`` file, whole or not at all.

    Arguments:
        path: file to write.
        params: nested dict of arrays.
        state: nested dict of arrays, or None for ``{}``.

    Returns:
        The path written.

    Raises:
        OSError: as :func:`save_npz`.
    """
    path = os.fspath(path)
    arrays, meta = _encode(params, state)
    # The bytes, then a plain write: safetensors' own file writer reports a full disk as a
    # SafetensorError, not the OSError every caller handles.
    write_bytes_whole(path, safetensors.numpy.save(arrays, metadata={_META_KEY: json.dumps(meta)}))
    return path


def load_safetensors(path, *, like=None, skip=()):
    """Read a file written by :func:`save_safetensors`.

    Arguments:
        path: the ``.safetensors`` file.
        like, skip: as in :func:`load_npz`.

    Returns:
        ``(params, state)`` as nested dicts of NumPy arrays.
    """
    path = os.fspath(path)
    _check_exists(path)
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            meta_text = (f.metadata() or {}).get(_META_KEY)
            if like is not None:  # shapes from the header, before any tensor is read
                _declared(path, {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, like,
                          skip)
            arrays = {k: f.get_tensor(k) for k in f.keys()
                      if not _under(k.partition("/")[2], skip)}
    except (safetensors.SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable .safetensors file "
                         f"({type(e).__name__}: {e})") from e
    return _decode(path, arrays, _parse_meta(path, meta_text), like, skip)
