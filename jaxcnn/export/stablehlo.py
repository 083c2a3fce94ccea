"""Export a model's eval-mode forward pass as serialised StableHLO (``jax.export``).

The parameters are baked into the module as constants, so the bytes are a
self-contained program: ``jax.export.deserialize(data).call(x)`` runs it in a
process that has JAX but not this model's Python code.  The batch dimension
is symbolic (``jax.export.symbolic_shape("b, H, W, C")``) unless a fixed
batch is asked for.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import export as jax_export

from jaxcnn.data.files import write_bytes_whole
from jaxcnn.errors import ExportError


def export_stablehlo(model, params, state, image_shape, *, batch="dynamic", layout: str = "nhwc",
                     dtype=jnp.float32, platforms=None, path=None, preprocessing=None) -> bytes:
    """Serialise ``x -> model.apply(params, state, x, train=False)[0]``.

    Arguments:
        model: a Layer tree (a zoo model, or one folded/quantised by this package).
        params, state: its parameters and state, embedded as constants.
        image_shape: ``(H, W, C)`` of one image.
        batch: an int for a fixed batch size, or ``"dynamic"`` for a symbolic ``b``.
        layout: ``"nhwc"`` (input ``(b, H, W, C)``) or ``"nchw"`` (input
            ``(b, C, H, W)``, transposed to NHWC inside).
        dtype: input dtype (without ``preprocessing``).
        platforms: lowering platforms, e.g. ``("cpu", "cuda")``; None = the
            default backend's.
        path: also write the bytes to this file.
        preprocessing: a :class:`jaxcnn.data.preprocessing.Preprocessing` to build in: the
            input is then raw pixels of its ``pixel_dtype`` (``uint8`` in ``[0, 255]``, or
            float32 on the unit scale), normalised inside as the trainer does.

    Returns:
        The serialised ``jax.export.Exported`` (load with :func:`load_stablehlo`).
    """
    if layout not in ("nhwc", "nchw"):
        raise ExportError(f"layout must be 'nhwc' or 'nchw', got {layout!r}")
    if batch != "dynamic" and not (isinstance(batch, int) and batch >= 1):
        raise ExportError(f"batch must be a positive int or 'dynamic', got {batch!r}")
    h, w, c = (int(d) for d in image_shape)
    params, state = jax.tree_util.tree_map(jnp.asarray, (params, state))

    if preprocessing is not None:
        if tuple(preprocessing.image_shape)[-1] != c:
            raise ExportError(f"preprocessing has {len(preprocessing.mean)} channels but the "
                              f"input has {c}")
        dtype = jnp.dtype(preprocessing.pixel_dtype)
        scale, offset = (jnp.asarray(v) for v in preprocessing.scale_offset())

    def forward(x):
        if layout == "nchw":
            x = jnp.transpose(x, (0, 2, 3, 1))
        if preprocessing is not None:  # as jaxcnn.data.normalize: x * (1/255/std) - mean/std
            x = x.astype(jnp.float32) * scale - offset
        return model.apply(params, state, x, train=False)[0]

    dims = (h, w, c) if layout == "nhwc" else (c, h, w)
    b = "b" if batch == "dynamic" else str(int(batch))
    shape = jax_export.symbolic_shape(f"{b}, {dims[0]}, {dims[1]}, {dims[2]}")
    exported = jax_export.export(jax.jit(forward), platforms=platforms)(
        jax.ShapeDtypeStruct(shape, dtype))
    data = bytes(exported.serialize())
    if path is not None:
        write_bytes_whole(path, data)
    return data


def load_stablehlo(source):
    """Deserialise an export made by :func:`export_stablehlo`.

    Arguments:
        source: the bytes, or a path to the file holding them.

    Returns:
        A ``jax.export.Exported``; ``exported.call(x)`` runs the model and
        ``exported.in_avals`` shows the expected input (``b`` is the batch).
    """
    if isinstance(source, (str, os.PathLike)):
        with open(os.fspath(source), "rb") as f:
            source = f.read()
    try:
        return jax_export.deserialize(bytearray(source))
    except Exception as e:  # flatbuffer/MLIR errors have no common type
        raise ExportError(f"not a serialised jax.export module ({type(e).__name__}: {e})") from e
