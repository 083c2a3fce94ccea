"""Augmentation of arrays: against a per-image reference and the batches of before, torchvision's
resized crop, determinism, settings parsing."""
import numpy as np
import pytest

from jaxcnn.data import (FILE_RECIPE, Augment, Dataset, as_augment, augment_draws, batch_indices, crop_and_flip,
                         resolve_augment, train_batch)
from jaxcnn.data.augment import resized_crop
from torchvision_ref import torchvision_transforms


def _reference(image, oy, ox, flip, pad):
    # Shift by (pad - oy, pad - ox) with zero fill, then mirror: written pixel by pixel.
    h, w, _ = image.shape
    out = np.zeros_like(image)
    for i in range(h):
        for j in range(w):
            jj = w - 1 - j if flip else j
            si, sj = i + oy - pad, jj + ox - pad
            if 0 <= si < h and 0 <= sj < w:
                out[i, j] = image[si, sj]
    return out


@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_crop_and_flip_matches_reference(rng, dtype):
    images = rng.integers(1, 256, (12, 7, 6, 2)).astype(dtype)
    offsets = rng.integers(0, 7, (12, 2))
    flips = rng.random(12) < 0.5
    got = crop_and_flip(images, offsets, flips, 3)
    assert got.dtype == dtype and got.shape == images.shape
    for b in range(12):
        np.testing.assert_array_equal(got[b], _reference(images[b], *offsets[b], flips[b], 3))


def test_flip_alone_reverses_width(rng):
    images = rng.integers(0, 256, (3, 4, 5, 1), dtype=np.uint8)
    got = crop_and_flip(images, np.zeros((3, 2), int), np.array([True, False, True]), 0)
    np.testing.assert_array_equal(got[0], images[0, :, ::-1])
    np.testing.assert_array_equal(got[1], images[1])
    np.testing.assert_array_equal(got[2], images[2, :, ::-1])


def test_extreme_offsets_shift_in_zero_rows_and_columns():
    image = np.arange(1, 17, dtype=np.uint8).reshape(1, 4, 4, 1)
    top_left = crop_and_flip(image, np.array([[0, 0]]), np.array([False]), 2)[0, ..., 0]
    np.testing.assert_array_equal(top_left[:2], 0)
    np.testing.assert_array_equal(top_left[:, :2], 0)
    np.testing.assert_array_equal(top_left[2:, 2:], image[0, :2, :2, 0])
    bottom_right = crop_and_flip(image, np.array([[4, 4]]), np.array([False]), 2)[0, ..., 0]
    np.testing.assert_array_equal(bottom_right[:2, :2], image[0, 2:, 2:, 0])
    assert not bottom_right[2:].any() and not bottom_right[:, 2:].any()


def test_draws_are_deterministic_and_cover_the_range():
    augment = Augment(crop_padding=4, hflip=0.5)
    offsets, flips, vflips = augment_draws(5, 11, 4096, augment)
    again = augment_draws(5, 11, 4096, augment)
    np.testing.assert_array_equal(offsets, again[0])
    np.testing.assert_array_equal(flips, again[1])
    assert offsets.min() == 0 and offsets.max() == 8
    assert 0.45 < flips.mean() < 0.55
    assert not np.array_equal(offsets, augment_draws(5, 12, 4096, augment)[0])
    assert not augment_draws(5, 11, 64, Augment(crop_padding=4))[1].any() and not vflips.any()


def test_train_batch_augmentation_is_reproducible_and_correct(rng):
    x = rng.integers(1, 256, (20, 8, 8, 3), dtype=np.uint8)
    dataset = Dataset(x, np.zeros(20, np.int32), x[:2], np.zeros(2, np.int32), 10, "toy").with_stats()
    augment = Augment(crop_padding=4, hflip=0.5)
    batch = train_batch(dataset, 3, seed=9, batch_size=8, augment=augment)
    again = train_batch(dataset, 3, seed=9, batch_size=8, augment=augment)
    np.testing.assert_array_equal(batch["image"], again["image"])
    indices = batch_indices(20, 8, 9, 3)
    offsets, flips, _ = augment_draws(9, 3, 8, augment)
    for b in range(8):
        raw = _reference(x[indices[b]], *offsets[b], flips[b], 4)
        expected = (raw / 255 - dataset.mean) / dataset.std
        np.testing.assert_allclose(batch["image"][b], expected, rtol=1e-5, atol=1e-5)
    plain = train_batch(dataset, 3, seed=9, batch_size=8, augment=False)
    assert not np.array_equal(plain["image"], batch["image"])


def test_as_augment():
    assert as_augment(None) == Augment() and not as_augment(False).active
    assert as_augment({"crop_padding": 4, "hflip": 1}) == Augment(crop_padding=4, hflip=1)
    assert as_augment({"scale": [0.5, 1], "ratio": [1, 1]}).scale == (0.5, 1)
    with pytest.raises(ValueError, match=r"unknown keys \['pad'\]"):
        as_augment({"pad": 4})
    with pytest.raises(ValueError, match="crop_padding must be a non-negative int"):
        as_augment(Augment(crop_padding=-1))
    with pytest.raises(ValueError, match=r"hflip must be a probability in \[0, 1\], got 'yes'"):
        as_augment({"hflip": "yes"})
    with pytest.raises(ValueError, match=r"vflip must be a probability in \[0, 1\], got 1.5"):
        as_augment({"vflip": 1.5})
    with pytest.raises(ValueError, match="give scale and ratio together"):
        as_augment({"scale": (0.5, 1)})
    with pytest.raises(ValueError, match=r"scale must be \[lo, hi\] with 0 < lo <= hi <= 1"):
        as_augment({"scale": (0.5, 1.5), "ratio": (1, 1)})
    with pytest.raises(ValueError, match="ratio must be"):
        as_augment({"scale": (0.5, 1), "ratio": (2, 1)})
    with pytest.raises(ValueError, match="interpolation must be one of"):
        as_augment({"interpolation": "lanczos"})
    with pytest.raises(ValueError, match="expected None, False, Augment or a mapping"):
        as_augment(True)


