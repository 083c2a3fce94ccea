"""Mixup and CutMix of a batch, on the device, inside the train step.

Both pair each image with the batch read backwards (example ``i`` with ``N - 1 - i``, as
timm's batch mode does) and train on the pair with weight ``lam`` on the first label and
``1 - lam`` on the second: the loss is ``lam * CE(logits, y) + (1 - lam) * CE(logits, y_rev)``,
which equals the cross-entropy against the mixed (and label-smoothed) target, since that loss
is linear in the target distribution.

- **Mixup** (Zhang et al. 2018): ``x = lam * x + (1 - lam) * x_rev`` with
  ``lam ~ Beta(alpha, alpha)``.
- **CutMix** (Yun et al. 2019): a box of ``x_rev`` is pasted into ``x``. Its side is
  ``sqrt(1 - lam)`` of the image's (``int(H * sqrt(1 - lam))`` rows), its centre uniform over
  the image, clipped at the border; ``lam`` is then recomputed as the fraction of ``x`` that is
  left, ``1 - box area / (H * W)`` (timm's ``correct_lam``).

One draw per batch picks what the batch gets: CutMix with probability ``cutmix_prob``, else
Mixup with probability ``mixup_prob``, else nothing (``lam = 1``). Every draw comes from the key
the step is given, so the batch of step ``s`` is mixed the same way after a resume. Under
``shard_map``/``pmap`` each device mixes its own part of the batch (as timm does per GPU).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class MixSpec(NamedTuple):
    """What a run mixes: Beta parameters (0 = off) and the probability of each, per batch."""

    mixup_alpha: float = 0.0
    mixup_prob: float = 1.0
    cutmix_alpha: float = 0.0
    cutmix_prob: float = 1.0

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


class MixDraw(NamedTuple):
    """The random choices for one batch: ``kind`` 0 none, 1 mixup, 2 cutmix; ``lam`` the weight
    of the batch's own images (mixup) or the box side fraction's complement (cutmix, before the
    clipping correction); ``centre`` (row, col) of the cutmix box."""

    kind: jax.Array
    lam: jax.Array
    centre: jax.Array


def draw(key, spec: MixSpec, image_hw: tuple[int, int]) -> MixDraw:
    """The batch's choices (:class:`MixDraw`) from ``key``.

    ``lam`` is ``Beta(alpha, alpha)`` of the batch's kind, drawn from that kind's key (the second
    of ``split(key, 5)`` for mixup, the third for CutMix); 1 for a batch left unmixed.  With both
    kinds on it is one draw whose parameter and key the kind picks: a batch uses one of the two,
    and each Beta draw is two Gamma rejection loops, most of a small step's kernels."""
    keys = jax.random.split(key, 5)
    k_pick, k_mix, k_cut, k_row, k_col = keys
    u = jax.random.uniform(k_pick)
    cut_p = spec.cutmix_prob if spec.cutmix_alpha > 0 else 0.0
    mix_p = spec.mixup_prob if spec.mixup_alpha > 0 else 0.0
    kind = jnp.where(u < cut_p, 2, jnp.where(u < cut_p + mix_p, 1, 0)).astype(jnp.int32)
    on = [(k, a, k_lam) for k, a, k_lam in ((1, spec.mixup_alpha, k_mix), (2, spec.cutmix_alpha, k_cut))
          if a > 0]
    lam = 1.0
    if len(on) == 1:
        (one, alpha, k_lam), = on
        lam = jnp.where(kind == one, jax.random.beta(k_lam, alpha, alpha), 1.0)
    elif on:
        alpha = jnp.where(kind == 2, spec.cutmix_alpha, spec.mixup_alpha)
        k_lam = keys[jnp.where(kind == 2, 2, 1)]  # k_cut or k_mix
        lam = jnp.where(kind == 0, 1.0, jax.random.beta(k_lam, alpha, alpha))
    lam = jnp.asarray(lam, jnp.float32)
    h, w = image_hw
    centre = jnp.stack([jax.random.randint(k_row, (), 0, h), jax.random.randint(k_col, (), 0, w)])
    return MixDraw(kind, lam, centre)


def cutmix_box(lam, centre, image_hw: tuple[int, int]):
    """``(top, bottom, left, right)`` of the CutMix box (end exclusive): sides
    ``int(H * sqrt(1 - lam))`` and ``int(W * sqrt(1 - lam))`` around ``centre``, clipped."""
    h, w = image_hw
    ratio = jnp.sqrt(1.0 - lam)
    cut_h = jnp.floor(h * ratio).astype(jnp.int32)
    cut_w = jnp.floor(w * ratio).astype(jnp.int32)
    top = jnp.clip(centre[0] - cut_h // 2, 0, h)
    bottom = jnp.clip(centre[0] + cut_h // 2, 0, h)
    left = jnp.clip(centre[1] - cut_w // 2, 0, w)
    right = jnp.clip(centre[1] + cut_w // 2, 0, w)
    return top, bottom, left, right


def apply(images, labels, mix: MixDraw):
    """Mix a batch as ``mix`` says.

    Arguments:
        images: ``(N, H, W, C)`` floating images (already normalised).
        labels: ``(N,)`` integer labels.
        mix: from :func:`draw`.

    Returns:
        ``(images, labels, other_labels, lam)``: the mixed images, the labels weighted
        ``lam`` and those (of the reversed batch) weighted ``1 - lam``; for a CutMix batch
        ``lam`` is the fraction of each image left after the box was pasted.
    """
    n, h, w = images.shape[:3]
    other = images[::-1]
    top, bottom, left, right = cutmix_box(mix.lam, mix.centre, (h, w))
    rows = jnp.arange(h)[:, None]
    cols = jnp.arange(w)[None, :]
    inside = (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)
    cut_lam = 1.0 - jnp.sum(inside).astype(jnp.float32) / (h * w)
    lam = jnp.where(mix.kind == 2, cut_lam, mix.lam).astype(jnp.float32)
    lam_x = lam.astype(images.dtype)
    mixed = jnp.where(mix.kind == 1, lam_x * images + (1 - lam_x) * other, images)
    mixed = jnp.where((mix.kind == 2) & inside[None, :, :, None], other, mixed)
    return mixed, labels, labels[::-1], lam
