"""Hand-written PyTorch twins of MobileNetV3, EfficientNet-B0 and ConvNeXt-T
with torchvision's module names and settings (torchvision is not installed
here), written from torchvision's ``models/mobilenetv3.py``,
``models/efficientnet.py``, ``models/convnext.py``, ``ops/misc.py``
(``SqueezeExcitation``, ``Conv2dNormActivation``) and ``ops/stochastic_depth.py``.
``torch_zoo.build`` dispatches here for these names.

Only imported by tests that already did ``pytest.importorskip("torch")``.
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

NAMES = ("mobilenet_v3_small", "mobilenet_v3_large", "efficientnet_b0", "convnext_tiny")


def make_divisible(v, divisor=8):
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def stochastic_depth(x, p, mode, training):
    """torchvision's ``ops.stochastic_depth``."""
    if not training or p == 0.0:
        return x
    survival = 1.0 - p
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(survival)
    if survival > 0.0:
        noise.div_(survival)
    return x * noise


class StochasticDepth(nn.Module):
    def __init__(self, p, mode):
        super().__init__()
        self.p, self.mode = p, mode

    def forward(self, x):
        return stochastic_depth(x, self.p, self.mode, self.training)


class SqueezeExcitation(nn.Module):
    def __init__(self, channels, squeeze, activation=nn.ReLU, scale_activation=nn.Sigmoid):
        super().__init__()
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.activation = activation()
        self.scale_activation = scale_activation()

    def forward(self, x):
        s = self.scale_activation(self.fc2(self.activation(self.fc1(self.avgpool(x)))))
        return s * x


def conv_norm_act(cin, cout, k, stride=1, groups=1, norm=nn.BatchNorm2d, act=None):
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), norm(cout)]
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)

# ---------------------------------------------------------------- MobileNetV3


# torchvision's bneck_conf rows: input, kernel, expanded, output, SE, activation, stride.
V3_LARGE = [(16, 3, 16, 16, False, "RE", 1), (16, 3, 64, 24, False, "RE", 2),
            (24, 3, 72, 24, False, "RE", 1), (24, 5, 72, 40, True, "RE", 2),
            (40, 5, 120, 40, True, "RE", 1), (40, 5, 120, 40, True, "RE", 1),
            (40, 3, 240, 80, False, "HS", 2), (80, 3, 200, 80, False, "HS", 1),
            (80, 3, 184, 80, False, "HS", 1), (80, 3, 184, 80, False, "HS", 1),
            (80, 3, 480, 112, True, "HS", 1), (112, 3, 672, 112, True, "HS", 1),
            (112, 5, 672, 160, True, "HS", 2), (160, 5, 960, 160, True, "HS", 1),
            (160, 5, 960, 160, True, "HS", 1)]
V3_SMALL = [(16, 3, 16, 16, True, "RE", 2), (16, 3, 72, 24, False, "RE", 2),
            (24, 3, 88, 24, False, "RE", 1), (24, 5, 96, 40, True, "HS", 2),
            (40, 5, 240, 40, True, "HS", 1), (40, 5, 240, 40, True, "HS", 1),
            (40, 5, 120, 48, True, "HS", 1), (48, 5, 144, 48, True, "HS", 1),
            (48, 5, 288, 96, True, "HS", 2), (96, 5, 576, 96, True, "HS", 1),
            (96, 5, 576, 96, True, "HS", 1)]


