"""AlexNet as in torchvision (``torchvision.models.alexnet``, the one-GPU
variant of Krizhevsky 2014): 61,100,840 parameters for 1000 classes.

``features`` (five convolutions, three max-pools), ``avgpool`` (adaptive, to
6x6) and ``classifier`` (dropout, 9216->4096, dropout, 4096->4096, ->classes),
with torchvision's indices: ``features.0``, ``features.3``, ``features.6``,
``features.8``, ``features.10``, ``classifier.1``, ``classifier.4``,
``classifier.6``.  Inputs must be at least 63x63.  Initialisation is
PyTorch's default, as torchvision's.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models.registry import register


@register("alexnet", input_shape=(1, 224, 224, 3))
def alexnet(*, num_classes: int = 1000, dropout: float = 0.5, classifier_width: int = 4096):
    """AlexNet.

    Arguments:
        num_classes: output size of ``classifier.6``.
        dropout: dropout rate before ``classifier.1`` and ``classifier.4``.
        classifier_width: output size of ``classifier.1`` and ``classifier.4``
            (torchvision's 4096 by default).

    Returns:
        A Layer: ``(N, H, W, 3)`` images, ``H, W >= 63`` -> ``(N, num_classes)`` logits.
    """
    features = L.serial(
        L.Conv2D(64, 11, stride=4, padding=2), L.Relu(), L.MaxPool2D(3, stride=2),
        L.Conv2D(192, 5, padding=2), L.Relu(), L.MaxPool2D(3, stride=2),
        L.Conv2D(384, 3, padding=1), L.Relu(),
        L.Conv2D(256, 3, padding=1), L.Relu(),
        L.Conv2D(256, 3, padding=1), L.Relu(), L.MaxPool2D(3, stride=2),
    )
    classifier = L.serial(
        L.Dropout(dropout), L.Linear(classifier_width), L.Relu(),
        L.Dropout(dropout), L.Linear(classifier_width), L.Relu(),
        L.Linear(num_classes),
    )
    return L.serial(("features", features), ("avgpool", L.AdaptiveAvgPool2D(6)),
                    ("flatten", L.Flatten()), ("classifier", classifier))
