"""Hand-written PyTorch twins of the zoo models, with torchvision's module
names (torchvision itself is not installed here), for the interop tests.

Only imported by tests that already did ``pytest.importorskip("torch")``.
"""
from __future__ import annotations

import torch
import torch_zoo_modern
from torch import nn

# ---------------------------------------------------------------- MNIST models


class MnistNet(nn.Module):
    """PyTorch's examples/mnist ``Net`` without the final log_softmax."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x):
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        x = self.dropout1(nn.functional.max_pool2d(x, 2))
        x = self.dropout2(torch.relu(self.fc1(torch.flatten(x, 1))))
        return self.fc2(x)


class LeNet5(nn.Module):
    def __init__(self, num_classes=10, activation="relu", pooling="max"):
        super().__init__()
        self.act = {"relu": torch.relu, "tanh": torch.tanh}[activation]
        self.pool = {"max": nn.functional.max_pool2d, "avg": nn.functional.avg_pool2d}[pooling]
        self.conv1 = nn.Conv2d(1, 6, 5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(400, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, num_classes)

    def forward(self, x):
        x = self.pool(self.act(self.conv1(x)), 2)
        x = self.pool(self.act(self.conv2(x)), 2)
        x = self.act(self.fc1(torch.flatten(x, 1)))
        return self.fc3(self.act(self.fc2(x)))

# ------------------------------------------------------------ AlexNet and VGG


class AlexNet(nn.Module):
    def __init__(self, num_classes=1000, classifier_width=4096):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, 11, stride=4, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
            nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
            nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
            nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(0.5), nn.Linear(256 * 36, classifier_width), nn.ReLU(),
            nn.Dropout(0.5), nn.Linear(classifier_width, classifier_width), nn.ReLU(),
            nn.Linear(classifier_width, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


VGG_CONFIGS = {
    "vgg11": [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg13": [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    "vgg16": [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M",
              512, 512, 512, "M"],
    "vgg19": [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M",
              512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(self, config, batch_norm, num_classes=1000, classifier_width=4096, dropout=0.5):
        super().__init__()
        layers, c = [], 3
        for v in config:
            if v == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            layers.append(nn.Conv2d(c, v, 3, padding=1))
            layers += [nn.BatchNorm2d(v)] if batch_norm else []
            layers.append(nn.ReLU())
            c = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 49, classifier_width), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(classifier_width, classifier_width), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(classifier_width, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

# --------------------------------------------------------------------- ResNet


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin, planes, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or cin != planes:
            self.downsample = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin, planes, stride, groups=1, width_per_group=64):
        super().__init__()
        cout = planes * 4
        width = int(planes * (width_per_group / 64.0)) * groups     # torchvision's rule
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet(nn.Module):
    def __init__(self, block, counts, num_classes=1000, cifar_stem=False, **block_options):
        super().__init__()
        if cifar_stem:
            self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
            self.maxpool = nn.Identity()
        else:
            self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
            self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        cin = 64
        for i, (planes, n) in enumerate(zip((64, 128, 256, 512), counts)):
            blocks = []
            for j in range(n):
                blocks.append(block(cin, planes, 2 if i > 0 and j == 0 else 1, **block_options))
                cin = planes * block.expansion
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))

# ---------------------------------------------------------------- MobileNetV2


def make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def conv_bn_relu6(cin, cout, k, stride=1, groups=1):
    return nn.Sequential(nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6())


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, t):
        super().__init__()
        hidden = int(round(cin * t))
        self.use_res = stride == 1 and cin == cout
        layers = [conv_bn_relu6(cin, hidden, 1)] if t != 1 else []
        layers += [conv_bn_relu6(hidden, hidden, 3, stride, hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes=1000, width_mult=1.0):
        super().__init__()
        settings = [[1, 16, 1, 1], [6, 24, 2, 2], [6, 32, 3, 2], [6, 64, 4, 2],
                    [6, 96, 3, 1], [6, 160, 3, 2], [6, 320, 1, 1]]
        cin = make_divisible(32 * width_mult)
        last = make_divisible(1280 * max(1.0, width_mult))
        features = [conv_bn_relu6(3, cin, 3, 2)]
        for t, c, n, s in settings:
            cout = make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(cin, cout, s if i == 0 else 1, t))
                cin = cout
        features.append(conv_bn_relu6(cin, last, 1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(last, num_classes))

    def forward(self, x):
        x = nn.functional.adaptive_avg_pool2d(self.features(x), (1, 1))
        return self.classifier(torch.flatten(x, 1))


def build(name, num_classes=None, **options):
    """The PyTorch twin of zoo model ``name`` (same options as ``models.get``)."""
    kw = dict(options)
    if num_classes is not None:
        kw["num_classes"] = num_classes
    if name in torch_zoo_modern.NAMES:       # MobileNetV3, EfficientNet-B0, ConvNeXt-T
        return torch_zoo_modern.build(name, **kw)
    if name == "mnist_cnn":
        return MnistNet(**kw)
    if name == "lenet5":
        return LeNet5(**kw)
    if name == "alexnet":
        return AlexNet(**kw)
    if name.startswith("vgg"):
        return VGG(VGG_CONFIGS[name[:5]], name.endswith("_bn"), **kw)
    if name == "mobilenet_v2":
        return MobileNetV2(**kw)
    block, counts = {"resnet18": (BasicBlock, (2, 2, 2, 2)), "resnet34": (BasicBlock, (3, 4, 6, 3)),
                     "resnet50": (Bottleneck, (3, 4, 6, 3))}.get(name, (None, None))
    if block is None:       # the deeper, wide and grouped bottleneck ResNets
        block, counts, extra = {
            "resnet101": (Bottleneck, (3, 4, 23, 3), {}),
            "resnet152": (Bottleneck, (3, 8, 36, 3), {}),
            "wide_resnet50_2": (Bottleneck, (3, 4, 6, 3), {"width_per_group": 128}),
            "resnext50_32x4d": (Bottleneck, (3, 4, 6, 3), {"groups": 32, "width_per_group": 4}),
        }[name]
        kw.update(extra)
    return ResNet(block, counts, **kw)


def randomize_(model, seed=0):
    """Fill every parameter and BatchNorm buffer with random values (in
    place), so no layout mistake can hide behind a symmetric initialisation;
    weights are scaled by fan-in to keep activations O(1) through deep nets."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                fan_in = m.weight[0].numel()
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * (1.0 / fan_in) ** 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.1)
            elif isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.weight.copy_(1 + 0.2 * torch.randn(c, generator=g))
                m.bias.copy_(0.1 * torch.randn(c, generator=g))
                m.running_mean.copy_(0.1 * torch.randn(c, generator=g))
                m.running_var.copy_(0.5 + torch.rand(c, generator=g))
                m.num_batches_tracked.fill_(int(torch.randint(1, 1000, (1,), generator=g)))
    torch_zoo_modern.randomize_extra_(model, g)
    return model


def both_modes(model, params, state, x):
    """``(eval logits, train logits, train-mode new state)`` of a jaxcnn model on ``x``, from one
    compilation (``train=True`` with a fixed dropout key)."""
    import jax

    @jax.jit
    def both(params, state, x):
        y_eval, _ = model.apply(params, state, x)
        y_train, new_state = model.apply(params, state, x, train=True, rng=jax.random.PRNGKey(0))
        return y_eval, y_train, new_state

    return both(params, state, x)


def twin_and_ours(name, seed=0, **options):
    """A randomised PyTorch twin of zoo model ``name`` (eval mode) and the same weights in
    jaxcnn: ``(net, state_dict, params, state, model)``; checks both hold as many parameters."""
    import jax
    import numpy as np

    from jaxcnn import models
    from jaxcnn.interop import from_torch_state_dict

    net = randomize_(build(name, **options), seed=seed).eval()
    sd = net.state_dict()
    params, state = from_torch_state_dict(name, sd, **options)
    n_ours = sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))
    assert n_ours == sum(p.numel() for p in net.parameters())
    return net, sd, params, state, models.get(name, **options)
