"""PyTorch state-dict interop for every zoo model, checked against
hand-written PyTorch twins (``torch_zoo``): same parameter count, same
eval-mode logits after ``from_torch_state_dict`` (relative 1e-4, float32), and
an exact ``to_torch_state_dict`` round trip."""
import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_zoo  # noqa: E402  (needs torch)
import torch_zoo_modern  # noqa: E402

from jaxcnn import models  # noqa: E402
from jaxcnn.interop import from_torch_state_dict, to_torch_state_dict  # noqa: E402

# (name, options, NHWC input): small inputs, each case a few seconds on 2 cores.
CASES = [
    ("mnist_cnn", {}, (2, 28, 28, 1)),
    ("lenet5", {}, (2, 28, 28, 1)),
    ("lenet5", {"activation": "tanh", "pooling": "avg", "num_classes": 7}, (2, 28, 28, 1)),
    # AlexNet needs >= 63 px.  A narrow classifier keeps these fast; the
    # flatten-order permutation is exercised all the same (6x6 and 7x7 maps).
    ("alexnet", {"num_classes": 10, "classifier_width": 64}, (1, 64, 64, 3)),
    ("vgg11", {"num_classes": 10, "classifier_width": 64}, (1, 32, 32, 3)),
    ("vgg16", {"num_classes": 10, "classifier_width": 64}, (1, 32, 32, 3)),
    ("vgg16_bn", {"num_classes": 10, "classifier_width": 64}, (1, 32, 32, 3)),
    ("resnet18", {}, (2, 64, 64, 3)),
    ("resnet18", {"cifar_stem": True, "num_classes": 10}, (2, 32, 32, 3)),
    ("resnet34", {"num_classes": 10}, (1, 64, 64, 3)),
    ("resnet50", {"num_classes": 10}, (1, 64, 64, 3)),
    ("mobilenet_v2", {"num_classes": 10}, (2, 64, 64, 3)),
    ("mobilenet_v2", {"num_classes": 10, "width_mult": 0.5}, (1, 32, 32, 3)),
]
CASES += torch_zoo_modern.CASES     # MobileNetV3, EfficientNet-B0, ConvNeXt-T; train: *_modern.py


def _id(case):
    name, options, _ = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


def test_every_model_is_covered():
    # The newer ResNets and VGGs are checked in eval and train mode there.
    from test_interop_torch_classic import NAMES as CLASSIC
    assert {c[0] for c in CASES} | set(CLASSIC) == set(models.names())


@pytest.mark.parametrize("name", models.names())
def test_default_parameter_count_matches_pytorch(name):
    with torch.device("meta"):          # shapes only: no 138M-parameter allocation
        net = torch_zoo.build(name)
    model = models.get(name)
    params, _ = jax.eval_shape(lambda k: model.init(k, models.default_input_shape(name))[:2],
                               jax.random.PRNGKey(0))
    n_ours = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    assert n_ours == sum(p.numel() for p in net.parameters())


# In the slow run only (-m slow): MobileNetV3-Small and ConvNeXt-T are checked in the default run
# by test_interop_modern.py (the same inputs, eval and train logits, the exact round trip), and
# MobileNetV3-Large there through MobileNetV3-Small (the same builder, hard-swish, hard-sigmoid
# squeeze-excitation and BatchNorm; Large's own block forms, a stride-1 residual block without
# expansion or squeeze-excitation and ReLU blocks with it, are checked by name, shape and
# parameter count in tests/models/test_models_modern.py, their logits only in -m slow); ResNet-34 and VGG-11 only repeat the
# state-dict names of ResNet-18 and VGG-16 in other numbers.  The 64x64 ResNet-18 (7x7 stem,
# max-pool, basic blocks) is covered by ResNet-50 (the same stem and max-pool, at 64x64) and the
# CIFAR ResNet-18 (the same basic blocks); VGG-16-BN by VGG-16 (configuration D) and
# test_interop_torch_classic.py's BatchNorm VGGs (eval and train); the full-width MobileNetV2 by
# the half-width one (the same builder and module names, with channel rounding on top).
SLOW = {"mobilenet_v3_small", "convnext_tiny", "resnet34", "vgg11", "mobilenet_v3_large",
        "vgg16_bn"}
SLOW_CASES = {"resnet18", "mobilenet_v2-num_classes=10"}     # by id


def _slow(case):
    return case[0] in SLOW or _id(case) in SLOW_CASES


@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c), marks=[pytest.mark.slow] if _slow(c) else [])
                                  for c in CASES])
def test_logits_and_round_trip_match_pytorch(case):
    _check_against_pytorch(*case)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["alexnet", "vgg16_bn"])
def test_full_width_classifier_matches_pytorch(name):
    _check_against_pytorch(name, {}, (1, 64, 64, 3))


def _check_against_pytorch(name, options, shape):
    net, sd, params, state, model = torch_zoo.twin_and_ours(name, **options)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    ours, new_state = jax.jit(model.apply)(params, state, x)
    with torch.no_grad():
        theirs = net(torch.from_numpy(x.transpose(0, 3, 1, 2))).numpy()
    scale = np.abs(theirs).max()
    assert scale > 1e-3        # a dead network would compare equal trivially
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-4, atol=1e-4 * scale)

    back = to_torch_state_dict(name, params, state, **options)
    assert list(back) == list(sd)          # same keys, in PyTorch's order
    for key, value in sd.items():
        assert back[key].dtype == value.dtype, key
        assert torch.equal(back[key], value), key
    net.load_state_dict(back)              # strict: PyTorch accepts it as-is
