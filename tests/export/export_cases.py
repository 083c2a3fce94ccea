"""Shared pieces of the export tests (imported as ``export_cases``): small zoo models with random parameters.

Every zoo model is built with 7 classes and a small input (VGG/AlexNet with a
32-wide classifier, which keeps the 512*7*7 -> width layer but not its 100M
weights).  BatchNorm statistics, affine parameters and biases are randomised
so that folding and export cannot pass by accident with the identity
statistics a fresh model has.  The zoo cases draw their weights with NumPy
from the shapes ``jax.eval_shape`` gives: compiling the models' own
initialisers would take most of the time of the whole-zoo tests.
"""
import jax
import numpy as np
import pytest

from jaxcnn import models

ZOO = {
    # name: (options, (H, W, C))
    "mnist_cnn": ({}, (28, 28, 1)),
    "lenet5": ({}, (28, 28, 1)),
    "alexnet": ({"classifier_width": 32}, (63, 63, 3)),
    "vgg11": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg16": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg16_bn": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg11_bn": ({"classifier_width": 32}, (32, 32, 3)),
    "resnet18": ({}, (32, 32, 3)),
    "resnet34": ({}, (32, 32, 3)),
    "resnet50": ({}, (32, 32, 3)),
    "resnext50_32x4d": ({}, (32, 32, 3)),    # grouped 3x3 convolutions
    "mobilenet_v2": ({}, (32, 32, 3)),
    # deeper and wider variants of the kinds above: ONNX-checked in the slow run only (HEAVY)
    "resnet101": ({}, (32, 32, 3)),
    "resnet152": ({}, (32, 32, 3)),
    "wide_resnet50_2": ({}, (32, 32, 3)),
    "vgg13": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg13_bn": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg19": ({"classifier_width": 32}, (32, 32, 3)),
    "vgg19_bn": ({"classifier_width": 32}, (32, 32, 3)),
}
HEAVY = {"resnet101", "resnet152", "wide_resnet50_2", "vgg13", "vgg13_bn", "vgg19", "vgg19_bn"}


def randomize(params, state, seed=0):
    """Random BatchNorm statistics/affine parameters and biases (NumPy trees)."""
    rng = np.random.default_rng(seed)

    def leaf(path, v):
        v = np.asarray(v)
        key = path[-1].key
        if key == "var":
            return rng.uniform(0.5, 2.0, v.shape).astype(v.dtype)
        if key == "mean":
            return rng.normal(0.0, 0.2, v.shape).astype(v.dtype)
        if key == "scale":
            return rng.uniform(0.5, 1.5, v.shape).astype(v.dtype)
        if key in ("bias", "b"):
            return rng.normal(0.0, 0.1, v.shape).astype(v.dtype)
        return v

    return (jax.tree_util.tree_map_with_path(leaf, params),
            jax.tree_util.tree_map_with_path(leaf, state))


def init_model(model, image_shape, seed=0, jit=False):
    """Randomised ``(params, state)`` of ``model`` for images ``(H, W, C)``
    (``jit=True`` for big models: one compile instead of many small ops)."""
    init = jax.jit(model.init, static_argnums=1) if jit else model.init
    params, state, _ = init(jax.random.PRNGKey(seed), (1,) + tuple(image_shape))
    return randomize(jax.device_get(params), jax.device_get(state), seed)


def random_init(model, image_shape, seed=0):
    """Randomised ``(params, state)`` without running the model's initialisers:
    weights ``w`` uniform in +-1/sqrt(fan_in) (PyTorch's default range, fan_in =
    all axes but the last), the rest as :func:`randomize` draws them."""
    like = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), (1,) + tuple(image_shape))[:2])
    rng = np.random.default_rng(seed)

    def leaf(path, v):
        if path[-1].key == "w":
            bound = 1.0 / np.sqrt(max(int(np.prod(v.shape[:-1])), 1))
            return rng.uniform(-bound, bound, v.shape).astype(v.dtype)
        return np.zeros(v.shape, v.dtype)

    params, state = (jax.tree_util.tree_map_with_path(leaf, t) for t in like)
    return randomize(params, state, seed)


def eval_logits(model, params, state, x):
    return np.asarray(jax.jit(lambda p, s, x: model.apply(p, s, x, train=False)[0])(
        params, state, x))


class ZooCase:
    def __init__(self, name):
        options, self.image_shape = ZOO[name]
        self.name = name
        self.model = models.get(name, num_classes=7, **options)
        self.params, self.state = random_init(self.model, self.image_shape)
        self.x = np.random.default_rng(1).normal(size=(2,) + self.image_shape).astype(np.float32)
        self.logits = eval_logits(self.model, self.params, self.state, self.x)


def onnx_run(proto, x, optimize=True):
    """Run an ONNX model on CPU with onnxruntime; ``optimize=False`` keeps QDQ as written."""
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(proto.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    return session.run(None, {"input": np.asarray(x, np.float32)})[0]
