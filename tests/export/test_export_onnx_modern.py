"""ONNX export of MobileNetV3, EfficientNet-B0 and ConvNeXt-T (hard-sigmoid,
squeeze-excitation gates, LayerNorm over channels, layer scale, stochastic
depth dropped in eval) run in onnxruntime (CPU) against jaxcnn's eval-mode
logits; 7 classes, 32x32 inputs, batch 2, random weights, BatchNorm
statistics, LayerNorm affines and layer scales (``export_cases.random_init``).

Tolerance: float32, max |onnx - jax| <= 1e-4 * max |jax|.
"""
import os

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



def test_export_command_line_from_a_parameter_file(tmp_path, capsys):
    """``jaxcnn-export weights.npz --model convnext_tiny`` (the model by its zoo name)."""
    from jaxcnn import interop
    from jaxcnn.export.cli import main

    model = models.get("convnext_tiny", num_classes=5)
    params, state = random_init(model, (32, 32, 3))
    path, out = str(tmp_path / "w.npz"), str(tmp_path / "model.onnx")
    interop.save_npz(path, params, state)
    assert main([path, "--model", "convnext_tiny", "--num-classes", "5", "--input-shape",
                 "32,32,3", "--format", "onnx", "--out", out]) == 0, capsys.readouterr().err
    x = np.random.default_rng(3).normal(size=(2, 32, 32, 3)).astype(np.float32)
    ref = eval_logits(model, params, state, x)
    np.testing.assert_allclose(onnx_run(onnx.load(out), x), ref, rtol=RTOL,
                               atol=RTOL * np.abs(ref).max())


@pytest.mark.slow
def test_train_and_export_command_lines(tmp_path, capsys):
    """``jaxcnn-train model.name=mobilenet_v3_small`` (one step, train mode: BatchNorm,
    dropout, the squeeze-excitation gates) and ``jaxcnn-export RUN_DIR`` to ONNX
    (about a minute of compiling on 2 cores)."""
    from jaxcnn.export.cli import main
    from jaxcnn.train.cli import train_main

    work, out = str(tmp_path / "run"), str(tmp_path / "model.onnx")
    args = ["mesh.data=1", "data.source=synthetic", "data.image_size=[32,32,3]",
            "data.num_train=8", "data.num_eval=4", "data.batch_size=4", "data.prefetch=0",
            "model.name=mobilenet_v3_small", "model.num_classes=5", "train.steps=1",
            "train.eval_every=null", "logging.progress=none", "optim.name=sgd", "optim.lr=0.01"]
    assert train_main([os.path.join("configs", "mobilenet_v2_cifar10.yaml"), *args,
                       "--workdir", work]) == 0, capsys.readouterr().err
    assert main([work, "--format", "onnx", "--out", out, "--batch", "2"]) == 0, \
        capsys.readouterr().err
    proto = onnx.load(out)
    assert "HardSigmoid" in {n.op_type for n in proto.graph.node}
    pixels = np.random.default_rng(3).integers(0, 256, size=(2, 32, 32, 3), dtype=np.uint8)
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    logits = session.run(None, {"input": pixels})[0]
    assert logits.shape == (2, 5) and np.all(np.isfinite(logits))
