"""Synthetic data: determinism from (seed, step), process shares, value ranges."""
import numpy as np
import pytest

from jaxcnn.data import SyntheticSpec, load_dataset, synthetic_batch, synthetic_dataset, train_batch
from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD

SPEC = SyntheticSpec(image_shape=(9, 7, 3), num_classes=5)  # 189 bytes: not a multiple of 8


def test_deterministic_per_seed_and_step():
    a = synthetic_batch(SPEC, 4, seed=1, batch_size=6)
    b = synthetic_batch(SPEC, 4, seed=1, batch_size=6)
    for key in ("image", "label"):
        np.testing.assert_array_equal(a[key], b[key])
    assert not np.array_equal(a["image"], synthetic_batch(SPEC, 5, seed=1, batch_size=6)["image"])
    assert not np.array_equal(a["image"], synthetic_batch(SPEC, 4, seed=2, batch_size=6)["image"])
    assert a["image"].shape == (6, 9, 7, 3) and a["image"].dtype == np.float32
    assert a["label"].dtype == np.int32 and a["label"].min() >= 0 and a["label"].max() < 5


def test_process_shares_partition_the_global_batch():
    whole = synthetic_batch(SPEC, 2, seed=3, batch_size=12, image_dtype="uint8")
    shares = [synthetic_batch(SPEC, 2, seed=3, batch_size=12, process_index=i, process_count=3, image_dtype="uint8")
              for i in range(3)]
    for key in ("image", "label"):
        np.testing.assert_array_equal(np.concatenate([s[key] for s in shares]), whole[key])
    with pytest.raises(ValueError, match="not divisible"):
        synthetic_batch(SPEC, 2, seed=3, batch_size=12, process_count=5)


def test_float_images_are_normalised_noise():
    spec = SyntheticSpec(image_shape=(32, 32, 3), num_classes=1000)
    raw = synthetic_batch(spec, 0, seed=0, batch_size=16, image_dtype="uint8")["image"]
    images = synthetic_batch(spec, 0, seed=0, batch_size=16)["image"]
    np.testing.assert_allclose(images, (raw / 255 - NOISE_MEAN) / NOISE_STD, rtol=1e-5, atol=1e-5)
    assert abs(images.mean()) < 0.05 and abs(images.std() - 1) < 0.05
    assert np.bincount(raw.ravel(), minlength=256).min() > 0  # every byte value occurs: uniform noise
    with pytest.raises(ValueError, match="image_dtype must be"):
        synthetic_batch(spec, 0, seed=0, batch_size=2, image_dtype="int8")


def test_imagenet_shaped_default():
    batch = synthetic_batch(SyntheticSpec(), 0, seed=0, batch_size=2, image_dtype="uint8")
    assert batch["image"].shape == (2, 224, 224, 3) and batch["label"].max() < 1000


def test_materialised_dataset_runs_through_train_batch():
    dataset = synthetic_dataset(SPEC, num_train=10, num_test=3, seed=4)
    again = load_dataset("synthetic", image_shape=[9, 7, 3], num_classes=5, num_train=10, num_test=3, seed=4)
    np.testing.assert_array_equal(dataset.x_train, again.x_train)
    assert dataset.x_train.shape == (10, 9, 7, 3) and dataset.x_test.shape == (3, 9, 7, 3)
    assert not np.array_equal(dataset.x_train[:3], dataset.x_test)
    batch = train_batch(dataset, 0, seed=0, batch_size=4, augment=None)
    assert batch["image"].shape == (4, 9, 7, 3)
