"""VGG 11, 13, 16 and 19, with and without BatchNorm, as in torchvision
(``torchvision.models.vgg11``, ``vgg11_bn`` ... ``vgg19_bn``).

``features`` is one flat sequence of 3x3 convolutions (padding 1), optional
BatchNorm, ReLU and 2x2 max-pools, indexed like torchvision's
(``features.0``, ``features.1``...); then ``avgpool`` (adaptive, to 7x7) and
``classifier`` (``classifier.0``, ``.3``, ``.6``).  Parameters: vgg11
132,863,336, vgg11_bn 132,868,840, vgg13 133,047,848, vgg13_bn 133,053,736,
vgg16 138,357,544, vgg16_bn 138,365,992, vgg19 143,667,240, vgg19_bn
143,678,248 (1000 classes).
Initialisation as torchvision: convolutions ``kaiming_normal(fan_out, relu)``
with zero bias, BatchNorm ones/zeros, linear layers ``N(0, 0.01^2)`` with zero
bias.  Inputs must be at least 32x32.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.registry import register

# Output channels of each convolution; "M" is a 2x2 max-pool.
_CONFIGS = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"),
}


def vgg(config, *, batch_norm: bool, num_classes: int = 1000, dropout: float = 0.5,
        classifier_width: int = 4096):
    """A VGG network from a list of channel counts and ``"M"`` (max-pool).

    Arguments:
        config: sequence of ints (3x3 convolution with that many output
            channels) and ``"M"`` (2x2 max-pool, stride 2).
        batch_norm: put a BatchNorm after every convolution.
        num_classes: output size of ``classifier.6``.
        dropout: dropout rate after ``classifier.1`` and ``classifier.4``.
        classifier_width: output size of ``classifier.0`` and ``classifier.3``;
            torchvision's 4096 by default (smaller widths suit small data sets
            and fast tests; 4096 puts 120M of the 138M parameters there).

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    features = []
    for item in config:
        if item == "M":
            features.append(L.MaxPool2D(2, stride=2))
            continue
        features.append(L.Conv2D(item, 3, padding=1, w_init=tv.CONV_FAN_OUT, b_init=tv.ZEROS))
        if batch_norm:
            features.append(L.BatchNorm())
        features.append(L.Relu())
    linear = dict(w_init=tv.normal(0.01), b_init=tv.ZEROS)
    classifier = L.serial(
        L.Linear(classifier_width, **linear), L.Relu(), L.Dropout(dropout),
        L.Linear(classifier_width, **linear), L.Relu(), L.Dropout(dropout),
        L.Linear(num_classes, **linear),
    )
    return L.serial(("features", L.serial(*features)), ("avgpool", L.AdaptiveAvgPool2D(7)),
                    ("flatten", L.Flatten()), ("classifier", classifier))


@register("vgg11", input_shape=(1, 224, 224, 3))
def vgg11(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-11 (configuration "A"). Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg11"], batch_norm=False, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg11_bn", input_shape=(1, 224, 224, 3))
def vgg11_bn(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-11 with BatchNorm after every convolution. Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg11"], batch_norm=True, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg13", input_shape=(1, 224, 224, 3))
def vgg13(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-13 (configuration "B"). Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg13"], batch_norm=False, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg13_bn", input_shape=(1, 224, 224, 3))
def vgg13_bn(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-13 with BatchNorm after every convolution. Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg13"], batch_norm=True, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg16", input_shape=(1, 224, 224, 3))
def vgg16(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-16 (configuration "D"). Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg16"], batch_norm=False, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg16_bn", input_shape=(1, 224, 224, 3))
def vgg16_bn(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-16 with BatchNorm after every convolution. Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg16"], batch_norm=True, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg19", input_shape=(1, 224, 224, 3))
def vgg19(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-19 (configuration "E"). Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg19"], batch_norm=False, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)


@register("vgg19_bn", input_shape=(1, 224, 224, 3))
def vgg19_bn(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """VGG-19 with BatchNorm after every convolution. Arguments as :func:`vgg`."""
    return vgg(_CONFIGS["vgg19"], batch_norm=True, num_classes=num_classes, dropout=dropout,
               classifier_width=classifier_width)
