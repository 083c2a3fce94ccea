"""timm's AugMix (``auto_augment: augmix-m5-w4-d2``) on the host, with `rand_augment`'s ops.

An image is augmented by ``width`` chains of ``depth`` ops (1 to 3 at random when ``depth`` is
not positive), each op drawn uniformly with replacement from timm's AugMix set and applied at a magnitude
uniform in ``[0, m]`` (or ``N(m, mstd)`` when ``mstd`` is given), translations up to 0.3 of the
side. The chains are mixed with Dirichlet(``alpha``) weights and the mix blended with the image
by a Beta(``alpha``, ``alpha``) factor, in float32 as timm computes it; ``b1`` blends each chain
into the image in turn instead (timm's faster variant, same draws).

Every draw comes from the ``np.random.Generator`` passed in: `draw_augmix` makes them all.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from PIL import Image

from jaxcnn.data.rand_augment import (DEFAULT_FILL, LEVEL_DENOM, Layer, apply_op, auto_augment_error, draw_op,
                                      policy_sections, resample_choices)

AUGMIX_TRANSFORMS = ("AutoContrast", "ColorIncreasing", "ContrastIncreasing", "BrightnessIncreasing",
                     "SharpnessIncreasing", "Equalize", "Rotate", "PosterizeIncreasing", "SolarizeIncreasing",
                     "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
AUGMIX_TRANSLATE_PCT = 0.3


class AugMix(NamedTuple):
    """A parsed ``augmix-...`` string.

    Fields:
        magnitude: ``m`` (0-10 scale).
        width: ``w``, the number of chains.
        depth: ``d``, ops per chain, or 1 to 3 at random when not positive (``d0``, the default -1).
        alpha: ``a``, of the Dirichlet and Beta draws.
        blended: ``b``, each chain blended into the image in turn.
        magnitude_std: ``mstd`` (``inf``, the default: uniform in ``[0, m]``).
        fill: RGB ``uint8`` fill of geometric ops.
        resample: the Pillow filters geometric ops choose from.
    """

    magnitude: float = 3.0
    width: int = 3
    depth: int = -1
    alpha: float = 1.0
    blended: bool = False
    magnitude_std: float = float("inf")
    fill: tuple = DEFAULT_FILL
    resample: tuple = (Image.Resampling.BILINEAR, Image.Resampling.BICUBIC)


def parse_augmix(value: str, *, fill=DEFAULT_FILL, interpolation: str = "random") -> AugMix:
    """Parses timm's ``augmix-<sections>``: ``m`` (int, default 3), ``w`` (int, 3), ``d`` (int,
    -1), ``a`` (float, 1), ``b`` (0/1), ``mstd`` (float; unlike RandAugment's, taken as the std
    even above 100), in any order. Arguments as `rand_augment.parse_rand_augment`'s.

    Raises:
        ValueError: one line naming the string and showing a valid one.
    """
    resample = resample_choices(value, interpolation)
    if value.split("-")[0] != "augmix":
        raise auto_augment_error(value, "not an AugMix string 'augmix-...'")
    fields = policy_sections(value, {"m": int, "w": int, "d": int, "a": float, "b": int, "mstd": float})
    policy = AugMix(float(fields.get("m", 3)), fields.get("w", 3), fields.get("d", -1), fields.get("a", 1.0),
                    bool(fields.get("b", 0)), fields.get("mstd", float("inf")), tuple(int(c) for c in fill),
                    resample)
    if policy.width < 1 or not policy.alpha > 0:
        raise auto_augment_error(value, "AugMix needs w >= 1 and a > 0")
    return policy


class AugMixDraws(NamedTuple):
    """One image's AugMix draws: float32 chain weights (summing to 1), the float32 blend factor
    of the mix, and each chain's ops in order."""

    weights: np.ndarray
    blend: np.float32
    chains: list[list[Layer]]


def draw_augmix(policy: AugMix, rng: np.random.Generator) -> AugMixDraws:
    """All of one image's draws, in this order: the Dirichlet weights, the Beta blend, then per
    chain its depth (when random), its ops and each op's `rand_augment.draw_op` draws."""
    weights = np.float32(rng.dirichlet([policy.alpha] * policy.width))
    blend = np.float32(rng.beta(policy.alpha, policy.alpha))
    chains = []
    for _ in range(policy.width):
        depth = policy.depth if policy.depth > 0 else int(rng.integers(1, 4))
        picks = rng.integers(0, len(AUGMIX_TRANSFORMS), size=depth)
        chains.append([draw_op(rng, AUGMIX_TRANSFORMS[int(i)], policy.magnitude, policy.magnitude_std,
                               LEVEL_DENOM, policy.resample) for i in picks])
    return AugMixDraws(weights, blend, chains)


def _chain(image, chain, fill):
    for layer in chain:
        image = apply_op(image, layer.name, layer.magnitude, layer.sign, fill=fill, resample=layer.resample,
                         translate_pct=AUGMIX_TRANSLATE_PCT)
    return image


def _blended_weights(weights, blend):
    """The per-chain blend factors that, applied in turn, give each chain ``blend * weight``."""
    scaled = weights * blend
    factors, remaining = [], np.float32(1.0)
    for w in scaled[::-1]:
        factor = w / remaining
        remaining = remaining * (np.float32(1.0) - factor)
        factors.append(factor)
    return np.array(factors[::-1], np.float32)


def augmix(image, policy: AugMix, rng: np.random.Generator):
    """Applies AugMix to an RGB ``PIL.Image`` with `draw_augmix`'s draws; returns a ``PIL.Image``.

    Each chain starts from ``image``. Plain: the chains' ``uint8`` results are summed with their
    weights in float32, clipped to ``[0, 255]`` and truncated to ``uint8``, and the sum blended
    with ``image`` by ``blend`` (``Image.blend``). ``blended``: each chain's result is blended
    into the running image in turn by factors that give it the same share.
    """
    draws = draw_augmix(policy, rng)
    if policy.blended:
        mixed = image
        for factor, chain in zip(_blended_weights(draws.weights, draws.blend), draws.chains):
            mixed = Image.blend(mixed, _chain(image, chain, policy.fill), float(factor))
        return mixed
    total = np.zeros((image.height, image.width, len(image.getbands())), np.float32)
    for weight, chain in zip(draws.weights, draws.chains):
        total += weight * np.asarray(_chain(image, chain, policy.fill), np.float32)
    np.clip(total, 0, 255, out=total)
    return Image.blend(image, Image.fromarray(total.astype(np.uint8)), float(draws.blend))
