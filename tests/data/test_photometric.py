"""Colour jitter, RandAugment/TrivialAugment and random erasing against timm and torchvision.

Each op at a fixed magnitude and sign is compared pixel for pixel with timm's own op (the same
Pillow calls, so exactly equal); whole RandAugment and AugMix images with timm's transforms fed
our draws (timm's ``random`` and ``np.random`` scripted); the colour adjustments with
torchvision's PIL functional; the parsers with timm's; random erasing's geometry with timm's
``RandomErasing`` driven draw for draw by the same numpy generator. The random draws themselves
are checked over many images against the definitions.
"""
import math
import re
import types

import numpy as np
import pytest
from PIL import Image

from jaxcnn.data import photometric
from jaxcnn.data.augmix import AUGMIX_TRANSFORMS, draw_augmix
from jaxcnn.data.photometric import (auto_augment, color_jitter, color_jitter_draws, erase_box, mean_fill,
                                     parse_auto_augment, parse_color_jitter, random_erase)
from jaxcnn.data.rand_augment import OP_NAMES, apply_op, draw_layers, op_argument
from jaxcnn.data.transforms import example_rng

from photometric_references import references

FILL = (124, 116, 104)  # ImageNet's mean as timm's img_mean
BILINEAR, BICUBIC = Image.Resampling.BILINEAR, Image.Resampling.BICUBIC


