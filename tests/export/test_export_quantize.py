"""int8 post-training quantisation: the integer layers against a float32
reference of the same integer arithmetic (exact below 2**24), the whole quantised model against
its ONNX QDQ export (onnxruntime without graph rewrites), and the
quantisation error against the float model."""
import jax
import numpy as np
import pytest
from export_cases import eval_logits, init_model, onnx_run

from jaxcnn import layers as L
from jaxcnn.export import calibrate, export_onnx, quantize_int8
from jaxcnn.export.quantize import quantize_weight


def test_quantize_weight_per_channel():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 3, 4, 5)).astype(np.float32) * np.array([1, 10, 0.01, 0, 3], np.float32)
    w_q, scale = quantize_weight(w)
    assert w_q.dtype == np.int8 and scale.shape == (5,)
    np.testing.assert_array_equal(np.abs(w_q).reshape(-1, 5).max(0), [127, 127, 127, 0, 127])
    assert scale[3] == 1.0                                  # all-zero channel
    np.testing.assert_allclose(w_q * scale, w, atol=0.5 * scale.max() * 1.0001)
    assert np.all(np.abs(w_q * scale - w) <= 0.5 * scale * 1.0001)


def _model_and_data(seed=0):
    model = L.serial(("conv", L.Conv2D(8, 3, stride=2, padding=((1, 0), (1, 1)), groups=2)),
                     ("bn", L.BatchNorm()), ("relu", L.Relu()), ("pool", L.MaxPool2D(2)),
                     ("flat", L.Flatten()), ("fc", L.Linear(4)))
    params, state = init_model(model, (9, 8, 4), seed)
    x = np.random.default_rng(seed).normal(size=(6, 9, 8, 4)).astype(np.float32)
    return model, params, state, x


def test_integer_layers_match_float32_reference():
    model, params, state, x = _model_and_data()
    qm, qp, qs = quantize_int8(model, params, state, [x[:3], x[3:]])
    kinds = [c.kind for _, c in qm.children]
    assert kinds[0] == "quantized_conv2d" and kinds[-1] == "quantized_linear"
    assert "batch_norm" not in kinds
    conv = qp["conv"]
    assert conv["w_q"].dtype == np.int8 and conv["b_q"].dtype == np.int32
    # the calibrated scale is max|x| / 127 over both batches
    np.testing.assert_allclose(conv["x_scale"], np.abs(x).max() / 127, rtol=1e-6)
    # reference: the same integer arithmetic in float32, exact while |acc| < 2**24
    x_q = np.clip(np.round(x / conv["x_scale"]), -128, 127)
    acc = jax.lax.conv_general_dilated(
        x_q.astype(np.float32), conv["w_q"].astype(np.float32), (2, 2), ((1, 0), (1, 1)),
        dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=2, precision="highest")
    y = qm.children[0][1].apply(conv, {}, x)[0]
    acc = np.asarray(acc) + conv["b_q"]
    assert np.abs(acc).max() < 2 ** 24
    np.testing.assert_allclose(np.asarray(y), acc * (conv["x_scale"] * conv["w_scale"]),
                               rtol=1e-6, atol=1e-6)


def test_quantised_model_close_to_float_and_equal_to_qdq_onnx():
    model, params, state, x = _model_and_data(1)
    ref = eval_logits(model, params, state, x)
    qm, qp, qs = quantize_int8(model, params, state, [x])
    out = eval_logits(qm, qp, qs, x)
    assert np.abs(out - ref).max() <= 0.05 * np.abs(ref).max()   # int8 noise, not a bug
    proto = export_onnx(qm, qp, qs, (9, 8, 4))
    ops = [n.op_type for n in proto.graph.node]
    assert ops.count("QuantizeLinear") == 2 and ops.count("DequantizeLinear") >= 6
    onnx_out = onnx_run(proto, x, optimize=False)
    np.testing.assert_allclose(onnx_out, out, rtol=0, atol=1e-5 * np.abs(out).max())


def test_calibrate_needs_batches():
    model, params, state, _ = _model_and_data()
    with pytest.raises(ValueError, match="at least one batch"):
        calibrate(model, params, state, [])
