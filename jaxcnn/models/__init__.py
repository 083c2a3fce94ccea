"""The model zoo: classic CNNs built from :mod:`jaxcnn.layers`, by name.

Every model's parameter tree mirrors torchvision's module paths
(``features.0``, ``classifier.1``, ``layer1.0.conv1``, ``layer1.0.downsample.0``),
so a PyTorch parameter name is the dotted path with the leaf renamed
(``w``->``weight``, ``b``->``bias``, ``scale``->``weight``, ``mean``->``running_mean``,
``var``->``running_var``, ``count``->``num_batches_tracked``); see
:mod:`jaxcnn.interop.torch`.  Models take NHWC images and return logits.

>>> model = get("resnet18", num_classes=10, cifar_stem=True)
"""
from jaxcnn.models import alexnet, lenet, mnist_cnn, mobilenet, resnet, vgg  # noqa: F401 (register)
from jaxcnn.models import convnext, efficientnet, mobilenet_v3  # noqa: F401 (register)
from jaxcnn.models.registry import default_input_shape, get, names, register

__all__ = ["get", "names", "default_input_shape", "register"]
