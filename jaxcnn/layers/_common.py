"""Small helpers shared by the layer modules: argument normalisation, the
window output-size arithmetic used by ``init``, input-shape checks and the
policy casting done at every layer boundary."""
from __future__ import annotations

import math
from typing import Sequence

from jaxcnn._geometry import explicit_pads, out_size, pair
from jaxcnn.functional import _dispatch
from jaxcnn.layers.base import choices_or_default, where
from jaxcnn.precision import DEFAULT_FP32_KINDS, cast_for


def padding_pairs(padding, layer: str, allow_strings: bool = True):
    """Normalise a padding argument to ``"SAME"``, ``"VALID"`` or
    ``((top, bottom), (left, right))``.

    Arguments:
        padding: ``int``, ``(ph, pw)`` (symmetric), ``((top, bottom), (left, right))``
            or, when ``allow_strings``, ``"SAME"``/``"VALID"`` (any case).
        layer: name used in error messages.
        allow_strings: whether the string forms are accepted.
    """
    if isinstance(padding, str):
        if allow_strings and padding.upper() in ("SAME", "VALID"):
            return padding.upper()
        raise ValueError(f"{layer}: padding string must be 'SAME' or 'VALID', got {padding!r}"
                         if allow_strings else f"{layer}: padding must be numeric, got {padding!r}")
    if (isinstance(padding, Sequence) and len(padding) == 2
            and all(isinstance(p, Sequence) for p in padding)):
        return (pair(padding[0], "padding", layer, 0), pair(padding[1], "padding", layer, 0))
    ph, pw = pair(padding, "padding", layer, 0)
    return ((ph, ph), (pw, pw))


def window_output_size(size: int, kernel: int, stride: int, pad: tuple[int, int] | str,
                       dilation: int = 1, ceil_mode: bool = False) -> int:
    """Output length of a sliding window (convolution or pooling), PyTorch rules.

    Arguments:
        size: input length.
        kernel, stride, dilation: window parameters along this axis.
        pad: ``(before, after)`` zero padding, or ``"SAME"``/``"VALID"`` (XLA rules).
        ceil_mode: round up instead of down, dropping a last window that would
            start inside the right padding (``torch.nn.MaxPool2d(ceil_mode=True)``).
    """
    span = dilation * (kernel - 1) + 1
    if isinstance(pad, str):
        pad = explicit_pads(pad, (size,), (span,), (stride,))[0]
    before, after = pad
    if size + before + after < span:
        return 0
    return out_size(size, before, after, span, stride, ceil_mode)


def transpose_output_size(size: int, kernel: int, stride: int, pad: tuple[int, int],
                          dilation: int, output_padding: int) -> int:
    """Output length of a transposed convolution (``torch.nn.ConvTranspose2d``)."""
    return (size - 1) * stride - pad[0] - pad[1] + dilation * (kernel - 1) + output_padding + 1


def check_image(layer: str, input_shape):
    """Raise ``ValueError`` naming ``layer`` unless ``input_shape`` is ``(N, H, W, C)``."""
    if len(input_shape) != 4:
        raise ValueError(f"{layer}: expected a rank-4 input (N, H, W, C), "
                         f"got shape {tuple(input_shape)}")


def check_min_rank(layer: str, input_shape, min_rank: int):
    """Raise ``ValueError`` naming ``layer`` unless ``input_shape`` has rank >= ``min_rank``."""
    if len(input_shape) < min_rank:
        raise ValueError(f"{layer}: expected an input of rank >= {min_rank}, "
                         f"got shape {tuple(input_shape)}")


def check_positive(layer: str, input_shape, output_shape):
    """Raise ``ValueError`` when a window does not fit, i.e. an output size is < 1."""
    if any(d < 1 for d in output_shape[1:]):
        raise ValueError(f"{layer}: input shape {tuple(input_shape)} is too small for the "
                         f"window; output shape would be {tuple(output_shape)}")


def prod(values) -> int:
    return math.prod(int(v) for v in values)


def cast_in(policy, kind: str, x, params=None):
    """Cast the input and parameters to the compute dtype ``policy`` gives ``kind``
    (no casting at all when ``policy`` is None)."""
    return cast_for(policy, kind, (x, params))


def cast_out(policy, kind: str, y, input_dtype):
    """Float32 kinds (normalisation, softmax) hand back the dtype their input
    came in with, so a bf16 network stays bf16 around them; other kinds return
    the compute dtype they already produced."""
    if policy is not None and kind in DEFAULT_FP32_KINDS:
        return y.astype(input_dtype)
    return y


def layer_height_axis(choices) -> str | None:
    """The ops' ``height_axis`` for a layer applied with ``choices``."""
    return choices_or_default(choices).height_axis


def whole_images_only(name: str, choices, why: str = "computes on whole images") -> None:
    """Raise when ``choices`` says ``x`` is one block of each image's rows
    (``Choices.height_axis``) and the layer ``name`` cannot compute its share from that block
    alone (it would return a wrong result per block, silently)."""
    axis = layer_height_axis(choices)
    if axis is not None:
        raise ValueError(f"{where(name)}: {why}, but Choices.height_axis={axis!r} makes x one block "
                         f"of each image's rows; gather the rows first (apply it without height_axis)")


def layer_impl(choices) -> str:
    """The ops' ``impl`` argument for a layer applied with ``choices`` (a ``Choices`` or None)."""
    return _dispatch.layer_impl(choices_or_default(choices).impl)
