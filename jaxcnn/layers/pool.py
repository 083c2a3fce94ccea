"""Pooling layers over NHWC images: :func:`MaxPool2D`, :func:`AvgPool2D`,
:func:`AdaptiveAvgPool2D`, :func:`GlobalAvgPool2D` (PyTorch semantics)."""
from __future__ import annotations

from jaxcnn import functional as F
from jaxcnn.layers._common import (cast_in, check_image, check_positive, layer_height_axis,
                                   layer_impl, padding_pairs, pair, whole_images_only,
                                   window_output_size)
from jaxcnn.layers.base import Layer, leaf


def _window_layer(name, kind, kernel_size, stride, padding, dilation, ceil_mode, run, extra):
    """A max/avg pooling layer; ``run(x, kernel, stride, padding, impl, height_axis)`` calls the op."""
    kernel = pair(kernel_size, "kernel_size", name)
    stride = kernel if stride is None else pair(stride, "stride", name)
    dilation = pair(dilation, "dilation", name)
    padding = padding_pairs(padding, name)
    if not isinstance(padding, str):
        for k, pads in zip(kernel, padding):
            if max(pads) > k // 2:  # PyTorch's rule: every window overlaps the input
                raise ValueError(f"{name}: padding {padding} must be at most half the "
                                 f"kernel size {kernel}")
    config = dict(kernel_size=kernel, stride=stride, padding=padding, dilation=dilation,
                  ceil_mode=ceil_mode, **extra)

    def init(key, input_shape):
        del key
        check_image(name, input_shape)
        n, h, w, c = input_shape
        pads = (padding, padding) if isinstance(padding, str) else padding
        out_shape = (n,
                     window_output_size(h, kernel[0], stride[0], pads[0], dilation[0], ceil_mode),
                     window_output_size(w, kernel[1], stride[1], pads[1], dilation[1], ceil_mode),
                     c)
        check_positive(name, input_shape, out_shape)
        return {}, {}, out_shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng
        x, _ = cast_in(policy, kind, x)
        return run(x, kernel, stride, padding, layer_impl(choices), layer_height_axis(choices)), state

    return leaf(kind, init, apply, config)


def MaxPool2D(kernel_size, stride=None, padding=0, dilation=1, ceil_mode: bool = False) -> Layer:
    """Max pooling, like ``torch.nn.MaxPool2d`` (padding never wins the max).

    Arguments:
        kernel_size: ``k`` or ``(KH, KW)``.
        stride: ``s`` or ``(sh, sw)``; default ``kernel_size``.
        padding: ``p``, ``(ph, pw)``, ``((top, bottom), (left, right))`` (each at
            most half the kernel), ``"SAME"`` or ``"VALID"``.
        dilation: ``d`` or ``(dh, dw)``.
        ceil_mode: round the output size up (PyTorch's rule).

    Returns:
        A Layer of kind ``"max_pool2d"``: ``(N, H, W, C) -> (N, H', W', C)``, no params.
    """
    return _window_layer(
        "MaxPool2D", "max_pool2d", kernel_size, stride, padding, dilation, ceil_mode,
        lambda x, k, s, p, impl, rows: F.max_pool2d(x, k, stride=s, padding=p, dilation=dilation,
                                                    ceil_mode=ceil_mode, impl=impl, height_axis=rows), {})


def AvgPool2D(kernel_size, stride=None, padding=0, ceil_mode: bool = False,
              count_include_pad: bool = True) -> Layer:
    """Average pooling, like ``torch.nn.AvgPool2d``.

    Arguments:
        kernel_size: ``k`` or ``(KH, KW)``.
        stride: ``s`` or ``(sh, sw)``; default ``kernel_size``.
        padding: ``p``, ``(ph, pw)``, ``((top, bottom), (left, right))`` (each at
            most half the kernel), ``"SAME"`` or ``"VALID"``.
        ceil_mode: round the output size up (PyTorch's rule).
        count_include_pad: whether zero padding counts in each window's divisor.

    Returns:
        A Layer of kind ``"avg_pool2d"``: ``(N, H, W, C) -> (N, H', W', C)``, no params.
    """
    return _window_layer(
        "AvgPool2D", "avg_pool2d", kernel_size, stride, padding, 1, ceil_mode,
        lambda x, k, s, p, impl, rows: F.avg_pool2d(x, k, stride=s, padding=p, ceil_mode=ceil_mode,
                                                    count_include_pad=count_include_pad, impl=impl,
                                                    height_axis=rows),
        dict(count_include_pad=count_include_pad))


def AdaptiveAvgPool2D(output_size) -> Layer:
    """Adaptive average pooling to a fixed size, like ``torch.nn.AdaptiveAvgPool2d``.

    Arguments:
        output_size: ``o`` or ``(OH, OW)``; an entry ``None`` keeps that input size.

    Returns:
        A Layer of kind ``"adaptive_avg_pool2d"``: ``(N, H, W, C) -> (N, OH, OW, C)``.
    """
    name = "AdaptiveAvgPool2D"
    if isinstance(output_size, (tuple, list)) and len(output_size) == 2:
        for o in output_size:
            if o is not None:
                pair(o, "output_size", name)
        sizes = tuple(output_size)
    else:
        sizes = pair(output_size, "output_size", name)

    def init(key, input_shape):
        del key
        check_image(name, input_shape)
        n, h, w, c = input_shape
        oh, ow = (d if o is None else o for o, d in zip(sizes, (h, w)))
        return {}, {}, (n, oh, ow, c)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng
        whole_images_only(name, choices)
        x, _ = cast_in(policy, "adaptive_avg_pool2d", x)
        return F.adaptive_avg_pool2d(x, sizes), state

    return leaf("adaptive_avg_pool2d", init, apply, dict(output_size=sizes))


def GlobalAvgPool2D() -> Layer:
    """Mean over the spatial axes.

    Returns:
        A Layer of kind ``"global_avg_pool2d"``: ``(N, H, W, C) -> (N, C)``, no params.
    """
    name = "GlobalAvgPool2D"

    def init(key, input_shape):
        del key
        check_image(name, input_shape)
        return {}, {}, (input_shape[0], input_shape[3])

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng
        whole_images_only(name, choices)
        x, _ = cast_in(policy, "global_avg_pool2d", x)
        return F.global_avg_pool2d(x), state

    return leaf("global_avg_pool2d", init, apply, {})
