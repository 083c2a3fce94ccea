"""Convolution layers: :func:`Conv2D` and :func:`ConvTranspose2D` (NHWC).

Kernels are stored HWIO: ``(KH, KW, C_in // groups, C_out)`` for Conv2D and
``(KH, KW, C_in, C_out // groups)`` for ConvTranspose2D (PyTorch's
``(C_in, C_out // groups, KH, KW)`` transposed by ``(2, 3, 0, 1)``).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcnn import functional as F
from jaxcnn.layers import initializers as inits
from jaxcnn.layers._common import (cast_in, check_image, check_positive, layer_height_axis,
                                   layer_impl, padding_pairs, pair, transpose_output_size,
                                   whole_images_only, window_output_size)
from jaxcnn.layers.base import Layer, leaf


def _check_groups(layer: str, in_channels: int, out_channels: int, groups: int, input_shape):
    if in_channels % groups or out_channels % groups:
        raise ValueError(f"{layer}: groups={groups} must divide both the input channels "
                         f"({in_channels}, input shape {tuple(input_shape)}) and "
                         f"out_channels={out_channels}")


def _init_weights(key, w_shape, fan_in, fan_out, out_channels, use_bias, w_init, b_init):
    k_w, k_b = jax.random.split(key)
    params = {"w": w_init(k_w, w_shape, jnp.float32, fan_in, fan_out)}
    if use_bias:
        params["b"] = b_init(k_b, (out_channels,), jnp.float32, fan_in, fan_out)
    return params


def Conv2D(out_channels: int, kernel_size, *, stride=1, padding=0, dilation=1, groups: int = 1,
           use_bias: bool = True, w_init=None, b_init=None) -> Layer:
    """2-D convolution over NHWC images, like ``torch.nn.Conv2d``.

    Arguments:
        out_channels: number of output channels ``C_out``.
        kernel_size: ``k`` or ``(KH, KW)``.
        stride: ``s`` or ``(sh, sw)``.
        padding: ``p``, ``(ph, pw)``, ``((top, bottom), (left, right))``, ``"SAME"``
            or ``"VALID"``.
        dilation: ``d`` or ``(dh, dw)``.
        groups: number of channel groups; must divide ``C_in`` and ``C_out``.
        use_bias: whether to add a bias ``b`` of shape ``(C_out,)``.
        w_init, b_init: initialiser or name (see :mod:`jaxcnn.layers.initializers`);
            default PyTorch's (``U(±1/sqrt(fan_in))`` for both).

    Returns:
        A Layer of kind ``"conv2d"``: input ``(N, H, W, C_in)``, output
        ``(N, H', W', C_out)``; params ``{"w": (KH, KW, C_in // groups, C_out), "b": (C_out,)}``.
    """
    name = "Conv2D"
    kh, kw = pair(kernel_size, "kernel_size", name)
    stride, dilation = pair(stride, "stride", name), pair(dilation, "dilation", name)
    padding = padding_pairs(padding, name)
    if out_channels < 1 or groups < 1:
        raise ValueError(f"{name}: out_channels and groups must be >= 1, got "
                         f"{out_channels} and {groups}")
    w_init = inits.resolve(w_init, inits.torch_default_weight())
    b_init = inits.resolve(b_init, inits.torch_default_bias())
    config = dict(out_channels=out_channels, kernel_size=(kh, kw), stride=stride, padding=padding,
                  dilation=dilation, groups=groups, use_bias=use_bias)

    def init(key, input_shape):
        check_image(name, input_shape)
        n, h, w, c = input_shape
        _check_groups(name, c, out_channels, groups, input_shape)
        pads = (padding, padding) if isinstance(padding, str) else padding
        out_shape = (n,
                     window_output_size(h, kh, stride[0], pads[0], dilation[0]),
                     window_output_size(w, kw, stride[1], pads[1], dilation[1]),
                     out_channels)
        check_positive(name, input_shape, out_shape)
        fan_in, fan_out = kh * kw * c // groups, kh * kw * out_channels
        params = _init_weights(key, (kh, kw, c // groups, out_channels), fan_in, fan_out,
                               out_channels, use_bias, w_init, b_init)
        return params, {}, out_shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        x, params = cast_in(policy, "conv2d", x, params)
        y = F.conv2d(x, params["w"], params.get("b"), stride=stride, padding=padding,
                     dilation=dilation, groups=groups, impl=layer_impl(choices),
                     height_axis=layer_height_axis(choices))
        return y, state

    return leaf("conv2d", init, apply, config)


def ConvTranspose2D(out_channels: int, kernel_size, *, stride=1, padding=0, output_padding=0,
                    dilation=1, groups: int = 1, use_bias: bool = True, w_init=None,
                    b_init=None) -> Layer:
    """2-D transposed convolution over NHWC images, like ``torch.nn.ConvTranspose2d``.

    ``H' = (H - 1) * sh - top - bottom + dh * (KH - 1) + output_padding_h + 1``
    (and likewise for ``W'``).

    Arguments:
        out_channels: number of output channels ``C_out``.
        kernel_size: ``k`` or ``(KH, KW)``.
        stride: ``s`` or ``(sh, sw)``.
        padding: ``p``, ``(ph, pw)`` or ``((top, bottom), (left, right))``; removes
            that many rows/columns from the full output, as PyTorch.
        output_padding: ``op`` or ``(oph, opw)``, extra rows/columns added at the
            bottom/right; each must be smaller than its stride or its dilation.
        dilation: ``d`` or ``(dh, dw)``.
        groups: number of channel groups; must divide ``C_in`` and ``C_out``.
        use_bias: whether to add a bias ``b`` of shape ``(C_out,)``.
        w_init, b_init: initialiser or name; default PyTorch's, with
            ``fan_in = KH * KW * C_out // groups`` as PyTorch computes it for its
            ``(C_in, C_out // groups, KH, KW)`` weight.

    Returns:
        A Layer of kind ``"conv_transpose2d"``: input ``(N, H, W, C_in)``, output
        ``(N, H', W', C_out)``; params ``{"w": (KH, KW, C_in, C_out // groups), "b": (C_out,)}``.
    """
    name = "ConvTranspose2D"
    kh, kw = pair(kernel_size, "kernel_size", name)
    stride, dilation = pair(stride, "stride", name), pair(dilation, "dilation", name)
    padding = padding_pairs(padding, name, allow_strings=False)
    output_padding = pair(output_padding, "output_padding", name, minimum=0)
    for op, s, d in zip(output_padding, stride, dilation):
        if op >= s and op >= d:
            raise ValueError(f"{name}: output_padding {output_padding} must be smaller than "
                             f"either stride {stride} or dilation {dilation}")
    if out_channels < 1 or groups < 1:
        raise ValueError(f"{name}: out_channels and groups must be >= 1, got "
                         f"{out_channels} and {groups}")
    w_init = inits.resolve(w_init, inits.torch_default_weight())
    b_init = inits.resolve(b_init, inits.torch_default_bias())
    config = dict(out_channels=out_channels, kernel_size=(kh, kw), stride=stride, padding=padding,
                  output_padding=output_padding, dilation=dilation, groups=groups,
                  use_bias=use_bias)

    def init(key, input_shape):
        check_image(name, input_shape)
        n, h, w, c = input_shape
        _check_groups(name, c, out_channels, groups, input_shape)
        out_shape = (n,
                     transpose_output_size(h, kh, stride[0], padding[0], dilation[0],
                                           output_padding[0]),
                     transpose_output_size(w, kw, stride[1], padding[1], dilation[1],
                                           output_padding[1]),
                     out_channels)
        check_positive(name, input_shape, out_shape)
        fan_in, fan_out = kh * kw * out_channels // groups, kh * kw * c
        params = _init_weights(key, (kh, kw, c, out_channels // groups), fan_in, fan_out,
                               out_channels, use_bias, w_init, b_init)
        return params, {}, out_shape

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del train, rng
        whole_images_only(name, choices, "has no halo exchange of its own")
        x, params = cast_in(policy, "conv_transpose2d", x, params)
        y = F.conv_transpose2d(x, params["w"], params.get("b"), stride=stride, padding=padding,
                               output_padding=output_padding, dilation=dilation, groups=groups)
        return y, state

    return leaf("conv_transpose2d", init, apply, config)
