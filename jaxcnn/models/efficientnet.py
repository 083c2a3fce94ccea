"""EfficientNet-B0 as in torchvision (``torchvision.models.efficientnet_b0``):
5,288,548 parameters for 1000 classes.

``features.0`` is the 3x3/2 stem (conv, BatchNorm, SiLU as ``.0``, ``.1``,
``.2``), ``features.1`` .. ``features.7`` the seven stages of MBConv blocks
(``features.2.0``, ``features.2.1``, ...), ``features.8`` the 1x1 convolution
to 1280 channels; then global average pooling and ``classifier`` (``.0``
dropout, ``.1`` linear).  A block's layers sit in ``block`` as in
torchvision: the expanding 1x1 conv-BN-SiLU (absent at expansion 1), the
depthwise conv-BN-SiLU, the squeeze-excitation (``fc1``, ``fc2``: squeeze to
a quarter of the block's input channels, SiLU, sigmoid gate) and the
projecting 1x1 conv-BN.  Blocks that keep their shape add their input back
after stochastic depth (``mode="row"``) whose rate grows linearly with the
block's index, ``stochastic_depth_prob * i / 16``.  Initialisation as
torchvision: convolutions ``kaiming_normal(fan_out)``, zero conv biases,
BatchNorm ones/zeros, the classifier ``U(+-1/sqrt(num_classes))`` with a zero bias.
"""
from __future__ import annotations

import math

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.mobilenet import make_divisible
from jaxcnn.models.registry import register

# (expansion, kernel, first stride, input channels, output channels, blocks): the paper's table 1.
_B0 = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
       (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))


def _conv_bn_silu(out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1,
                  activation: bool = True):
    items = [L.Conv2D(out_channels, kernel_size, stride=stride, padding=(kernel_size - 1) // 2,
                      groups=groups, use_bias=False, w_init=tv.CONV_FAN_OUT), L.BatchNorm()]
    if activation:
        items.append(L.Silu())
    return L.serial(*items)


def mbconv(in_channels: int, out_channels: int, expansion: float, kernel_size: int, stride: int,
           stochastic_depth_prob: float):
    """EfficientNet's MBConv block (torchvision's ``MBConv``).

    Arguments:
        in_channels: channels of the input.
        out_channels: channels of the output.
        expansion: expanded channels = ``make_divisible(in_channels * expansion)``.
        kernel_size: of the depthwise convolution.
        stride: of the depthwise convolution.
        stochastic_depth_prob: drop rate of the residual branch (used only when
            the block adds its input back).

    Returns:
        A Layer with child ``block``; a residual one (with ``stochastic_depth``
        after ``block``) when ``stride == 1`` and the channel count is kept.
    """
    expanded = make_divisible(in_channels * expansion, 8)
    body = []
    if expanded != in_channels:
        body.append(_conv_bn_silu(expanded, 1))
    body += [_conv_bn_silu(expanded, kernel_size, stride, groups=expanded),
             L.SqueezeExcitation(expanded, max(1, in_channels // 4), activation=L.Silu,
                                 conv_init=tv.CONV_FAN_OUT),
             _conv_bn_silu(out_channels, 1, activation=False)]
    block = ("block", L.serial(*body))
    if stride == 1 and in_channels == out_channels:
        return L.residual(block, ("stochastic_depth", L.StochasticDepth(stochastic_depth_prob)))
    return L.serial(block)


@register("efficientnet_b0", input_shape=(1, 224, 224, 3))
def efficientnet_b0(*, num_classes: int = 1000, dropout: float = 0.2,
                    stochastic_depth_prob: float = 0.2):
    """EfficientNet-B0.

    Arguments:
        num_classes: output size of ``classifier.1``.
        dropout: dropout rate before the classifier.
        stochastic_depth_prob: stochastic depth rate of the last block (the
            ``i``-th of the 16 blocks drops with ``stochastic_depth_prob * i / 16``).

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    if not 0.0 <= stochastic_depth_prob <= 1.0:
        raise ValueError(f"efficientnet_b0: stochastic_depth_prob must be in [0, 1], "
                         f"got {stochastic_depth_prob!r}")
    total = sum(row[-1] for row in _B0)
    features = [_conv_bn_silu(_B0[0][3], 3, stride=2)]
    index = 0
    for expansion, kernel, stride, in_channels, out_channels, count in _B0:
        stage = []
        for i in range(count):
            stage.append(mbconv(in_channels if i == 0 else out_channels, out_channels, expansion,
                                kernel, stride if i == 0 else 1,
                                stochastic_depth_prob * index / total))
            index += 1
        features.append(L.serial(*stage))
    features.append(_conv_bn_silu(4 * _B0[-1][4], 1))
    classifier = L.serial(L.Dropout(dropout),
                          L.Linear(num_classes, w_init=tv.uniform(1 / math.sqrt(num_classes)),
                                   b_init=tv.ZEROS))
    return L.serial(("features", L.serial(*features)), ("avgpool", L.GlobalAvgPool2D()),
                    ("classifier", classifier))
