"""Mesh construction and its configuration errors (plain ValueErrors naming the key, which the
trainer reports as ConfigErrors)."""
import jax
import pytest

from jaxcnn import parallel
from jaxcnn.train.config import ConfigError, config_from_dict
from jaxcnn.train._plan import parallel_config_errors


def test_minus_one_fills_the_data_axis():
    mesh = parallel.make_mesh(-1, 2)
    assert mesh.axis_names == ("data", "model")
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.devices.size == jax.device_count() == 8
    assert dict(parallel.make_mesh(-1, 1).shape) == {"data": 8, "model": 1}
    assert dict(parallel.make_mesh(2, 4).shape) == {"data": 2, "model": 4}


def test_mesh_over_a_subset_of_devices():
    mesh = parallel.make_mesh(-1, 1, devices=jax.devices()[:4])
    assert dict(mesh.shape) == {"data": 4, "model": 1}
    assert list(mesh.devices.reshape(-1)) == jax.devices()[:4]


@pytest.mark.parametrize("data,model,key,words", [
    (-1, 3, "mesh.model", "3 does not divide the 8"),
    (-1, 16, "mesh.model", "16 does not divide the 8"),
    (4, 4, "mesh.data", "4 x 4 = 16 devices, but 8"),
])
def test_sizes_that_do_not_fit_name_the_key(data, model, key, words):
    with pytest.raises(ValueError, match=f"^{key}: ") as err:
        parallel.make_mesh(data, model)
    assert words in str(err.value) and not isinstance(err.value, ConfigError)
    assert "\n" not in str(err.value)
    # Where the trainer calls parallel, the same message is a ConfigError naming the key.
    with pytest.raises(ConfigError, match=f"^{key}: ") as err, parallel_config_errors():
        parallel.make_mesh(data, model)
    assert words in str(err.value) and err.value.path == key
    assert "\n" not in str(err.value)


def test_only_setting_errors_become_config_errors():
    """By type, not by where they were raised or what their text says: a ValueError whose text
    looks like a key passes as it is; a SettingError from anywhere is named by its key."""
    from jaxcnn.errors import SettingError
    with pytest.raises(ValueError, match="mesh.model: elsewhere") as err, parallel_config_errors():
        raise ValueError("mesh.model: elsewhere")
    assert not isinstance(err.value, ConfigError)
    with pytest.raises(ConfigError, match=r"^parallel\.pipeline\.split: bad$") as err, parallel_config_errors():
        raise SettingError("pipeline.split", "bad")
    assert err.value.path == "parallel.pipeline.split"
    # the other arguments a message names are named by their keys too, whole words only
    error = SettingError("strategy", "not with fsdp=True (fsdp_x, mesh.fsdp)", mentions=("fsdp",))
    assert str(error) == "strategy: not with fsdp=True (fsdp_x, mesh.fsdp)"
    with pytest.raises(ConfigError) as err, parallel_config_errors():
        raise error
    assert str(err.value) == "parallel.strategy: not with parallel.fsdp=True (fsdp_x, mesh.fsdp)"


def test_explicit_sizes_may_use_the_first_devices():
    mesh = parallel.make_mesh(3, 2)
    assert dict(mesh.shape) == {"data": 3, "model": 2}
    assert list(mesh.devices.flat) == jax.devices()[:6]
    assert dict(parallel.make_mesh(1, 1).shape) == {"data": 1, "model": 1}


def test_global_batch_must_divide_over_data():
    mesh = parallel.make_mesh(-1, 2)
    parallel.check_batch(mesh, 12)
    with pytest.raises(ValueError, match=r"^batch_size: global batch 10 does not divide over the 4 "):
        parallel.check_batch(mesh, 10)
    with pytest.raises(ConfigError, match=r"^data.batch_size: global batch 10 does not divide") as err, \
            parallel_config_errors():
        parallel.check_batch(mesh, 10)
    assert err.value.path == "data.batch_size"


def test_mesh_from_config_and_default_strategy():
    cfg = config_from_dict({"model": {"name": "mnist_cnn"}, "train": {"steps": 1},
                            "data": {"source": "synthetic"}}, ["mesh.model=2"])
    assert cfg.parallel.strategy == "shard_map"
    from jaxcnn.train._plan import config_mesh
    assert dict(config_mesh(cfg).shape) == {"data": 4, "model": 2}


def test_pipe_and_spatial_axes_appear_only_when_asked_for():
    mesh = parallel.make_mesh(-1, 1, pipe=4)
    assert mesh.axis_names == ("data", "pipe", "model")
    assert dict(mesh.shape) == {"data": 2, "pipe": 4, "model": 1}
    mesh = parallel.make_mesh(2, 1, spatial=4)
    assert mesh.axis_names == ("data", "spatial", "model")
    assert parallel.axis_size(mesh, "spatial") == 4 and parallel.axis_size(mesh, "pipe") == 1
    mesh = parallel.make_mesh(-1, 2, pipe=2, spatial=2)
    assert dict(mesh.shape) == {"data": 1, "pipe": 2, "spatial": 2, "model": 2}
    assert parallel.make_mesh(-1, 1).axis_names == ("data", "model")


@pytest.mark.parametrize("kw,key,words", [
    (dict(data=-1, pipe=3), "mesh.pipe", "3 does not divide the 8"),
    (dict(data=-1, model=2, spatial=8), "mesh.spatial", "8 does not divide the 8 available devices (with"),
    (dict(data=4, pipe=4), "mesh.data", "data x pipe x model = 4 x 4 x 1 = 16 devices, but 8"),
])
def test_pipe_and_spatial_sizes_that_do_not_fit_name_the_key(kw, key, words):
    with pytest.raises(ValueError, match=f"^{key}: ") as err:
        parallel.make_mesh(**kw)
    assert words in str(err.value), str(err.value)
