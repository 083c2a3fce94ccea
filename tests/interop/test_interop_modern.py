"""MobileNetV3, EfficientNet-B0 and ConvNeXt-T against their hand-written
PyTorch twins (``torch_zoo_modern``, torchvision's module names; random
weights, LayerNorm affines and layer scales included):

* eval mode: logits after ``from_torch_state_dict`` equal the twin's;
* train mode, with dropout and stochastic depth off (``p=0`` in both, so no
  random mask has to be matched): logits (BatchNorm on batch statistics)
  and the updated running statistics and ``num_batches_tracked`` equal the
  twin's after one forward pass;
* ``to_torch_state_dict`` gives back the twin's state dict exactly, in its key
  order, and the twin loads it with ``strict=True``.

Tolerance: float32, max |ours - torch| <= 1e-4 * max |torch| (+1e-4 relative
per element) for logits, 1e-4 relative for the running statistics.  Stochastic
depth with a matched mask is checked on a ConvNeXt block in
``tests/models/test_models_modern.py``.
"""
import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import torch_zoo  # noqa: E402  (needs torch)
import torch_zoo_modern  # noqa: E402

from jaxcnn import models  # noqa: E402
from jaxcnn.interop import from_torch_state_dict, to_torch_state_dict  # noqa: E402

RTOL = 1e-4
# The heavier twins run in the slow suite; MobileNetV3-Small (hard-swish,
# hard-sigmoid SE, BatchNorm) and ConvNeXt-T (LayerNorm, GELU, layer scale)
# represent them in the default run.
SLOW = {"mobilenet_v3_large", "efficientnet_b0"}


def _close(ours, theirs, what):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    scale = np.abs(theirs).max()
    assert scale > 1e-3, what        # a dead network would compare equal trivially
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=RTOL * scale, err_msg=what)


@pytest.mark.parametrize("case", [
    pytest.param(c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else [])
    for c in torch_zoo_modern.CASES])
def test_eval_and_train_logits_and_state_dict_match_pytorch(case):
    name, options, shape = case
    options = {**options, **torch_zoo_modern.NO_DROP[name]}
    net = torch_zoo.randomize_(torch_zoo.build(name, **options)).eval()
    sd = {k: v.clone() for k, v in net.state_dict().items()}
    params, state = from_torch_state_dict(name, sd, **options)
    model = models.get(name, **options)

    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    y_eval, y_train, new_state = torch_zoo.both_modes(model, params, state, x)
    xt = torch.from_numpy(x.transpose(0, 3, 1, 2))
    with torch.no_grad():
        _close(y_eval, net(xt).numpy(), f"{name} eval logits")
        trained = copy.deepcopy(net).train()
        _close(y_train, trained(xt).numpy(), f"{name} train logits")
    after = trained.state_dict()
    ours_after = to_torch_state_dict(name, params, new_state, **options)
    buffers = [k for k in after if k.endswith(("running_mean", "running_var"))]
    assert bool(buffers) == name.startswith(("mobilenet", "efficientnet"))
    for key in buffers:
        np.testing.assert_allclose(ours_after[key].numpy(), after[key].numpy(), rtol=RTOL,
                                   atol=RTOL, err_msg=key)
    for key in (k for k in after if k.endswith("num_batches_tracked")):
        assert int(ours_after[key]) == int(after[key]) == int(sd[key]) + 1, key

    back = to_torch_state_dict(name, params, state, **options)
    assert list(back) == list(sd)          # same keys, in PyTorch's order
    for key, value in sd.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
    net.load_state_dict(back, strict=True)


def test_layer_scale_is_the_blocks_own_parameter():
    sd = torch_zoo.build("convnext_tiny").state_dict()
    params, _ = from_torch_state_dict("convnext_tiny", sd)
    keys = list(sd)
    # PyTorch lists a module's own parameter before its submodules' ones.
    assert keys.index("features.1.0.layer_scale") < keys.index("features.1.0.block.0.weight")
    assert tuple(sd["features.5.8.layer_scale"].shape) == (384, 1, 1)
    assert params["features"]["5"]["8"]["layer_scale"]["scale"].shape == (384,)
