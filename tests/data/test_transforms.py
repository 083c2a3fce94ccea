"""The ImageNet transforms against independent references: torchvision's own transforms fed the
same random draws (pixel for pixel), timm's crop_pct rounding, torchvision's crop rule written out as
a plain loop, torch's antialiased bilinear resize on the CPU, and naive index arithmetic."""
import math

import numpy as np
import pytest
from PIL import Image

from jaxcnn.data.augment import FILE_RECIPE, Augment
from torchvision_ref import feed_draws, torchvision_transforms
from jaxcnn.data.transforms import (INTERPOLATIONS, center_crop_box, default_eval_resize, eval_transform,
                                    example_rng, random_flips, random_resized_crop_box, resized_shape,
                                    train_transform)


def reference_crop_box(draws, height, width, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop.get_params (v0.20), transcribed; ``draws`` is an
    object with ``uniform(a, b)`` and ``integers(lo, hi)`` standing in for torch's generator."""
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * draws.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(draws.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(draws.integers(0, height - h + 1))
            j = int(draws.integers(0, width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def test_crop_box_matches_torchvision_rule_on_random_sizes():
    sizes = np.random.default_rng(0).integers(1, 600, size=(400, 2))
    fallbacks = 0
    for n, (h, w) in enumerate(sizes):
        for scale, ratio in (((0.08, 1.0), (3 / 4, 4 / 3)), ((0.9, 1.0), (2.0, 3.0))):
            got = random_resized_crop_box(np.random.default_rng(n), int(h), int(w), scale, ratio)
            want = reference_crop_box(np.random.default_rng(n), int(h), int(w), scale, ratio)
            if 0 in want[2:]:  # torchvision's fallback can round a 1-pixel side to 0: ours keeps 1 pixel
                want = ((h - max(1, want[2])) // 2, (w - max(1, want[3])) // 2, max(1, want[2]), max(1, want[3]))
            assert got == want, (h, w, scale, ratio)
            top, left, ch, cw = got
            assert 0 <= top and top + ch <= h and 0 <= left and left + cw <= w and ch > 0 and cw > 0
    # The centre-crop fallback is taken for thin images and extreme ratios: make sure it was exercised.
    for h, w in ((1, 500), (500, 1), (3, 3), (100, 100)):
        got = random_resized_crop_box(np.random.default_rng(1), h, w, (0.9, 1.0), (2.0, 3.0))
        if got == reference_crop_box(np.random.default_rng(1), h, w, (0.9, 1.0), (2.0, 3.0)):
            fallbacks += got[:2] == ((h - got[2]) // 2, (w - got[3]) // 2)
    assert fallbacks >= 2


def test_crop_statistics_follow_scale_and_ratio():
    """Over many draws on a large image, the crop's area fraction and log aspect ratio are uniform."""
    areas, logs = [], []
    for n in range(3000):
        _, _, h, w = random_resized_crop_box(np.random.default_rng(n), 1000, 1000)
        areas.append(h * w / 1e6)
        logs.append(math.log(w / h))
    areas, logs = np.array(areas), np.array(logs)
    assert 0.075 <= areas.min() and areas.max() <= 1.0
    # Crops that do not fit are redrawn, so large areas are under-represented: mean below 0.54.
    assert 0.40 < areas.mean() < 0.54
    assert abs(logs.mean()) < 0.02 and logs.min() >= math.log(3 / 4) - 0.01 and logs.max() <= math.log(4 / 3) + 0.01


def test_train_transform_is_crop_resize_flip():
    """Output = Pillow's bilinear resize of the crop the box names, mirrored by the flip draw,
    checked against torch's antialiased bilinear interpolation (the resize) and naive slicing."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    flips = 0
    for n in range(40):
        h, w = (int(v) for v in rng.integers(17, 90, size=2))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        size = (int(rng.integers(8, 40)), int(rng.integers(8, 40)))
        out = train_transform(Image.fromarray(pixels), size, example_rng(5, n, 7), FILE_RECIPE)
        assert out.shape == size + (3,) and out.dtype == np.uint8
        draws = example_rng(5, n, 7)
        top, left, ch, cw = reference_crop_box(draws, h, w)
        flip = draws.random() < 0.5
        flips += flip
        crop = torch.from_numpy(pixels[top:top + ch, left:left + cw].copy()).permute(2, 0, 1)[None].float()
        ref = torch.nn.functional.interpolate(crop, size=size, mode="bilinear", antialias=True, align_corners=False)
        ref = ref[0].permute(1, 2, 0).round().clamp(0, 255).numpy().astype(np.uint8)
        if flip:
            ref = ref[:, ::-1]
        # Pillow resamples in fixed point (8 fraction bits for 8-bit images): one level apart at most.
        diff = np.abs(out.astype(int) - ref.astype(int))
        assert diff.max() <= 1, (n, diff.max())
    assert 5 < flips < 35


def test_eval_transform_resize_and_centre_crop():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    for n in range(30):
        h, w = (int(v) for v in rng.integers(10, 120, size=2))
        pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        size = (int(rng.integers(4, 30)), int(rng.integers(4, 30)))
        resize = max(size) + int(rng.integers(0, 10))
        out = eval_transform(Image.fromarray(pixels), size, resize)
        new_h, new_w = resized_shape(h, w, resize)
        assert min(new_h, new_w) == resize
        # torchvision: the long side is int(resize * long / short)
        assert max(new_h, new_w) == int(resize * max(h, w) / min(h, w))
        t = torch.from_numpy(pixels).permute(2, 0, 1)[None].float()
        ref = torch.nn.functional.interpolate(t, size=(new_h, new_w), mode="bilinear", antialias=True,
                                              align_corners=False)[0].permute(1, 2, 0)
        ref = ref.round().clamp(0, 255).numpy().astype(np.uint8)
        top = int(round((new_h - size[0]) / 2.0))
        left = int(round((new_w - size[1]) / 2.0))
        assert center_crop_box(new_h, new_w, size) == (top, left)
        ref = ref[top:top + size[0], left:left + size[1]]
        assert out.shape == size + (3,)
        assert np.abs(out.astype(int) - ref.astype(int)).max() <= 1, n
    with pytest.raises(ValueError, match="smaller than the crop"):
        eval_transform(Image.fromarray(pixels), (20, 20), 19)
    assert default_eval_resize((224, 224)) == 256 and default_eval_resize((32, 28)) == 37


def test_draws_depend_only_on_seed_step_position():
    image = Image.fromarray(np.random.default_rng(5).integers(0, 256, (50, 60, 3), dtype=np.uint8))
    a = train_transform(image, (16, 16), example_rng(1, 2, 3), FILE_RECIPE)
    np.testing.assert_array_equal(a, train_transform(image, (16, 16), example_rng(1, 2, 3), FILE_RECIPE))
    others = [train_transform(image, (16, 16), example_rng(*key), FILE_RECIPE)
              for key in ((2, 2, 3), (1, 3, 3), (1, 2, 4))]
    assert all(not np.array_equal(a, b) for b in others)


# ------------------------------------------- against torchvision's own transforms (and timm)

@pytest.mark.parametrize("scale, ratio", [((0.5, 1.0), (1.0, 1.0)), ((1.0, 1.0), (1.0, 1.0)),
                                          ((0.25, 0.5), (0.5, 2.0)), ((0.9, 1.0), (2.0, 3.0))])
def test_crop_box_is_torchvisions_get_params_fed_the_same_draws(monkeypatch, scale, ratio):
    T = torchvision_transforms()
    sizes = np.random.default_rng(1).integers(1, 300, size=(150, 2))
    for n, (h, w) in enumerate(sizes):
        feed_draws(monkeypatch, T, np.random.default_rng(n))
        want = T.RandomResizedCrop.get_params(Image.new("RGB", (int(w), int(h))), list(scale), list(ratio))
        got = random_resized_crop_box(np.random.default_rng(n), int(h), int(w), scale, ratio)
        if 0 in want[2:]:  # torchvision's fallback can round a 1-pixel side to 0: ours keeps 1 pixel
            continue
        assert got == tuple(want), (h, w)


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
@pytest.mark.parametrize("hflip, vflip, padding", [(0.5, 0.0, 0), (0.0, 0.0, 0), (1.0, 0.3, 2), (0.2, 1.0, 3)])
def test_train_transform_is_torchvisions_pipeline_fed_the_same_draws(monkeypatch, interpolation, hflip, vflip,
                                                                      padding):
    """RandomResizedCrop(scale, ratio, interpolation) -> RandomHorizontalFlip(p) -> RandomVerticalFlip(p)
    -> RandomCrop(size, padding), a flip of probability 0 left out as timm does: pixel for pixel."""
    T = torchvision_transforms()
    mode = T.InterpolationMode(interpolation)
    rng = np.random.default_rng(8)
    augment = Augment(scale=(0.3, 1.0), ratio=(0.6, 1.6), interpolation=interpolation, hflip=hflip, vflip=vflip,
                      crop_padding=padding)
    for n in range(12):
        h, w = (int(v) for v in rng.integers(12, 70, size=2))
        image = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
        size = (int(rng.integers(6, 30)), int(rng.integers(6, 30)))
        steps = [T.RandomResizedCrop(size, scale=augment.scale, ratio=augment.ratio, interpolation=mode)]
        steps += [T.RandomHorizontalFlip(hflip)] if hflip else []
        steps += [T.RandomVerticalFlip(vflip)] if vflip else []
        steps += [T.RandomCrop(size, padding=padding)] if padding else []
        feed_draws(monkeypatch, T, example_rng(5, n, 7))
        want = np.asarray(T.Compose(steps)(image))
        got = train_transform(image, size, example_rng(5, n, 7), augment)
        np.testing.assert_array_equal(got, want, err_msg=str(n))


def test_scale_and_ratio_of_one_is_a_plain_resize_of_a_square_image():
    rng = np.random.default_rng(2)
    whole = Augment(scale=(1.0, 1.0), ratio=(1.0, 1.0))
    square = Image.fromarray(rng.integers(0, 256, size=(40, 40, 3), dtype=np.uint8))
    for position in range(5):
        got = train_transform(square, (12, 16), example_rng(0, 0, position), whole)
        np.testing.assert_array_equal(got, np.asarray(square.resize((16, 12), Image.BILINEAR)))
    # A non-square image has no crop of its whole area with ratio 1: torchvision's fallback, the
    # centred square (here rows 10..49 of 60), resized.
    tall = Image.fromarray(rng.integers(0, 256, size=(60, 40, 3), dtype=np.uint8))
    got = train_transform(tall, (12, 12), example_rng(0, 0, 0), whole)
    np.testing.assert_array_equal(got, np.asarray(tall.crop((0, 10, 40, 50)).resize((12, 12), Image.BILINEAR)))


def test_flips_draw_with_their_probabilities_and_nothing_at_zero():
    image = np.arange(12).reshape(3, 4, 1)
    rng = np.random.default_rng(0)
    counts = np.zeros(2)
    for _ in range(4000):
        out = random_flips(image, rng, 0.3, 0.7)
        counts += (out[0, 0, 0] in (3, 11), out[0, 0, 0] in (8, 11))  # mirrored width, height
    assert abs(counts[0] / 4000 - 0.3) < 0.03 and abs(counts[1] / 4000 - 0.7) < 0.03
    a, b = np.random.default_rng(1), np.random.default_rng(1)
    np.testing.assert_array_equal(random_flips(image, a, 0.0, 0.0), image)
    assert a.random() == b.random()  # a probability of 0 draws nothing
    np.testing.assert_array_equal(random_flips(image, a, 1.0, 1.0), image[::-1, ::-1])


@pytest.mark.parametrize("interpolation", INTERPOLATIONS)
def test_eval_transform_is_torchvisions_resize_and_centre_crop(interpolation):
    T = torchvision_transforms()
    rng = np.random.default_rng(6)
    for n, crop_pct in enumerate((None, 0.95, 0.875, 0.5, 1.0) * 3):
        h, w = (int(v) for v in rng.integers(10, 120, size=2))
        image = Image.fromarray(rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8))
        size = (int(rng.integers(4, 30)), int(rng.integers(4, 30)))
        resize = default_eval_resize(size, crop_pct)
        want = T.Compose([T.Resize(resize, interpolation=T.InterpolationMode(interpolation)), T.CenterCrop(size)])
        np.testing.assert_array_equal(eval_transform(image, size, resize, interpolation),
                                      np.asarray(want(image)), err_msg=str(n))


def test_crop_pct_resize_is_timms_and_null_keeps_the_old_rounding():
    torchvision_transforms()
    factory = pytest.importorskip("timm.data.transforms_factory")
    for side in (224, 32, 28, 299, 384, 17):
        for crop_pct in (0.875, 0.9, 0.95, 1.0, 0.5, 0.125, 0.8):
            resize = factory.transforms_imagenet_eval(side, crop_pct=crop_pct).transforms[0]
            assert default_eval_resize((side, side), crop_pct) == resize.size, (side, crop_pct)
    # null is the default from before crop_pct (rounded, not timm's floor): 32 -> 37, not 36.
    assert default_eval_resize((32, 32)) == 37 and default_eval_resize((32, 32), 0.875) == 36


def test_photometric_steps_come_in_timms_order_from_the_examples_generator():
    """auto_augment, then color_jitter after the flips, random erasing last on the finished crop,
    every draw from the example's generator in that order (each step is tested against timm's or
    torchvision's own in tests/data/test_photometric.py)."""
    from jaxcnn.data import photometric
    from jaxcnn.data.transforms import IMAGENET_MEAN, IMAGENET_STD
    from jaxcnn.data.transforms import pil_filter, random_padded_crop
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (30, 26, 3), np.uint8), "RGB")
    augment = Augment((0.3, 1.0), (0.75, 1.33), "bicubic", hflip=0.5, vflip=0.5, crop_padding=2,
                      color_jitter=(0.4, 0.3, 0.2, 0.1), auto_augment="rand-m9-n2-mstd0.5-t3a", reprob=1.0,
                      remode="const")
    policy = photometric.parse_auto_augment(augment.auto_augment, fill=photometric.mean_fill(IMAGENET_MEAN),
                                            interpolation="bicubic")
    mean, std = 255.0 * np.asarray(IMAGENET_MEAN), 255.0 * np.asarray(IMAGENET_STD)
    for position in range(6):
        got = train_transform(image, (16, 12), example_rng(3, 1, position), augment)
        draws = example_rng(3, 1, position)
        top, left, h, w = random_resized_crop_box(draws, 30, 26, augment.scale, augment.ratio)
        want = image.crop((left, top, left + w, top + h)).resize((12, 16), pil_filter("bicubic"))
        want = Image.fromarray(np.ascontiguousarray(random_flips(np.asarray(want), draws, 0.5, 0.5)))
        want = photometric.color_jitter(photometric.auto_augment(want, policy, draws), draws, 0.4, 0.3, 0.2, 0.1)
        want = np.array(random_padded_crop(np.asarray(want), draws, 2))
        photometric.random_erase(want, draws, 1.0, mean=mean, std=std, mode="const")
        np.testing.assert_array_equal(got, want)
        assert (got == np.rint(mean).astype(np.uint8)).all(-1).any()  # the erased box, in the mean colour
