"""The deeper, wide and grouped ResNets and the VGG-11/13/19 variants against
their hand-written PyTorch twins (``torch_zoo``, torchvision's module names),
in eval and in train mode, with the same random weights.

Per case, one compilation runs both modes.  Checked: the parameter count; eval
logits; train-mode logits (BatchNorm on batch statistics; dropout off on both
sides, rate 0, since the two frameworks draw different masks) and the running
statistics that one training step leaves (momentum 0.1, unbiased variance,
counter + 1); the exact ``to_torch_state_dict`` round trip in PyTorch's key
order, loaded with ``strict=True``.  Tolerances, float32, relative to the
output's scale (max |ours - torch| <= rtol * max |torch|): eval logits 1e-4
(measured <= 1e-6); train logits and the running statistics (made from
train-mode activations) 1e-4 for the VGGs (measured <= 2e-5), looser for the
ResNets: in train mode every BatchNorm divides by a standard deviation of few
values (8 per channel in ``layer4``), and with random weights the float32
rounding differences grow block after block.  Measured train-mode logit
errors: ResNeXt-50 5.9e-5 and Wide ResNet-50 8.5e-5 (3e-4 allowed), ResNet-101
3.8e-4 (1e-3), ResNet-152 1.4e-3 (5e-3), while the same ResNet-152 comparison
in float64 on both sides agrees to 2.6e-12: the gap is rounding, not a
difference in what is computed.

Inputs are tiny (batch 2, 32x32 for VGG, 64x64 for ResNets so that ``layer4``'s
BatchNorm still sees 2x2x2 values per channel in train mode).  The default run
keeps one representative per new code path: ResNeXt-50 32x4d (grouped and
resized bottlenecks; ResNet-101/152 only repeat ResNet-50's bottleneck, Wide
ResNet only resizes it) and two BatchNorm VGGs, VGG-11-BN and VGG-19-BN
(VGG-13/19 without BatchNorm share their configurations; VGG-13-BN's
configuration B has only two-conv stages, which VGG-11-BN and VGG-19-BN both
have, and its parameter count is checked against the twin in
test_interop_torch.py); the others, 3 to 28 s of CPU each, run with
``-m slow``.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_zoo  # noqa: E402  (needs torch)

from jaxcnn.interop import from_torch_state_dict, to_torch_state_dict  # noqa: E402

RTOL = 1e-4
VGG = {"num_classes": 10, "classifier_width": 64, "dropout": 0.0}
RESNET = {"num_classes": 10}
CASES = [
    # (name, options, NHWC input, train-mode rtol, slow)
    ("vgg11_bn", VGG, (2, 32, 32, 3), 1e-4, False),
    ("vgg13", VGG, (2, 32, 32, 3), 1e-4, True),
    ("vgg13_bn", VGG, (2, 32, 32, 3), 1e-4, True),
    ("vgg19", VGG, (2, 32, 32, 3), 1e-4, True),
    ("vgg19_bn", VGG, (2, 32, 32, 3), 1e-4, False),
    ("resnext50_32x4d", RESNET, (2, 64, 64, 3), 3e-4, False),
    ("wide_resnet50_2", RESNET, (2, 64, 64, 3), 3e-4, True),
    ("resnet101", RESNET, (2, 64, 64, 3), 1e-3, True),
    ("resnet152", RESNET, (2, 64, 64, 3), 5e-3, True),
]
NAMES = [c[0] for c in CASES]


def _close(ours, theirs, what, rtol=RTOL):
    scale = float(np.abs(theirs).max())
    assert scale > 1e-3, what           # a dead network would compare equal trivially
    err = float(np.abs(np.asarray(ours) - theirs).max())
    assert err <= rtol * scale, f"{what}: max error {err:g} vs scale {scale:g}"


@pytest.mark.parametrize("name, options, shape, train_rtol", [
    pytest.param(*c[:4], id=c[0], marks=[pytest.mark.slow] if c[4] else []) for c in CASES])
def test_eval_and_train_logits_and_state_dict_match_pytorch(name, options, shape, train_rtol):
    net, sd, params, state, model = torch_zoo.twin_and_ours(name, seed=1, **options)
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    y_eval, y_train, new_state = torch_zoo.both_modes(model, params, state, x)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2))
    trained = copy.deepcopy(net).train()
    with torch.no_grad():
        _close(y_eval, net(xt).numpy(), "eval logits")
        _close(y_train, trained(xt).numpy(), "train logits", train_rtol)

    # The statistics one training step leaves, in PyTorch's names.
    after = to_torch_state_dict(name, params, new_state, **options)
    for key, value in trained.state_dict().items():
        if key.endswith("num_batches_tracked"):
            assert int(after[key]) == int(sd[key]) + 1 == int(value), key
        elif "running_" in key:
            np.testing.assert_allclose(after[key].numpy(), value.numpy(), rtol=train_rtol,
                                       atol=train_rtol * float(value.abs().max()), err_msg=key)
    assert any("running_" in k for k in after) == name.endswith(("_bn", "resnet50_2", "32x4d",
                                                                 "resnet101", "resnet152"))

    back = to_torch_state_dict(name, params, state, **options)
    assert list(back) == list(sd)           # same keys, in PyTorch's order
    for key, value in sd.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    fresh = torch_zoo.build(name, **options)
    fresh.load_state_dict(back, strict=True)


def test_state_dict_without_counters_loads_as_in_pytorch():
    # PyTorch's load_state_dict accepts a state dict without num_batches_tracked and
    # leaves those counters at a fresh module's 0; from_torch_state_dict does the same,
    # and infers the 10 classes from fc.weight.  (ResNet-18: the counters and the head are
    # the same in every ResNet, at less than half of ResNeXt-50's cost to build and fill.)
    net = torch_zoo.randomize_(torch_zoo.build("resnet18", num_classes=10), seed=2)
    sd = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    fresh = torch_zoo.build("resnet18", num_classes=10)
    fresh.load_state_dict(sd, strict=True)
    params, state = from_torch_state_dict("resnet18", sd, input_shape=(1, 32, 32, 3))
    back = to_torch_state_dict("resnet18", params, state, num_classes=10)
    expected = fresh.state_dict()
    assert list(back) == list(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value), key
