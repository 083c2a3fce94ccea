"""MobileNetV3 (small and large) as in torchvision (``torchvision.models.mobilenet_v3_*``):
2,542,856 and 5,483,032 parameters for 1000 classes.

``features.0`` is the 3x3/2 stem (conv, BatchNorm, hard-swish as ``.0``,
``.1``, ``.2``), then one inverted residual block per row of the paper's table
(``features.1`` ..), then a 1x1 convolution to six times the last block's
channels.  Global average pooling follows, and ``classifier``: ``.0`` linear
(to 1024 or 1280), ``.1`` hard-swish, ``.2`` dropout, ``.3`` linear.  A
block's layers sit in ``block`` as in torchvision: the expanding 1x1
conv-BN-activation (absent when the expansion keeps the channels), the
depthwise conv-BN-activation, the squeeze-excitation (``fc1``, ``fc2``: 1x1
convolutions with biases, squeeze to ``make_divisible(channels / 4)``, ReLU,
hard-sigmoid gate) where the table has one, and the projecting 1x1
conv-BN.  The activation is ReLU or hard-swish per row.  BatchNorm uses
``eps=0.001``, ``momentum=0.01``.  Initialisation as torchvision:
convolutions ``kaiming_normal(fan_out)``, zero conv biases, BatchNorm
ones/zeros, linear ``N(0, 0.01^2)`` with zero biases.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.mobilenet import make_divisible
from jaxcnn.models.registry import register

# (input channels, kernel, expanded channels, output channels, squeeze-excitation,
#  hard-swish (else ReLU), stride): torchvision's settings, the paper's tables 1 and 2.
_LARGE = ((16, 3, 16, 16, False, False, 1), (16, 3, 64, 24, False, False, 2),
          (24, 3, 72, 24, False, False, 1), (24, 5, 72, 40, True, False, 2),
          (40, 5, 120, 40, True, False, 1), (40, 5, 120, 40, True, False, 1),
          (40, 3, 240, 80, False, True, 2), (80, 3, 200, 80, False, True, 1),
          (80, 3, 184, 80, False, True, 1), (80, 3, 184, 80, False, True, 1),
          (80, 3, 480, 112, True, True, 1), (112, 3, 672, 112, True, True, 1),
          (112, 5, 672, 160, True, True, 2), (160, 5, 960, 160, True, True, 1),
          (160, 5, 960, 160, True, True, 1))
_SMALL = ((16, 3, 16, 16, True, False, 2), (16, 3, 72, 24, False, False, 2),
          (24, 3, 88, 24, False, False, 1), (24, 5, 96, 40, True, True, 2),
          (40, 5, 240, 40, True, True, 1), (40, 5, 240, 40, True, True, 1),
          (40, 5, 120, 48, True, True, 1), (48, 5, 144, 48, True, True, 1),
          (48, 5, 288, 96, True, True, 2), (96, 5, 576, 96, True, True, 1),
          (96, 5, 576, 96, True, True, 1))


def _bn():
    return L.BatchNorm(momentum=0.01, eps=0.001)


def _conv_bn_act(out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1,
                 activation=None):
    items = [L.Conv2D(out_channels, kernel_size, stride=stride, padding=(kernel_size - 1) // 2,
                      groups=groups, use_bias=False, w_init=tv.CONV_FAN_OUT), _bn()]
    if activation is not None:
        items.append(activation())
    return L.serial(*items)


def inverted_residual_v3(in_channels: int, kernel_size: int, expanded: int, out_channels: int,
                         use_se: bool, hardswish: bool, stride: int):
    """MobileNetV3's block (torchvision's ``InvertedResidual``).

    Arguments:
        in_channels: channels of the input.
        kernel_size: of the depthwise convolution (3 or 5).
        expanded: channels of the expanded (depthwise) part.
        out_channels: channels of the output.
        use_se: whether a squeeze-excitation follows the depthwise convolution.
        hardswish: hard-swish activations (else ReLU).
        stride: of the depthwise convolution (1 or 2).

    Returns:
        A Layer whose only child is ``block``; it adds its input back when
        ``stride == 1`` and the channel count is kept.
    """
    act = L.Hardswish if hardswish else L.Relu
    body = []
    if expanded != in_channels:
        body.append(_conv_bn_act(expanded, 1, activation=act))
    body.append(_conv_bn_act(expanded, kernel_size, stride, groups=expanded, activation=act))
    if use_se:
        body.append(L.SqueezeExcitation(expanded, make_divisible(expanded // 4, 8),
                                        scale_activation=L.Hardsigmoid, conv_init=tv.CONV_FAN_OUT))
    body.append(_conv_bn_act(out_channels, 1))
    block = ("block", L.serial(*body))
    if stride == 1 and in_channels == out_channels:
        return L.residual(block)
    return L.serial(block)


def mobilenet_v3(settings, last_channel: int, *, num_classes: int = 1000, dropout: float = 0.2):
    """A MobileNetV3 from its block settings (see ``_LARGE``, ``_SMALL``).

    Arguments:
        settings: one tuple per block, as ``inverted_residual_v3``'s arguments.
        last_channel: width of the classifier's hidden layer.
        num_classes: output size of ``classifier.3``.
        dropout: dropout rate in the classifier.

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    features = [_conv_bn_act(settings[0][0], 3, stride=2, activation=L.Hardswish)]
    features += [inverted_residual_v3(*row) for row in settings]
    last_conv = 6 * settings[-1][3]
    features.append(_conv_bn_act(last_conv, 1, activation=L.Hardswish))
    classifier = L.serial(L.Linear(last_channel, w_init=tv.normal(0.01), b_init=tv.ZEROS),
                          L.Hardswish(), L.Dropout(dropout),
                          L.Linear(num_classes, w_init=tv.normal(0.01), b_init=tv.ZEROS))
    return L.serial(("features", L.serial(*features)), ("avgpool", L.GlobalAvgPool2D()),
                    ("classifier", classifier))


@register("mobilenet_v3_large", input_shape=(1, 224, 224, 3))
def mobilenet_v3_large(*, num_classes: int = 1000, dropout: float = 0.2):
    """MobileNetV3-Large (15 blocks, classifier width 1280). Arguments as :func:`mobilenet_v3`."""
    return mobilenet_v3(_LARGE, 1280, num_classes=num_classes, dropout=dropout)


@register("mobilenet_v3_small", input_shape=(1, 224, 224, 3))
def mobilenet_v3_small(*, num_classes: int = 1000, dropout: float = 0.2):
    """MobileNetV3-Small (11 blocks, classifier width 1024). Arguments as :func:`mobilenet_v3`."""
    return mobilenet_v3(_SMALL, 1024, num_classes=num_classes, dropout=dropout)
