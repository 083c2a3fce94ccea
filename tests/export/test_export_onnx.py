"""ONNX export: every zoo model and every supported layer kind, run in
onnxruntime (CPU) against jaxcnn's eval-mode output.

Tolerance: float32, max |onnx - jax| <= 1e-4 * max |jax| (relative to the
output's scale; different summation orders in conv/matmul).
"""
import os

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from export_cases import HEAVY, ZOO, eval_logits, onnx_run  # noqa: E402
from export_cases import random_init  # noqa: E402

from jaxcnn import layers as L  # noqa: E402
from jaxcnn.export import ExportError, export_onnx  # noqa: E402

RTOL = 1e-4

# The layer-kind models take random_init's weights (NumPy, from jax.eval_shape): the models'
# own initialisers, run op by op, took 97% of these tests' time; the export and the
# comparison with eval-mode jaxcnn are the same for any weights (BatchNorm statistics and
# biases are randomised the same way).

# Zoo models that only repeat another one's kinds of layers in ONNX: checked in the slow run
# (with HEAVY); resnet18 covers resnet34's basic blocks, resnext50_32x4d resnet50's bottlenecks
# (grouped, a superset), vgg16 and vgg16_bn the VGG-11 configurations.
REPEATS = {"resnet34", "resnet50", "vgg11", "vgg11_bn"}


def assert_close(out, ref, rtol=RTOL):
    assert out.shape == ref.shape
    scale = max(float(np.abs(ref).max()), 1e-6)
    err = float(np.abs(out - ref).max())
    assert err <= rtol * scale, f"max error {err:g} vs output scale {scale:g}"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY | REPEATS else n
                                  for n in sorted(ZOO)])
def test_zoo_model_matches_onnxruntime(zoo_case, name):
    case = zoo_case(name)
    proto = export_onnx(case.model, case.params, case.state, case.image_shape)
    assert proto.opset_import[0].version >= 17
    ops = {n.op_type for n in proto.graph.node}
    assert "Dropout" not in ops
    assert_close(onnx_run(proto, case.x), case.logits)


