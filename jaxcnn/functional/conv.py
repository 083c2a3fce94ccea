"""2-D convolution and transposed convolution, NHWC with HWIO kernels."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn.functional import _channels, _dispatch, _halo


def _check_bias(op: str, b, channels: int, w_shape) -> None:
    if b is not None and tuple(jnp.shape(b)) != (channels,):
        raise ValueError(
            f"{op}: bias must have shape ({channels},) to match w shape {tuple(w_shape)}, "
            f"got {tuple(jnp.shape(b))}")


def conv2d(x, w, b=None, *, stride=1, padding=0, dilation=1, groups=1, impl="auto",
           height_axis=None):
    """2-D cross-correlation with PyTorch ``Conv2d`` semantics, in NHWC.

    Arguments:
        x: input ``(N, H, W, C_in)``.
        w: kernel ``(KH, KW, C_in // groups, C_out)`` (HWIO); a PyTorch weight
            ``(C_out, C_in // groups, KH, KW)`` maps here by ``transpose(2, 3, 1, 0)``.
        b: optional bias ``(C_out,)``.
        stride: int or ``(sh, sw)``, each >= 1.
        padding: int, ``(ph, pw)`` (symmetric), ``((top, bottom), (left, right))``,
            or ``"SAME"``/``"VALID"`` with XLA's meaning (``"SAME"`` gives
            ``ceil(H / sh)`` rows, the odd extra pad at the bottom/right).
        dilation: int or ``(dh, dw)``, each >= 1.
        groups: number of groups; divides both ``C_in`` and ``C_out``.
        impl: ``"xla"``; ``"pallas"`` (:func:`pallas_kernels.conv2d`, groups=1 or
            depthwise only); or ``"auto"``: XLA unless on a GPU where the
            autotuner measured the kernel faster for this shape; on a CPU,
            large convolutions whose weight gradient XLA would give to
            YNNPACK get an im2col-matmul weight gradient instead
            (:mod:`jaxcnn.functional._cpu_lowering`).
        height_axis: inside ``shard_map`` over an axis whose devices hold the image's
            rows in equal blocks, in order: that axis's name.  ``x`` is then this
            device's block and the result its block of the whole image's output
            (padding and output size are the whole image's); the rows the block's
            windows need from its neighbours come by ``ppermute``
            (:mod:`jaxcnn.functional._halo`), and the convolution runs on XLA.

    Returns:
        ``(N, H_out, W_out, C_out)`` with
        ``H_out = floor((H + top + bottom - dh * (KH - 1) - 1) / sh) + 1``.

    Raises:
        ValueError: on wrong ranks, channel/group mismatches, a dilated kernel
            larger than the padded input, or malformed stride/padding/dilation.
    """
    op = "conv2d"
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    geo.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    geo.check_rank(op, "w", w_shape, 4, "(KH, KW, C_in // groups, C_out)")
    if not geo.is_int(groups) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    c_in, c_out = x_shape[3], w_shape[3]
    if c_in % groups or c_out % groups:
        raise ValueError(
            f"{op}: groups={groups} must divide both input channels {c_in} and output "
            f"channels {c_out} (x shape {x_shape}, w shape {w_shape})")
    if w_shape[2] * groups != c_in:
        nchw = ("; jaxcnn takes NHWC images and x looks like NCHW (N, C, H, W): "
                "x.transpose(0, 2, 3, 1)" if x_shape[1] == w_shape[2] * groups else "")
        raise ValueError(
            f"{op}: channel mismatch: x has {c_in} channels but w expects "
            f"{w_shape[2]} * groups={groups} = {w_shape[2] * groups} "
            f"(x shape {x_shape}, w shape {w_shape}){nchw}")
    _check_floating(op, x, w)
    _check_bias(op, b, c_out, w_shape)
    if height_axis is not None:
        return _halo.conv2d(x, w, b, stride=stride, padding=padding, dilation=dilation, groups=groups,
                            axis_name=height_axis, run=conv2d)
    stride, dilation, pads, _ = geo.conv_geometry(op, x_shape, w_shape, stride, padding,
                                                  dilation)
    x, pads = geo.pad_beyond_window(x, pads, geo.dilated(w_shape[:2], dilation))
    run = _dispatch.choose(op, impl, (x, w, b), dict(
        stride=stride, padding=pads, dilation=dilation, groups=groups))
    if run is not None:
        return run(x, w, b)
    y = lax.conv_general_dilated(
        x, w, window_strides=stride, padding=pads, rhs_dilation=dilation,
        dimension_numbers=geo.DIMS, feature_group_count=groups)
    return _channels.add_bias(y, b)


def _check_floating(op: str, x, w) -> None:
    """Integer images (uint8 pixels) are refused in one line: scaling and normalising them
    is the caller's (as the model was trained), not a silent cast's."""
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"{op}: x is {jnp.result_type(x)}, w {jnp.result_type(w)}: convert "
                        "images to floating point first, scaled and normalised as the model "
                        "was trained (e.g. x.astype(jnp.float32) / 255, then the mean and std)")


def _transpose_geometry(x, w, b, stride, padding, output_padding, dilation, groups):
    """:func:`conv_transpose2d`'s arguments checked (one-line ValueErrors naming them) and
    normalised: ``(stride, dilation, output_padding, pads, dilated window)``."""
    op = "conv_transpose2d"
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    geo.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    geo.check_rank(op, "w", w_shape, 4, "(KH, KW, C_in, C_out // groups)")
    stride = geo.pair(stride, "stride", op)
    dilation = geo.pair(dilation, "dilation", op)
    output_padding = geo.pair(output_padding, "output_padding", op, minimum=0)
    pads = geo.padding_spec(padding, op, allow_strings=False)
    if not geo.is_int(groups) or groups < 1:
        raise ValueError(f"{op}: groups must be a positive int, got {groups!r}")
    c_in = x_shape[3]
    if w_shape[2] != c_in:
        raise ValueError(
            f"{op}: channel mismatch: x has {c_in} channels but w expects {w_shape[2]} "
            f"(x shape {x_shape}, w shape {w_shape})")
    if c_in % groups:
        raise ValueError(
            f"{op}: groups={groups} must divide input channels {c_in} "
            f"(x shape {x_shape}, w shape {w_shape})")
    _check_bias(op, b, w_shape[3] * groups, w_shape)
    for op_, s, d in zip(output_padding, stride, dilation):
        if op_ >= max(s, d):
            raise ValueError(
                f"{op}: output_padding {output_padding} must be smaller than stride {stride} "
                f"or dilation {dilation} on each axis")
    window = geo.dilated(w_shape[:2], dilation)
    out_hw = tuple((n - 1) * s - lo - hi + k + o for n, s, (lo, hi), k, o
                   in zip(x_shape[1:3], stride, pads, window, output_padding))
    if min(out_hw) < 1:
        raise ValueError(
            f"{op}: output size {out_hw} is empty (x shape {x_shape}, w shape {w_shape}, "
            f"stride {stride}, padding {pads}, dilation {dilation})")
    return stride, dilation, output_padding, pads, window


def conv_transpose2d(x, w, b=None, *, stride=1, padding=0, output_padding=0, dilation=1,
                     groups=1):
    """Transposed 2-D convolution with PyTorch ``ConvTranspose2d`` semantics, NHWC.

    It is the gradient of :func:`conv2d` with respect to its input: every input
    pixel scatters ``w`` (scaled) into the output at ``stride`` spacing, then
    ``padding`` rows/columns are cropped from each border and
    ``output_padding`` extra rows/columns are kept at the bottom/right.

    Arguments:
        x: input ``(N, H, W, C_in)``.
        w: kernel ``(KH, KW, C_in, C_out // groups)``; a PyTorch weight
            ``(C_in, C_out // groups, KH, KW)`` maps here by ``transpose(2, 3, 0, 1)``.
        b: optional bias ``(C_out,)``.
        stride: int or ``(sh, sw)``, each >= 1.
        padding: int, ``(ph, pw)`` or ``((top, bottom), (left, right))``: how much
            is cropped from each border of the full output.
        output_padding: int or ``(oph, opw)``, each smaller than the stride or
            the dilation on that axis (as in PyTorch).
        dilation: int or ``(dh, dw)``, each >= 1.
        groups: number of groups; divides ``C_in``.

    Returns:
        ``(N, H_out, W_out, C_out)`` with
        ``H_out = (H - 1) * sh - top - bottom + dh * (KH - 1) + oph + 1``.

    Raises:
        ValueError: on wrong ranks, channel/group mismatches, an empty output,
            or malformed arguments.
    """
    stride, dilation, output_padding, pads, window = _transpose_geometry(
        x, w, b, stride, padding, output_padding, dilation, groups)
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    c_in = x_shape[3]

    # As a forward convolution: dilate the input by the stride, pad each border
    # by the window extent minus one less the crop (negative pads crop), and
    # correlate with the spatially flipped kernel.  Groups need the kernel's
    # in/out axes swapped within each group: (KH, KW, g * ci, co) ->
    # (KH, KW, ci, g * co).
    kh, kw, _, co = w_shape
    ci = c_in // groups
    wf = w[::-1, ::-1].reshape(kh, kw, groups, ci, co).transpose(0, 1, 3, 2, 4)
    wf = wf.reshape(kh, kw, ci, groups * co)
    # A negative pad (a crop wider than the window less one) is cropped after the
    # convolution instead: XLA:CPU miscomputes some convolutions with a negative low pad
    # (see geo.pad_beyond_window).
    conv_pads = tuple((k - 1 - lo, k - 1 - hi + o)
                      for k, (lo, hi), o in zip(window, pads, output_padding))
    y = lax.conv_general_dilated(
        x, wf, window_strides=(1, 1), padding=tuple((max(lo, 0), max(hi, 0)) for lo, hi in conv_pads),
        lhs_dilation=stride, rhs_dilation=dilation, dimension_numbers=geo.DIMS,
        feature_group_count=groups)
    (top, bottom), (left, right) = ((max(-lo, 0), max(-hi, 0)) for lo, hi in conv_pads)
    y = y[:, top:y.shape[1] - bottom, left:y.shape[2] - right]
    return _channels.add_bias(y, b)
