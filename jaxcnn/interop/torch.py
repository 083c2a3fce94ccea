"""Convert zoo-model parameters to and from PyTorch ``state_dict`` form.

The zoo models mirror torchvision's module paths, so the mapping is read off
the model itself: :func:`~jaxcnn.layers.base.record_layers` around an
abstract ``init`` reports every leaf layer's dotted path, kind and shapes, and

* a parameter's PyTorch name is ``path + "." + leaf`` with the leaf renamed
  (``w``->``weight``, ``b``->``bias``, ``scale``->``weight``,
  ``mean``->``running_mean``, ``var``->``running_var``,
  ``count``->``num_batches_tracked``);
* its layout is converted by the layer's kind: ``conv2d`` OIHW <-> HWIO,
  ``conv_transpose2d`` ``(C_in, C_out/g, KH, KW)`` <-> ``(KH, KW, C_in, C_out/g)``,
  ``linear`` ``(out, in)`` <-> ``(in, out)``;
* a ``layer_scale`` leaf is a parameter of the enclosing PyTorch module: its
  path is the PyTorch name (``features.1.0.layer_scale``), of shape ``(C, 1, 1)``;
* the first ``linear`` layer after a ``flatten`` of an ``(N, H, W, C)`` input with
  ``H * W > 1`` also has its input rows permuted, because PyTorch flattens
  NCHW (index ``c*H*W + h*W + w``) and we flatten NHWC (``(h*W + w)*C + c``).

PyTorch is never imported at module import: state dicts are read through
duck typing (``.detach().cpu().numpy()`` or ``np.asarray``), and
:func:`to_torch_state_dict` imports it only when called.
"""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcnn import models
from jaxcnn.interop.arrays import first_few, tree_items, unflatten
from jaxcnn.layers.base import Layer, record_layers

# Our leaf name -> PyTorch's; the order is PyTorch's order within a module
# (parameters, then buffers).
_TORCH_LEAF = {"w": "weight", "scale": "weight", "b": "bias", "bias": "bias",
               "mean": "running_mean", "var": "running_var", "count": "num_batches_tracked"}
_TORCH_ORDER = ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")


class _Entry(NamedTuple):
    collection: str          # "params" or "state"
    path: str                # our dotted path, e.g. "layer1.0.conv1.w"
    torch_name: str          # e.g. "layer1.0.conv1.weight"
    shape: tuple             # our shape
    dtype: np.dtype          # our dtype
    torch_shape: tuple
    to_ours: Callable[[np.ndarray], np.ndarray]
    to_torch: Callable[[np.ndarray], np.ndarray]
    kind: str = ""           # the layer's kind, e.g. "linear"


def _identity(a):
    return a


def _layout(kind: str, leaf: str, shape: tuple, flatten_hwc):
    """``(torch_shape, to_ours, to_torch)`` for one parameter of a ``kind`` layer."""
    if leaf == "w" and kind == "conv2d":        # (O, I/g, KH, KW) <-> (KH, KW, I/g, O)
        kh, kw, i, o = shape
        return ((o, i, kh, kw), (lambda t: t.transpose(2, 3, 1, 0)),
                (lambda a: a.transpose(3, 2, 0, 1)))
    if leaf == "w" and kind == "conv_transpose2d":   # (I, O/g, KH, KW) <-> (KH, KW, I, O/g)
        kh, kw, i, o = shape
        swap = (lambda a: a.transpose(2, 3, 0, 1))    # its own inverse
        return (i, o, kh, kw), swap, swap
    if leaf == "w" and kind == "linear":
        n_in, n_out = shape
        if flatten_hwc is None:
            return (n_out, n_in), (lambda t: t.T), (lambda a: a.T)
        h, w, c = flatten_hwc
        return ((n_out, n_in),
                lambda t: t.reshape(n_out, c, h, w).transpose(2, 3, 1, 0).reshape(n_in, n_out),
                lambda a: a.reshape(h, w, c, n_out).transpose(3, 2, 0, 1).reshape(n_out, n_in))
    return shape, _identity, _identity


