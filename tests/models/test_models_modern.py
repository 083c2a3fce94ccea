"""MobileNetV3, EfficientNet-B0 and ConvNeXt-T in the zoo: torchvision's
module names, MACs at 224x224 against torchvision's published GFLOPS, options
and their errors, and stochastic depth inside the residual blocks against the
eval-mode block with the same per-example mask.  (Parameter counts are in
test_models_zoo.py's table; logits against PyTorch twins in
tests/interop/test_interop_modern.py.)"""
import jax
import numpy as np
import pytest

from jaxcnn import models
from jaxcnn.models import convnext, efficientnet
from jaxcnn.summary import summary

# torchvision's "GFLOPS" column (multiply-accumulates, in billions, 2 decimals) at 224x224.
PUBLISHED_GMACS = {"mobilenet_v3_small": 0.06, "mobilenet_v3_large": 0.22,
                   "efficientnet_b0": 0.39, "convnext_tiny": 4.46}


def _abstract_init(model, shape):
    return jax.eval_shape(lambda k: model.init(k, shape)[:2], jax.random.PRNGKey(0))


def _flat_names(tree):
    return {jax.tree_util.keystr(path, simple=True, separator=".")
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.parametrize("name", sorted(PUBLISHED_GMACS))
def test_macs_match_torchvision_published_gflops(name):
    assert models.default_input_shape(name) == (1, 224, 224, 3)
    s = summary(models.get(name), (1, 224, 224, 3))
    assert round(s.total_macs / 1e9, 2) == PUBLISHED_GMACS[name]


@pytest.mark.parametrize("name, expected", [
    ("mobilenet_v3_small", {
        "features.0.0.w", "features.0.1.scale", "features.1.block.0.0.w",
        "features.1.block.1.fc1.w", "features.1.block.1.fc1.b", "features.1.block.1.fc2.w",
        "features.1.block.2.0.w", "features.1.block.2.1.bias", "features.2.block.0.0.w",
        "features.4.block.2.fc1.w", "features.12.0.w", "classifier.0.w", "classifier.3.b"}),
    ("mobilenet_v3_large", {
        "features.1.block.0.0.w", "features.1.block.1.0.w", "features.4.block.2.fc2.b",
        "features.16.0.w", "classifier.0.w", "classifier.3.w"}),
    ("efficientnet_b0", {
        "features.0.0.w", "features.1.0.block.0.0.w", "features.1.0.block.1.fc1.w",
        "features.1.0.block.2.0.w", "features.2.0.block.0.0.w", "features.2.0.block.2.fc2.b",
        "features.2.1.block.3.1.scale", "features.7.0.block.3.0.w", "features.8.0.w",
        "classifier.1.w", "classifier.1.b"}),
    ("convnext_tiny", {
        "features.0.0.w", "features.0.0.b", "features.0.1.scale", "features.1.0.block.0.w",
        "features.1.0.block.2.scale", "features.1.0.block.3.w", "features.1.0.block.5.b",
        "features.1.0.layer_scale.scale", "features.2.0.scale", "features.2.1.w",
        "features.5.8.block.3.w", "features.7.2.layer_scale.scale", "classifier.0.scale",
        "classifier.2.w"}),
])
def test_torchvision_module_names(name, expected):
    params, state = _abstract_init(models.get(name), models.default_input_shape(name))
    names = _flat_names(params)
    assert expected <= names
    assert not any(k in n for n in names for k in ("activation", "stochastic", "avgpool"))
    if name == "convnext_tiny":
        assert state == {}
    else:
        assert {n.rsplit(".", 1)[1] for n in _flat_names(state)} == {"mean", "var", "count"}


def test_shapes_of_the_characteristic_layers():
    params, state = _abstract_init(models.get("mobilenet_v3_large"), (1, 224, 224, 3))
    se = params["features"]["4"]["block"]["2"]            # 72 -> make_divisible(72 // 4) = 24
    assert se["fc1"]["w"].shape == (1, 1, 72, 24) and se["fc2"]["w"].shape == (1, 1, 24, 72)
    assert params["features"]["14"]["block"]["1"]["0"]["w"].shape == (5, 5, 1, 960)
    params, _ = _abstract_init(models.get("efficientnet_b0"), (1, 224, 224, 3))
    se = params["features"]["2"]["1"]["block"]["2"]        # squeeze to input channels // 4
    assert se["fc1"]["w"].shape == (1, 1, 144, 6)
    params, _ = _abstract_init(models.get("convnext_tiny"), (1, 224, 224, 3))
    block = params["features"]["3"]["1"]
    assert block["block"]["0"]["w"].shape == (7, 7, 1, 192)
    assert block["block"]["3"]["w"].shape == (192, 768)
    assert block["layer_scale"]["scale"].shape == (192,)
    assert params["features"]["0"]["0"]["w"].shape == (4, 4, 3, 96)


def test_options_and_their_errors():
    params, _ = _abstract_init(models.get("convnext_tiny", num_classes=7), (1, 32, 32, 3))
    assert params["classifier"]["2"]["w"].shape == (768, 7)
    for name in ("efficientnet_b0", "convnext_tiny"):
        with pytest.raises(ValueError, match=f"{name}: stochastic_depth_prob must be in"):
            models.get(name, stochastic_depth_prob=1.5)
    with pytest.raises(ValueError, match=r"unknown option.*'width_mult'.*dropout"):
        models.get("mobilenet_v3_small", width_mult=0.5)
    with pytest.raises(ValueError, match=r"Dropout: rate must be in \[0, 1\]"):
        models.get("efficientnet_b0", dropout=2.0)


def test_initial_values_follow_torchvision():
    block = convnext.cn_block(96, 1e-6, 0.0)           # a block, not the 28M-parameter model
    params, _, _ = jax.jit(block.init, static_argnums=1)(jax.random.PRNGKey(0), (1, 8, 8, 96))
    np.testing.assert_array_equal(params["layer_scale"]["scale"], np.full(96, 1e-6, np.float32))
    w = np.asarray(params["block"]["3"]["w"])           # trunc_normal(std=0.02)
    assert abs(w.std() - 0.02) < 0.001 and np.abs(w).max() < 0.02 * 6
    np.testing.assert_array_equal(params["block"]["3"]["b"], 0)
    np.testing.assert_array_equal(params["block"]["2"]["scale"], 1)


def _random_variables(model, shape, seed=0):
    rng = np.random.default_rng(seed)

    def fill(path, a):  # NumPy, in the leaf's dtype, put as it is: no program compiled per shape
        if path[-1].key == "count":
            return jax.device_put(np.zeros(a.shape, a.dtype))
        if path[-1].key == "var":
            return jax.device_put(np.asarray(rng.uniform(0.5, 1.5, a.shape), a.dtype))
        return jax.device_put(np.asarray(0.5 * rng.standard_normal(a.shape), a.dtype))

    return tuple(jax.tree_util.tree_map_with_path(fill, t) for t in _abstract_init(model, shape))


@pytest.mark.parametrize("make, p", [
    (lambda p: convnext.cn_block(8, 0.7, p), 0.5),
    (lambda p: efficientnet.mbconv(8, 8, 2, 3, 1, p), 0.3),
])
def test_stochastic_depth_drops_whole_examples_of_the_branch(make, p):
    """Train mode with stochastic depth: each example is either passed through
    unchanged (its branch dropped) or gets the branch of the same block built
    with p=0 (also in train mode) scaled by 1/(1-p): the p=0 block with the
    per-example mask matched.  In eval mode the two blocks are equal."""
    shape = (64, 6, 6, 8)
    block, reference = make(p), make(0.0)
    params, state = _random_variables(block, shape)
    x = jax.random.normal(jax.random.PRNGKey(1), shape)

    @jax.jit
    def run(x):
        y, _ = block.apply(params, state, x, train=True, rng=jax.random.PRNGKey(2))
        full, _ = reference.apply(params, state, x, train=True, rng=jax.random.PRNGKey(3))
        return y, full, block.apply(params, state, x)[0], reference.apply(params, state, x)[0]

    y, full, y_eval, ref_eval = run(x)
    y, x, branch = np.asarray(y), np.asarray(x), np.asarray(full) - np.asarray(x)
    dropped = np.all(y == x, axis=(1, 2, 3))
    assert 0 < dropped.sum() < shape[0]
    assert abs(dropped.mean() - p) < 5 * np.sqrt(p * (1 - p) / shape[0])
    kept = ~dropped
    np.testing.assert_allclose(y[kept] - x[kept], branch[kept] / (1 - p), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(y_eval, ref_eval)      # eval: the identity, no rng needed
    with pytest.raises(ValueError, match="StochasticDepth: apply.*needs an rng key"):
        # traced only (the error is raised while tracing): eagerly, every op of the block
        # before it compiled on its own
        jax.eval_shape(lambda x: block.apply(params, state, x, train=True), x)
