"""ResNet-18/34/50/101/152, Wide ResNet-50-2 and ResNeXt-50 32x4d as in
torchvision (``torchvision.models.resnet*``, ``wide_resnet50_2``,
``resnext50_32x4d``; v1.5: the bottleneck strides in its 3x3 convolution).

Names mirror torchvision: ``conv1``, ``bn1``, ``layer1.0.conv1``,
``layer1.0.bn1``, ``layer2.0.downsample.0`` (1x1 projection) and
``layer2.0.downsample.1`` (its BatchNorm), ``fc``.  Parameters for 1000
classes: resnet18 11,689,512, resnet34 21,797,672, resnet50 25,557,032,
resnet101 44,549,160, resnet152 60,192,808, wide_resnet50_2 68,883,240,
resnext50_32x4d 25,028,904.  The wide and ResNeXt variants only change the
bottleneck's inner width, ``int(planes * width_per_group / 64) * groups``, and
split its 3x3 convolution into ``groups`` groups (torchvision's rule).
``cifar_stem=True`` replaces the 7x7/2 stem convolution and its max-pool by a
3x3/1 convolution, the usual change for 32x32 images.  Initialisation as
torchvision: convolutions ``kaiming_normal(fan_out, relu)``, BatchNorm
ones/zeros, ``fc`` PyTorch's default.
"""
from __future__ import annotations

from jaxcnn import layers as L
from jaxcnn.models import _torchvision_init as tv
from jaxcnn.models.registry import register


def _conv(out_channels: int, kernel_size: int, stride: int = 1, groups: int = 1):
    return L.Conv2D(out_channels, kernel_size, stride=stride, padding=kernel_size // 2,
                    groups=groups, use_bias=False, w_init=tv.CONV_FAN_OUT)


def _downsample(out_channels: int, stride: int):
    return L.serial(_conv(out_channels, 1, stride), L.BatchNorm())


def basic_block(in_channels: int, planes: int, stride: int = 1):
    """Two 3x3 convolutions with an identity (or 1x1 projection) shortcut.

    Arguments:
        in_channels: channels of the block's input.
        planes: channels of both convolutions and of the output.
        stride: stride of ``conv1`` and of the projection.

    Returns:
        A residual Layer with children ``conv1, bn1, conv2, bn2`` and, when the
        shape changes, ``downsample``.
    """
    shortcut = None
    if stride != 1 or in_channels != planes:
        shortcut = _downsample(planes, stride)
    return L.residual(
        ("conv1", _conv(planes, 3, stride)), ("bn1", L.BatchNorm()), ("relu1", L.Relu()),
        ("conv2", _conv(planes, 3)), ("bn2", L.BatchNorm()),
        shortcut=shortcut, shortcut_name="downsample", activation=L.Relu())


def bottleneck(in_channels: int, planes: int, stride: int = 1, groups: int = 1,
               width_per_group: int = 64):
    """1x1 reduce, 3x3 (strided, grouped), 1x1 expand to ``4 * planes`` channels.

    Arguments:
        in_channels: channels of the block's input.
        planes: sets the output width ``4 * planes`` and, with the next two,
            the inner width ``int(planes * width_per_group / 64) * groups``
            (``planes`` for plain ResNets).
        stride: stride of ``conv2`` and of the projection.
        groups: groups of the 3x3 convolution ``conv2`` (32 for ResNeXt-50 32x4d).
        width_per_group: inner channels per group for ``planes = 64`` (64 plain,
            4 for ResNeXt-50 32x4d, 128 for Wide ResNet-50-2).

    Returns:
        A residual Layer with children ``conv1..3, bn1..3`` and, when the
        shape changes, ``downsample``.
    """
    out_channels = 4 * planes
    width = int(planes * (width_per_group / 64.0)) * groups
    shortcut = None
    if stride != 1 or in_channels != out_channels:
        shortcut = _downsample(out_channels, stride)
    return L.residual(
        ("conv1", _conv(width, 1)), ("bn1", L.BatchNorm()), ("relu1", L.Relu()),
        ("conv2", _conv(width, 3, stride, groups)), ("bn2", L.BatchNorm()), ("relu2", L.Relu()),
        ("conv3", _conv(out_channels, 1)), ("bn3", L.BatchNorm()),
        shortcut=shortcut, shortcut_name="downsample", activation=L.Relu())