class V3Block(nn.Module):
    def __init__(self, cin, k, exp, cout, se, act, stride, norm):
        super().__init__()
        self.use_res = stride == 1 and cin == cout
        act = nn.Hardswish if act == "HS" else nn.ReLU
        layers = []
        if exp != cin:
            layers.append(conv_norm_act(cin, exp, 1, norm=norm, act=act))
        layers.append(conv_norm_act(exp, exp, k, stride, groups=exp, norm=norm, act=act))
        if se:
            layers.append(SqueezeExcitation(exp, make_divisible(exp // 4, 8),
                                            scale_activation=nn.Hardsigmoid))
        layers.append(conv_norm_act(exp, cout, 1, norm=norm))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        y = self.block(x)
        return y + x if self.use_res else y


class MobileNetV3(nn.Module):
    def __init__(self, setting, last_channel, num_classes=1000, dropout=0.2):
        super().__init__()
        norm = partial(nn.BatchNorm2d, eps=0.001, momentum=0.01)
        layers = [conv_norm_act(3, setting[0][0], 3, 2, norm=norm, act=nn.Hardswish)]
        layers += [V3Block(*row, norm=norm) for row in setting]
        last_in = setting[-1][3]
        layers.append(conv_norm_act(last_in, 6 * last_in, 1, norm=norm, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(6 * last_in, last_channel), nn.Hardswish(),
                                        nn.Dropout(p=dropout), nn.Linear(last_channel, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

# ------------------------------------------------------------- EfficientNet-B0


# expand_ratio, kernel, stride, input, output, layers (torchvision's MBConvConfig order).
B0 = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
      (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]


class MBConv(nn.Module):
    def __init__(self, ratio, k, stride, cin, cout, sd_prob):
        super().__init__()
        self.use_res = stride == 1 and cin == cout
        exp = make_divisible(cin * ratio, 8)
        layers = []
        if exp != cin:
            layers.append(conv_norm_act(cin, exp, 1, act=nn.SiLU))
        layers.append(conv_norm_act(exp, exp, k, stride, groups=exp, act=nn.SiLU))
        layers.append(SqueezeExcitation(exp, max(1, cin // 4), activation=nn.SiLU))
        layers.append(conv_norm_act(exp, cout, 1))
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x):
        y = self.block(x)
        return self.stochastic_depth(y) + x if self.use_res else y


class EfficientNetB0(nn.Module):
    def __init__(self, num_classes=1000, dropout=0.2, stochastic_depth_prob=0.2):
        super().__init__()
        layers = [conv_norm_act(3, B0[0][3], 3, 2, act=nn.SiLU)]
        total, i = sum(row[-1] for row in B0), 0
        for ratio, k, stride, cin, cout, n in B0:
            stage = []
            for j in range(n):
                stage.append(MBConv(ratio, k, stride if j == 0 else 1, cin if j == 0 else cout,
                                    cout, stochastic_depth_prob * float(i) / total))
                i += 1
            layers.append(nn.Sequential(*stage))
        layers.append(conv_norm_act(B0[-1][4], 4 * B0[-1][4], 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(p=dropout), nn.Linear(4 * B0[-1][4], num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

# ------------------------------------------------------------------ ConvNeXt-T


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of an NCHW tensor."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = nn.functional.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    def __init__(self, dim, layer_scale, sd_prob):
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, 7, padding=3, groups=dim, bias=True), Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6), nn.Linear(dim, 4 * dim), nn.GELU(),
            nn.Linear(4 * dim, dim), Permute([0, 3, 1, 2]))
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, x):
        return self.stochastic_depth(self.layer_scale * self.block(x)) + x


class ConvNeXtTiny(nn.Module):
    def __init__(self, num_classes=1000, stochastic_depth_prob=0.1, layer_scale=1e-6):
        super().__init__()
        setting = [(96, 192, 3), (192, 384, 3), (384, 768, 9), (768, None, 3)]
        norm = partial(LayerNorm2d, eps=1e-6)
        layers = [nn.Sequential(nn.Conv2d(3, 96, 4, 4, 0, bias=True), norm(96))]
        total, i = sum(n for _, _, n in setting), 0
        for cin, cout, n in setting:
            stage = []
            for _ in range(n):
                stage.append(CNBlock(cin, layer_scale, stochastic_depth_prob * i / (total - 1.0)))
                i += 1
            layers.append(nn.Sequential(*stage))
            if cout is not None:
                layers.append(nn.Sequential(norm(cin), nn.Conv2d(cin, cout, 2, 2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(norm(768), nn.Flatten(1), nn.Linear(768, num_classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


def build(name, **kw):
    if name == "mobilenet_v3_large":
        return MobileNetV3(V3_LARGE, 1280, **kw)
    if name == "mobilenet_v3_small":
        return MobileNetV3(V3_SMALL, 1024, **kw)
    if name == "efficientnet_b0":
        return EfficientNetB0(**kw)
    if name == "convnext_tiny":
        return ConvNeXtTiny(**kw)
    raise KeyError(name)


def randomize_extra_(model, g):
    """Random LayerNorm affine parameters and layer scales (``torch_zoo.randomize_``
    covers convolutions, linear layers and BatchNorm): the initial ``1e-6``
    layer scale would make every ConvNeXt block nearly the identity."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.copy_(1 + 0.2 * torch.randn(m.weight.shape, generator=g))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=g))
            if isinstance(getattr(m, "layer_scale", None), nn.Parameter):
                m.layer_scale.copy_(0.5 + torch.rand(m.layer_scale.shape, generator=g))


# (name, options, NHWC input) for the logits/round-trip comparisons; the
# train-mode cases switch dropout and stochastic depth off (p=0).
CASES = [
    ("mobilenet_v3_small", {"num_classes": 10}, (2, 64, 64, 3)),
    ("mobilenet_v3_large", {"num_classes": 10}, (2, 64, 64, 3)),
    ("efficientnet_b0", {"num_classes": 10}, (2, 64, 64, 3)),
    ("convnext_tiny", {"num_classes": 10}, (2, 32, 32, 3)),
]
NO_DROP = {"mobilenet_v3_small": {"dropout": 0.0}, "mobilenet_v3_large": {"dropout": 0.0},
           "efficientnet_b0": {"dropout": 0.0, "stochastic_depth_prob": 0.0},
           "convnext_tiny": {"stochastic_depth_prob": 0.0}}
