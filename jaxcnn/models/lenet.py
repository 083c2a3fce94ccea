"""LeNet-5 for 28x28 inputs.

LeCun et al.'s 6-16-120-84-10 layout on MNIST-sized images: ``conv1`` pads by
2, which makes a 28x28 image behave like the original 32x32 input, so ``fc1``
sees 16x5x5 features and the model has 61,706 parameters.  By default it uses
ReLU and max-pooling (trains quickly); ``activation="tanh", pooling="avg"``
gives the classic choice.  Names: ``conv1``, ``conv2``, ``fc1``, ``fc2``, ``fc3``.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models.registry import register

_ACTIVATIONS = {"relu": L.Relu, "tanh": L.Tanh}
_POOLS = {"max": L.MaxPool2D, "avg": L.AvgPool2D}


@register("lenet5", input_shape=(1, 28, 28, 1))
def lenet5(*, num_classes: int = 10, activation: str = "relu", pooling: str = "max"):
    """LeNet-5.

    Arguments:
        num_classes: output size of ``fc3``.
        activation: ``"relu"`` or ``"tanh"``.
        pooling: ``"max"`` or ``"avg"`` (2x2, stride 2).

    Returns:
        A Layer: ``(N, 28, 28, C)`` images -> ``(N, num_classes)`` logits.
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"lenet5: activation must be one of {sorted(_ACTIVATIONS)}, "
                         f"got {activation!r}")
    if pooling not in _POOLS:
        raise ValueError(f"lenet5: pooling must be one of {sorted(_POOLS)}, got {pooling!r}")
    act, pool = _ACTIVATIONS[activation], _POOLS[pooling]
    return L.serial(
        ("conv1", L.Conv2D(6, 5, padding=2)), ("act1", act()), ("pool1", pool(2)),
        ("conv2", L.Conv2D(16, 5)), ("act2", act()), ("pool2", pool(2)),
        ("flatten", L.Flatten()),
        ("fc1", L.Linear(120)), ("act3", act()),
        ("fc2", L.Linear(84)), ("act4", act()),
        ("fc3", L.Linear(num_classes)),
    )
