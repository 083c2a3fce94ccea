"""The convolutional network of PyTorch's MNIST example (``examples/mnist``).

conv 3x3 1->32, ReLU, conv 3x3 32->64, ReLU, max-pool 2, dropout 0.25,
flatten, linear 9216->128, ReLU, dropout 0.5, linear 128->10:
1,199,882 parameters for 28x28x1 inputs.  The PyTorch example ends in
``log_softmax``; this model returns the logits (``cross_entropy`` takes
logits).  Parameter names follow the example's modules: ``conv1``, ``conv2``,
``fc1``, ``fc2``.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models.registry import register


@register("mnist_cnn", input_shape=(1, 28, 28, 1))
def mnist_cnn(*, num_classes: int = 10):
    """PyTorch's MNIST example network.

    Arguments:
        num_classes: output size of ``fc2``.

    Returns:
        A Layer: ``(N, 28, 28, C)`` images -> ``(N, num_classes)`` logits
        (``fc1`` fixes the spatial size at 28x28).
    """
    return L.serial(
        ("conv1", L.Conv2D(32, 3)), ("relu1", L.Relu()),
        ("conv2", L.Conv2D(64, 3)), ("relu2", L.Relu()),
        ("pool", L.MaxPool2D(2)),
        ("dropout1", L.Dropout(0.25)),
        ("flatten", L.Flatten()),
        ("fc1", L.Linear(128)), ("relu3", L.Relu()),
        ("dropout2", L.Dropout(0.5)),
        ("fc2", L.Linear(num_classes)),
    )