def _entries(model, input_shape, model_options) -> tuple[str, list[_Entry]]:
    """Build the model and list every parameter and state array with its
    PyTorch name and layout conversion, in PyTorch's ``state_dict`` order."""
    if isinstance(model, Layer):
        if input_shape is None or model_options:
            raise ValueError("a Layer needs input_shape=... and takes no model options")
        label = model.kind
    else:
        label = model
        input_shape = input_shape or models.default_input_shape(model)
        model = models.get(model, **model_options)
    with record_layers() as records:
        params, state = jax.eval_shape(lambda k: model.init(k, tuple(input_shape))[:2],
                                       jax.random.PRNGKey(0))
    entries, flatten_input, own = [], None, set()
    for rec in records:
        if rec.kind == "flatten":
            flatten_input = rec.input_shape
            continue
        flatten_hwc = None
        if rec.kind == "linear" and flatten_input is not None:
            if len(flatten_input) == 4 and flatten_input[1] * flatten_input[2] > 1:
                flatten_hwc = flatten_input[1:]
                if rec.input_shape[-1] != np.prod(flatten_hwc):
                    raise ValueError(
                        f"{label}: linear layer {rec.path!r} follows a flatten of "
                        f"{flatten_input} but takes {rec.input_shape[-1]} features; cannot "
                        f"map PyTorch's NCHW flatten order onto it")
            flatten_input = None
        if rec.kind in _OWN_PARAMETER_KINDS:
            entries.append(_own_parameter(label, rec))
            own.add(entries[-1].torch_name)
            continue
        found = []
        for collection, tree in (("params", rec.params), ("state", rec.state)):
            for leaf_path, leaf in tree_items(tree):
                leaf_name = leaf_path.rsplit(".", 1)[-1]
                if leaf_name not in _TORCH_LEAF:
                    raise ValueError(f"{label}: no PyTorch name for {collection} leaf "
                                     f"{leaf_path!r} of {rec.kind} layer {rec.path!r}")
                torch_leaf = leaf_path[:-len(leaf_name)] + _TORCH_LEAF[leaf_name]
                shape = tuple(leaf.shape)
                torch_shape, to_ours, to_torch = _layout(rec.kind, leaf_name, shape, flatten_hwc)
                found.append(_Entry(collection, ".".join(filter(None, [rec.path, leaf_path])),
                                    ".".join(filter(None, [rec.path, torch_leaf])), shape,
                                    np.dtype(leaf.dtype), torch_shape, to_ours, to_torch,
                                    rec.kind))
        found.sort(key=lambda e: _TORCH_ORDER.index(e.torch_name.rsplit(".", 1)[-1]))
        entries += found
    entries = _own_parameters_first(entries, own)
    _check_paths(label, entries, params, state)
    return label, entries


# Leaf kinds that stand for a parameter PyTorch keeps on the enclosing module
# itself (``nn.Parameter`` attribute, not a submodule): the leaf's path is the
# PyTorch name.  ConvNeXt's ``features.1.0.layer_scale`` is a ``(C, 1, 1)`` tensor.
_OWN_PARAMETER_KINDS = {"layer_scale": "scale"}


def _own_parameter(label, rec) -> _Entry:
    leaf_name = _OWN_PARAMETER_KINDS[rec.kind]
    if set(rec.params) != {leaf_name} or rec.state:
        raise ValueError(f"{label}: {rec.kind} layer {rec.path!r} must hold exactly the "
                         f"params leaf {leaf_name!r}")
    shape = tuple(rec.params[leaf_name].shape)
    torch_shape = shape + (1, 1)
    return _Entry("params", f"{rec.path}.{leaf_name}", rec.path, shape,
                  np.dtype(rec.params[leaf_name].dtype), torch_shape,
                  (lambda t: t.reshape(shape)), (lambda a: a.reshape(torch_shape)))


