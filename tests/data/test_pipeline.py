"""Stateless batching: determinism, epoch coverage, process shares, normalisation, eval padding."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxcnn.data import (DataError, Dataset, batch_indices, channel_mean_std, eval_batches, normalize,
                         steps_per_epoch, train_batch)


@pytest.fixture(scope="module")
def dataset():
    rng = np.random.default_rng(7)
    x = rng.integers(0, 256, (40, 6, 5, 3), dtype=np.uint8)
    y = np.arange(40, dtype=np.int32) % 10  # label = index % 10 lets tests recover which example they got
    return Dataset(x, y, x[:13], y[:13], 10, "toy").with_stats()


def test_batch_is_a_pure_function_of_seed_and_step():
    first = batch_indices(100, 8, 3, 17)
    np.testing.assert_array_equal(first, batch_indices(100, 8, 3, 17))
    assert not np.array_equal(first, batch_indices(100, 8, 4, 17))
    # Step 17 and step 17 + steps_per_epoch sit at the same position of different epochs.
    assert not np.array_equal(first, batch_indices(100, 8, 3, 17 + steps_per_epoch(100, 8)))
    first[:] = -1  # callers may modify what they get without corrupting the cached permutation
    assert (batch_indices(100, 8, 3, 17) >= 0).all()


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 60), batch=st.integers(1, 16), seed=st.integers(0, 2**31), epoch=st.integers(0, 5))
def test_one_epoch_visits_each_example_once(n, batch, seed, epoch):
    per_epoch = steps_per_epoch(n, batch, drop_last=False)
    steps = range(epoch * per_epoch, (epoch + 1) * per_epoch)
    seen = np.concatenate([batch_indices(n, batch, seed, s, drop_last=False) for s in steps])
    np.testing.assert_array_equal(np.sort(seen), np.arange(n))
    if n >= batch:
        full = steps_per_epoch(n, batch)
        kept = np.concatenate([batch_indices(n, batch, seed, epoch * full + s) for s in range(full)])
        assert len(kept) == full * batch and len(np.unique(kept)) == len(kept)


def test_steps_per_epoch():
    assert steps_per_epoch(10, 3) == 3 and steps_per_epoch(10, 3, drop_last=False) == 4
    with pytest.raises(ValueError, match="5 examples make no full batch of 8"):
        steps_per_epoch(5, 8)
    with pytest.raises(ValueError, match="non-negative"):
        batch_indices(10, 2, 0, -1)


def test_train_batch_contents_and_normalisation(dataset):
    batch = train_batch(dataset, 5, seed=1, batch_size=8, augment=None)
    indices = batch_indices(40, 8, 1, 5)
    assert batch["image"].dtype == np.float32 and batch["image"].shape == (8, 6, 5, 3)
    assert batch["label"].dtype == np.int32
    np.testing.assert_array_equal(batch["label"], dataset.y_train[indices])
    expected = (dataset.x_train[indices].astype(np.float64) / 255 - dataset.mean) / dataset.std
    np.testing.assert_allclose(batch["image"], expected, rtol=1e-5, atol=1e-5)


def test_normalised_training_set_has_zero_mean_unit_std(dataset):
    mean, std = channel_mean_std(dataset.x_train)
    normalised = normalize(dataset.x_train, mean, std).astype(np.float64)
    np.testing.assert_allclose(normalised.mean(axis=(0, 1, 2)), 0, atol=1e-5)
    np.testing.assert_allclose(normalised.std(axis=(0, 1, 2)), 1, atol=1e-5)


def test_float_images_are_not_divided_by_255():
    x = np.full((2, 1, 1, 1), 0.75, np.float32)
    np.testing.assert_allclose(normalize(x, [0.5], [0.25]), 1.0)
    np.testing.assert_allclose(normalize((x * 255).astype(np.uint8), [0.5], [0.25]), (191 / 255 - 0.5) / 0.25,
                               rtol=1e-6)


@pytest.mark.parametrize("augment", [None, {"crop_padding": 2, "hflip": 0.5},
                                     {"crop_padding": 1, "hflip": 0.5, "vflip": 0.5, "scale": (0.3, 1),
                                      "ratio": (0.5, 2), "interpolation": "bicubic"}])
def test_process_shares_partition_the_global_batch(dataset, augment):
    whole = train_batch(dataset, 9, seed=2, batch_size=8, augment=augment)
    shares = [train_batch(dataset, 9, seed=2, batch_size=8, augment=augment, process_index=i, process_count=4)
              for i in range(4)]
    assert all(share["image"].shape[0] == 2 for share in shares)
    for key in ("image", "label"):
        np.testing.assert_array_equal(np.concatenate([share[key] for share in shares]), whole[key])


def test_indivisible_global_batch(dataset):
    with pytest.raises(ValueError, match="global batch size 10 is not divisible by process_count 4"):
        train_batch(dataset, 0, seed=0, batch_size=10, augment=None, process_index=0, process_count=4)
    with pytest.raises(ValueError, match=r"process_index 2 is not in \[0, process_count=2\)"):
        train_batch(dataset, 0, seed=0, batch_size=10, augment=None, process_index=2, process_count=2)


def test_dataset_without_stats(dataset):
    with pytest.raises(DataError, match="toy: dataset has no mean/std"):
        train_batch(dataset._replace(mean=None), 0, seed=0, batch_size=4, augment=None)


@pytest.mark.parametrize("batch_size, process_count", [(4, 1), (5, 1), (13, 1), (16, 1), (6, 2), (8, 4)])
def test_eval_batches_cover_everything_once_with_a_mask(dataset, batch_size, process_count):
    images, labels = dataset.x_test, dataset.y_test  # 13 examples
    num_batches = -(-13 // batch_size)
    per_process = [list(eval_batches(images, labels, batch_size, mean=dataset.mean, std=dataset.std,
                                     process_index=i, process_count=process_count)) for i in range(process_count)]
    assert all(len(batches) == num_batches for batches in per_process)
    # Reassemble the global batches from the shares, in order.
    glued = {key: np.concatenate([np.concatenate([per_process[p][b][key] for p in range(process_count)])
                                  for b in range(num_batches)]) for key in ("image", "label", "mask")}
    assert len(glued["mask"]) == num_batches * batch_size
    assert glued["mask"].sum() == 13 and glued["mask"][:13].all()
    np.testing.assert_array_equal(glued["label"][:13], labels)
    np.testing.assert_allclose(glued["image"][:13], normalize(images, dataset.mean, dataset.std))
    assert not glued["image"][13:].any() and not glued["label"][13:].any()
    assert glued["label"].dtype == np.int32 and glued["image"].dtype == np.float32


def test_eval_batches_without_stats_use_the_unit_scale(dataset):
    (batch,) = eval_batches(dataset.x_test[:3], dataset.y_test[:3], 4)
    np.testing.assert_allclose(batch["image"][:3], dataset.x_test[:3] / 255, rtol=1e-6)
    np.testing.assert_array_equal(batch["mask"], [True, True, True, False])
    with pytest.raises(ValueError, match="3 images but 2 labels"):
        list(eval_batches(dataset.x_test[:3], dataset.y_test[:2], 4))


def test_channel_mean_std_float_images_and_constant_channel():
    rng = np.random.default_rng(3)
    x = rng.random((9, 4, 3, 2)).astype(np.float32)
    x[..., 1] = 0.25
    mean, std = channel_mean_std(x)
    np.testing.assert_allclose(mean, [x[..., 0].astype(np.float64).mean(), 0.25], rtol=1e-6)
    np.testing.assert_allclose(std, [x[..., 0].astype(np.float64).std(), 1.0], rtol=1e-5)
    with pytest.raises(DataError, match=r"expected non-empty \(N, H, W, C\) images, got shape \(0, 2, 2, 1\)"):
        channel_mean_std(np.zeros((0, 2, 2, 1), np.uint8))