def test_nchw_layout_fixed_batch_and_folded_batchnorm(zoo_case):
    case = zoo_case("resnet18")
    from jaxcnn.export import fold_batch_norm
    model, params, state = fold_batch_norm(case.model, case.params, case.state)
    proto = export_onnx(model, params, state, case.image_shape, batch=2, layout="nchw")
    dims = [d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [2, 3, 32, 32]
    assert "BatchNormalization" not in {n.op_type for n in proto.graph.node}
    assert dict((p.key, p.value) for p in proto.metadata_props)["input_layout"] == "NCHW"
    assert_close(onnx_run(proto, case.x.transpose(0, 3, 1, 2)), case.logits)


def _check(model, image_shape, batch=3, seed=0):
    params, state = random_init(model, image_shape, seed)
    x = np.random.default_rng(seed).normal(size=(batch,) + image_shape).astype(np.float32)
    ref = eval_logits(model, params, state, x)
    proto = export_onnx(model, params, state, image_shape)
    out = onnx_run(proto, x)
    assert_close(out, ref)
    return proto


def _branches(*layers):
    """One model holding many variants side by side (one compile, one session):
    each branch ends in Flatten and the features are concatenated."""
    return L.parallel(*[L.serial(layer, L.Flatten()) for layer in layers])


def test_conv_variants():
    _check(L.serial(_branches(
        L.Conv2D(8, 3, padding=1),
        L.Conv2D(8, (3, 2), stride=(2, 1), padding=((2, 0), (1, 1))),   # asymmetric
        L.Conv2D(8, 3, dilation=2, padding="SAME", stride=2),
        L.Conv2D(8, 3, groups=4, padding="VALID", use_bias=False),
        L.Conv2D(8, 1, groups=8),                                       # depthwise 1x1
    ), L.Relu(), L.Linear(5)), (9, 10, 8))


def test_pooling_variants():
    _check(L.serial(L.Conv2D(4, 1), _branches(
        L.MaxPool2D(3, stride=2, padding=1, ceil_mode=True),
        L.MaxPool2D(2, stride=2, ceil_mode=True),
        L.MaxPool2D(3, stride=1, dilation=2, padding=1),
        L.MaxPool2D(3, stride=2, padding="SAME"),
        L.AvgPool2D(3, stride=2, padding=1),
        L.AvgPool2D(3, stride=2, padding=1, count_include_pad=False),
        L.AvgPool2D(3, stride=2, padding=1, ceil_mode=True),
        L.AvgPool2D(2, stride=2, padding=((1, 0), (0, 1)), ceil_mode=True, count_include_pad=False),
        L.AvgPool2D(3, stride=2, padding="SAME"),
        L.AdaptiveAvgPool2D(3),            # 7 -> 3: overlapping bins (MatMul path)
        L.AdaptiveAvgPool2D((7, 2)),       # equal bins on both axes (AveragePool path)
        L.AdaptiveAvgPool2D(9),            # bigger than the input
        L.GlobalAvgPool2D(),
    )), (7, 8, 3))


def test_activations():
    acts = [L.Relu6(), L.LeakyRelu(0.2), L.Elu(0.7), L.Gelu(), L.Gelu(approximate=True), L.Silu(),
            L.Hardswish(), L.Sigmoid(), L.Tanh(), L.Softmax(), L.LogSoftmax(), L.Softmax(axis=1)]
    _check(L.serial(L.Conv2D(6, 3, padding=1), L.parallel(*acts), L.Conv2D(4, 1)), (5, 5, 2))


def test_parallel_residual_linear_on_images_and_transposed_conv():
    branch = L.parallel(L.Conv2D(3, 1), L.serial(L.Conv2D(5, 3, padding=1), L.Relu()))
    added = L.parallel(L.Conv2D(8, 3, padding=1), L.Identity(), combine="add")
    model = L.serial(
        branch, L.BatchNorm(), added,
        L.residual(L.Conv2D(8, 3, padding=1), L.Relu(), shortcut=L.Conv2D(8, 1),
                   activation=L.Relu()),
        L.Linear(6),                     # over the channels of an image
        L.ConvTranspose2D(4, 3, stride=2, padding=((1, 0), (0, 1)), output_padding=1),
        L.Dropout(0.5),
    )
    proto = _check(model, (6, 5, 3))
    out_dims = [d.dim_value for d in proto.graph.output[0].type.tensor_type.shape.dim][1:]
    assert out_dims == [13, 11, 4]       # image outputs come back NHWC


def test_flatten_uses_nhwc_order():
    # A Linear after Flatten reads features in H*W*C order: a permutation-sensitive check.
    _check(L.serial(L.Conv2D(3, 1), L.Flatten(), L.Linear(4), L.BatchNorm(), L.Linear(2)),
           (2, 3, 3))


def test_dynamic_batch():
    model = L.serial(L.Conv2D(4, 3), L.GlobalAvgPool2D(), L.Linear(2))
    params, state = random_init(model, (6, 6, 1))
    proto = export_onnx(model, params, state, (6, 6, 1))
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"
    for n in (1, 5):
        x = np.random.default_rng(n).normal(size=(n, 6, 6, 1)).astype(np.float32)
        assert_close(onnx_run(proto, x), eval_logits(model, params, state, x))


def test_unsupported_layer_names_path_and_kind():
    model = L.serial(("stem", L.serial(L.Conv2D(4, 3), ("norm", L.GroupNorm(2)))),
                     ("head", L.Flatten()))
    params, state = random_init(model, (6, 6, 1))
    with pytest.raises(ExportError, match=r"'stem\.norm'.*'group_norm'"):
        export_onnx(model, params, state, (6, 6, 1))


def test_external_data_round_trip(tmp_path):
    model = L.serial(L.Conv2D(16, 3), L.Flatten(), L.Linear(3))
    params, state = random_init(model, (8, 8, 2))
    path = tmp_path / "m.onnx"
    export_onnx(model, params, state, (8, 8, 2), path=path, external_data=True)
    assert (tmp_path / "m.onnx.data").stat().st_size > 16 * 3 * 36 * 4
    loaded = onnx.load(str(path))     # loads the side file too
    x = np.random.default_rng(0).normal(size=(2, 8, 8, 2)).astype(np.float32)
    assert_close(onnx_run(loaded, x), eval_logits(model, params, state, x))
    # Exported again over it: the same two files, the weights not appended to the old ones
    # (onnx appends to an existing file), nothing else left beside them.
    size = (tmp_path / "m.onnx.data").stat().st_size
    export_onnx(model, params, state, (8, 8, 2), path=path, external_data=True)
    assert (tmp_path / "m.onnx.data").stat().st_size == size
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "m.onnx.data"]
    assert_close(onnx_run(onnx.load(str(path)), x), eval_logits(model, params, state, x))


def test_bad_arguments():
    model = L.serial(L.Conv2D(2, 1))
    params, state = random_init(model, (4, 4, 1))
    for kwargs, match in [(dict(layout="chwn"), "layout"), (dict(opset=13), "opset"),
                          (dict(batch=0), "batch")]:
        with pytest.raises(ExportError, match=match):
            export_onnx(model, params, state, (4, 4, 1), **kwargs)