def structured_image(height=20, width=24, seed=0):
    """An RGB image with gradients, an edge and noise, within [30, 208]: every op changes it."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[:height, :width]
    base = np.stack([x * 9, y * 11, (x + y) * 5], axis=-1) + 40 * (x > width // 2)[..., None]
    noisy = base + rng.integers(-20, 21, size=base.shape)
    return Image.fromarray((np.clip(noisy, 0, 255) * 0.7 + 30).astype(np.uint8))


def pixels(image):
    return np.asarray(image, np.int16)


# ---- each op against timm's -------------------------------------------------------------------

@pytest.mark.torch
@pytest.mark.parametrize("name", OP_NAMES)
def test_each_op_equals_timms_augment_op(name, monkeypatch):
    """timm's AugmentOp at probability 1, fixed magnitude, fixed sign and resample, equals
    apply_op exactly (the same Pillow operations: no resampling tolerance is needed)."""
    aa, _, _ = references()
    image = structured_image()
    for sign in (1, -1):
        monkeypatch.setattr(aa, "_randomly_negate", lambda v, sign=sign: sign * v)
        for magnitude in (0.0, 3.7, 9.0, 10.0):
            for resample in (BILINEAR, BICUBIC):
                hparams = dict(img_mean=FILL, interpolation=resample, translate_const=100)
                got = apply_op(image, name, magnitude, sign, fill=FILL, resample=resample)
                if name.startswith("Posterize") and op_argument(name, magnitude) == 0:
                    # timm asks Pillow for 0 bits, which Pillow 13 refuses: no bits kept is black
                    np.testing.assert_array_equal(pixels(got), 0)
                    continue
                want = aa.AugmentOp(name, prob=1.0, magnitude=magnitude, hparams=hparams)(image)
                assert got.mode == "RGB" and got.size == image.size
                np.testing.assert_array_equal(pixels(got), pixels(want), err_msg=f"{name} m={magnitude} {sign}")


@pytest.mark.torch
def test_op_arguments_equal_timms_level_to_arg(monkeypatch):
    aa, _, _ = references()
    magnitudes = np.concatenate([np.linspace(0, 10, 101), np.random.default_rng(0).uniform(0, 10, 200)])
    for sign in (1, -1):
        monkeypatch.setattr(aa, "_randomly_negate", lambda v, sign=sign: sign * v)
        for name in OP_NAMES:
            level = aa.LEVEL_TO_ARG[name]
            for m in magnitudes.tolist():
                want = None if level is None else level(m, dict(translate_pct=0.45))[0]
                assert op_argument(name, m, sign) == want, (name, m, sign)


def test_ops_change_the_image_and_keep_its_shape():
    image = structured_image()
    for name in OP_NAMES:
        out = apply_op(image, name, 6.0, -1, fill=FILL)  # at 5 the enhancements are the identity
        assert out.size == image.size and out.mode == "RGB"
        assert not np.array_equal(pixels(out), pixels(image)), name


def test_geometric_ops_fill_uncovered_pixels_with_the_mean():
    image = Image.fromarray(np.full((20, 24, 3), 250, np.uint8))
    out = np.asarray(apply_op(image, "TranslateXRel", 10.0, 1, fill=FILL, resample=BILINEAR))
    shift = round(0.45 * 24)  # the content moves left by 10.8 pixels: the right ten columns are fill
    assert (out[:, -shift + 1:] == FILL).all() and (out[:, :10] == 250).all()


# ---- the parser against timm's ------------------------------------------------------------------

PARSE_STRINGS = ("rand", "rand-m9-n2-mstd0.5-inc1", "rand-m9-mstd0.5", "rand-n3-m7-p0.8", "rand-mstd101-m8",
                 "rand-m12-mmax15-n1", "rand-m9-mmax0", "rand-tweights-n3", "rand-t3a-m5", "rand-t3aw-mstd1-inc1",
                 "rand-inc0-m5-n4-p1")


@pytest.mark.torch
@pytest.mark.parametrize("string", PARSE_STRINGS)
def test_parser_agrees_with_timm(string):
    aa, _, _ = references()
    theirs = aa.rand_augment_transform(string, dict(img_mean=FILL, translate_const=100))
    ours = parse_auto_augment(string, fill=FILL)
    assert ours.ops == tuple(op.name for op in theirs.ops)
    assert ours.num_layers == theirs.num_layers
    op = theirs.ops[0]
    assert (ours.magnitude, ours.prob, ours.magnitude_std) == (op.magnitude, op.prob, op.magnitude_std)
    assert ours.magnitude_max == (op.magnitude_max or 10)
    if theirs.choice_weights is None:
        assert ours.weights is None
    else:
        np.testing.assert_allclose(ours.weights, theirs.choice_weights, rtol=1e-12)
    assert ours.fill == FILL


def test_trivialaugment_is_timms_one_op_uniform_magnitude_form():
    assert parse_auto_augment("trivialaugment") == parse_auto_augment("rand-n1-m10-mstd101-p1")
    policy = parse_auto_augment("trivialaugment")
    assert policy.num_layers == 1 and policy.prob == 1.0 and policy.magnitude_std == math.inf


@pytest.mark.parametrize("string, why", [
    ("rand-m9-x1", "unknown section 'x1'"), ("randaugment", "unknown policy"), ("v0", "unknown policy"),
    ("augmixx-m5", "unknown policy"), ("augmix-m5-x1", "unknown section 'x1'"),
    ("augmix-w0", "AugMix needs w >= 1"), ("augmix-m5-tweights", "unknown section 'tweights'"),
    ("rand-tfoo", "unknown transform set 'tfoo'"),
    ("rand-m", "section 'm' needs a number"), ("rand-m9.5", "section 'm9.5' needs a number"),
    ("rand-tweights-n16", "n16 distinct ops drawn from a set of 15"), ("", "unknown policy"), (None, "not a string"),
])
def test_bad_strings_are_one_line_naming_the_string_and_an_example(string, why):
    with pytest.raises(ValueError) as error:
        parse_auto_augment(string)
    message = str(error.value)
    assert repr(string) in message and why in message and "rand-m9-n2-mstd0.5-inc1" in message
    assert "augmix-m5-w4-d2" in message
    assert "\n" not in message


def test_interpolation_names():
    assert parse_auto_augment("rand", interpolation="bicubic").resample == (BICUBIC,)
    assert parse_auto_augment("rand").resample == (BILINEAR, BICUBIC)
    with pytest.raises(ValueError, match="not interpolation 'lanczos'"):
        parse_auto_augment("rand", interpolation="lanczos")


# ---- the draws against the definition --------------------------------------------------------------

def _layers(string, images=3000, seed=0):
    policy = parse_auto_augment(string)
    rng = np.random.default_rng(seed)
    return policy, [draw_layers(policy, rng) for _ in range(images)]


def test_layer_draws_follow_the_definition():
    policy, draws = _layers("rand-m9-n2-mstd0.5")
    layers = [layer for image in draws for layer in image]
    assert abs(len(layers) / (2 * len(draws)) - 0.5) < 0.02  # each of n=2 layers applied with p=0.5
    counts = np.array([sum(layer.name == name for layer in layers) for name in policy.ops])
    expected = len(layers) / len(policy.ops)
    assert np.all(np.abs(counts - expected) < 5 * math.sqrt(expected))  # uniform over the 15 ops
    magnitudes = np.array([layer.magnitude for layer in layers])
    reference = np.clip(np.random.default_rng(1).normal(9, 0.5, 200_000), 0, 10)  # N(m, mstd) clipped to [0, 10]
    assert magnitudes.max() <= 10.0 and magnitudes.min() >= 0.0 and np.mean(magnitudes == 10.0) > 0.01
    assert abs(magnitudes.mean() - reference.mean()) < 0.03 and abs(magnitudes.std() - reference.std()) < 0.03
    assert abs(np.mean([layer.sign == -1 for layer in layers]) - 0.5) < 0.03
    assert abs(np.mean([layer.resample == BICUBIC for layer in layers]) - 0.5) < 0.03


def test_fixed_uniform_and_clipped_magnitudes():
    _, draws = _layers("rand-m7-n1-p1", images=200)
    assert all(len(image) == 1 and image[0].magnitude == 7.0 for image in draws)
    _, draws = _layers("rand-m8-n1-p1-mstd101", images=3000)
    magnitudes = np.array([image[0].magnitude for image in draws])
    assert magnitudes.min() >= 0 and magnitudes.max() <= 8 and abs(magnitudes.mean() - 4) < 0.15
    _, draws = _layers("rand-m14-n1-p1-mmax12", images=50)
    assert {image[0].magnitude for image in draws} == {12.0}
    _, draws = _layers("rand-m14-n1-p1", images=50)
    assert {image[0].magnitude for image in draws} == {10.0}


def test_weighted_sets_draw_distinct_ops_by_weight():
    policy, draws = _layers("rand-tweights-n1-p1", images=6000)
    names = [image[0].name for image in draws]
    for name, weight in zip(policy.ops, policy.weights):
        expected = weight * len(names)
        assert abs(names.count(name) - expected) < 5 * math.sqrt(expected) + 3, name
    _, draws = _layers("rand-t3aw-n3-p1", images=300)
    assert all(len({layer.name for layer in image}) == 3 for image in draws)


def test_probability_zero_and_one():
    _, draws = _layers("rand-n3-p0", images=100)
    assert all(image == [] for image in draws)
    _, draws = _layers("rand-n3-p1", images=100)
    assert all(len(image) == 3 for image in draws)


class _OpWithDraws:
    """One of timm's AugmentOps, called with a given layer's draws (timm's own prob check, noise,
    clip, level function and op run; the scripted ``random`` answers with the layer's draws)."""

    def __init__(self, op, layer, random):
        self.op, self.layer, self.random = op, layer, random

    def __call__(self, image):
        self.random.layer, self.random.prob_check = self.layer, self.op.prob < 1.0
        return self.op(image)


class _ScriptedLayerRandom:
    """Python's ``random`` as timm's AugmentOp calls it: the prob check passes, then the current
    layer's magnitude, sign and filter."""

    layer = None
    prob_check = False

    def random(self):
        if self.prob_check:  # timm skips the op when random() > prob: applied layers pass
            self.prob_check = False
            return 0.0
        return 0.9 if self.layer.sign == -1 else 0.1  # timm negates when random() > 0.5

    def uniform(self, low, high):
        return self.layer.magnitude

    def gauss(self, mu, sigma):
        return self.layer.magnitude

    def choice(self, options):
        assert self.layer.resample in options
        return self.layer.resample


@pytest.mark.torch
@pytest.mark.parametrize("string", ["rand-m9-n2-mstd0.5-inc1", "rand-m7-n3-p0.7", "trivialaugment",
                                    "rand-m9-tweights-n2-mstd1", "rand-t3a-n2-m6"])
def test_rand_augment_equals_timms_with_the_same_draws(string, monkeypatch):
    aa, _, _ = references()
    image = structured_image()
    policy = parse_auto_augment(string, fill=FILL)
    theirs = aa.rand_augment_transform("rand-n1-m10-mstd101-p1" if string == "trivialaugment" else string,
                                       dict(img_mean=FILL, translate_const=100))
    by_name = {op.name: op for op in theirs.ops}
    scripted = _ScriptedLayerRandom()
    monkeypatch.setattr(aa, "random", scripted)
    for seed in range(12):
        layers = draw_layers(policy, np.random.default_rng(seed))
        ops = [_OpWithDraws(by_name[layer.name], layer, scripted) for layer in layers]
        monkeypatch.setattr(theirs, "ops", ops)
        monkeypatch.setattr(aa, "np", types.SimpleNamespace(random=types.SimpleNamespace(
            choice=lambda ops, n, replace, p: ops)))  # the applied layers, in order
        want = theirs(image)
        got = auto_augment(image, policy, np.random.default_rng(seed))
        np.testing.assert_array_equal(pixels(got), pixels(want), err_msg=f"{string} seed {seed} {layers}")


# ---- AugMix against timm's ------------------------------------------------------------------------

AUGMIX_STRINGS = ("augmix", "augmix-m5-w4-d2", "augmix-m3-mstd0.5-a0.5-b1", "augmix-d0-w2-b1", "augmix-m9-d3-w1")


def _timm_augmix(aa, string):
    """timm's AugMix as its transforms factory builds it (translations up to 0.3 of the side)."""
    return aa.augment_and_mix_transform(string, dict(img_mean=FILL, translate_const=100, translate_pct=0.3))


@pytest.mark.torch
@pytest.mark.parametrize("string", AUGMIX_STRINGS)
def test_augmix_parser_agrees_with_timm(string):
    aa, _, _ = references()
    theirs = _timm_augmix(aa, string)
    ours = parse_auto_augment(string, fill=FILL)
    assert (ours.width, ours.depth, ours.alpha, ours.blended) == (theirs.width, theirs.depth, theirs.alpha,
                                                                  theirs.blended)
    assert tuple(op.name for op in theirs.ops) == AUGMIX_TRANSFORMS
    assert {(op.magnitude, op.magnitude_std, op.prob) for op in theirs.ops} == {
        (ours.magnitude, ours.magnitude_std, 1.0)}


class _ScriptedNumpy:
    """numpy, but ``numpy.random`` hands timm's AugMixAugment the draws of one `draw_augmix`."""

    def __init__(self, draws, ops):
        self.random = self
        self.draws, self.ops, self.chain = draws, {op.name: op for op in ops}, 0

    def __getattr__(self, name):
        return getattr(np, name)

    def dirichlet(self, alphas):
        return self.draws.weights.astype(np.float64)

    def beta(self, a, b):
        return self.draws.blend

    def randint(self, low, high):
        return len(self.draws.chains[self.chain])

    def choice(self, ops, depth, replace=True):
        chain = self.draws.chains[self.chain]
        self.chain += 1
        assert depth == len(chain) and replace
        return [self.ops[layer.name] for layer in chain]


class _ScriptedRandom:
    """Python's ``random`` as timm's AugmentOp calls it, answering with given layers' draws."""

    def __init__(self, layers):
        self.layers, self.layer = iter(layers), None

    def uniform(self, low, high):
        self.layer = next(self.layers)
        return self.layer.magnitude

    def gauss(self, mu, sigma):
        return self.uniform(mu, sigma)

    def random(self):  # timm negates when random() > 0.5
        return 0.9 if self.layer.sign == -1 else 0.1

    def choice(self, options):
        assert self.layer.resample in options
        return self.layer.resample


@pytest.mark.torch
@pytest.mark.parametrize("string", AUGMIX_STRINGS)
def test_augmix_equals_timms_with_the_same_draws(string, monkeypatch):
    aa, _, _ = references()
    image = structured_image()
    policy = parse_auto_augment(string, fill=FILL)
    theirs = _timm_augmix(aa, string)
    for seed in range(8):
        draws = draw_augmix(policy, np.random.default_rng(seed))
        scripted_numpy = _ScriptedNumpy(draws, theirs.ops)
        scripted_random = _ScriptedRandom([layer for chain in draws.chains for layer in chain])
        monkeypatch.setattr(aa, "np", scripted_numpy)
        monkeypatch.setattr(aa, "random", scripted_random)
        want = theirs(image)
        assert scripted_numpy.chain == len(draws.chains) and next(scripted_random.layers, None) is None
        got = auto_augment(image, policy, np.random.default_rng(seed))
        np.testing.assert_array_equal(pixels(got), pixels(want), err_msg=f"{string} seed {seed}")


def test_augmix_draws_follow_the_definition():
    policy = parse_auto_augment("augmix-m6")
    rng = np.random.default_rng(0)
    draws = [draw_augmix(policy, rng) for _ in range(2000)]
    weights = np.array([d.weights for d in draws])
    assert weights.dtype == np.float32 and np.allclose(weights.sum(1), 1, atol=1e-6) and weights.min() >= 0
    assert abs(weights.mean() - 1 / 3) < 0.01  # Dirichlet(1, 1, 1): each weight has mean 1/3
    blends = np.array([d.blend for d in draws])
    assert 0 <= blends.min() and blends.max() <= 1  # Beta(1, 1) is uniform: mean 1/2, variance 1/12
    assert abs(blends.mean() - 0.5) < 0.02 and abs(blends.var() - 1 / 12) < 0.01
    depths = np.array([len(chain) for d in draws for chain in d.chains])
    assert set(depths) == {1, 2, 3} and all(abs(np.mean(depths == k) - 1 / 3) < 0.02 for k in (1, 2, 3))
    magnitudes = np.array([layer.magnitude for d in draws for chain in d.chains for layer in chain])
    assert magnitudes.min() >= 0 and magnitudes.max() <= 6 and abs(magnitudes.mean() - 3) < 0.1
    names = [layer.name for d in draws for chain in d.chains for layer in chain]
    assert set(names) == set(AUGMIX_TRANSFORMS)


# ---- colour jitter against torchvision -------------------------------------------------------------

@pytest.mark.torch
def test_each_adjustment_equals_torchvisions():
    _, _, F = references()
    image = structured_image()
    cases = [(0, F.adjust_brightness, (0.0, 0.6, 1.0, 1.4)), (1, F.adjust_contrast, (0.0, 0.6, 1.0, 1.4)),
             (2, F.adjust_saturation, (0.0, 0.6, 1.0, 1.4)), (3, F.adjust_hue, (-0.5, -0.3, -0.001, 0.0, 0.1, 0.5))]
    for index, reference, factors in cases:
        for factor in factors:
            got = photometric.ADJUSTMENTS[index](image, factor)
            np.testing.assert_array_equal(pixels(got), pixels(reference(image, factor)), err_msg=f"{index} {factor}")


@pytest.mark.torch
def test_color_jitter_equals_torchvision_in_the_drawn_order():
    _, _, F = references()
    image = structured_image()
    adjust = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
    for seed in range(20):
        order, factors = color_jitter_draws(np.random.default_rng(seed), 0.4, 0.3, 0.5, 0.1)
        want = image
        for i in order:
            want = adjust[i](want, factors[i])
        got = color_jitter(image, np.random.default_rng(seed), 0.4, 0.3, 0.5, 0.1)
        np.testing.assert_array_equal(pixels(got), pixels(want))


def test_color_jitter_draws_follow_torchvision_get_params():
    rng = np.random.default_rng(0)
    orders, factors = zip(*(color_jitter_draws(rng, 1.5, 0.4, 0.2, 0.1) for _ in range(4800)))
    assert all(sorted(order) == [0, 1, 2, 3] for order in orders)
    permutations = {}
    for order in orders:
        permutations[tuple(order)] = permutations.get(tuple(order), 0) + 1
    assert len(permutations) == 24 and all(abs(count - 200) < 70 for count in permutations.values())
    factors = np.array(factors)
    for column, (low, high) in enumerate([(0.0, 2.5), (0.6, 1.4), (0.8, 1.2), (-0.1, 0.1)]):
        values = factors[:, column]
        assert low <= values.min() and values.max() <= high
        assert abs(values.mean() - (low + high) / 2) < 0.03 * (high - low)
    order, factors = color_jitter_draws(rng, 0.4, 0.0, 0.4, 0.0)
    assert factors[1] is None and factors[3] is None


def test_parse_color_jitter():
    assert parse_color_jitter(0.4) == (0.4, 0.4, 0.4, 0.0)
    assert parse_color_jitter(1) == (1.0, 1.0, 1.0, 0.0)
    assert parse_color_jitter([0.1, 0.2, 0.3]) == (0.1, 0.2, 0.3, 0.0)
    assert parse_color_jitter((0.1, 0.2, 0.3, 0.5)) == (0.1, 0.2, 0.3, 0.5)
    for bad in (True, "0.4", [0.1, 0.2], [0.1, 0.2, 0.3, 0.1, 0.1], [0.1, "a", 0.3], None):
        with pytest.raises(ValueError, match=r"data.augment.color_jitter: expected a number or a list of 3 or 4"):
            parse_color_jitter(bad, "data.augment.color_jitter")
    for bad in (-0.1, [0.1, 0.2, 0.3, 0.6], [0.1, 0.2, 0.3, -0.1], float("inf")):
        with pytest.raises(ValueError, match=r"color_jitter: brightness, contrast and saturation must be >= 0"):
            parse_color_jitter(bad)


# ---- random erasing against timm -------------------------------------------------------------------

class _NumpyAsRandom:
    """Python's ``random`` API (as timm's RandomErasing calls it) drawing from a numpy generator
    the same way random_erase does."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def random(self):
        return self.rng.random()

    def uniform(self, a, b):
        return self.rng.uniform(a, b)

    def randint(self, a, b):
        return int(self.rng.integers(a, b + 1))


@pytest.mark.torch
@pytest.mark.parametrize("max_count", [1, 3])
def test_random_erase_geometry_equals_timms(max_count, monkeypatch):
    _, re_module, _ = references()
    import torch

    sizes = [(20, 24), (3, 3), (1, 40), (64, 9), (224, 224)]
    erased = 0
    for seed in range(150):
        height, width = sizes[seed % len(sizes)]
        monkeypatch.setattr(re_module, "random", _NumpyAsRandom(seed))
        tensor = torch.ones(3, height, width)
        re_module.RandomErasing(0.7, mode="const", max_count=max_count, device="cpu")(tensor)
        want = (tensor == 0).all(0).numpy()
        array = np.full((height, width, 3), 255, np.uint8)
        random_erase(array, np.random.default_rng(seed), 0.7, mean=FILL, max_count=max_count)
        got = (array == FILL).all(-1)
        np.testing.assert_array_equal(got, want, err_msg=f"seed {seed} {height}x{width}")
        assert ((array == 255).all(-1) | got).all()
        erased += got.any()
    assert erased > 50


def test_erase_boxes_stay_inside_with_the_areas_and_aspects_of_the_definition():
    rng = np.random.default_rng(0)
    height, width = 60, 80
    boxes = [erase_box(rng, height, width) for _ in range(3000)]
    assert all(box is not None for box in boxes)
    top, left, h, w = np.array(boxes).T
    assert (top >= 0).all() and (left >= 0).all() and (top + h <= height).all() and (left + w <= width).all()
    assert (h < height).all() and (w < width).all()
    area = h * w / (height * width)
    assert area.min() > 0.015 and area.max() < 0.36  # [0.02, 1/3] up to the rounding of the sides
    aspect = np.log(h / w)
    assert aspect.min() > math.log(0.3) - 0.2 and aspect.max() < -math.log(0.3) + 0.2
    assert aspect.min() < math.log(0.3) + 0.2 and aspect.max() > -math.log(0.3) - 0.2  # both ends reached
    assert erase_box(rng, 1, 1)[2:] == (0, 0)  # as timm's: a 1x1 image gets an empty box


def test_erase_probability_and_fills():
    rng = np.random.default_rng(0)
    image = np.asarray(structured_image(40, 40))
    erased = sum(not np.array_equal(random_erase(image.copy(), rng, 0.25, mean=FILL), image) for _ in range(2000))
    assert abs(erased / 2000 - 0.25) < 0.03
    mean, std = (124.0, 116.3, 103.5), (58.4, 57.1, 57.4)
    for mode in ("const", "rand", "pixel"):
        array = np.zeros((100, 100, 3), np.uint8)
        random_erase(array, np.random.default_rng(3), 1.0, mean=mean, std=std, mode=mode, min_area=0.3)
        block = array[(array != 0).any(-1)]
        assert len(block) >= 0.25 * 100 * 100
        if mode == "const":
            assert (block == np.round(mean)).all()
        elif mode == "rand":
            assert (block == block[0]).all() and not (block[0] == np.round(mean)).all()
        else:
            np.testing.assert_allclose(block.mean(0), mean, atol=3)
            np.testing.assert_allclose(block.std(0), std, rtol=0.1)


def test_erase_rejects_bad_input_in_one_line():
    image = np.zeros((8, 8, 3), np.uint8)
    cases = [(image.astype(np.float32), {}, "expected a uint8 (H, W, C) array"),
             (image[..., 0], {}, "expected a uint8 (H, W, C) array"),
             (np.asarray(Image.fromarray(image)), {}, "read-only"),
             (image, {"mode": "noise"}, "mode must be one of"),
             (image, {"mean": (1, 2)}, "one value per channel"),
             (image, {"mode": "pixel"}, "mean and std need one value per channel"),
             (image, {"max_count": 0}, "1 <= min_count <= max_count")]
    for array, overrides, message in cases:
        kwargs = {"mean": FILL, **overrides}
        with pytest.raises(ValueError, match=re.escape(message)):
            random_erase(array, np.random.default_rng(0), 0.5, **kwargs)


def test_mean_fill_is_timms_img_mean():
    assert mean_fill((0.485, 0.456, 0.406)) == FILL
    assert mean_fill((1.0, 0.0, 0.5)) == (255, 0, 128)


# ---- determinism ------------------------------------------------------------------------------------

def _augment(rng, policy, image):
    out = color_jitter(auto_augment(image, policy, rng), rng, 0.4, 0.4, 0.4, 0.1)
    array = np.array(out)
    return random_erase(array, rng, 1.0, mean=FILL, std=(58, 57, 57), mode="pixel")


def test_same_generator_state_same_image_and_positions_differ():
    policy = parse_auto_augment("rand-m9-n3-p1-mstd0.5", fill=FILL)
    image = structured_image()
    first = [_augment(example_rng(7, 3, position), policy, image) for position in range(6)]
    again = [_augment(example_rng(7, 3, position), policy, image) for position in range(6)]
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    for i in range(6):
        for j in range(i):
            assert not np.array_equal(first[i], first[j]), (i, j)
    assert draw_layers(policy, example_rng(7, 4, 0)) != draw_layers(policy, example_rng(7, 3, 0))
