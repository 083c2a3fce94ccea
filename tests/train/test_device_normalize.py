"""Throughput runs on synthetic data move uint8 bytes and normalise them in the train step."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcnn import models
from jaxcnn import precision as P
from jaxcnn.data import SyntheticSpec, synthetic_batch
from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD
from jaxcnn.train import _build, _data
from jaxcnn.train.config import load_config
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import device_normalize, make_train_step

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
SPEC = SyntheticSpec((8, 8, 3), 4)
NORM = (NOISE_MEAN, NOISE_STD)


def test_device_normalize_equals_the_host_float_batch():
    raw = synthetic_batch(SPEC, 5, seed=1, batch_size=6, image_dtype="uint8")
    host = synthetic_batch(SPEC, 5, seed=1, batch_size=6)  # float32, normalised on the host
    got = jax.jit(device_normalize, static_argnums=1)(raw["image"], NORM)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), host["image"], rtol=0, atol=2e-6)
    floats = jnp.asarray(host["image"])
    assert device_normalize(floats, NORM) is floats  # float images are used as given
    assert device_normalize(raw["image"], None) is raw["image"]


def test_train_step_on_bytes_matches_the_float_step():
    spec = SyntheticSpec((28, 28, 1), 4)
    model = models.get("lenet5", num_classes=4)
    tx = optax.sgd(0.1)
    state = create_train_state(model, tx, jax.random.PRNGKey(0), (6, 28, 28, 1),
                               loss_scale=P.make_loss_scale("none"))
    raw = synthetic_batch(spec, 0, seed=2, batch_size=6, image_dtype="uint8")
    host = synthetic_batch(spec, 0, seed=2, batch_size=6)
    _, on_bytes = jax.jit(make_train_step(model, tx, image_norm=NORM).step)(state, raw)
    _, on_floats = jax.jit(make_train_step(model, tx).step)(state, host)
    np.testing.assert_allclose(on_bytes["loss"], on_floats["loss"], rtol=1e-5)
    np.testing.assert_allclose(on_bytes["grad_norm"], on_floats["grad_norm"], rtol=1e-4)


def test_on_the_fly_synthetic_batches_are_bytes(monkeypatch):
    monkeypatch.setattr(_data, "_SYNTHETIC_IN_MEMORY_BYTES", 0)  # force per-step generation
    cfg = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"), [
        "data.source=synthetic", "data.image_size=[8,8,3]", "data.num_classes=4",
        "model.num_classes=4", "data.batch_size=4", "data.augment.crop_padding=0"])  # noise: never augmented
    run = _build.build_run(cfg)
    assert run.dataset is None and run.synthetic is not None
    batch = _data.batch_fn(run)(0)
    assert batch["image"].dtype == np.uint8 and batch["image"].shape == (4, 8, 8, 3)
