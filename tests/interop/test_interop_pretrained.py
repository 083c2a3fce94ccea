"""What pretrained PyTorch state dicts need from the mapping (no torch needed): no
``num_batches_tracked``, the class count read from the head, layers skipped, and the same
from a safetensors file whose header is checked before any tensor is read."""
import jax
import numpy as np
import pytest
import safetensors.numpy

from jaxcnn import interop, models
from jaxcnn.interop import from_torch_state_dict, load_torch_safetensors, match_state_dict


def _state_dict(name, **options):
    model = models.get(name, **options)
    template = jax.eval_shape(lambda k: model.init(k, models.default_input_shape(name))[:2],
                              jax.random.PRNGKey(0))
    rng = np.random.default_rng(1)
    params, state = jax.tree_util.tree_map(
        lambda s: rng.standard_normal(s.shape).astype(s.dtype), template)
    return {k: np.asarray(v) for k, v in
            interop.to_torch_state_dict(name, params, state, **options).items()}


def test_num_batches_tracked_may_be_left_out():
    sd = _state_dict("resnet18", num_classes=7)
    slim = {k: v for k, v in sd.items() if not k.endswith("num_batches_tracked")}
    assert len(slim) < len(sd)
    params, state = from_torch_state_dict("resnet18", slim, num_classes=7)
    assert np.asarray(state["bn1"]["count"]) == 0
    np.testing.assert_array_equal(np.asarray(state["bn1"]["mean"]), sd["bn1.running_mean"])
    np.testing.assert_array_equal(np.asarray(params["fc"]["w"]), sd["fc.weight"].T)


def test_num_classes_is_read_from_the_head():
    sd = _state_dict("lenet5", num_classes=7)
    params, _ = from_torch_state_dict("lenet5", sd)      # lenet5's default is 10
    assert params["fc3"]["w"].shape == (84, 7)
    np.testing.assert_array_equal(np.asarray(params["fc3"]["w"]), sd["fc3.weight"].T)


def test_skip_leaves_layers_out_in_either_naming():
    sd = _state_dict("lenet5")
    for skip in (["fc3"], ["fc3.weight", "fc3.bias"], ["fc3.w", "fc3.b"]):
        wrong_head = dict(sd, **{"fc3.weight": np.zeros((1000, 84), np.float32),
                                 "fc3.bias": np.zeros((1000,), np.float32)})
        params, _ = from_torch_state_dict("lenet5", wrong_head, skip=skip, num_classes=10)
        assert "fc3" not in params and set(params) == {"conv1", "conv2", "fc1", "fc2"}
        np.testing.assert_array_equal(np.asarray(params["fc2"]["b"]), sd["fc2.bias"])
    with pytest.raises(ValueError, match=r"skip \['fc9'\] names no layer"):
        match_state_dict("lenet5", {k: v.shape for k, v in sd.items()}, skip=["fc9"])


def test_safetensors_header_checked_before_reading(tmp_path):
    sd = _state_dict("lenet5")
    path = str(tmp_path / "lenet.safetensors")
    safetensors.numpy.save_file(sd, path)
    params, _ = load_torch_safetensors(path, "lenet5")
    assert isinstance(params["conv1"]["w"], np.ndarray)
    np.testing.assert_array_equal(params["conv1"]["w"], sd["conv1.weight"].transpose(2, 3, 1, 0))
    with pytest.raises(ValueError, match=rf"{path}: lenet5: .*key 'fc3.weight' has shape "
                                         r"\(10, 84\), the model's is \(5, 84\)"):
        load_torch_safetensors(path, "lenet5", num_classes=5)
