"""timm's RandAugment (``auto_augment: rand-m9-n2-mstd0.5-inc1``) and TrivialAugment on the host.

The ops, their names and their magnitude-to-argument mappings are timm's
(``timm/data/auto_augment.py``), re-implemented with Pillow: a magnitude ``m`` in ``[0, mmax]``
(``mmax`` 10 by default) becomes the fraction ``m / 10`` of each op's range, and signed ops
(rotate, shear, translate, the ``*Increasing`` enhancements) are negated with probability 1/2.
An image gets ``n`` layers; each picks an op (uniformly with replacement, or by timm's weights
without replacement for ``t``-sets), is applied with probability ``p``, and draws its
magnitude from ``N(m, mstd)`` (``mstd > 100``: uniform in ``[0, m]``) clipped to ``[0, mmax]``.
Geometric ops fill uncovered pixels with the dataset mean and resample bilinearly, bicubically
or with a random one of the two (timm's ``interpolation: random``).

Every draw comes from the ``np.random.Generator`` passed in, never from Python's ``random``:
`draw_layers` makes all of an image's draws, `apply_op` applies one op, so the same generator
state gives the same image whichever process makes it. `photometric.parse_auto_augment` reads
any ``auto_augment`` string (this module's and `augmix`'s); `photometric.auto_augment` applies it.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

LEVEL_DENOM = 10.0
TRANSLATE_PCT = 0.45  # timm's translate range for RandAugment, a fraction of the image side
DEFAULT_FILL = (128, 128, 128)
EXAMPLE = "rand-m9-n2-mstd0.5-inc1"

RAND_TRANSFORMS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd",
                   "Color", "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel",
                   "TranslateYRel")
RAND_INCREASING_TRANSFORMS = ("AutoContrast", "Equalize", "Invert", "Rotate", "PosterizeIncreasing",
                              "SolarizeIncreasing", "SolarizeAdd", "ColorIncreasing", "ContrastIncreasing",
                              "BrightnessIncreasing", "SharpnessIncreasing", "ShearX", "ShearY",
                              "TranslateXRel", "TranslateYRel")
# timm's weighted transform sets, chosen by `-t<name>` (drawn without replacement by weight).
WEIGHTED_TRANSFORMS = {
    "weights": {"Rotate": 3, "ShearX": 2, "ShearY": 2, "TranslateXRel": 1, "TranslateYRel": 1,
                "ColorIncreasing": .25, "SharpnessIncreasing": 0.25, "AutoContrast": 0.25,
                "SolarizeIncreasing": .05, "SolarizeAdd": .05, "ContrastIncreasing": .05,
                "BrightnessIncreasing": .05, "Equalize": .05, "PosterizeIncreasing": 0.05, "Invert": 0.05},
    "3aw": {"SolarizeIncreasing": 6, "Desaturate": 6, "GaussianBlur": 6, "Rotate": 3, "ShearX": 2, "ShearY": 2,
            "PosterizeIncreasing": 1, "AutoContrast": 1, "ColorIncreasing": 1, "SharpnessIncreasing": 1,
            "ContrastIncreasing": 1, "BrightnessIncreasing": 1, "Equalize": 1, "Invert": 1},
}
UNIFORM_TRANSFORMS = {"3a": ("SolarizeIncreasing", "Desaturate", "GaussianBlur")}

_RESAMPLE = {"nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
             "bicubic": Image.Resampling.BICUBIC}


def _enhance(fraction, sign, pct):
    return fraction * 1.8 + 0.1


def _enhance_increasing(fraction, sign, pct):
    return max(0.1, 1.0 + sign * (fraction * 0.9))


def _clamped(low, high):
    def argument(fraction, sign, pct):
        return max(low, min(high, low + (high - low) * fraction))
    return argument


# Op name -> its argument as a function of (m / 10, sign = +1 or -1, translate range); None: the op
# takes none.
_ARGUMENT = {
    "AutoContrast": None, "Equalize": None, "Invert": None,
    "Rotate": lambda fraction, sign, pct: sign * (fraction * 30.0),
    "Posterize": lambda fraction, sign, pct: int(fraction * 4),
    "PosterizeIncreasing": lambda fraction, sign, pct: 4 - int(fraction * 4),
    "Solarize": lambda fraction, sign, pct: min(256, int(fraction * 256)),
    "SolarizeIncreasing": lambda fraction, sign, pct: 256 - min(256, int(fraction * 256)),
    "SolarizeAdd": lambda fraction, sign, pct: min(128, int(fraction * 110)),
    "Color": _enhance, "Contrast": _enhance, "Brightness": _enhance, "Sharpness": _enhance,
    "ColorIncreasing": _enhance_increasing, "ContrastIncreasing": _enhance_increasing,
    "BrightnessIncreasing": _enhance_increasing, "SharpnessIncreasing": _enhance_increasing,
    "ShearX": lambda fraction, sign, pct: sign * (fraction * 0.3),
    "ShearY": lambda fraction, sign, pct: sign * (fraction * 0.3),
    "TranslateXRel": lambda fraction, sign, pct: sign * (fraction * pct),
    "TranslateYRel": lambda fraction, sign, pct: sign * (fraction * pct),
    "Desaturate": _clamped(0.5, 1.0),
    "GaussianBlur": _clamped(0.1, 2.0),
}


def op_argument(name: str, magnitude: float, sign: int = 1, translate_pct: float = TRANSLATE_PCT):
    """timm's argument for op ``name`` at ``magnitude`` (0-10 scale, already clipped); ``sign``
    (+1 or -1) is the random negation of the signed ops; ``translate_pct`` the translate range
    (RandAugment's 0.45, AugMix's 0.3). None for ops without an argument."""
    level = _ARGUMENT[name]
    return None if level is None else level(magnitude / LEVEL_DENOM, sign, translate_pct)


def _affine(image, coefficients, fill, resample):
    return image.transform(image.size, Image.Transform.AFFINE, coefficients, resample, fillcolor=fill)


def _posterize(image, bits):
    """Keeps the ``bits`` high bits of each channel: ``ImageOps.posterize`` for 1-8 bits, and
    black for 0 bits, which timm's Posterize draws below magnitude 2.5 and PosterizeIncreasing
    at 10, and which Pillow 13 refuses (timm then raises)."""
    mask = 256 - 2 ** (8 - bits)
    return image.point([i & mask for i in range(256)] * len(image.getbands()))


def _solarize_add(image, add, threshold=128):
    values = np.arange(256)
    lut = np.where(values < threshold, np.minimum(255, values + add), values)
    return image.point(np.tile(lut, len(image.getbands())).tolist())


_OPS = {
    "AutoContrast": lambda image, arg, fill, resample: ImageOps.autocontrast(image),
    "Equalize": lambda image, arg, fill, resample: ImageOps.equalize(image),
    "Invert": lambda image, arg, fill, resample: ImageOps.invert(image),
    "Rotate": lambda image, arg, fill, resample: image.rotate(arg, resample=resample, fillcolor=fill),
    "Posterize": lambda image, arg, fill, resample: image if arg >= 8 else _posterize(image, arg),
    "Solarize": lambda image, arg, fill, resample: ImageOps.solarize(image, arg),
    "SolarizeAdd": lambda image, arg, fill, resample: _solarize_add(image, arg),
    "Color": lambda image, arg, fill, resample: ImageEnhance.Color(image).enhance(arg),
    "Contrast": lambda image, arg, fill, resample: ImageEnhance.Contrast(image).enhance(arg),
    "Brightness": lambda image, arg, fill, resample: ImageEnhance.Brightness(image).enhance(arg),
    "Sharpness": lambda image, arg, fill, resample: ImageEnhance.Sharpness(image).enhance(arg),
    "ShearX": lambda image, arg, fill, resample: _affine(image, (1, arg, 0, 0, 1, 0), fill, resample),
    "ShearY": lambda image, arg, fill, resample: _affine(image, (1, 0, 0, arg, 1, 0), fill, resample),
    "TranslateXRel": lambda image, arg, fill, resample: _affine(
        image, (1, 0, arg * image.size[0], 0, 1, 0), fill, resample),
    "TranslateYRel": lambda image, arg, fill, resample: _affine(
        image, (1, 0, 0, 0, 1, arg * image.size[1]), fill, resample),
    "Desaturate": lambda image, arg, fill, resample: ImageEnhance.Color(image).enhance(
        min(1.0, max(0.0, 1.0 - arg))),
    "GaussianBlur": lambda image, arg, fill, resample: image.filter(ImageFilter.GaussianBlur(radius=arg)),
}
_OPS.update({name + "Increasing": _OPS[name]
             for name in ("Posterize", "Solarize", "Color", "Contrast", "Brightness", "Sharpness")})
OP_NAMES = tuple(_ARGUMENT)


def apply_op(image, name: str, magnitude: float, sign: int = 1, *, fill=DEFAULT_FILL,
             resample=Image.Resampling.BILINEAR, translate_pct: float = TRANSLATE_PCT):
    """Applies timm's op ``name`` at ``magnitude`` to an RGB ``PIL.Image``; returns a ``PIL.Image``.

    Arguments:
        magnitude: on timm's 0-10 scale, already noised and clipped (`draw_layers` does both).
        sign: +1, or -1 to negate a signed op's argument (ignored by the others).
        fill: the RGB ``uint8`` colour that geometric ops leave where no pixel maps (timm's
            ``img_mean``; `photometric.mean_fill` makes it from the dataset mean).
        resample: the Pillow filter of geometric ops.
        translate_pct: the range of the translations, a fraction of the image side.
    """
    return _OPS[name](image, op_argument(name, magnitude, sign, translate_pct), tuple(fill), resample)


class RandAugment(NamedTuple):
    """A parsed ``auto_augment`` string: what `draw_layers` draws from.

    Fields:
        ops: the op names a layer picks from.
        weights: one probability per op (timm's ``t``-sets: ``num_layers`` distinct ops are drawn
            by weight), or None (each layer picks uniformly, with replacement).
        num_layers: ``n``, ops per image.
        magnitude: ``m``, on the 0-10 scale.
        prob: ``p``, the probability that each layer is applied.
        magnitude_std: ``mstd``; 0: fixed magnitude, ``inf``: uniform in ``[0, m]``.
        magnitude_max: ``mmax``, the upper clip of the drawn magnitude.
        fill: RGB ``uint8`` fill of geometric ops.
        resample: the Pillow filters geometric ops choose from (one: fixed; two: timm's random).
    """

    ops: tuple
    weights: tuple | None = None
    num_layers: int = 2
    magnitude: float = 10.0
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float = LEVEL_DENOM
    fill: tuple = DEFAULT_FILL
    resample: tuple = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC)


class Layer(NamedTuple):
    """One op with its draws (a RandAugment layer or an AugMix chain step): `apply_op`'s arguments."""

    name: str
    magnitude: float
    sign: int
    resample: int


def auto_augment_error(value, why: str) -> ValueError:
    """The one-line error for a bad ``auto_augment`` string ``value``."""
    return ValueError(f"auto_augment {value!r}: {why}; expected e.g. {EXAMPLE!r}, 'trivialaugment' "
                      f"or 'augmix-m5-w4-d2'")


def resample_choices(value, interpolation) -> tuple:
    """The Pillow filters of geometric ops for the ``interpolation`` name (``'random'``: timm's
    bilinear or bicubic per op); ``value`` is the ``auto_augment`` string named in the error."""
    if interpolation == "random":
        return _RESAMPLE["bilinear"], _RESAMPLE["bicubic"]
    if interpolation not in _RESAMPLE:
        raise auto_augment_error(value, f"geometric ops resample with 'random' or one of {sorted(_RESAMPLE)}, "
                          f"not interpolation {interpolation!r}")
    return (_RESAMPLE[interpolation],)


def _transform_set(value, name: str, increasing: bool):
    """``(ops, weights)`` for a ``t`` section (``None``: the plain or increasing set)."""
    if name is None:
        return (RAND_INCREASING_TRANSFORMS if increasing else RAND_TRANSFORMS), None
    if name in UNIFORM_TRANSFORMS:
        return UNIFORM_TRANSFORMS[name], None
    if name not in WEIGHTED_TRANSFORMS:
        known = sorted([*WEIGHTED_TRANSFORMS, *UNIFORM_TRANSFORMS])
        raise auto_augment_error(value, f"unknown transform set 't{name}' (known: {known})")
    ops, weights = zip(*WEIGHTED_TRANSFORMS[name].items())
    weights = np.asarray(weights, np.float64)
    return tuple(ops), tuple((weights / weights.sum()).tolist())


def policy_sections(value: str, parsers: dict) -> dict:
    """The ``key -> value`` sections after the policy name of an ``auto_augment`` string, each
    ``<key><number>`` parsed by ``parsers[key]`` (timm's formats), or ``t<name>`` when ``parsers``
    has ``t``."""
    fields = {}
    for section in value.split("-")[1:]:
        if section.startswith("t") and "t" in parsers:
            fields["t"] = section[1:]
            continue
        match = re.fullmatch(r"([a-z]+)(.*)", section)
        if match is None or match.group(1) not in parsers:
            raise auto_augment_error(value, f"unknown section {section!r} (known: {', '.join(parsers)})")
        try:
            fields[match.group(1)] = parsers[match.group(1)](match.group(2))
        except ValueError:
            raise auto_augment_error(value, f"section {section!r} needs a number") from None
    return fields


def parse_rand_augment(value: str, *, fill=DEFAULT_FILL, interpolation: str = "random") -> RandAugment:
    """Parses timm's RandAugment ``auto_augment`` string, or ``trivialaugment``.

    ``rand-<sections>``: RandAugment with timm's sections, in any order: ``m`` (int magnitude,
    default 10), ``n`` (int layers, 2), ``p`` (float probability per layer, 0.5), ``mstd``
    (float magnitude noise, 0; above 100 means uniform), ``mmax`` (int clip, 10), ``inc``
    (0/1: the ``*Increasing`` ops), ``t<name>`` (transform set ``weights``, ``3a`` or ``3aw``).
    ``trivialaugment``: TrivialAugment on RandAugment's op set (one op per image, always
    applied, magnitude uniform in ``[0, 10]``), timm's ``rand-n1-m10-mstd101-p1``.

    Arguments:
        fill: RGB ``uint8`` fill of geometric ops (`photometric.mean_fill` of the dataset mean).
        interpolation: ``'random'`` (bilinear or bicubic per op, as timm) or the name of one.

    Raises:
        ValueError: one line naming the string and showing a valid one.
    """
    resample = resample_choices(value, interpolation)
    fill = tuple(int(c) for c in fill)
    if value == "trivialaugment":
        return RandAugment(RAND_TRANSFORMS, None, 1, 10.0, 1.0, float("inf"), LEVEL_DENOM, fill, resample)
    if value.split("-")[0] != "rand":
        raise auto_augment_error(value, "not a RandAugment string 'rand-...'")
    fields = policy_sections(value, {"m": int, "n": int, "p": float, "mstd": float, "mmax": int, "inc": int,
                                     "t": str})
    ops, weights = _transform_set(value, fields.get("t"), bool(fields.get("inc", 0)))
    mstd = fields.get("mstd", 0.0)
    num_layers = fields.get("n", 2)
    if weights is not None and num_layers > len(ops):
        raise auto_augment_error(value, f"n{num_layers} distinct ops drawn from a set of {len(ops)}")
    return RandAugment(ops, weights, num_layers, float(fields.get("m", LEVEL_DENOM)), fields.get("p", 0.5),
                       float("inf") if mstd > 100 else mstd, float(fields.get("mmax", 0) or LEVEL_DENOM),
                       fill, resample)


def draw_op(rng: np.random.Generator, name: str, magnitude: float, magnitude_std: float, magnitude_max: float,
            resample: tuple) -> Layer:
    """One op's draws, in this order: its magnitude (``N(magnitude, magnitude_std)``, or uniform in
    ``[0, magnitude]`` when ``magnitude_std`` is ``inf``) clipped to ``[0, magnitude_max]``, its
    sign (-1 with probability 1/2) and its filter (uniform over ``resample``)."""
    if magnitude_std == float("inf"):
        drawn = rng.uniform(0.0, magnitude)
    else:
        drawn = magnitude + magnitude_std * rng.standard_normal()
    sign = -1 if rng.random() < 0.5 else 1
    filter_ = resample[int(rng.integers(0, len(resample)))]
    return Layer(name, max(0.0, min(float(drawn), magnitude_max)), sign, filter_)


def draw_layers(policy: RandAugment, rng: np.random.Generator) -> list[Layer]:
    """All of one image's draws: the layers applied, in order (skipped layers are left out).

    The ops of the ``num_layers`` layers are drawn first; then each layer, applied or not, draws
    a uniform for ``prob`` and `draw_op`'s draws, so the number of draws is fixed by the policy.
    """
    if policy.weights is None:
        picks = rng.integers(0, len(policy.ops), size=policy.num_layers)
    else:
        picks = rng.choice(len(policy.ops), size=policy.num_layers, replace=False, p=policy.weights)
    layers = []
    for pick in picks:
        applied = rng.random() < policy.prob
        layer = draw_op(rng, policy.ops[int(pick)], policy.magnitude, policy.magnitude_std, policy.magnitude_max,
                        policy.resample)
        if applied:
            layers.append(layer)
    return layers


def rand_augment(image, policy: RandAugment, rng: np.random.Generator):
    """Applies `draw_layers`'s layers to an RGB ``PIL.Image``; returns a ``PIL.Image``."""
    for layer in draw_layers(policy, rng):
        image = apply_op(image, layer.name, layer.magnitude, layer.sign, fill=policy.fill,
                         resample=layer.resample)
    return image