def _todays_train_batch_images(dataset, step, seed, batch_size, crop_padding, flip):
    """The augmented images of `train_batch` as it was before `Augment` had more than
    ``crop_padding`` and ``flip`` (transcribed): one stream drawing offsets, then flips."""
    indices = batch_indices(len(dataset.x_train), batch_size, seed, step)
    draws = np.random.default_rng([seed, step, 0xA06])
    offsets = draws.integers(0, 2 * crop_padding + 1, size=(batch_size, 2))
    flips = draws.random(batch_size) < 0.5
    if not flip:
        flips[:] = False
    images = dataset.x_train[indices]
    if crop_padding or flip:
        images = crop_and_flip(images, offsets, flips, crop_padding)
    return (images / 255 - dataset.mean) / dataset.std


@pytest.mark.parametrize("crop_padding, flip", [(0, False), (4, True), (2, False), (0, True)])
def test_default_keys_give_the_batches_of_before(rng, crop_padding, flip):
    """What a config with crop_padding and the old flip (now hflip 0.5, or null) trains on is
    unchanged: same draws, same order."""
    x = rng.integers(0, 256, (24, 9, 7, 3), dtype=np.uint8)
    dataset = Dataset(x, np.zeros(24, np.int32), x[:2], np.zeros(2, np.int32), 10, "toy").with_stats()
    augment = resolve_augment(files=False, crop_padding=crop_padding, hflip=0.5 if flip else None)
    for step in (0, 5):
        got = train_batch(dataset, step, seed=3, batch_size=8, augment=augment)["image"]
        np.testing.assert_allclose(got, _todays_train_batch_images(dataset, step, 3, 8, crop_padding, flip),
                                   rtol=0, atol=1e-6)


def test_resolve_augment_takes_each_sources_recipe():
    assert resolve_augment(files=True) == FILE_RECIPE == Augment((0.08, 1.0), (3 / 4, 4 / 3), hflip=0.5)
    assert resolve_augment(files=False) == Augment() and not Augment().active
    assert resolve_augment(files=False, scale=[0.5, 1]) == Augment((0.5, 1), (3 / 4, 4 / 3))
    assert resolve_augment(files=True, hflip=0, scale=[0.8, 1]) == Augment((0.8, 1), (3 / 4, 4 / 3))
    assert resolve_augment(files=True, no_aug=True, interpolation="bicubic") == Augment(interpolation="bicubic")


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
def test_resized_crop_of_an_array_is_torchvisions_resized_crop(interpolation):
    """Each channel resized on its own as an 8-bit image is Pillow's RGB resize (torchvision's
    ``resized_crop`` on the PIL image) pixel for pixel; float images as 32-bit float images."""
    T = torchvision_transforms()
    F = T.functional
    from PIL import Image

    rng = np.random.default_rng(4)
    for n in range(10):
        h, w = (int(v) for v in rng.integers(8, 40, size=2))
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        top, left = int(rng.integers(0, h // 2)), int(rng.integers(0, w // 2))
        box = (top, left, int(rng.integers(1, h - top + 1)), int(rng.integers(1, w - left + 1)))
        want = F.resized_crop(Image.fromarray(image), *box, [h, w], interpolation=T.InterpolationMode(interpolation))
        np.testing.assert_array_equal(resized_crop(image, box, interpolation), np.asarray(want))
        np.testing.assert_array_equal(resized_crop(image[..., :1], box, interpolation), np.asarray(want)[..., :1])
    floats = rng.random((20, 16, 2)).astype(np.float32)
    got = resized_crop(floats, (2, 3, 10, 8), "bilinear")
    torch = pytest.importorskip("torch")
    crop = torch.from_numpy(floats[2:12, 3:11].copy()).permute(2, 0, 1)[None]
    want = torch.nn.functional.interpolate(crop, size=(20, 16), mode="bilinear", antialias=True, align_corners=False)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want[0].permute(1, 2, 0).numpy(), atol=1e-5)


def test_each_key_changes_array_batches_as_documented(rng):
    x = rng.integers(0, 256, (24, 12, 12, 1), dtype=np.uint8)
    dataset = Dataset(x, np.zeros(24, np.int32), x[:2], np.zeros(2, np.int32), 10, "toy").with_stats()

    def batch(**keys):
        augment = resolve_augment(files=False, **keys)
        return train_batch(dataset, 2, seed=1, batch_size=8, augment=augment)["image"]

    plain = batch()
    np.testing.assert_array_equal(plain, batch(no_aug=True))
    np.testing.assert_array_equal(plain, batch(hflip=0, vflip=0))
    np.testing.assert_array_equal(batch(vflip=1), plain[:, ::-1])
    np.testing.assert_array_equal(batch(hflip=1), plain[:, :, ::-1])
    np.testing.assert_array_equal(batch(scale=[1, 1], ratio=[1, 1]), plain)  # the whole image, resized to itself
    cropped = batch(scale=[0.3, 0.6])
    assert cropped.shape == plain.shape and not np.array_equal(cropped, plain)
    assert not np.array_equal(cropped, batch(scale=[0.3, 0.6], interpolation="nearest"))
    # The random-resized crop has a stream of its own: the flips drawn with it are the ones drawn without.
    np.testing.assert_array_equal(batch(scale=[1, 1], ratio=[1, 1], hflip=0.5), batch(hflip=0.5))
