"""MobileNetV2 as in torchvision (``torchvision.models.mobilenet_v2``):
3,504,872 parameters for 1000 classes at ``width_mult=1``.

``features.0`` is the 3x3/2 stem (conv, BatchNorm, ReLU6 as ``features.0.0``,
``.1``, ``.2``), ``features.1`` .. ``features.17`` the inverted residual blocks,
``features.18`` the final 1x1 convolution to 1280 channels, then global
average pooling and ``classifier`` (``classifier.0`` dropout, ``classifier.1``
linear).  Inside a block, ``conv`` holds, as torchvision: the expanding 1x1
conv-BN-ReLU6 (absent when the expansion is 1), the depthwise 3x3
conv-BN-ReLU6, the projecting 1x1 convolution and its BatchNorm.
Initialisation as torchvision: convolutions ``kaiming_normal(fan_out)``,
BatchNorm ones/zeros, linear ``N(0, 0.01^2)``, zero biases.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.registry import register

# (expansion t, output channels c, repeats n, first stride s), from the paper's Table 2.
_SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
             (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


def make_divisible(value: float, divisor: int = 8) -> int:
    """Round ``value`` to a multiple of ``divisor`` (at least ``divisor``),
    never more than 10% below it; torchvision's channel rounding."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    if rounded < 0.9 * value:
        rounded += divisor
    return rounded


def _conv_bn_relu6(out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1):
    return L.serial(
        L.Conv2D(out_channels, kernel_size, stride=stride, padding=(kernel_size - 1) // 2,
                 groups=groups, use_bias=False, w_init=tv.CONV_FAN_OUT),
        L.BatchNorm(), L.Relu6())


def inverted_residual(in_channels: int, out_channels: int, stride: int, expansion: int):
    """MobileNetV2's inverted residual block.

    Arguments:
        in_channels: channels of the input.
        out_channels: channels of the output.
        stride: stride of the depthwise convolution (1 or 2).
        expansion: hidden channels = ``round(in_channels * expansion)``.

    Returns:
        A Layer whose only child is ``conv``; it adds its input back when
        ``stride == 1`` and the channel count is kept.
    """
    hidden = int(round(in_channels * expansion))
    body = []
    if expansion != 1:
        body.append(_conv_bn_relu6(hidden, 1))
    body += [_conv_bn_relu6(hidden, 3, stride, groups=hidden),
             L.Conv2D(out_channels, 1, use_bias=False, w_init=tv.CONV_FAN_OUT),
             L.BatchNorm()]
    conv = ("conv", L.serial(*body))
    if stride == 1 and in_channels == out_channels:
        return L.residual(conv)
    return L.serial(conv)


@register("mobilenet_v2", input_shape=(1, 224, 224, 3))
def mobilenet_v2(*, num_classes: int = 1000, width_mult: float = 1.0, dropout: float = 0.2):
    """MobileNetV2.

    Arguments:
        num_classes: output size of ``classifier.1``.
        width_mult: multiplies every channel count (rounded to multiples of 8);
            the last convolution keeps at least 1280 channels.
        dropout: dropout rate before the classifier.

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    if width_mult <= 0:
        raise ValueError(f"mobilenet_v2: width_mult must be > 0, got {width_mult!r}")
    in_channels = make_divisible(32 * width_mult)
    last_channels = make_divisible(1280 * max(1.0, width_mult))
    features = [_conv_bn_relu6(in_channels, 3, stride=2)]
    for t, c, n, s in _SETTINGS:
        out_channels = make_divisible(c * width_mult)
        for i in range(n):
            features.append(inverted_residual(in_channels, out_channels, s if i == 0 else 1, t))
            in_channels = out_channels
    features.append(_conv_bn_relu6(last_channels, 1))
    classifier = L.serial(L.Dropout(dropout),
                          L.Linear(num_classes, w_init=tv.normal(0.01), b_init=tv.ZEROS))
    return L.serial(("features", L.serial(*features)), ("avgpool", L.GlobalAvgPool2D()),
                    ("classifier", classifier))
