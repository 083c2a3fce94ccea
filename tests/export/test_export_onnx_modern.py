"""ONNX export of MobileNetV3, EfficientNet-B0 and ConvNeXt-T (hard-sigmoid,
squeeze-excitation gates, LayerNorm over channels, layer scale, stochastic
depth dropped in eval) run in onnxruntime (CPU) against jaxcnn's eval-mode
logits; 7 classes, 32x32 inputs, batch 2, random weights, BatchNorm
statistics, LayerNorm affines and layer scales (``export_cases.random_init``).

Tolerance: float32, max |onnx - jax| <= 1e-4 * max |jax|.
"""
import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from export_cases import eval_logits, onnx_run, random_init  # noqa: E402

from jaxcnn import models  # noqa: E402
from jaxcnn.export import export_onnx  # noqa: E402

RTOL = 1e-4


@pytest.mark.parametrize("name, ops", [
    ("mobilenet_v3_small", {"HardSigmoid", "HardSwish", "Mul"}),
    pytest.param("mobilenet_v3_large", {"HardSigmoid", "HardSwish"}, marks=pytest.mark.slow),
    pytest.param("efficientnet_b0", {"Sigmoid", "Mul"}, marks=pytest.mark.slow),
    ("convnext_tiny", {"LayerNormalization", "Erf", "Mul"}),
])
def test_zoo_model_matches_onnxruntime(name, ops):
    image_shape = (32, 32, 3)
    model = models.get(name, num_classes=7)
    params, state = random_init(model, image_shape)     # layer scales too (leaf "scale")
    x = np.random.default_rng(1).normal(size=(2,) + image_shape).astype(np.float32)
    ref = eval_logits(model, params, state, x)
    proto = export_onnx(model, params, state, image_shape)
    found = {n.op_type for n in proto.graph.node}
    assert ops <= found and "Dropout" not in found
    out = onnx_run(proto, x)
    scale = float(np.abs(ref).max())
    assert out.shape == ref.shape == (2, 7) and scale > 1e-3
    assert float(np.abs(out - ref).max()) <= RTOL * scale

