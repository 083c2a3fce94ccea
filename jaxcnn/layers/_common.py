"""Small helpers shared by the layer modules: argument normalisation, the
window output-size arithmetic used by ``init``, input-shape checks and the
policy casting done at every layer boundary."""
from __future__ import annotations

import math
import numbers
from typing import Sequence

from jaxcnn.precision import DEFAULT_FP32_KINDS, cast_for

Pair = tuple[int, int]


def _is_int(value) -> bool:
    # bool is Integral too, but `stride=True` is surely a mistake
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def pair(value, what: str, layer: str, minimum: int = 1) -> Pair:
    """``value`` (an int or two ints) as ``(h, w)``, each at least ``minimum``."""
    if _is_int(value):
        out = (int(value), int(value))
    elif isinstance(value, Sequence) and len(value) == 2 and all(_is_int(v) for v in value):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{layer}: {what} must be an int or a pair of ints, got {value!r}")
    if min(out) < minimum:
        raise ValueError(f"{layer}: {what} must be >= {minimum}, got {value!r}")
    return out


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
    if pad == "SAME":  # XLA: ceil(size / stride) outputs, the odd pad at the end
        total = max((-(-size // stride) - 1) * stride + span - size, 0)
        pad = (total // 2, total - total // 2)
    elif pad == "VALID":
        pad = (0, 0)
    before, after = pad
    room = size + before + after - span
    if room < 0:
        return 0
    out = (-(-room // stride) if ceil_mode else room // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + before:
        out -= 1
    return out


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
