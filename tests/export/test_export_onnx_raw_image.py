"""ONNX export with ``raw_image=True``: the graph takes one ``uint8`` image ``(H, W, 3)`` of any
size and resizes (shorter side ``S``), centre-crops and normalises it inside.

Reference: :func:`jaxcnn.data.transforms.eval_transform` (Pillow's ``BILINEAR`` resize,
torchvision's ``Resize(S)`` shape and ``CenterCrop`` offsets). The graph's resized and cropped
``uint8`` images are read by adding its two named tensors (``RESIZED``, ``CROPPED``) to the
graph's outputs in the test, so the exported graph itself is the one users get. A tiny random
``mnist_cnn`` on a non-square ``12x16`` crop (a swapped axis would show), ``S = 19``, on
noise (the worst case for resampling) and smooth images.

Measured (onnxruntime 1.32, Pillow 13, these 17 sizes x 2 images): resized shapes equal, crops
at the same offsets; cropped pixels within 1 uint8 step, 0.33% of them off by one overall, 2.8% at
worst (noise upscaled 16 -> 19: onnxruntime computes the filter weights in float32, Pillow in
double, before both round them to 22-bit fixed point, so a few sums round the other way at .5);
logits within 3e-4 and probabilities within 5e-5 of the JAX model on ``eval_transform``'s
pixels. Tolerances below: 1 step, 5% of the pixels of an image, 1e-3 and 2e-4.
"""
import jax
import numpy as np
import pytest
from PIL import Image

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from jaxcnn import models  # noqa: E402
from jaxcnn.data.preprocessing import Preprocessing  # noqa: E402
from jaxcnn.data.transforms import eval_transform, resized_shape  # noqa: E402
from jaxcnn.errors import ExportError  # noqa: E402
from jaxcnn.export.onnx_export import CROPPED, RESIZED, export_onnx  # noqa: E402

CROP, SIDE = (12, 16), 19
PREP = Preprocessing(CROP + (3,), "uint8", (0.45, 0.5, 0.55), (0.22, 0.25, 0.3), True, None,
                     "folder", SIDE)
# (H, W): smaller and larger than S, square, portrait, landscape, odd, exactly the crop, exactly S
# on one side (no resize: crop offsets round(3.5) = 4 and round(2.5) = 2, Python's half-to-even),
# thin strips, a large photo-like one.
SIZES = [(12, 16), (16, 16), (19, 19), (19, 21), (19, 23), (21, 19), (25, 24), (24, 37), (37, 24),
         (23, 61), (101, 67), (300, 200), (7, 9), (2, 3), (1, 40), (40, 1), (1, 1)]
MAX_STEPS, MAX_DIFFERING = 1, 0.05   # uint8 steps; fraction of an image's pixels off by one
LOGIT_ATOL, PROB_ATOL = 1e-3, 2e-4


@pytest.fixture(scope="module")
def case():
    model = models.get("mnist_cnn", num_classes=5)
    params, state, _ = model.init(jax.random.PRNGKey(0), (1,) + CROP + (3,))
    proto = export_onnx(model, params, state, CROP + (3,), preprocessing=PREP, raw_image=True)
    for name in (RESIZED, CROPPED):  # test-only outputs: the graph's own intermediate images
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.UINT8, None))
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    forward = jax.jit(lambda x: model.apply(params, state, x, train=False)[0])
    return proto, session, forward


def _images(h, w):
    rng = np.random.default_rng(h * 1000 + w)
    noise = rng.integers(0, 256, (h, w, 3)).astype(np.uint8)
    y, x = np.mgrid[0:h, 0:w]
    smooth = np.stack([127 + 120 * np.sin(x / 5.0 + c) * np.cos(y / 7.0) for c in range(3)], -1)
    return {"noise": noise, "smooth": smooth.astype(np.uint8)}


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_the_graph_takes_one_image_of_any_size(case):
    proto, session, _ = case
    (inp,) = session.get_inputs()
    assert (inp.shape, inp.type) == (["H_in", "W_in", 3], "tensor(uint8)")
    assert session.get_outputs()[0].shape == [1, 5]
    assert proto.opset_import[0].version == 18
    resizes = [n for n in proto.graph.node if n.op_type == "Resize"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in resizes]
    assert [a["axes"] for a in attrs] == [[1], [0]]   # Pillow's order: the width first
    assert all((a["antialias"], a["exclude_outside"], a["mode"]) == (1, 1, b"linear") for a in attrs)
    props = {p.key: p.value for p in proto.metadata_props}
    assert props["input_layout"] == "HWC" and "shorter side 19" in proto.doc_string


@pytest.mark.parametrize("h, w", SIZES)
def test_pixels_and_logits_match_eval_transform(case, h, w):
    _, session, forward = case
    for kind, image in _images(h, w).items():
        logits, resized, cropped = session.run(None, {"input": image})
        assert resized.shape == resized_shape(h, w, SIDE) + (3,), kind
        ref = eval_transform(Image.fromarray(image), CROP, SIDE)
        assert cropped.shape == ref.shape
        diff = np.abs(cropped.astype(np.int64) - ref)
        assert diff.max() <= MAX_STEPS, (kind, diff.max())
        assert np.mean(diff > 0) <= MAX_DIFFERING, (kind, np.mean(diff > 0))
        ref_logits = np.asarray(forward(PREP.apply(ref[None])))
        assert logits.shape == ref_logits.shape == (1, 5)
        np.testing.assert_allclose(logits, ref_logits, rtol=0, atol=LOGIT_ATOL)
        np.testing.assert_allclose(_softmax(logits), _softmax(ref_logits), rtol=0, atol=PROB_ATOL)


def test_what_a_raw_image_export_refuses_is_one_line(case):
    model = models.get("mnist_cnn", num_classes=5)
    params, state, _ = model.init(jax.random.PRNGKey(0), (1,) + CROP + (3,))
    for kwargs, match in [
            (dict(preprocessing=PREP._replace(resize_shorter_side=None)), "its images come at the model's size"),
            (dict(preprocessing=None), "there is no preprocessing"),
            (dict(preprocessing=PREP._replace(pixel_dtype="float32")), "takes uint8 images"),
            (dict(preprocessing=PREP._replace(resize_interpolation="bicubic")), "resizes with 'bicubic'"),
            (dict(preprocessing=PREP, layout="nchw"), "layout='nchw' does not apply"),
            (dict(preprocessing=PREP, batch=4), "batch=4 does not apply"),
            (dict(preprocessing=PREP, opset=17), "needs opset 18"),
            (dict(preprocessing=PREP._replace(resize_shorter_side=15)), "smaller than the 12x16 crop")]:
        with pytest.raises(ExportError, match=match) as e:
            export_onnx(model, params, state, CROP + (3,), raw_image=True, **kwargs)
        assert "\n" not in str(e.value)


def test_the_export_refuses_a_run_with_another_filter_before_any_work():
    """A run resized with bicubic (data.augment.interpolation) is refused when the export reads
    its preprocessing, before loading, pruning or quantising anything."""
    from types import SimpleNamespace
    from jaxcnn.export.pipeline import _preprocessing_meta
    src = SimpleNamespace(preprocessing=PREP._replace(resize_interpolation="bicubic"), image_shape=CROP + (3,))
    with pytest.raises(ExportError, match=r"this run resizes with 'bicubic' \(data.augment.interpolation\)") as e:
        _preprocessing_meta(src, True, "onnx", "nhwc", raw_image=True)
    assert "\n" not in str(e.value)