def resnet(block: str, blocks_per_stage, *, num_classes: int = 1000, cifar_stem: bool = False,
           groups: int = 1, width_per_group: int = 64):
    """A ResNet: stem, four stages of residual blocks, global pooling, ``fc``.

    Arguments:
        block: ``"basic"`` or ``"bottleneck"``.
        blocks_per_stage: number of blocks in ``layer1`` .. ``layer4``.
        num_classes: output size of ``fc``.
        cifar_stem: 3x3 stride-1 ``conv1`` and no max-pool (for 32x32 inputs).
        groups, width_per_group: the bottleneck's grouping and inner width
            (see :func:`bottleneck`); basic blocks take only the defaults 1, 64.

    Returns:
        A Layer: ``(N, H, W, 3)`` images -> ``(N, num_classes)`` logits.
    """
    if block not in ("basic", "bottleneck"):
        raise ValueError(f"block must be 'basic' or 'bottleneck', got {block!r}")
    if block == "basic":
        if groups != 1 or width_per_group != 64:
            raise ValueError(f"basic blocks take only groups=1 and width_per_group=64, got "
                             f"groups={groups}, width_per_group={width_per_group}")
        make_block, expansion = basic_block, 1
    else:
        def make_block(in_channels, planes, stride):
            return bottleneck(in_channels, planes, stride, groups, width_per_group)
        expansion = 4
    if cifar_stem:
        stem = [("conv1", _conv(64, 3)), ("bn1", L.BatchNorm()), ("relu", L.Relu())]
    else:
        stem = [("conv1", _conv(64, 7, stride=2)), ("bn1", L.BatchNorm()), ("relu", L.Relu()),
                ("maxpool", L.MaxPool2D(3, stride=2, padding=1))]
    stages, in_channels = [], 64
    for i, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
        stage = []
        for j in range(count):
            stride = 2 if i > 0 and j == 0 else 1
            stage.append(make_block(in_channels, planes, stride))
            in_channels = planes * expansion
        stages.append((f"layer{i + 1}", L.serial(*stage)))
    return L.serial(*stem, *stages, ("avgpool", L.GlobalAvgPool2D()),
                    ("fc", L.Linear(num_classes)))


@register("resnet18", input_shape=(1, 224, 224, 3))
def resnet18(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNet-18 (basic blocks 2-2-2-2). Arguments as :func:`resnet`."""
    return resnet("basic", (2, 2, 2, 2), num_classes=num_classes, cifar_stem=cifar_stem)


@register("resnet34", input_shape=(1, 224, 224, 3))
def resnet34(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNet-34 (basic blocks 3-4-6-3). Arguments as :func:`resnet`."""
    return resnet("basic", (3, 4, 6, 3), num_classes=num_classes, cifar_stem=cifar_stem)


@register("resnet50", input_shape=(1, 224, 224, 3))
def resnet50(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNet-50 (bottleneck blocks 3-4-6-3). Arguments as :func:`resnet`."""
    return resnet("bottleneck", (3, 4, 6, 3), num_classes=num_classes, cifar_stem=cifar_stem)


@register("resnet101", input_shape=(1, 224, 224, 3))
def resnet101(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNet-101 (bottleneck blocks 3-4-23-3). Arguments as :func:`resnet`."""
    return resnet("bottleneck", (3, 4, 23, 3), num_classes=num_classes, cifar_stem=cifar_stem)


@register("resnet152", input_shape=(1, 224, 224, 3))
def resnet152(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNet-152 (bottleneck blocks 3-8-36-3). Arguments as :func:`resnet`."""
    return resnet("bottleneck", (3, 8, 36, 3), num_classes=num_classes, cifar_stem=cifar_stem)


@register("wide_resnet50_2", input_shape=(1, 224, 224, 3))
def wide_resnet50_2(*, num_classes: int = 1000, cifar_stem: bool = False):
    """Wide ResNet-50-2: ResNet-50 with bottlenecks twice as wide inside
    (``width_per_group=128``). Arguments as :func:`resnet`."""
    return resnet("bottleneck", (3, 4, 6, 3), num_classes=num_classes, cifar_stem=cifar_stem,
                  width_per_group=128)


@register("resnext50_32x4d", input_shape=(1, 224, 224, 3))
def resnext50_32x4d(*, num_classes: int = 1000, cifar_stem: bool = False):
    """ResNeXt-50 32x4d: ResNet-50 with 32 groups of 4 channels (for ``layer1``)
    in each bottleneck's 3x3 convolution. Arguments as :func:`resnet`."""
    return resnet("bottleneck", (3, 4, 6, 3), num_classes=num_classes, cifar_stem=cifar_stem,
                  groups=32, width_per_group=4)
