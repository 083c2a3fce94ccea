"""The PyTorch name/layout mapping without PyTorch (runs on every venv):
layouts checked against NumPy re-implementations of the PyTorch ops, exact
round trips, and errors that name the offending key."""
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn import models
from jaxcnn.interop import from_torch_state_dict, to_torch_state_dict


def _numpy_state_dict(name, seed=0, **options):
    """A random PyTorch-layout state dict for zoo model ``name``, as NumPy
    arrays; shapes come from the mapping itself (checked elsewhere against
    real PyTorch modules)."""
    model = models.get(name, **options)
    template = jax.eval_shape(lambda k: model.init(k, models.default_input_shape(name))[:2],
                              jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)
    params, state = jax.tree_util.tree_map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), template)
    sd = to_torch_state_dict(name, params, state, **options)
    return {k: np.asarray(v) for k, v in sd.items()}


def test_importing_interop_does_not_import_torch():
    code = "import sys, jaxcnn.interop, jaxcnn.models; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_first_linear_after_flatten_takes_nchw_order():
    sd = _numpy_state_dict("mnist_cnn")
    params, _ = from_torch_state_dict("mnist_cnn", sd)
    w_torch = sd["fc1.weight"]                         # (128, 64*12*12), NCHW flatten order
    x = np.random.default_rng(1).standard_normal((12, 12, 64)).astype(np.float32)   # HWC
    expected = w_torch @ x.transpose(2, 0, 1).reshape(-1)          # what PyTorch computes
    got = x.reshape(-1) @ np.asarray(params["fc1"]["w"])           # what we compute (NHWC)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Later linear layers are a plain transpose.
    np.testing.assert_array_equal(np.asarray(params["fc2"]["w"]), sd["fc2.weight"].T)


def test_conv_layouts():
    sd = _numpy_state_dict("mobilenet_v2", width_mult=0.5)
    params, state = from_torch_state_dict("mobilenet_v2", sd, width_mult=0.5)
    w = sd["features.2.conv.1.0.weight"]                 # depthwise: (C, 1, 3, 3)
    np.testing.assert_array_equal(params["features"]["2"]["conv"]["1"]["0"]["w"],
                                  w.transpose(2, 3, 1, 0))
    np.testing.assert_array_equal(state["features"]["0"]["1"]["var"],
                                  sd["features.0.1.running_var"])
    assert state["features"]["0"]["1"]["count"].dtype == np.int32


def test_conv_transpose_layout_and_custom_layer_model():
    model = L.serial(("up", L.ConvTranspose2D(6, 3, stride=2, groups=2)), ("bn", L.BatchNorm()),
                     ("pool", L.GlobalAvgPool2D()), ("head", L.Linear(3)))
    rng = np.random.default_rng(0)
    sd = {"up.weight": rng.standard_normal((4, 3, 3, 3)).astype(np.float32),  # (I, O/g, kh, kw)
          "up.bias": rng.standard_normal(6).astype(np.float32),
          "bn.weight": np.ones(6, np.float32), "bn.bias": np.zeros(6, np.float32),
          "bn.running_mean": np.zeros(6, np.float32), "bn.running_var": np.ones(6, np.float32),
          "bn.num_batches_tracked": np.asarray(3, np.int64),
          "head.weight": rng.standard_normal((3, 6)).astype(np.float32),
          "head.bias": np.zeros(3, np.float32)}
    params, state = from_torch_state_dict(model, sd, input_shape=(1, 5, 5, 4))
    np.testing.assert_array_equal(params["up"]["w"], sd["up.weight"].transpose(2, 3, 0, 1))
    assert int(state["bn"]["count"]) == 3
    back = to_torch_state_dict(model, params, state, input_shape=(1, 5, 5, 4))
    assert list(back) == list(sd)
    for k in sd:
        np.testing.assert_array_equal(np.asarray(back[k]), sd[k])


@pytest.mark.parametrize("name, options", [
    ("alexnet", {"classifier_width": 16}), ("vgg16_bn", {"classifier_width": 16}),
    ("resnet18", {}), ("lenet5", {})])
