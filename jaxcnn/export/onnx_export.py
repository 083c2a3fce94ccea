"""Export a jaxcnn model to ONNX (opset 17+), built with the ``onnx`` helper API.

The exporter walks the Layer tree (``kind``/``config``/``children``) with the
parameters and writes one ONNX node (or a few) per layer.  Inside the graph
images are NCHW, ONNX's native layout for Conv and pooling:

* ``layout="nhwc"`` (default): the graph input is ``(N, H, W, C)`` like
  jaxcnn's and a ``Transpose`` to NCHW follows it;
* ``layout="nchw"``: the graph input is ``(N, C, H, W)`` (PyTorch's layout).

With ``raw_image=True`` the input is one ``uint8`` image ``(H_in, W_in, C)`` of any size,
resized (Pillow's antialiased bilinear, as ``Resize`` with ``antialias``) and centre-cropped
inside exactly as the run's evaluation does before the normalisation; see :func:`_raw_image`.

Stochastic depth emits no node (it is the identity in eval mode), a ``gate``
(squeeze-excitation) is its body followed by a ``Mul``, a LayerScale a ``Mul``
by a constant, and LayerNorm over the channel axis a ``LayerNormalization`` on
the NHWC view.

The output is the model's output (logits ``(N, classes)`` for the zoo); an
image-shaped output is transposed back to the input's layout.  ``Flatten``
transposes to NHWC first so the features come in jaxcnn's ``H*W*C`` order
and the Linear weights need no permutation.  Dropout and Identity emit no
node.  Pooling with ``ceil_mode`` or ``count_include_pad=False`` is written
as explicit pads plus, for averages, a constant per-window divisor
correction, so the results follow PyTorch's (and jaxcnn's) rules exactly
instead of relying on each runtime's reading of ``ceil_mode``.  Adaptive
average pooling is an ``AveragePool`` when the bins are equal and two
``MatMul`` with bin matrices otherwise.  Quantised layers (from
:mod:`jaxcnn.export.quantize`) are written in QDQ form.
"""
from __future__ import annotations

import math
import os
import shutil
import tempfile

import numpy as np

from jaxcnn.data.files import write_whole
from jaxcnn.errors import ExportError
from jaxcnn.layers._tree import child_path, get_path, residual_parts, show
from jaxcnn.layers.base import record_layers

MIN_OPSET = 17
_NCHW = (0, 3, 1, 2)            # NHWC -> NCHW
_NHWC = (0, 2, 3, 1)            # NCHW -> NHWC
_NHWC_TO_NCHW_AXIS = {0: 0, 1: 2, 2: 3, 3: 1}
SUPPORTED_KINDS = (
    "conv2d", "conv_transpose2d", "linear", "quantized_conv2d", "quantized_linear", "batch_norm",
    "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "global_avg_pool2d", "flatten",
    "identity", "dropout", "relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "hardswish",
    "sigmoid", "tanh", "softmax", "log_softmax",
    "hardsigmoid", "stochastic_depth", "layer_scale", "layer_norm")
# Pillow's BILINEAR resize as ONNX Resize (opset 18) spells it; see _raw_image.
_PILLOW_BILINEAR = dict(mode="linear", antialias=1, exclude_outside=1,
                        coordinate_transformation_mode="half_pixel")
RAW_IMAGE_OPSET = 18
# The raw-image graph's resized (H', W', C) and centre-cropped (H, W, C) uint8 image tensors.
RESIZED, CROPPED = "image_resized", "image_cropped"
# Above this many bytes of weights the protobuf (2 GiB limit) keeps them in a side file.
_EXTERNAL_DATA_BYTES = 1536 * 2**20


def _onnx():
    try:
        import onnx
    except ImportError as e:  # an optional dependency
        raise ExportError("ONNX export needs the 'onnx' package (pip install 'jaxcnn[export]')") from e
    return onnx


