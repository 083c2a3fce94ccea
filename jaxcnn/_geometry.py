"""Window geometry shared by :mod:`jaxcnn.functional` and :mod:`pallas_kernels`.

A leaf: it imports neither package, so the kernels (below ``functional`` in the
layering) and the functional ops read one definition of the argument forms,
padding rules and output sizes.  Every checker takes the op's name so that an
error says which call was wrong (``"conv2d: ..."``); all checks run on static
Python values and shapes, so they fire at trace time.  The XLA window
reductions of max and average pooling live here too: the functional ops run
them, and the Pallas pooling kernels differentiate them for ``backward="xla"``.
"""
from __future__ import annotations

import numbers

import jax.numpy as jnp
import numpy as np
from jax import lax

# Images NHWC, kernels HWIO: lax.conv_general_dilated's dimension_numbers.
DIMS = ("NHWC", "HWIO", "NHWC")

Pads = tuple[tuple[int, int], tuple[int, int]]


def is_int(value) -> bool:
    # bool is an Integral too, but `stride=True` is surely a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_int_pair(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value)


def pair(value, name: str, op: str, minimum: int = 1) -> tuple[int, int]:
    """``(a, b)`` from an int or a pair of ints, each at least ``minimum``."""
    if is_int(value):
        out = (int(value), int(value))
    elif _is_int_pair(value):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    if min(out) < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return out


def padding_spec(padding, op: str, *, allow_strings: bool = True) -> str | Pads:
    """``"SAME"``, ``"VALID"`` or explicit ``((top, bottom), (left, right))``.

    Accepts an int (all four sides), ``(ph, pw)`` (symmetric per axis), the
    explicit nested form, or the strings ``"SAME"``/``"VALID"`` (any case).
    """
    if isinstance(padding, str):
        if allow_strings and padding.upper() in ("SAME", "VALID"):
            return padding.upper()
    elif is_int(padding) or _is_int_pair(padding):
        ph, pw = pair(padding, "padding", op, minimum=0)
        return ((ph, ph), (pw, pw))
    elif (isinstance(padding, (tuple, list)) and len(padding) == 2
          and all(_is_int_pair(p) for p in padding)):
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
        if min(min(p) for p in pads) < 0:
            raise ValueError(f"{op}: padding must be non-negative, got {padding!r}")
        return pads
    forms = "an int, (ph, pw), ((top, bottom), (left, right))"
    forms += ", 'SAME' or 'VALID'" if allow_strings else ""
    raise ValueError(f"{op}: padding must be {forms}; got {padding!r}")