def _own_parameters_first(entries, own):
    """PyTorch's ``state_dict`` lists a module's own parameters before its
    submodules' entries: move each entry named in ``own`` before its siblings'."""
    out = [e for e in entries if e.torch_name not in own]
    for e in (e for e in entries if e.torch_name in own):
        parent = e.torch_name.rsplit(".", 1)[0] + "." if "." in e.torch_name else ""
        at = next((i for i, f in enumerate(out) if f.torch_name.startswith(parent)), len(out))
        out.insert(at, e)
    return out


def _check_paths(label, entries, params, state):
    """The records must account for exactly the model's parameter tree (they
    would not if a combinator stored a child under another name than its scope)."""
    for collection, tree in (("params", params), ("state", state)):
        recorded = {e.path for e in entries if e.collection == collection}
        actual = {p for p, _ in tree_items(tree)}
        if recorded != actual:
            raise ValueError(f"{label}: recorded layer paths do not match the {collection} "
                             f"tree: only recorded {sorted(recorded - actual)[:5]}, "
                             f"only in tree {sorted(actual - recorded)[:5]}")


def _to_numpy(value) -> np.ndarray:
    """A NumPy view of a torch tensor (duck-typed) or any array-like; the
    caller copies (``jnp.array``) after converting the layout."""
    if hasattr(value, "detach"):
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":     # NumPy has no bfloat16: widen exactly
            value = value.float()
        value = value.numpy()
    return np.asarray(value)