class _Graph:
    """Nodes and initialisers being collected, with unique tensor names."""

    def __init__(self):
        self.onnx = _onnx()
        self.nodes, self.initializers, self._used = [], [], set()

    def name(self, hint: str) -> str:
        base = hint.replace(".", "_") or "t"
        name, i = base, 1
        while name in self._used:
            name, i = f"{base}_{i}", i + 1
        self._used.add(name)
        return name

    def const(self, hint: str, array) -> str:
        name = self.name(hint)
        self.initializers.append(self.onnx.numpy_helper.from_array(np.asarray(array), name))
        return name

    def node(self, op: str, inputs, hint: str, **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(self.onnx.helper.make_node(op, list(inputs), [out],
                                                     name=self.name(f"{hint}/{op}"), **attrs))
        return out


def _f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _explicit_pads(padding, in_hw, window, stride):
    """``((top, bottom), (left, right))`` for a padding config (XLA's "SAME" rule)."""
    if padding == "VALID":
        return ((0, 0), (0, 0))
    if padding == "SAME":
        out = []
        for n, k, s in zip(in_hw, window, stride):
            total = max((-(-n // s) - 1) * s + k - n, 0)
            out.append((total // 2, total - total // 2))
        return tuple(out)
    return tuple(tuple(p) for p in padding)


def _onnx_pads(pads):
    (t, b), (l, r) = pads
    return [int(t), int(l), int(b), int(r)]


def _window_counts(n, lo, hi, k, s, out, include_pad):
    """Positions of each pooling window inside the input (and the padding, if counted);
    the ``ceil_mode`` overhang beyond the padding never counts (PyTorch's divisor)."""
    first, last = (-lo, n + hi) if include_pad else (0, n)
    starts = np.arange(out) * s - lo
    return np.minimum(starts + k, last) - np.maximum(starts, first)


def _bin_matrix(n: int, out: int) -> np.ndarray:
    """``(out, n)`` averaging matrix of adaptive pooling's bins (PyTorch's)."""
    i = np.arange(out)
    start, end = (i * n) // out, -((-(i + 1) * n) // out)
    pos = np.arange(n)
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(np.float32)


class _Exporter:
    def __init__(self, records, params, state):
        self.g = _Graph()
        self.records = records
        self.params, self.state = params, state

    # -- tree walk ---------------------------------------------------------------------
    def emit(self, layer, path, x, rank):
        """Emit ``layer`` on tensor ``x`` (NCHW when ``rank == 4``); returns ``(y, rank)``."""
        kind = layer.kind
        if kind == "serial":
            for name, child in layer.children:
                x, rank = self.emit(child, child_path(path, name), x, rank)
            return x, rank
        if kind == "residual":
            main, shortcut, activation = residual_parts(layer)
            y, r = x, rank
            for name, child in main:
                y, r = self.emit(child, child_path(path, name), y, r)
            s = x
            if shortcut is not None:
                s, _ = self.emit(shortcut[1], child_path(path, shortcut[0]), x, rank)
            y = self.g.node("Add", [y, s], f"{path}.add")
            if activation is not None:
                y, r = self.emit(activation[1], child_path(path, "activation"), y, r)
            return y, r
        if kind == "parallel":
            outs = [self.emit(child, child_path(path, name), x, rank)
                    for name, child in layer.children]
            r = outs[0][1]
            names = [o for o, _ in outs]
            if layer.config["combine"] == "add":
                return self.g.node("Sum", names, f"{path}.sum"), r
            return self.g.node("Concat", names, f"{path}.concat", axis=1 if r == 4 else -1), r
        if kind == "gate":
            g, r = x, rank
            for name, child in layer.children:
                g, r = self.emit(child, child_path(path, name), g, r)
            if r != rank:
                raise ExportError(f"ONNX export: gate {show(path)} computes a rank-{r} factor "
                                  f"for a rank-{rank} input")
            return self.g.node("Mul", [x, g], f"{path}.mul"), rank
        if kind not in SUPPORTED_KINDS:
            raise ExportError(f"ONNX export: layer {show(path)} of kind {kind!r} is not supported "
                              f"(supported: {', '.join(supported_kinds())})")
        rec = self.records.get(path)
        if rec is None:
            raise ExportError(f"ONNX export: layer {show(path)} of kind {kind!r} reported no "
                              "shapes while initialising (is it built with layers.leaf?)")
        if len(rec.input_shape) not in (2, 4) and kind not in ("dropout", "identity"):
            raise ExportError(f"ONNX export: layer {show(path)} of kind {kind!r} gets a rank-"
                              f"{len(rec.input_shape)} input {rec.input_shape}; only images "
                              "(N, H, W, C) and features (N, F) are supported")
        return getattr(self, "_" + kind)(layer.config, path, x, rank, rec,
                       get_path(self.params, path), get_path(self.state, path))

    # -- helpers -------------------------------------------------------------------------
    def _channels_last(self, path, x, rank, fn):
        """Run ``fn`` on the NHWC view of a rank-4 tensor (ops over the last axis)."""
        if rank != 4:
            return fn(x)
        y = fn(self.g.node("Transpose", [x], f"{path}.to_nhwc", perm=list(_NHWC)))
        return self.g.node("Transpose", [y], f"{path}.to_nchw", perm=list(_NCHW))

    def _quantize(self, path, x, scale):
        """QuantizeLinear + DequantizeLinear of an activation (int8, zero point 0)."""
        s = self.g.const(f"{path}.x_scale", _f32(scale))
        z = self.g.const(f"{path}.x_zero_point", np.zeros((), np.int8))
        q = self.g.node("QuantizeLinear", [x, s, z], f"{path}.x_q")
        return self.g.node("DequantizeLinear", [q, s, z], f"{path}.x_dq")

    def _dequantized(self, path, what, q, scale, axis):
        s = self.g.const(f"{path}.{what}_scale", _f32(scale))
        z = self.g.const(f"{path}.{what}_zero_point", np.zeros(np.shape(scale), np.asarray(q).dtype))
        qn = self.g.const(f"{path}.{what}_q", np.asarray(q))
        return self.g.node("DequantizeLinear", [qn, s, z], f"{path}.{what}_dq", axis=axis)

    # -- leaf kinds ----------------------------------------------------------------------
    def _conv_attrs(self, c, rec):
        pads = _explicit_pads(c["padding"], rec.input_shape[1:3],
                              [d * (k - 1) + 1 for d, k in zip(c["dilation"], c["kernel_size"])],
                              c["stride"])
        return dict(kernel_shape=list(c["kernel_size"]), strides=list(c["stride"]),
                    dilations=list(c["dilation"]), group=int(c["groups"]), pads=_onnx_pads(pads))

    def _conv2d(self, c, path, x, rank, rec, p, s):
        inputs = [x, self.g.const(f"{path}.weight", _f32(p["w"]).transpose(3, 2, 0, 1))]
        if "b" in p:
            inputs.append(self.g.const(f"{path}.bias", _f32(p["b"])))
        return self.g.node("Conv", inputs, path, **self._conv_attrs(c, rec)), 4

    def _conv_transpose2d(self, c, path, x, rank, rec, p, s):
        inputs = [x, self.g.const(f"{path}.weight", _f32(p["w"]).transpose(2, 3, 0, 1))]
        if "b" in p:
            inputs.append(self.g.const(f"{path}.bias", _f32(p["b"])))
        return self.g.node("ConvTranspose", inputs, path, kernel_shape=list(c["kernel_size"]),
                           strides=list(c["stride"]), dilations=list(c["dilation"]),
                           group=int(c["groups"]), pads=_onnx_pads(c["padding"]),
                           output_padding=list(c["output_padding"])), 4

    def _linear(self, c, path, x, rank, rec, p, s):
        w = self.g.const(f"{path}.weight", _f32(p["w"]))
        b = self.g.const(f"{path}.bias", _f32(p["b"])) if "b" in p else None
        if rank == 2:
            return self.g.node("Gemm", [x, w] + ([b] if b else []), path), 2

        def matmul(v):
            y = self.g.node("MatMul", [v, w], path)
            return self.g.node("Add", [y, b], f"{path}.add_bias") if b else y
        return self._channels_last(path, x, rank, matmul), rank

    def _quantized_conv2d(self, c, path, x, rank, rec, p, s):
        xdq = self._quantize(path, x, p["x_scale"])
        w = self._dequantized(path, "weight", np.asarray(p["w_q"]).transpose(3, 2, 0, 1),
                              p["w_scale"], 0)
        inputs = [xdq, w]
        if "b_q" in p:
            inputs.append(self._dequantized(path, "bias", p["b_q"],
                                            _f32(p["x_scale"]) * _f32(p["w_scale"]), 0))
        return self.g.node("Conv", inputs, path, **self._conv_attrs(c, rec)), 4

    def _quantized_linear(self, c, path, x, rank, rec, p, s):
        if rank != 2:
            raise ExportError(f"ONNX export: quantised linear layer {show(path)} on a rank-"
                              f"{rank} input is not supported")
        xdq = self._quantize(path, x, p["x_scale"])
        inputs = [xdq, self._dequantized(path, "weight", p["w_q"], p["w_scale"], 1)]
        if "b_q" in p:
            inputs.append(self._dequantized(path, "bias", p["b_q"],
                                            _f32(p["x_scale"]) * _f32(p["w_scale"]), 0))
        return self.g.node("Gemm", inputs, path), 2

    def _batch_norm(self, c, path, x, rank, rec, p, s):
        inputs = [x] + [self.g.const(f"{path}.{k}", _f32(v)) for k, v in
                        (("weight", p["scale"]), ("bias", p["bias"]),
                         ("running_mean", s["mean"]), ("running_var", s["var"]))]
        return self.g.node("BatchNormalization", inputs, path, epsilon=float(c["eps"])), rank

    def _pool_geometry(self, c, rec, dilation=(1, 1)):
        window = [d * (k - 1) + 1 for d, k in zip(dilation, c["kernel_size"])]
        pads = _explicit_pads(c["padding"], rec.input_shape[1:3], window, c["stride"])
        out_hw = rec.output_shape[1:3]
        # Explicit bottom/right pads that make a floor-mode pool give exactly out_hw windows.
        run = [(lo, max(hi, (o - 1) * st + k - n - lo)) for n, (lo, hi), k, st, o in
               zip(rec.input_shape[1:3], pads, window, c["stride"], out_hw)]
        return pads, run, out_hw

    def _max_pool2d(self, c, path, x, rank, rec, p, s):
        _, run, _ = self._pool_geometry(c, rec, c["dilation"])
        return self.g.node("MaxPool", [x], path, kernel_shape=list(c["kernel_size"]),
                           strides=list(c["stride"]), dilations=list(c["dilation"]),
                           pads=_onnx_pads(run)), 4

    def _avg_pool2d(self, c, path, x, rank, rec, p, s):
        pads, run, out_hw = self._pool_geometry(c, rec)
        kh, kw = c["kernel_size"]
        y = self.g.node("AveragePool", [x], path, kernel_shape=[kh, kw], strides=list(c["stride"]),
                        pads=_onnx_pads(run), count_include_pad=1)  # = window sum / (kh * kw)
        counts = [_window_counts(n, lo, hi, k, st, o, c["count_include_pad"]) for
                  n, (lo, hi), k, st, o in zip(rec.input_shape[1:3], pads, (kh, kw), c["stride"],
                                               out_hw)]
        divisor = np.outer(*counts)
        if np.any(divisor != kh * kw):
            fix = (kh * kw / divisor).astype(np.float32)[None, None]
            y = self.g.node("Mul", [y, self.g.const(f"{path}.divisor_fix", fix)], f"{path}.fix")
        return y, 4

    def _adaptive_avg_pool2d(self, c, path, x, rank, rec, p, s):
        (h, w), (oh, ow) = rec.input_shape[1:3], rec.output_shape[1:3]
        if h % oh == 0 and w % ow == 0:
            k = [h // oh, w // ow]
            return self.g.node("AveragePool", [x], path, kernel_shape=k, strides=k), 4
        cols = self.g.const(f"{path}.cols", _bin_matrix(w, ow).T)   # (W, OW)
        rows = self.g.const(f"{path}.rows", _bin_matrix(h, oh))     # (OH, H)
        y = self.g.node("MatMul", [x, cols], f"{path}.pool_w")      # (N, C, H, OW)
        return self.g.node("MatMul", [rows, y], path), 4            # (N, C, OH, OW)

    def _global_avg_pool2d(self, c, path, x, rank, rec, p, s):
        y = self.g.node("GlobalAveragePool", [x], path)
        return self.g.node("Flatten", [y], f"{path}.flatten", axis=1), 2

    def _flatten(self, c, path, x, rank, rec, p, s):
        if rank == 4:  # jaxcnn flattens NHWC: (N, H*W*C)
            x = self.g.node("Transpose", [x], f"{path}.to_nhwc", perm=list(_NHWC))
        return self.g.node("Flatten", [x], path, axis=1), 2

    def _identity(self, c, path, x, rank, rec, p, s):
        return x, rank

    _dropout = _identity
    _stochastic_depth = _identity     # the identity in eval mode

    def _layer_scale(self, c, path, x, rank, rec, p, s):
        scale = _f32(p["scale"])
        if rank == 4:
            scale = scale.reshape(1, -1, 1, 1)
        return self.g.node("Mul", [x, self.g.const(f"{path}.scale", scale)], path), rank

    def _layer_norm(self, c, path, x, rank, rec, p, s):
        if tuple(a % len(rec.input_shape) for a in c["axes"]) != (len(rec.input_shape) - 1,):
            raise ExportError(f"ONNX export: layer_norm {show(path)} over axes {c['axes']} is not "
                              "supported (only over the last, channel axis)")
        w = self.g.const(f"{path}.weight", _f32(p["scale"]))
        b = self.g.const(f"{path}.bias", _f32(p["bias"]))
        return self._channels_last(path, x, rank, lambda v: self.g.node(
            "LayerNormalization", [v, w, b], path, axis=-1, epsilon=float(c["eps"]))), rank

    def _unary(self, op, path, x, rank, **attrs):
        return self.g.node(op, [x], path, **attrs), rank

    def _relu(self, c, path, x, rank, rec, p, s):
        return self._unary("Relu", path, x, rank)

    def _relu6(self, c, path, x, rank, rec, p, s):
        lo, hi = self.g.const(f"{path}.min", _f32(0)), self.g.const(f"{path}.max", _f32(6))
        return self.g.node("Clip", [x, lo, hi], path), rank

    def _leaky_relu(self, c, path, x, rank, rec, p, s):
        return self._unary("LeakyRelu", path, x, rank, alpha=float(c["negative_slope"]))

    def _elu(self, c, path, x, rank, rec, p, s):
        return self._unary("Elu", path, x, rank, alpha=float(c["alpha"]))

    def _sigmoid(self, c, path, x, rank, rec, p, s):
        return self._unary("Sigmoid", path, x, rank)

    def _tanh(self, c, path, x, rank, rec, p, s):
        return self._unary("Tanh", path, x, rank)

    def _hardswish(self, c, path, x, rank, rec, p, s):
        return self._unary("HardSwish", path, x, rank)

    def _hardsigmoid(self, c, path, x, rank, rec, p, s):   # relu6(x + 3) / 6
        return self._unary("HardSigmoid", path, x, rank, alpha=1.0 / 6.0, beta=0.5)

    def _silu(self, c, path, x, rank, rec, p, s):
        sig = self.g.node("Sigmoid", [x], f"{path}.sigmoid")
        return self.g.node("Mul", [x, sig], path), rank

    def _gelu(self, c, path, x, rank, rec, p, s):
        g, half = self.g, self.g.const(f"{path}.half", _f32(0.5))
        one = g.const(f"{path}.one", _f32(1.0))
        if c["approximate"]:   # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            x3 = g.node("Mul", [x, g.node("Mul", [x, x], f"{path}.x2")], f"{path}.x3")
            inner = g.node("Add", [x, g.node("Mul", [x3, g.const(f"{path}.c", _f32(0.044715))],
                                             f"{path}.cx3")], f"{path}.inner")
            arg = g.node("Mul", [inner, g.const(f"{path}.k", _f32(math.sqrt(2 / math.pi)))],
                         f"{path}.arg")
            t = g.node("Tanh", [arg], f"{path}.tanh")
        else:                  # 0.5 x (1 + erf(x / sqrt(2)))
            arg = g.node("Mul", [x, g.const(f"{path}.k", _f32(1 / math.sqrt(2)))], f"{path}.arg")
            t = g.node("Erf", [arg], f"{path}.erf")
        gate = g.node("Mul", [g.node("Add", [t, one], f"{path}.1p"), half], f"{path}.gate")
        return g.node("Mul", [x, gate], path), rank

    def _softmax_like(self, op, c, path, x, rank):
        axis = c["axis"] % rank
        if rank == 4:
            axis = _NHWC_TO_NCHW_AXIS[axis]
        return self.g.node(op, [x], path, axis=axis), rank

    def _softmax(self, c, path, x, rank, rec, p, s):
        return self._softmax_like("Softmax", c, path, x, rank)

    def _log_softmax(self, c, path, x, rank, rec, p, s):
        return self._softmax_like("LogSoftmax", c, path, x, rank)


def supported_kinds() -> list[str]:
    """Layer kinds the ONNX exporter can write (besides serial/residual/parallel)."""
    return sorted(SUPPORTED_KINDS)


def _records(model, image_shape):
    """Every leaf's LayerRecord by path, and the model's output shape, for batch 1."""
    import jax
    shape, out = (1,) + tuple(image_shape), []

    def init(key):
        params, state, out_shape = model.init(key, shape)
        out.append(out_shape)
        return params, state

    with record_layers() as records:
        jax.eval_shape(init, jax.random.PRNGKey(0))
    return {r.path: r for r in records}, tuple(out[0])


def export_onnx(model, params, state, image_shape, *, path=None, batch="dynamic",
                layout: str = "nhwc", opset: int | None = None, external_data=None,
                model_name: str = "jaxcnn", preprocessing=None, metadata=None,
                raw_image: bool = False):
    """Write ``model`` (eval mode) as an ONNX graph and check it with ``onnx.checker``.

    Arguments:
        model: a Layer tree (e.g. a zoo model, possibly folded or quantised).
        params, state: its parameters and state; converted to float32 (quantised
            weights keep their integer dtypes).
        image_shape: ``(H, W, C)`` of one input image.
        path: file to write, or None to only return the model.
        batch: an int for a fixed batch size, or ``"dynamic"`` (a symbolic ``N``).
        layout: ``"nhwc"`` (input ``(N, H, W, C)``, transposed inside) or
            ``"nchw"`` (input ``(N, C, H, W)``).
        opset: ONNX opset of the default domain, at least 17 (18 with ``raw_image``);
            None: the least.
        external_data: store the weights in ``<path>.data`` beside the model;
            None decides by size (above 1.5 GiB, under the 2 GiB protobuf limit).
        model_name: the graph's name.
        preprocessing: a :class:`jaxcnn.data.preprocessing.Preprocessing` to build into
            the graph: the input is then raw pixels of its ``pixel_dtype`` (``uint8`` in
            ``[0, 255]``, or float32 on the unit scale), cast and normalised inside
            (``x * scale - offset``, the same float32 arithmetic as the trainer's);
            None: the input is the network's own, already normalised, float32.
        metadata: extra ``metadata_props`` entries (strings).
        raw_image: the input is one raw ``uint8`` image ``(H_in, W_in, C)`` of any size
            (as decoded, no batch axis; the output is still ``(1, classes)``), resized and
            centre-cropped inside as the run's evaluation does
            (:func:`jaxcnn.data.transforms.eval_transform`, ``preprocessing.resize_shorter_side``),
            then normalised; needs such a ``preprocessing``, ``layout="nhwc"``, ``batch``
            ``"dynamic"`` or 1, and opset 18.

    Returns:
        The ``onnx.ModelProto`` (weights inline unless written externally).
        Raises :class:`ExportError` naming the layer path and kind for a layer
        the exporter does not know.
    """
    onnx = _onnx()
    if layout not in ("nhwc", "nchw"):
        raise ExportError(f"layout must be 'nhwc' or 'nchw', got {layout!r}")
    if opset is not None and opset < MIN_OPSET:
        raise ExportError(f"opset must be at least {MIN_OPSET}, got {opset}")
    if batch != "dynamic" and not (isinstance(batch, int) and batch >= 1):
        raise ExportError(f"batch must be a positive int or 'dynamic', got {batch!r}")
    opset = (RAW_IMAGE_OPSET if raw_image else MIN_OPSET) if opset is None else opset
    h, w, c = (int(d) for d in image_shape)
    if raw_image:
        _check_raw_image(preprocessing, layout, batch, opset, (h, w))
    records, out_shape = _records(model, (h, w, c))
    exporter = _Exporter(records, params, state)
    g = exporter.g
    n = 1 if raw_image else "N" if batch == "dynamic" else int(batch)
    x, in_type, in_shape = _graph_input(g, preprocessing, layout, (n, h, w, c), raw_image)
    y, rank = exporter.emit(model, "", x, 4)
    if rank == 4 and layout == "nhwc":
        y = g.node("Transpose", [y], "output_nhwc", perm=list(_NHWC))
    g.nodes.append(onnx.helper.make_node("Identity", [y], ["output"], name="output"))
    out_shape = [n] + list(out_shape[1:])
    if rank == 4 and layout == "nchw":
        out_shape = [out_shape[i] for i in _NCHW]
    graph = onnx.helper.make_graph(
        g.nodes, model_name,
        [onnx.helper.make_tensor_value_info("input", in_type, in_shape)],
        [onnx.helper.make_tensor_value_info("output", onnx.TensorProto.FLOAT, out_shape)],
        initializer=g.initializers)
    proto = _model_proto(onnx, graph, opset, "hwc" if raw_image else layout, in_shape, preprocessing,
                         metadata)
    return _checked_and_saved(onnx, proto, path, external_data, sum(t.ByteSize() for t in g.initializers))


def _graph_input(g, preprocessing, layout: str, nhwc, raw_image: bool):
    """The graph's input: ``(x, in_type, in_shape)``, ``x`` the NCHW float32 tensor the network
    takes, built from the input ``"input"`` (normalised inside when ``preprocessing`` is given;
    for a raw image also resized and cropped, :func:`_raw_image`)."""
    onnx = g.onnx
    n, h, w, c = nhwc
    in_shape = [n, h, w, c] if layout == "nhwc" else [n, c, h, w]
    x = "input"
    g._used.add(x)
    in_type = onnx.TensorProto.FLOAT
    if preprocessing is not None:
        if tuple(preprocessing.image_shape)[-1] != c:
            raise ExportError(f"preprocessing has {len(preprocessing.mean)} channels but the "
                              f"input has {c}")
        if raw_image:
            in_shape = ["H_in", "W_in", c]
            x = _raw_image(g, x, preprocessing.resize_shorter_side, h, w, c)
        if preprocessing.pixel_dtype == "uint8":
            in_type = onnx.TensorProto.UINT8
            x = g.node("Cast", [x], "input_float", to=onnx.TensorProto.FLOAT)
    if layout == "nhwc":
        x = g.node("Transpose", [x], "input_nchw", perm=list(_NCHW))
    if preprocessing is not None:
        scale, offset = preprocessing.scale_offset()
        x = g.node("Mul", [x, g.const("norm_scale", scale.reshape(1, c, 1, 1))], "input_scaled")
        x = g.node("Sub", [x, g.const("norm_offset", offset.reshape(1, c, 1, 1))],
                   "input_normalized")
    return x, in_type, in_shape


def _check_raw_image(preprocessing, layout: str, batch, opset: int, crop) -> None:
    """An :class:`ExportError` where a raw-image graph cannot be built: it needs the run's
    resize (``preprocessing.resize_shorter_side``, at least the ``crop``'s longer side) of
    ``uint8`` pixels, takes one ``(H, W, C)`` image and needs opset 18 (``Resize``'s
    ``antialias``)."""
    if preprocessing is None or preprocessing.resize_shorter_side is None:
        raise ExportError("raw_image=True builds the run's evaluation resize and crop into the graph, but "
                          + ("there is no preprocessing" if preprocessing is None else
                             "its preprocessing has none (its images come at the model's size)"))
    if preprocessing.pixel_dtype != "uint8":
        raise ExportError(f"raw_image=True takes uint8 images, but the preprocessing's pixels are "
                          f"{preprocessing.pixel_dtype}")
    if preprocessing.resize_interpolation != "bilinear":
        raise ExportError(f"raw_image=True resizes as Pillow's bilinear filter does; the run resizes with "
                          f"{preprocessing.resize_interpolation!r} (data.augment.interpolation), which the "
                          f"graph does not reproduce: export without --raw-image")
    if layout != "nhwc":
        raise ExportError(f"raw_image=True takes one image (H, W, C) as decoded; layout={layout!r} does not apply")
    if batch not in ("dynamic", 1):
        raise ExportError(f"raw_image=True takes one image; batch={batch!r} does not apply")
    if opset < RAW_IMAGE_OPSET:
        raise ExportError(f"raw_image=True needs opset {RAW_IMAGE_OPSET} or later (Resize with "
                          f"antialias), got {opset}")
    if preprocessing.resize_shorter_side < max(crop):
        raise ExportError(f"raw_image=True: the resize's shorter side {preprocessing.resize_shorter_side} "
                          f"is smaller than the {crop[0]}x{crop[1]} crop")


def _raw_image(g, x: str, side: int, h: int, w: int, c: int) -> str:
    """``x``, one ``(H_in, W_in, C)`` ``uint8`` image of any size, as the ``(1, h, w, C)``
    ``uint8`` batch :func:`jaxcnn.data.transforms.eval_transform` makes of it.

    The resized shape is :func:`~jaxcnn.data.transforms.resized_shape`'s: ``side * (H_in, W_in)
    // min(H_in, W_in)`` in int64 is its ``int(side * H_in / W_in)`` (the float quotient never
    rounds up to the next integer while ``side * H_in < 2**53``). The resize is Pillow's
    ``BILINEAR`` as ONNX ``Resize`` spells it: the triangle filter widened by the scale when
    shrinking (``antialias=1``), pixel centres at half-integers (``half_pixel``), weights
    renormalised at the borders (``exclude_outside=1``), and, as Pillow does, the width first, then
    the height, each pass rounded to ``uint8`` (onnxruntime's ``uint8`` ``Resize`` is Pillow's
    fixed-point arithmetic). The crop starts at ``round((new - crop) / 2)`` with ``Round``'s
    half-to-even, Python's ``round`` in ``center_crop_box``."""
    onnx = g.onnx

    def i64(hint, value):
        return g.const(hint, np.asarray(value, np.int64))

    hw = g.node("Shape", [x], "input_hw", start=0, end=2)
    shorter = g.node("ReduceMin", [hw], "input_shorter_side", keepdims=1)
    scaled = g.node("Mul", [hw, i64("resize_shorter_side", side)], "input_hw_scaled")
    sizes = g.node("Div", [scaled, shorter], "resized_hw")
    for axis, hint in ((1, "resized_w"), (0, RESIZED)):
        size = g.node("Gather", [sizes, i64(f"{hint}_axis", [axis])], f"{hint}_size")
        x = g.node("Resize", [x, "", "", size], hint, axes=[axis], **_PILLOW_BILINEAR)
    crop = i64("crop_hw", [h, w])
    margin = g.node("Cast", [g.node("Sub", [sizes, crop], "crop_margin")], "crop_margin_float",
                    to=onnx.TensorProto.FLOAT)
    half = g.node("Mul", [margin, g.const("half", _f32(0.5))], "crop_start_float")
    starts = g.node("Cast", [g.node("Round", [half], "crop_start_rounded")], "crop_start",
                    to=onnx.TensorProto.INT64)
    ends = g.node("Add", [starts, crop], "crop_end")
    x = g.node("Slice", [x, starts, ends, i64("crop_axes", [0, 1])], CROPPED)
    return g.node("Reshape", [x, i64("image_batch_shape", [1, h, w, c])], "image_batch")


def _model_proto(onnx, graph, opset: int, layout: str, in_shape, preprocessing, metadata):
    """The ``ModelProto`` of ``graph``: the oldest IR version that carries ``opset`` (so that
    older runtimes load the file), and a description of its input in its doc string and
    ``metadata_props``."""
    opsets = [onnx.helper.make_opsetid("", opset)]
    proto = onnx.helper.make_model(graph, opset_imports=opsets, producer_name="jaxcnn",
                                   ir_version=onnx.helper.find_min_ir_version_for(opsets))
    in_desc = "float32 (normalised)" if preprocessing is None else (
        f"raw {preprocessing.pixel_dtype} pixels in {list(preprocessing.pixel_range)}, "
        + (f"one image of any size, resized (shorter side {preprocessing.resize_shorter_side}, "
           "bilinear antialiased), centre-cropped and " if layout == "hwc" else "")
        + f"normalised inside as {preprocessing.formula}")
    proto.doc_string = (f"jaxcnn export; input 'input' is {layout.upper()} {in_desc} "
                        f"{in_shape}, output 'output'")
    onnx.helper.set_model_props(proto, {"input_layout": layout.upper(),
                                        **{str(k): str(v) for k, v in (metadata or {}).items()}})
    return proto


def _checked_and_saved(onnx, proto, path, external_data, size: int):
    """``proto`` checked by ``onnx.checker`` and written to ``path`` (when given); the weights
    in ``<path>.data`` with ``external_data`` (None: when ``size`` bytes are too many for one
    protobuf)."""
    if external_data is None:
        external_data = size > _EXTERNAL_DATA_BYTES
    if external_data and path is None:
        raise ExportError("external_data=True needs a path to write the weights beside")
    if not external_data:
        onnx.checker.check_model(proto, full_check=True)
        if path is not None:
            write_whole(path, lambda partial: onnx.save_model(proto, partial))
        return proto
    # Both files are written in a directory of their own beside ``path`` and renamed into place
    # once checked, the weights first: written in place, a full disk tore the model an earlier
    # export left, and onnx appends to an existing weights file (each export grew it).
    path = os.fspath(path)
    data = os.path.basename(path) + ".data"
    staging = tempfile.mkdtemp(prefix=".jaxcnn-onnx-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        staged = os.path.join(staging, os.path.basename(path))
        onnx.save_model(proto, staged, save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        onnx.checker.check_model(staged, full_check=True)
        os.replace(os.path.join(staging, data), path + ".data")
        os.replace(staged, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return proto
