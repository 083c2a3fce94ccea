"""ConvNeXt-T as in torchvision (``torchvision.models.convnext_tiny``):
28,589,128 parameters for 1000 classes.

``features.0`` is the 4x4/4 patchify stem (conv with bias, LayerNorm), then
``features.1``, ``.3``, ``.5``, ``.7`` hold 3, 3, 9, 3 blocks at widths 96,
192, 384, 768 and ``features.2``, ``.4``, ``.6`` downsample (LayerNorm, 2x2/2
conv); global average pooling and ``classifier`` (``.0`` LayerNorm, ``.1``
flatten, ``.2`` linear) end the network.  Every LayerNorm normalises the
channels of each position (torchvision's ``LayerNorm2d``), ``eps=1e-6``.
A block (torchvision's ``CNBlock``) is ``x + stochastic_depth(layer_scale *
block(x))`` with ``block`` = ``.0`` 7x7 depthwise conv (bias), ``.2``
LayerNorm, ``.3`` linear to 4x the channels, ``.4`` GELU (exact, erf), ``.5``
linear back (torchvision's ``.1`` and ``.6`` are NCHW<->NHWC permutes, which
NHWC needs not); ``layer_scale`` is a learned per-channel factor, initially
``1e-6``, and the stochastic depth rate grows linearly from 0 at the first
block to ``stochastic_depth_prob`` at the last.  Initialisation as
torchvision: convolution and linear weights ``trunc_normal(std=0.02)``, zero
biases, LayerNorm ones/zeros.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.registry import register

_INIT = dict(w_init=tv.trunc_normal(0.02), b_init=tv.ZEROS)
# (channels, blocks) per stage.
_TINY = ((96, 3), (192, 3), (384, 9), (768, 3))


def _norm():
    return L.LayerNorm(axes=-1, eps=1e-6)


def cn_block(channels: int, layer_scale: float, stochastic_depth_prob: float):
    """ConvNeXt's block (torchvision's ``CNBlock``).

    Arguments:
        channels: channels of the input and output.
        layer_scale: initial value of the per-channel ``layer_scale``.
        stochastic_depth_prob: drop rate of the residual branch.

    Returns:
        A residual Layer with children ``block``, ``layer_scale``, ``stochastic_depth``.
    """
    block = L.serial(("0", L.Conv2D(channels, 7, padding=3, groups=channels, **_INIT)),
                     ("2", _norm()), ("3", L.Linear(4 * channels, **_INIT)), ("4", L.Gelu()),
                     ("5", L.Linear(channels, **_INIT)))
    return L.residual(("block", block), ("layer_scale", L.LayerScale(layer_scale)),
                      ("stochastic_depth", L.StochasticDepth(stochastic_depth_prob)))


@register("convnext_tiny", input_shape=(1, 224, 224, 3))
def convnext_tiny(*, num_classes: int = 1000, stochastic_depth_prob: float = 0.1,
                  layer_scale: float = 1e-6):
    """ConvNeXt-T.

    Arguments:
        num_classes: output size of ``classifier.2``.
        stochastic_depth_prob: stochastic depth rate of the last block (block
            ``i`` of 18 drops with ``stochastic_depth_prob * i / 17``).
        layer_scale: initial value of every block's ``layer_scale``.

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    if not 0.0 <= stochastic_depth_prob <= 1.0:
        raise ValueError(f"convnext_tiny: stochastic_depth_prob must be in [0, 1], "
                         f"got {stochastic_depth_prob!r}")
    total = sum(n for _, n in _TINY)
    features = [L.serial(L.Conv2D(_TINY[0][0], 4, stride=4, **_INIT), _norm())]
    index = 0
    for stage, (channels, count) in enumerate(_TINY):
        blocks = []
        for _ in range(count):
            blocks.append(cn_block(channels, layer_scale,
                                   stochastic_depth_prob * index / (total - 1.0)))
            index += 1
        features.append(L.serial(*blocks))
        if stage + 1 < len(_TINY):
            features.append(L.serial(_norm(), L.Conv2D(_TINY[stage + 1][0], 2, stride=2,
                                                       **_INIT)))
    classifier = L.serial(_norm(), L.Flatten(), L.Linear(num_classes, **_INIT))
    return L.serial(("features", L.serial(*features)), ("avgpool", L.GlobalAvgPool2D()),
                    ("classifier", classifier))