def test_round_trip_is_exact(name, options):
    sd = _numpy_state_dict(name, **options)
    back = to_torch_state_dict(name, *from_torch_state_dict(name, sd, **options), **options)
    assert list(back) == list(sd)
    for k, v in sd.items():
        got = np.asarray(back[k])
        assert got.dtype == v.dtype and np.array_equal(got, v), k


def test_state_dict_errors_name_keys_and_shapes():
    sd = _numpy_state_dict("lenet5")
    missing = {k: v for k, v in sd.items() if k != "conv2.bias"}
    with pytest.raises(ValueError, match=r"lenet5: .*missing key 'conv2.bias' "
                                         r"\(the model's shape \(16,\)\)"):
        from_torch_state_dict("lenet5", missing)
    extra = dict(sd, **{"fc4.weight": np.zeros((2, 2))})
    with pytest.raises(ValueError, match=r"unexpected key 'fc4.weight' \(shape \(2, 2\)\)"):
        from_torch_state_dict("lenet5", extra)
    wrong = dict(sd, **{"fc1.weight": np.zeros((120, 401), np.float32)})
    with pytest.raises(ValueError, match=r"key 'fc1.weight' has shape \(120, 401\), "
                                         r"the model's is \(120, 400\)"):
        from_torch_state_dict("lenet5", wrong)
    with pytest.raises(ValueError, match="missing key 'fc3.weight'"):
        from_torch_state_dict("lenet5", {k: v for k, v in sd.items() if "fc3" not in k})
    with pytest.raises(ValueError, match=r"key 'fc3.weight' has shape \(10, 84\), "
                                         r"the model's is \(7, 84\)"):
        from_torch_state_dict("lenet5", sd, num_classes=7)


def test_params_errors_name_paths():
    params, state = from_torch_state_dict("lenet5", _numpy_state_dict("lenet5"))
    bad = {**params, "fc1": {"w": params["fc1"]["w"]}}
    with pytest.raises(ValueError, match="missing params 'fc1.b'"):
        to_torch_state_dict("lenet5", bad, state)
    bad = {**params, "extra": {"w": np.zeros(1)}}
    with pytest.raises(ValueError, match="unexpected params 'extra.w'"):
        to_torch_state_dict("lenet5", bad, state)
    bad = {**params, "fc2": {"w": params["fc2"]["w"][:5], "b": params["fc2"]["b"]}}
    with pytest.raises(ValueError,
                       match=r"params 'fc2.w' has shape \(5, 84\), expected \(120, 84\)"):
        to_torch_state_dict("lenet5", bad, state)
    with pytest.raises(ValueError, match="unknown model"):
        to_torch_state_dict("lenet6", params, state)
    with pytest.raises(ValueError, match="needs input_shape"):
        to_torch_state_dict(models.get("lenet5"), params, state)


@pytest.mark.parametrize("name, options, head", [
    ("resnet18", {"cifar_stem": True}, "fc"), ("vgg11_bn", {"classifier_width": 16}, "classifier.6"),
    ("mnist_cnn", {}, "fc2")])
def test_num_classes_is_inferred_from_the_head(name, options, head):
    sd = _numpy_state_dict(name, num_classes=7, **options)
    params, state = from_torch_state_dict(name, sd, **options)     # no num_classes given
    w = params
    for part in head.split("."):
        w = w[part]
    assert w["w"].shape[1] == 7 and w["b"].shape == (7,)
    back = to_torch_state_dict(name, params, state, num_classes=7, **options)
    assert list(back) == list(sd) and all(np.array_equal(np.asarray(back[k]), sd[k]) for k in sd)
    # A num_classes given is obeyed: a head of another size is an error naming both shapes.
    with pytest.raises(ValueError, match=rf"key '{head}.weight' has shape \(7, \d+\), "
                                         rf"the model's is \(5, \d+\)"):
        from_torch_state_dict(name, sd, num_classes=5, **options)


