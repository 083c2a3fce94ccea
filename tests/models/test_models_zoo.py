"""The model zoo: registry behaviour, parameter counts (abstract init only,
nothing allocated) against the published numbers, torchvision module names,
and jitted eval/train forward passes at small sizes."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import models, summary
from jaxcnn.models import resnet

# torchvision's counts (and PyTorch's MNIST example, and LeNet-5 6-16-120-84-10).
PARAM_COUNTS = {
    "mnist_cnn": 1_199_882,
    "lenet5": 61_706,
    "alexnet": 61_100_840,
    "vgg11": 132_863_336,
    "vgg16": 138_357_544,
    "vgg16_bn": 138_365_992,
    "vgg11_bn": 132_868_840,
    "vgg13": 133_047_848,
    "vgg13_bn": 133_053_736,
    "vgg19": 143_667_240,
    "vgg19_bn": 143_678_248,
    "resnet18": 11_689_512,
    "resnet34": 21_797_672,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "resnet152": 60_192_808,
    "wide_resnet50_2": 68_883_240,
    "resnext50_32x4d": 25_028_904,
    "mobilenet_v2": 3_504_872,
}


def _abstract_init(model, shape):
    return jax.eval_shape(lambda k: model.init(k, shape)[:2], jax.random.PRNGKey(0))


def _count(tree):
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))


def _flat_names(tree):
    return {jax.tree_util.keystr(path, simple=True, separator=".")
            for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]}


# MobileNetV3, EfficientNet-B0, ConvNeXt-T: torchvision's counts; their other tests are in
# test_models_modern.py.
PARAM_COUNTS.update({"mobilenet_v3_small": 2_542_856, "mobilenet_v3_large": 5_483_032,
                     "efficientnet_b0": 5_288_548, "convnext_tiny": 28_589_128})


def test_registry_lists_every_family():
    assert models.names() == sorted(PARAM_COUNTS)


@pytest.mark.parametrize("name", sorted(PARAM_COUNTS))
def test_parameter_count(name):
    params, _ = _abstract_init(models.get(name), models.default_input_shape(name))
    assert _count(params) == PARAM_COUNTS[name]


# torchvision's published GFLOPS (its model tables; really GMACs, at 224x224), two decimals.
TORCHVISION_GMACS = {
    "alexnet": 0.71, "vgg11": 7.61, "vgg16": 15.47, "vgg16_bn": 15.47,
    "resnet18": 1.81, "resnet34": 3.66, "resnet50": 4.09, "mobilenet_v2": 0.30,
    "resnet101": 7.80, "resnet152": 11.51, "wide_resnet50_2": 11.40, "resnext50_32x4d": 4.23,
    "vgg11_bn": 7.61, "vgg13": 11.31, "vgg13_bn": 11.31, "vgg19": 19.63, "vgg19_bn": 19.63,
}


@pytest.mark.parametrize("name", sorted(TORCHVISION_GMACS))
def test_summary_macs_match_torchvision(name):
    # summary() traces abstractly (no parameters allocated); ours must round to the
    # published figure: |ours - published| <= 0.005 GMACs.
    s = summary(models.get(name), (1, 224, 224, 3))
    assert abs(s.total_macs / 1e9 - TORCHVISION_GMACS[name]) <= 0.005, s.total_macs
    assert s.total_params == PARAM_COUNTS[name]


def test_wide_and_grouped_bottlenecks():
    # torchvision's inner width int(planes * width_per_group / 64) * groups, grouped 3x3.
    for name, width, per_group in [("resnext50_32x4d", 128, 4), ("wide_resnet50_2", 128, 128),
                                   ("resnet101", 64, 64)]:
        params, _ = _abstract_init(models.get(name), (1, 224, 224, 3))
        block = params["layer1"]["0"]
        assert block["conv1"]["w"].shape == (1, 1, 64, width)
        assert block["conv2"]["w"].shape == (3, 3, per_group, width)
        assert block["conv3"]["w"].shape == (1, 1, width, 256)
        assert params["layer4"]["0"]["conv2"]["w"].shape == (3, 3, per_group * 8, width * 8)
    with pytest.raises(ValueError, match="basic blocks take only groups=1"):
        resnet.resnet("basic", (2, 2, 2, 2), groups=32)
    with pytest.raises(ValueError, match="block must be 'basic' or 'bottleneck', got 'wide'"):
        resnet.resnet("wide", (2, 2, 2, 2))


def test_counts_follow_options():
    # The CIFAR ResNet-18 (3x3 stem, 10 classes) is the well-known 11,173,962.
    params, _ = _abstract_init(models.get("resnet18", num_classes=10, cifar_stem=True),
                               (1, 32, 32, 3))
    assert _count(params) == 11_173_962
    # Changing the classifier width of VGG-16 only changes the classifier.
    params, _ = _abstract_init(models.get("vgg16", classifier_width=64, num_classes=10),
                               (1, 32, 32, 3))
    convs = (PARAM_COUNTS["vgg16"] - (25088 * 4096 + 4096) - (4096 * 4096 + 4096)
             - (4096 * 1000 + 1000))
    assert _count(params) == convs + (25088 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)
    # MobileNetV2 at half width: channels rounded to multiples of 8 (torchvision: 1,968,680).
    params, _ = _abstract_init(models.get("mobilenet_v2", width_mult=0.5), (1, 224, 224, 3))
    assert _count(params) == 1_968_680


def test_default_input_shapes():
    assert models.default_input_shape("mnist_cnn") == (1, 28, 28, 1)
    assert models.default_input_shape("lenet5") == (1, 28, 28, 1)
    for name in ("alexnet", "vgg16", "resnet50", "mobilenet_v2"):
        assert models.default_input_shape(name) == (1, 224, 224, 3)


def test_registry_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown model 'resnet9'.*resnet18"):
        models.get("resnet9")
    with pytest.raises(ValueError, match="unknown option.*'cifar'.*cifar_stem"):
        models.get("resnet18", cifar=True)
    with pytest.raises(ValueError, match=r"\['num_clases'\]; it accepts \['cifar_stem', "
                                         r"'num_classes'\]; did you mean 'num_classes'\?"):
        models.get("resnet18", num_clases=3)
    with pytest.raises(ValueError, match=r"downloads no weights: .*from_torch_state_dict .*"
                                         r"model\.init_from"):
        models.get("resnet18", pretrained=True)
    with pytest.raises(ValueError, match="num_classes must be a positive int"):
        models.get("vgg11", num_classes=0)
    with pytest.raises(ValueError, match="unknown model"):
        models.default_input_shape("nope")
    with pytest.raises(ValueError, match="activation"):
        models.get("lenet5", activation="sigmoid")
    with pytest.raises(ValueError, match="width_mult"):
        models.get("mobilenet_v2", width_mult=0)


@pytest.mark.parametrize("name, expected", [
    ("mnist_cnn", {"conv1.w", "conv1.b", "conv2.w", "fc1.w", "fc2.b"}),
    ("lenet5", {"conv1.w", "conv2.b", "fc1.w", "fc2.w", "fc3.b"}),
    ("alexnet", {"features.0.w", "features.3.w", "features.6.w", "features.8.w",
                 "features.10.b", "classifier.1.w", "classifier.4.w", "classifier.6.b"}),
    ("vgg11", {"features.0.w", "features.3.w", "features.18.w", "classifier.0.w",
               "classifier.3.w", "classifier.6.b"}),
    ("vgg16_bn", {"features.0.w", "features.1.scale", "features.40.w", "features.41.bias",
                  "classifier.6.w"}),
    ("resnet18", {"conv1.w", "bn1.scale", "layer1.0.conv1.w", "layer1.1.bn2.bias",
                  "layer2.0.downsample.0.w", "layer2.0.downsample.1.scale", "fc.w", "fc.b"}),
    ("resnet50", {"layer1.0.conv3.w", "layer1.0.downsample.0.w", "layer4.2.bn3.scale"}),
    ("mobilenet_v2", {"features.0.0.w", "features.0.1.scale", "features.1.conv.0.0.w",
                      "features.1.conv.1.w", "features.1.conv.2.scale", "features.2.conv.0.0.w",
                      "features.2.conv.1.0.w", "features.2.conv.2.w", "features.2.conv.3.bias",
                      "features.18.0.w", "classifier.1.w"}),
])
def test_torchvision_module_names(name, expected):
    params, state = _abstract_init(models.get(name), models.default_input_shape(name))
    names = _flat_names(params)
    assert expected <= names
    assert not any(".relu" in n or "dropout" in n for n in names)   # no stray stateless keys
    if name in ("vgg16_bn", "resnet18", "resnet50", "mobilenet_v2"):
        assert {n.rsplit(".", 1)[1] for n in _flat_names(state)} == {"mean", "var", "count"}
    else:
        assert state == {}


def test_resnet_blocks_downsample_only_when_the_shape_changes():
    params, _ = _abstract_init(models.get("resnet18"), (1, 224, 224, 3))
    assert "downsample" not in params["layer1"]["0"]
    assert all("downsample" in params[f"layer{i}"]["0"] for i in (2, 3, 4))
    assert all("downsample" not in params[f"layer{i}"]["1"] for i in (1, 2, 3, 4))
    params, _ = _abstract_init(models.get("resnet50"), (1, 224, 224, 3))
    assert params["layer1"]["0"]["downsample"]["0"]["w"].shape == (1, 1, 64, 256)
    assert params["layer2"]["0"]["conv2"]["w"].shape == (3, 3, 128, 128)   # v1.5 stride here


def test_mobilenet_uses_depthwise_convolutions():
    params, _ = _abstract_init(models.get("mobilenet_v2"), (1, 224, 224, 3))
    assert params["features"]["2"]["conv"]["1"]["0"]["w"].shape == (3, 3, 1, 96)


def _random_variables(params, state, seed=0):
    """Random values for an abstract ``(params, state)``, made with NumPy:
    compiling ``model.init`` costs far more CPU time than the forward passes
    under test (XLA compiles every random draw), and ``init`` is not what these
    tests are about.  Weights are scaled by 1/sqrt(fan-in) to keep activations O(1).
    Each leaf is made in its dtype by NumPy and put on the device as it is: converting a float64
    array in JAX (``jnp.asarray(x, dtype)``), or ``jnp.asarray`` of any array under jax 0.11,
    compiles one small program per leaf shape (43 for MobileNetV2)."""
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        name = path[-1].key
        if name == "count":
            return jax.device_put(np.zeros(leaf.shape, leaf.dtype))
        if name in ("scale", "var"):
            return jax.device_put(np.asarray(1 + 0.1 * rng.random(leaf.shape), leaf.dtype))
        fan_in = math.prod(leaf.shape[:-1]) if len(leaf.shape) > 1 else 100
        return jax.device_put(np.asarray(rng.standard_normal(leaf.shape) / math.sqrt(fan_in), leaf.dtype))

    return tuple(jax.tree_util.tree_map_with_path(fill, tree) for tree in (params, state))


# Small but complete forward passes: (name, options, input shape).  VGG-11 and ResNet-34 only
# repeat the layers of VGG-16 and ResNet-18 (its basic blocks; ResNeXt-50 has the 7x7 stem and
# max-pool) in other numbers: they run in the slow run (-m slow), 9 and 28 s each on 2 busy cores.
# So do VGG-16, whose every layer VGG-16-BN runs too (the same builder and configuration, with
# BatchNorm added; dropout checked there), and ResNet-50, whose stem, max-pool and bottlenecks
# ResNeXt-50 32x4d runs too (the same builder, the 3x3 convolutions grouped).
JIT_CASES = [
    ("mnist_cnn", {}, (2, 28, 28, 1)),
    ("lenet5", {"activation": "tanh", "pooling": "avg"}, (2, 28, 28, 1)),
    ("alexnet", {"num_classes": 10, "classifier_width": 32}, (2, 64, 64, 3)),
    pytest.param("vgg11", {"num_classes": 10, "classifier_width": 32}, (2, 32, 32, 3),
                 marks=pytest.mark.slow),
    pytest.param("vgg16", {"num_classes": 10, "classifier_width": 32}, (2, 32, 32, 3),
                 marks=pytest.mark.slow),
    ("vgg16_bn", {"num_classes": 10, "classifier_width": 32}, (2, 32, 32, 3)),
    ("resnet18", {"num_classes": 10, "cifar_stem": True}, (2, 32, 32, 3)),
    pytest.param("resnet34", {"num_classes": 10}, (2, 32, 32, 3), marks=pytest.mark.slow),
    pytest.param("resnet50", {"num_classes": 10}, (2, 32, 32, 3), marks=pytest.mark.slow),
    ("resnext50_32x4d", {"num_classes": 10}, (2, 32, 32, 3)),   # grouped 3x3 convolutions
    ("mobilenet_v2", {"num_classes": 10}, (2, 32, 32, 3)),
]


@pytest.mark.parametrize("name, options, shape", JIT_CASES,
                         ids=[(c.values if hasattr(c, "values") else c)[0] for c in JIT_CASES])
def test_jitted_eval_and_train_forward(name, options, shape):
    model = models.get(name, **options)
    params, state = _random_variables(*_abstract_init(model, shape))
    x = jax.random.normal(jax.random.PRNGKey(2), shape)

    @jax.jit
    def both(params, state, x, rngs):        # one compilation for both modes
        y_eval, s_eval = model.apply(params, state, x)
        y_train, s_train = jax.vmap(
            lambda r: model.apply(params, state, x, train=True, rng=r))(rngs)
        return y_eval, s_eval, y_train, s_train

    y_eval, s_eval, y_trains, s_trains = both(params, state, x,
                                              jax.random.split(jax.random.PRNGKey(3), 2))
    # the first rng's statistics, taken in NumPy (indexing each leaf in JAX compiled a slice and
    # a squeeze per leaf shape)
    (y_train, y_train2), s_train = y_trains, jax.tree_util.tree_map(lambda a: np.asarray(a)[0], s_trains)
    n_classes = options.get("num_classes", 10)
    for y in (y_eval, y_train):
        assert y.shape == (shape[0], n_classes) and y.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(y)))
    assert jax.tree_util.tree_structure(s_eval) == jax.tree_util.tree_structure(state)
    assert jax.tree_util.tree_structure(s_train) == jax.tree_util.tree_structure(state)
    for old, new in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(s_eval)):
        np.testing.assert_array_equal(old, new)          # eval never touches the statistics
    counts = [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(s_train)[0]
              if path[-1].key == "count"]
    assert all(int(c) == 1 for c in counts)              # one training step recorded per BN
    has_dropout = name in ("mnist_cnn", "alexnet", "vgg11", "vgg16", "vgg16_bn", "mobilenet_v2")
    if has_dropout:     # dropout depends on the rng; without dropout or BN, train == eval
        assert not np.allclose(y_train, y_train2)
    if not counts and not has_dropout:
        np.testing.assert_allclose(y_train, y_eval, rtol=1e-6)