def explicit_pads(spec: str | Pads, in_hw, window_hw, stride_hw) -> Pads:
    """Resolves ``"SAME"``/``"VALID"`` to per-side pads with XLA's meaning.

    ``"SAME"`` gives ``ceil(size / stride)`` outputs, padding the total needed
    split with the extra element (if odd) at the end; ``window_hw`` is the
    dilated window extent.
    """
    if spec == "VALID":
        return ((0, 0), (0, 0))
    if spec == "SAME":
        pads = []
        for n, k, s in zip(in_hw, window_hw, stride_hw):
            out = -(-n // s)
            total = max((out - 1) * s + k - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return spec


def dilated(kernel_hw, dilation_hw) -> tuple[int, int]:
    """Extent of a dilated window: ``(k - 1) * d + 1`` per axis."""
    return tuple((k - 1) * d + 1 for k, d in zip(kernel_hw, dilation_hw))


def pad_beyond_window(x, pads, window):
    """``(x, pads)`` with every pad wider than the window less one applied to ``x``
    itself (zeros, by ``jnp.pad``), so that the convolution left keeps pads of at most
    ``window - 1`` on each side.  Same values, forward and backward.

    Why: a wider pad makes the convolution's input gradient (its transpose) a
    convolution with a *negative* low pad, and XLA:CPU's Eigen convolution (taken for
    up to 16 channels) reads outside its input for a negative low pad with a positive
    high one (openxla/xla#48713, open in jaxlib 0.10.2 and 0.11.2): garbage, NaN at
    times, in the gradient.  ``jnp.pad``'s own gradient is a slice.
    """
    extra = tuple((max(lo - (k - 1), 0), max(hi - (k - 1), 0)) for (lo, hi), k in zip(pads, window))
    if not any(a or b for a, b in extra):
        return x, pads
    x = jnp.pad(x, ((0, 0), *extra, (0, 0)))
    return x, tuple((lo - a, hi - b) for (lo, hi), (a, b) in zip(pads, extra))


def out_size(n: int, lo: int, hi: int, window: int, stride: int, ceil_mode: bool = False) -> int:
    """How many windows of extent ``window`` (dilated) fit along an axis, PyTorch's rule,
    with possibly unequal pads on the two sides.

    ``(n + lo + hi - window) // stride + 1``; with ``ceil_mode`` a partial last
    window counts, but only if it starts inside the input or the left padding
    (never wholly in the right padding or the overhang).
    """
    span = n + lo + hi - window
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + lo:
        out -= 1
    return out


def output_hw(in_hw, pads, window_hw, stride_hw) -> tuple[int, int]:
    """:func:`out_size` per spatial axis (floor mode); ``window_hw`` is the dilated extent."""
    return tuple(out_size(n, lo, hi, k, s) for n, (lo, hi), k, s in zip(in_hw, pads, window_hw, stride_hw))


def check_window_fits(op: str, x_shape, window_hw, pads: Pads, what: str = "window") -> None:
    """Raises if the (dilated) window is larger than the padded input."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(x_shape[1:3], pads))
    if any(k > p for k, p in zip(window_hw, padded)):
        raise ValueError(
            f"{op}: {what} {tuple(window_hw)} (dilated extent) is larger than the padded "
            f"input {padded} (x shape {tuple(x_shape)}, padding {pads})")


def check_rank(op: str, name: str, shape, rank: int, layout: str) -> None:
    """Raises unless ``shape`` has ``rank`` dimensions."""
    if len(shape) != rank:
        raise ValueError(f"{op}: {name} must have rank {rank} {layout}, got shape {tuple(shape)}")


def conv_geometry(op: str, x_shape, w_shape, stride, padding, dilation):
    """Validated ``(stride, dilation, pads, out_hw)`` of a convolution (HWIO ``w_shape``)."""
    stride = pair(stride, "stride", op)
    dilation = pair(dilation, "dilation", op)
    window = dilated(w_shape[:2], dilation)
    pads = explicit_pads(padding_spec(padding, op), x_shape[1:3], window, stride)
    check_window_fits(op, x_shape, window, pads, what="kernel")
    return stride, dilation, pads, output_hw(x_shape[1:3], pads, window, stride)


def pool_geometry(op, x_shape, kernel_size, stride, padding, dilation, ceil_mode):
    """Validated window, strides and the exact pads that give PyTorch's output size.

    Returns ``(kernel, stride, dilation, user_pads, run_pads, out_hw)``:
    ``user_pads`` are the pads the caller asked for, ``run_pads`` extend the
    bottom/right ones by the ``ceil_mode`` overhang so that a VALID reduction
    over the padded input yields exactly ``out_hw`` windows.
    """
    x_shape = tuple(x_shape)
    check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    kernel = pair(kernel_size, "kernel_size", op)
    stride = kernel if stride is None else pair(stride, "stride", op)
    dilation = pair(dilation, "dilation", op)
    spec = padding_spec(padding, op)
    window = dilated(kernel, dilation)
    pads = explicit_pads(spec, x_shape[1:3], window, stride)
    if not isinstance(spec, str):
        # PyTorch's rule; without dilation it keeps every window overlapping the input.
        for k, p in zip(kernel, pads):
            if max(p) > k // 2:
                raise ValueError(
                    f"{op}: padding {pads} must be at most half the kernel size {kernel} "
                    f"(x shape {x_shape})")
    check_window_fits(op, x_shape, window, pads)
    out_hw = tuple(out_size(n, lo, hi, k, s, ceil_mode)
                   for n, (lo, hi), k, s in zip(x_shape[1:3], pads, window, stride))
    run_pads = tuple((lo, max(hi, (o - 1) * s + k - n - lo))
                     for n, (lo, hi), k, s, o in zip(x_shape[1:3], pads, window, stride, out_hw))
    return kernel, stride, dilation, pads, run_pads, out_hw


def window_counts(n, lo, hi, k, s, out, include_pad):
    """How many positions of each window lie in the input (plus padding if counted).

    Positions past the bottom/right padding (the ``ceil_mode`` overhang) are
    never counted, as in PyTorch.
    """
    first, last = (-lo, n + hi) if include_pad else (0, n)
    starts = np.arange(out) * s - lo
    return np.minimum(starts + k, last) - np.maximum(starts, first)


def avg_divisor(in_hw, pads, kernel, stride, out_hw, count_include_pad) -> np.ndarray:
    """``(OH, OW)`` divisors of average pooling: :func:`window_counts` per axis, outer product."""
    ch, cw = (window_counts(n, lo, hi, k, s, o, count_include_pad)
              for n, (lo, hi), k, s, o in zip(in_hw, pads, kernel, stride, out_hw))
    return np.outer(ch, cw)


def lowest(dtype):
    """The identity of ``max`` for ``dtype``: -inf for floats, the minimum for ints."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return np.array(np.iinfo(dtype).min, dtype)
    return np.array(-np.inf, dtype)


def xla_max_pool(x, kernel, stride, dilation, run_pads, out_hw):
    """Max pooling by XLA over validated geometry (:func:`pool_geometry`); the gradient
    goes to each window's first maximum (row-major), as in PyTorch."""
    if dilation != (1, 1):
        return _dilated_max_pool(x, kernel, stride, dilation, run_pads, out_hw)
    # The gradient of reduce_window's max (select-and-scatter with >=) keeps the
    # first of equal values, i.e. PyTorch's first-max-wins.
    return lax.reduce_window(
        x, lowest(x.dtype), lax.max, (1, *kernel, 1), (1, *stride, 1),
        ((0, 0), *run_pads, (0, 0)))


def window_taps(xp, kernel, stride, dilation, out_hw) -> list:
    """The ``kh * kw`` taps of the windows over ``xp`` (already padded), row-major: tap
    ``a * kw + b`` is ``xp[:, a * dh + i * sh, b * dw + j * sw]`` for output ``(i, j)``,
    each ``(N, OH, OW, C)`` (strided slices, no gather)."""
    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out_hw
    n, c = xp.shape[0], xp.shape[3]
    return [lax.slice(xp, (0, a * dh, b * dw, 0),
                      (n, a * dh + (oh - 1) * sh + 1, b * dw + (ow - 1) * sw + 1, c), (1, sh, sw, 1))
            for a in range(kernel[0]) for b in range(kernel[1])]


def _dilated_max_pool(x, kernel, stride, dilation, run_pads, out_hw):
    """Max pooling with a dilated window, as an argmax over the window's taps.

    JAX has no gradient for ``reduce_window`` max with window dilation, so the
    ``kh * kw`` strided taps are stacked and the first maximum picked with
    ``argmax``; the gradient of the gather then goes to that first maximum.
    """
    xp = jnp.pad(x, ((0, 0), *run_pads, (0, 0)), constant_values=lowest(x.dtype))
    taps = jnp.stack(window_taps(xp, kernel, stride, dilation, out_hw))
    first = jnp.argmax(taps, axis=0)
    return jnp.take_along_axis(taps, first[None], axis=0)[0]


def xla_avg_pool(x, kernel, stride, pads, run_pads, out_hw, count_include_pad):
    """Average pooling by XLA over validated geometry (:func:`pool_geometry`): window
    sums in float32 (or wider) over :func:`avg_divisor`, in ``x.dtype``."""
    summed = window_sums(x, kernel, stride, run_pads)
    divisor = avg_divisor(jnp.shape(x)[1:3], pads, kernel, stride, out_hw, count_include_pad)
    return (summed / divisor.astype(summed.dtype)[None, :, :, None]).astype(x.dtype)


def window_sums(x, kernel, stride, run_pads):
    """Sums of every window over ``x`` zero-padded by ``run_pads``, in float32 (or wider)."""
    acc = jnp.promote_types(x.dtype, jnp.float32)
    return lax.reduce_window(x.astype(acc), np.array(0, acc), lax.add, (1, *kernel, 1),
                             (1, *stride, 1), ((0, 0), *run_pads, (0, 0)))