def test_num_batches_tracked_may_be_left_out():
    sd = _numpy_state_dict("resnet18", num_classes=10)
    counters = [k for k in sd if k.endswith("num_batches_tracked")]
    assert len(counters) == 20
    for dropped in (counters, counters[::2]):              # all of them, or some
        kept = {k: v for k, v in sd.items() if k not in dropped}
        params, state = from_torch_state_dict("resnet18", kept)
        back = to_torch_state_dict("resnet18", params, state, num_classes=10)
        assert list(back) == list(sd)
        for k, v in sd.items():            # a left-out counter starts at 0, as in PyTorch
            np.testing.assert_array_equal(np.asarray(back[k]), 0 if k in dropped else v, err_msg=k)
    # Only the counters may be left out.
    with pytest.raises(ValueError, match=r"missing key 'bn1.running_mean' \(the model's shape \(64,\)\)$"):
        from_torch_state_dict("resnet18", {k: v for k, v in sd.items() if k != "bn1.running_mean"})


def test_every_mismatched_key_is_named_with_both_shapes():
    sd = _numpy_state_dict("resnet18")
    sd["layer2.0.conv1.weight"] = np.zeros((128, 64, 3, 1), np.float32)
    sd["layer3.1.bn2.running_var"] = np.zeros((255,), np.float32)
    with pytest.raises(ValueError) as info:
        from_torch_state_dict("resnet18", sd)
    message = str(info.value)
    assert "\n" not in message and message.startswith("resnet18: ")
    assert ("key 'layer2.0.conv1.weight' has shape (128, 64, 3, 1), the model's is "
            "(128, 64, 3, 3)") in message
    assert "key 'layer3.1.bn2.running_var' has shape (255,), the model's is (256,)" in message


def _problems(message, sort):
    """The keys a mismatch message names as ``sort`` ("missing key", ...) and its "and N more"."""
    import re
    named = re.findall(rf"(?:: |; ){sort} '([^']+)'", message)
    more = re.search(rf"; and (\d+) more {sort.split()[0]}", message)
    return named, int(more.group(1)) if more else 0


def test_another_models_state_dict_is_a_short_line_naming_real_keys():
    """resnet18's keys into resnet34 (and back) named every key: a 13 KB line.  Now the first
    three of each sort, then how many more, all in one line under 1,000 characters."""
    sd18, sd34 = _numpy_state_dict("resnet18"), _numpy_state_dict("resnet34")
    for given, model, sort, wrong in [
            (sd18, "resnet34", "missing key",  # a missing counter is no problem (it reads as 0)
             sorted(k for k in set(sd34) - set(sd18) if not k.endswith("num_batches_tracked"))),
            (sd34, "resnet18", "unexpected key", sorted(set(sd34) - set(sd18)))]:
        with pytest.raises(ValueError) as info:
            from_torch_state_dict(model, given)
        message = str(info.value)
        assert "\n" not in message and len(message) < 1000, len(message)
        assert message.startswith(f"{model}: state_dict does not match the model: {sort} '")
        named, more = _problems(message, sort)
        assert len(named) == 3 and set(named) <= set(wrong), named
        assert more == len(wrong) - 3 > 0
        assert "num_batches_tracked" not in message or sort == "unexpected key"
    # mis-shaped keys, together with one missing and one unexpected
    bad = dict(sd18)
    for k in [k for k in bad if k.endswith("running_var")]:
        bad[k] = np.zeros((1,), np.float32)
    bad["extra.weight"] = bad.pop("layer4.1.conv2.weight")
    with pytest.raises(ValueError) as info:
        from_torch_state_dict("resnet18", bad)
    message = str(info.value)
    assert len(message) < 1000
    assert _problems(message, "missing key") == (["layer4.1.conv2.weight"], 0)
    assert _problems(message, "unexpected key") == (["extra.weight"], 0)
    shaped = sorted(k for k in sd18 if k.endswith("running_var"))
    assert message.count("has shape (1,), the model's is (") == 3
    assert f"; and {len(shaped) - 3} more mis-shaped keys" in message
    assert "key 'bn1.running_var' has shape (1,), the model's is (64,)" in message
