"""Post-training int8 quantisation of convolutions and linear layers.

Scheme (symmetric, zero points 0 everywhere):

* weights: per output channel, ``w_scale[c] = max|w[..., c]| / 127`` and
  ``w_q = round(w / w_scale)`` in ``[-127, 127]``;
* activations: the input of each quantised layer gets one scale from
  calibration, ``x_scale = max|x| / 127`` over a few batches, and
  ``x_q = clip(round(x / x_scale), -128, 127)`` (what ONNX ``QuantizeLinear``
  does);
* bias: ``b_q = round(b / (x_scale * w_scale))`` in int32.

A quantised layer computes ``acc = conv(x_q, w_q) + b_q`` in integers (int8
operands, int32 accumulation through ``lax.conv_general_dilated`` /
``lax.dot_general`` with ``preferred_element_type=int32``) and returns
``acc * x_scale * w_scale`` in float32; everything between quantised layers
(activations, pooling, residual adds) stays float32.  BatchNorm is folded
first.  The ONNX export of such a model is the same computation in QDQ form
(``QuantizeLinear``/``DequantizeLinear`` around activations and weights).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcnn.errors import ExportError
from jaxcnn.export.fold import fold_batch_norm
from jaxcnn.layers._tree import get_path, rewrite, show
from jaxcnn.layers.base import leaf, record_layers

QUANTIZABLE = ("conv2d", "linear")
_OBSERVED = "absmax"


def quantize_activation(x, x_scale):
    """``clip(round(x / x_scale), -128, 127)`` as int8 (round half to even)."""
    return jnp.clip(jnp.round(x / x_scale), -128, 127).astype(jnp.int8)


def quantize_weight(w):
    """Per-output-channel symmetric int8 weight.

    Arguments:
        w: ``(..., C_out)`` float weight (HWIO kernel or ``(in, out)`` matrix).

    Returns:
        ``(w_q, w_scale)``: int8 ``w_q`` of ``w``'s shape, float32 ``(C_out,)``
        scales; an all-zero channel gets scale 1.
    """
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w.reshape(-1, w.shape[-1])), axis=0)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    return np.clip(np.round(w / scale), -127, 127).astype(np.int8), scale


def _observer(layer):
    """``layer`` that also reports ``max|x|`` of its input as state."""
    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        y, _ = layer.apply(params, {}, x, train=train, rng=rng, policy=policy, choices=choices)
        return y, {_OBSERVED: jnp.max(jnp.abs(x)).astype(jnp.float32)}
    return leaf(layer.kind, layer.init, apply, layer.config)


def calibrate(model, params, state, batches) -> dict:
    """Largest ``|x|`` entering each conv2d/linear layer over ``batches``.

    Arguments:
        model: a Layer tree; params/state its trees.
        batches: iterable of ``(N, H, W, C)`` float images, preprocessed as for
            the model (a few batches of training data).

    Returns:
        ``{layer path: max |x|}`` (Python floats).
    """
    paths = []

    def observe(path, layer, p, s):
        if layer.kind in QUANTIZABLE:
            paths.append(path)
            return _observer(layer), p, s
        return layer, p, s

    watched, p, s = rewrite(model, params, state, leaf_fn=observe)
    run = jax.jit(lambda x: watched.apply(p, s, x, train=False)[1])
    ranges = dict.fromkeys(paths, 0.0)
    seen = 0
    for x in batches:
        seen += 1
        new_state = jax.device_get(run(jnp.asarray(x)))
        for path in paths:
            ranges[path] = max(ranges[path], float(get_path(new_state, path)[_OBSERVED]))
    if not seen:
        raise ExportError("calibration needs at least one batch of images")
    return ranges


def _conv_int8(config):
    stride, dilation, groups = config["stride"], config["dilation"], config["groups"]
    padding = config["padding"]
    padding = padding if isinstance(padding, str) else tuple(tuple(p) for p in padding)

    def op(x_q, w_q):
        return lax.conv_general_dilated(x_q, w_q, tuple(stride), padding, rhs_dilation=tuple(dilation),
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"),
                                        feature_group_count=groups,
                                        preferred_element_type=jnp.int32)
    return op


def _linear_int8(x_q, w_q):
    return lax.dot_general(x_q, w_q, (((x_q.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=jnp.int32)


def quantized_layer(layer):
    """The int8 version of a conv2d or linear ``layer``.

    Its params are ``{"w_q": int8 (weight shape), "w_scale": f32 (C_out,),
    "x_scale": f32 (), "b_q": int32 (C_out,)}`` (``b_q`` only with a bias) and
    its kind ``"quantized_conv2d"`` / ``"quantized_linear"``.
    """
    int_op = _conv_int8(layer.config) if layer.kind == "conv2d" else _linear_int8

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng, policy
        acc = int_op(quantize_activation(x, params["x_scale"]), params["w_q"])
        if "b_q" in params:
            acc = acc + params["b_q"]
        return acc.astype(jnp.float32) * (params["x_scale"] * params["w_scale"]), state

    return leaf(f"quantized_{layer.kind}", _shape_only_init(layer), apply, layer.config)


def _shape_only_init(layer):
    """``init`` that gives the float layer's output shape (for summaries and export)
    and int8/float32 placeholders of the quantised parameter shapes."""
    def init(key, input_shape):
        with record_layers():  # keep the float layer out of the caller's records
            p, _, out_shape = layer.init(key, input_shape)
        c_out = p["w"].shape[-1]
        params = {"w_q": jnp.zeros(p["w"].shape, jnp.int8),
                  "w_scale": jnp.ones((c_out,), jnp.float32),
                  "x_scale": jnp.ones((), jnp.float32)}
        if "b" in p:
            params["b_q"] = jnp.zeros((c_out,), jnp.int32)
        return params, {}, out_shape
    return init


def quantize_int8(model, params, state, calibration_batches):
    """Post-training int8 quantisation (see the module docstring for the scheme).

    Arguments:
        model: a Layer tree in float32; params/state its trees.
        calibration_batches: iterable of ``(N, H, W, C)`` preprocessed images
            (a few training batches are enough).

    Returns:
        ``(qmodel, qparams, qstate)``: BatchNorms folded, every conv2d/linear
        replaced by its int8 version; ``qmodel.apply(..., train=False)`` runs
        the integer path and returns float32 logits.
    """
    model, params, state = fold_batch_norm(model, params, state)
    ranges = calibrate(model, params, state, calibration_batches)

    def swap(path, layer, p, s):
        if layer.kind not in QUANTIZABLE:
            return layer, p, s
        if "w" not in p:
            raise ExportError(f"layer {show(path)} of kind {layer.kind!r} has no weight 'w'")
        w_q, w_scale = quantize_weight(p["w"])
        x_scale = np.float32(ranges[path] / 127.0 if ranges[path] > 0 else 1.0)
        qp = {"w_q": w_q, "w_scale": w_scale, "x_scale": np.asarray(x_scale)}
        if "b" in p:
            qp["b_q"] = np.round(np.asarray(p["b"], np.float64)
                                 / (np.float64(x_scale) * w_scale)).astype(np.int32)
        return quantized_layer(layer), qp, s

    return rewrite(model, params, state, leaf_fn=swap)