def _under(name: str, prefixes) -> bool:
    """Whether dotted ``name`` is one of ``prefixes`` or lies under one (whole components)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _skipped(entry: _Entry, skip) -> bool:
    return _under(entry.path, skip) or _under(entry.torch_name, skip)


def _head_classes(model, shapes, input_shape, model_options):
    """The class count of the state dict's classifier (the model's last 2-D weight), or None."""
    if not isinstance(model, str) or "num_classes" in model_options:
        return None
    _, entries = _entries(model, input_shape, model_options)
    heads = [e for e in entries if e.collection == "params" and len(e.torch_shape) == 2
             and e.torch_name.endswith(".weight")]
    if not heads or heads[-1].torch_name not in shapes:
        return None
    shape = tuple(shapes[heads[-1].torch_name])
    return int(shape[0]) if len(shape) == 2 and shape[0] != heads[-1].torch_shape[0] else None


def match_state_dict(model, shapes, *, input_shape=None, skip=(), **model_options):
    """Check a PyTorch ``state_dict``'s names and shapes against a model, before reading it.

    Arguments:
        model, input_shape, model_options: as :func:`from_torch_state_dict`.
        shapes: ``{torch name: shape}`` of the state dict (e.g. a safetensors header).
        skip: layer paths (``"fc"``, ``"layer4.1"``; torchvision's module names, which are
            ours too) or full parameter names in either naming (``"fc.weight"``, ``"fc.w"``)
            whose entries are not taken from the state dict: not required, not checked, and
            the state dict's own entries under them ignored.

    Returns:
        ``(label, entries)``: the model's entries to read, skipped ones left out.

    Raises:
        ValueError: naming the missing keys (with the model's shape), unexpected keys (with
            the state dict's shape) and mis-shaped keys (with both shapes), the first three of
            each sort and how many more, and each ``skip`` entry that names no parameter of
            the model. A missing ``num_batches_tracked`` is
            not a problem (PyTorch loads such state dicts; it reads as 0).
    """
    label, entries = _entries(model, input_shape, model_options)
    skip = tuple(skip)
    unknown = [p for p in skip if not any(_skipped(e, (p,)) for e in entries)]
    if unknown:
        layers = sorted({e.path.rsplit(".", 1)[0] for e in entries})
        raise ValueError(f"{label}: skip {unknown} names no layer or parameter of the model "
                         f"(its layers: {layers[:8]}{' ...' if len(layers) > 8 else ''})")
    kept = [e for e in entries if not _skipped(e, skip)]
    expected = {e.torch_name for e in entries}
    missing = [e for e in kept if e.torch_name not in shapes
               and not e.torch_name.endswith("num_batches_tracked")]
    unexpected = sorted(k for k in set(shapes) - expected if not _under(k, skip))
    problems = first_few([f"missing key {e.torch_name!r} (the model's shape {e.torch_shape})"
                           for e in missing], "missing keys")
    problems += first_few([f"unexpected key {k!r} (shape {tuple(shapes[k])})"
                            for k in unexpected], "unexpected keys")
    problems += first_few([f"key {e.torch_name!r} has shape {tuple(shapes[e.torch_name])}, "
                            f"the model's is {e.torch_shape}" for e in kept
                            if e.torch_name in shapes
                            and tuple(shapes[e.torch_name]) != e.torch_shape],
                           "mis-shaped keys")
    if problems:
        raise ValueError(f"{label}: state_dict does not match the model: " + "; ".join(problems))
    return label, kept


def _convert(entries, read) -> tuple[dict, dict]:
    """``(params, state)`` from ``read(torch name)`` (None: absent) for ``entries``."""
    flat = {"params": {}, "state": {}}
    for e in entries:
        array = read(e.torch_name)
        if array is None:  # num_batches_tracked, which PyTorch state dicts may leave out
            flat[e.collection][e.path] = jnp.zeros(e.shape, e.dtype)
            continue
        flat[e.collection][e.path] = jnp.array(e.to_ours(_to_numpy(array)), dtype=e.dtype)  # copies
    return unflatten(flat["params"]), unflatten(flat["state"])


def from_torch_state_dict(model, state_dict, *, input_shape=None, skip=(), **model_options):
    """Parameters and state of a zoo model from a PyTorch ``state_dict``.

    Arguments:
        model: a registry name (``"resnet50"``...) or a Layer whose paths follow
            PyTorch's module names.
        state_dict: mapping of PyTorch names to tensors (torch tensors or
            anything ``np.asarray`` accepts), e.g. ``torch_model.state_dict()``.
            ``num_batches_tracked`` entries may be left out (they read as 0).
        input_shape: input shape used for the abstract ``init``; default
            ``models.default_input_shape(name)``; required for a Layer.
        skip: layers (or parameters) left out of the result and not read from
            ``state_dict``, as in :func:`match_state_dict`.
        **model_options: passed to ``models.get`` (``cifar_stem``...). Without
            ``num_classes``, a registry model takes the state dict's classifier width.

    Returns:
        ``(params, state)``: nested dicts of ``jax.Array`` in our layouts and
        dtypes, ready for ``model.apply`` (without the skipped entries).

    Raises:
        ValueError: naming the keys that are missing, unexpected, or shaped
            differently from what the model needs (with both shapes), before
            any array is converted.
    """
    shapes = {k: tuple(v.shape) if hasattr(v, "shape") else np.shape(v)
              for k, v in state_dict.items()}
    classes = _head_classes(model, shapes, input_shape, model_options) if not skip else None
    if classes is not None:
        model_options = dict(model_options, num_classes=classes)
    _, entries = match_state_dict(model, shapes, input_shape=input_shape, skip=skip,
                                  **model_options)
    return _convert(entries, state_dict.get)


def is_torch_safetensors(path) -> bool:
    """Whether a ``.safetensors`` file holds a PyTorch ``state_dict`` (torchvision/timm names
    such as ``conv1.weight``, ``layer1.0.bn1.running_mean``) rather than jaxcnn's own
    ``params/...``/``state/...`` keys. Reads only the header."""
    import safetensors
    try:
        with safetensors.safe_open(os.fspath(path), framework="numpy") as f:
            keys = list(f.keys())
    except (safetensors.SafetensorError, OSError, ValueError):
        return False
    leaves = set(_TORCH_ORDER)
    return bool(keys) and not any(k.startswith(("params/", "state/")) for k in keys) and any(
        k.rsplit(".", 1)[-1] in leaves for k in keys)


def load_torch_safetensors(path, model, *, input_shape=None, skip=(), **model_options):
    """:func:`from_torch_state_dict` of a state dict saved as safetensors
    (``safetensors.torch.save_file(torch.load(p), out)``), checked from the file's header
    before any tensor is read (a header may declare any size).

    Returns:
        ``(params, state)`` as NumPy trees, without the ``skip`` entries.

    Raises:
        ValueError: naming the file and each missing, unexpected or mis-shaped key.
    """
    import safetensors
    path = os.fspath(path)
    try:
        with safetensors.safe_open(path, framework="numpy") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
            try:
                _, entries = match_state_dict(model, shapes, input_shape=input_shape, skip=skip,
                                              **model_options)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None

            def read(name):
                if name not in shapes:
                    return None
                try:
                    return f.get_tensor(name)
                except (TypeError, ValueError) as e:  # e.g. bfloat16, which NumPy lacks
                    raise ValueError(f"{path}: key {name!r} cannot be read as a NumPy array "
                                     f"({e}); save it as float32") from None
            trees = _convert(entries, read)
    except (safetensors.SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable .safetensors file "
                         f"({type(e).__name__}: {e})") from None
    return jax.device_get(trees)


def to_torch_state_dict(model, params, state, *, input_shape=None, **model_options) -> dict:
    """A PyTorch ``state_dict`` for a zoo model's ``(params, state)``.

    Arguments:
        model: a registry name or a Layer, as in :func:`from_torch_state_dict`.
        params: the model's parameters (nested dicts of arrays).
        state: the model's state (BatchNorm statistics), ``{}`` if none.
        input_shape: as in :func:`from_torch_state_dict`.
        **model_options: passed to ``models.get``.

    Returns:
        ``{torch name: tensor}`` in PyTorch's ``state_dict`` order: torch
        tensors when torch can be imported (``num_batches_tracked`` as int64,
        as PyTorch keeps it), NumPy arrays otherwise.  Load it with
        ``torch_model.load_state_dict(...)``.

    Raises:
        ValueError: naming missing, unexpected or mis-shaped entries of
            ``params``/``state``.
    """
    label, entries = _entries(model, input_shape, model_options)
    given = {"params": dict(tree_items(params)), "state": dict(tree_items(state or {}))}
    problems = []
    for collection in given:
        wanted = {e.path for e in entries if e.collection == collection}
        have = set(given[collection])
        problems += first_few([f"missing {collection} {p!r}" for p in sorted(wanted - have)],
                               f"missing {collection} entries")
        problems += first_few([f"unexpected {collection} {p!r}" for p in sorted(have - wanted)],
                               f"unexpected {collection} entries")
    if problems:
        raise ValueError(f"{label}: params/state do not match the model: " + "; ".join(problems))
    try:
        import torch
    except ImportError:
        torch = None
    out = {}
    for e in entries:
        array = np.asarray(given[e.collection][e.path])
        if tuple(array.shape) != e.shape:
            raise ValueError(f"{label}: {e.collection} {e.path!r} has shape {array.shape}, "
                             f"expected {e.shape}")
        array = np.array(e.to_torch(array), order="C")   # a copy; keeps 0-d arrays 0-d
        if e.torch_name.endswith("num_batches_tracked"):
            array = array.astype(np.int64)
        out[e.torch_name] = array if torch is None else _to_tensor(torch, array)
    return out


def _to_tensor(torch, array: np.ndarray):
    if array.dtype.kind == "V":       # bfloat16/float8 have no NumPy bridge: go through float32
        return torch.from_numpy(array.astype(np.float32)).to(getattr(torch, array.dtype.name))
    return torch.from_numpy(array)
