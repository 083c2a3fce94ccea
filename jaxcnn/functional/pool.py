"""Max, average, adaptive and global pooling over NHWC images (PyTorch semantics)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcnn.functional import _args, _cpu_lowering


def _out_size(n: int, lo: int, hi: int, window: int, stride: int, ceil_mode: bool) -> int:
    """PyTorch's pooling output size, with possibly unequal pads on the two sides.

    With ``ceil_mode`` a partial last window counts, but only if it starts
    inside the input or the left padding (never wholly in the right padding
    or the overhang).
    """
    span = n + lo + hi - window
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= n + lo:
        out -= 1
    return out


def _pool_geometry(op, x, kernel_size, stride, padding, dilation, ceil_mode):
    """Validated window, strides and the exact pads that give PyTorch's output size.

    Returns ``(kernel, stride, dilation, user_pads, run_pads, out_hw)``:
    ``user_pads`` are the pads the caller asked for, ``run_pads`` extend the
    bottom/right ones by the ``ceil_mode`` overhang so that a VALID reduction
    over the padded input yields exactly ``out_hw`` windows.
    """
    x_shape = tuple(jnp.shape(x))
    _args.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    kernel = _args.pair(kernel_size, "kernel_size", op)
    stride = kernel if stride is None else _args.pair(stride, "stride", op)
    dilation = _args.pair(dilation, "dilation", op)
    spec = _args.padding_spec(padding, op)
    window = _args.dilated(kernel, dilation)
    pads = _args.explicit_pads(spec, x_shape[1:3], window, stride)
    if not isinstance(spec, str):
        # PyTorch's rule; without dilation it keeps every window overlapping the input.
        for k, p in zip(kernel, pads):
            if max(p) > k // 2:
                raise ValueError(
                    f"{op}: padding {pads} must be at most half the kernel size {kernel} "
                    f"(x shape {x_shape})")
    _args.check_window_fits(op, x_shape, window, pads)
    out_hw = tuple(_out_size(n, lo, hi, k, s, ceil_mode)
                   for n, (lo, hi), k, s in zip(x_shape[1:3], pads, window, stride))
    run_pads = tuple((lo, max(hi, (o - 1) * s + k - n - lo))
                     for n, (lo, hi), k, s, o in zip(x_shape[1:3], pads, window, stride, out_hw))
    return kernel, stride, dilation, pads, run_pads, out_hw


def max_pool2d(x, kernel_size, *, stride=None, padding=0, dilation=1, ceil_mode=False,
               impl="auto"):
    """Max pooling with PyTorch ``MaxPool2d`` semantics, in NHWC.

    Padding is filled with ``-inf`` (the dtype's minimum for integers), so a
    dilated window whose taps all land in the padding yields ``-inf``, as in
    PyTorch. In the gradient each window's incoming gradient goes to the first
    maximum in row-major window order, as in PyTorch.

    Arguments:
        x: input ``(N, H, W, C)``.
        kernel_size: int or ``(kh, kw)``.
        stride: int or ``(sh, sw)``; ``None`` means ``kernel_size``.
        padding: int, ``(ph, pw)`` or ``((top, bottom), (left, right))``, each at
            most half the kernel size (PyTorch's rule); or ``"SAME"``/``"VALID"``
            (XLA's meaning).
        dilation: int or ``(dh, dw)``.
        ceil_mode: round the output size up instead of down; a last window must
            still start inside the input or the top/left padding.
        impl: ``"xla"``, ``"pallas"`` (the :mod:`pallas_kernels` kernel) or
            ``"auto"`` (XLA unless the autotuner measured the kernel faster on
            this GPU for this shape; on a CPU, unpadded pooling with stride =
            window runs as a reshape, see :mod:`jaxcnn.functional._cpu_lowering`).

    Returns:
        ``(N, H_out, W_out, C)``.

    Raises:
        ValueError: on a wrong rank, a window larger than the padded input, or
            malformed arguments.
    """
    op = "max_pool2d"
    kernel, stride, dilation, pads, run_pads, out_hw = _pool_geometry(
        op, x, kernel_size, stride, padding, dilation, ceil_mode)
    kernel_fn = _args.pallas_op(op, impl, (x,), dict(  # one form per call: the tuning-cache key
        kernel_size=kernel, stride=stride, padding=padding if isinstance(padding, str) else pads,
        dilation=dilation,
        ceil_mode=ceil_mode))
    if kernel_fn is not None:
        return kernel_fn(x)
    if impl == "auto":
        y = _cpu_lowering.max_pool2d(x, kernel, stride, dilation, run_pads, out_hw)
        if y is not None:
            return y
    if dilation != (1, 1):
        return _dilated_max_pool(x, kernel, stride, dilation, run_pads, out_hw)
    # The gradient of reduce_window's max (select-and-scatter with >=) keeps the
    # first of equal values, i.e. PyTorch's first-max-wins.
    return lax.reduce_window(
        x, _args.lowest(x.dtype), lax.max, (1, *kernel, 1), (1, *stride, 1),
        ((0, 0), *run_pads, (0, 0)))


def _dilated_max_pool(x, kernel, stride, dilation, run_pads, out_hw):
    """Max pooling with a dilated window, as an argmax over the window's taps.

    JAX has no gradient for ``reduce_window`` max with window dilation, so the
    ``kh * kw`` strided taps are stacked and the first maximum picked with
    ``argmax``; the gradient of the gather then goes to that first maximum.
    """
    xp = jnp.pad(x, ((0, 0), *run_pads, (0, 0)), constant_values=_args.lowest(x.dtype))
    (sh, sw), (dh, dw), (oh, ow) = stride, dilation, out_hw
    n, c = x.shape[0], x.shape[3]
    taps = jnp.stack([
        lax.slice(xp, (0, i * dh, j * dw, 0),
                  (n, i * dh + (oh - 1) * sh + 1, j * dw + (ow - 1) * sw + 1, c), (1, sh, sw, 1))
        for i in range(kernel[0]) for j in range(kernel[1])])
    first = jnp.argmax(taps, axis=0)
    return jnp.take_along_axis(taps, first[None], axis=0)[0]


def _window_counts(n, lo, hi, k, s, out, include_pad):
    """How many positions of each window lie in the input (plus padding if counted).

    Positions past the bottom/right padding (the ``ceil_mode`` overhang) are
    never counted, as in PyTorch.
    """
    first, last = (-lo, n + hi) if include_pad else (0, n)
    starts = np.arange(out) * s - lo
    return np.minimum(starts + k, last) - np.maximum(starts, first)


def avg_pool2d(x, kernel_size, *, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, impl="auto"):
    """Average pooling with PyTorch ``AvgPool2d`` semantics, in NHWC.

    The divisor of each window is the number of its positions inside the input,
    plus those in the padding when ``count_include_pad``; positions in the
    ``ceil_mode`` overhang beyond the padding are never counted. Sums run in
    float32 (or wider) and the result comes back in ``x.dtype``.

    Arguments:
        x: input ``(N, H, W, C)``, floating point.
        kernel_size: int or ``(kh, kw)``.
        stride: int or ``(sh, sw)``; ``None`` means ``kernel_size``.
        padding: int, ``(ph, pw)`` or ``((top, bottom), (left, right))``, each at
            most half the kernel size; or ``"SAME"``/``"VALID"`` (XLA's meaning).
        ceil_mode: round the output size up instead of down.
        count_include_pad: count zero padding in the divisor.
        impl: ``"xla"``, ``"pallas"`` (the :mod:`pallas_kernels` kernel) or
            ``"auto"`` (XLA unless the autotuner measured the kernel faster on
            this GPU for this shape).

    Returns:
        ``(N, H_out, W_out, C)``.

    Raises:
        ValueError: on a wrong rank, a window larger than the padded input, or
            malformed arguments.
    """
    op = "avg_pool2d"
    kernel, stride, _, pads, run_pads, out_hw = _pool_geometry(
        op, x, kernel_size, stride, padding, 1, ceil_mode)
    kernel_fn = _args.pallas_op(op, impl, (x,), dict(
        kernel_size=kernel, stride=stride,
        padding=padding if isinstance(padding, str) else pads, ceil_mode=ceil_mode,
        count_include_pad=count_include_pad))
    if kernel_fn is not None:
        return kernel_fn(x)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    summed = lax.reduce_window(
        x.astype(acc), np.array(0, acc), lax.add, (1, *kernel, 1), (1, *stride, 1),
        ((0, 0), *run_pads, (0, 0)))
    ch, cw = (_window_counts(n, lo, hi, k, s, o, count_include_pad)
              for n, (lo, hi), k, s, o in zip(jnp.shape(x)[1:3], pads, kernel, stride, out_hw))
    divisor = np.outer(ch, cw).astype(acc)[None, :, :, None]
    return (summed / divisor).astype(x.dtype)


def _bin_matrix(n: int, out: int, dtype) -> np.ndarray:
    """``(out, n)`` averaging matrix of PyTorch's adaptive bins.

    Bin ``i`` covers ``[floor(i * n / out), ceil((i + 1) * n / out))``; bins may
    overlap when ``n`` is not a multiple of ``out``.
    """
    i = np.arange(out)
    start = (i * n) // out
    end = -((-(i + 1) * n) // out)
    pos = np.arange(n)
    inside = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    return (inside / (end - start)[:, None]).astype(dtype)


def adaptive_avg_pool2d(x, output_size):
    """Adaptive average pooling with PyTorch ``AdaptiveAvgPool2d`` bins, in NHWC.

    Output row ``i`` averages input rows ``floor(i * H / OH)`` up to (not
    including) ``ceil((i + 1) * H / OH)``; likewise for columns.  Any sizes
    work, including ones that do not divide ``H``/``W`` or exceed them.

    Arguments:
        x: input ``(N, H, W, C)``, floating point.
        output_size: int or ``(OH, OW)``; an entry ``None`` keeps that input size.

    Returns:
        ``(N, OH, OW, C)`` in ``x.dtype``.
    """
    op = "adaptive_avg_pool2d"
    x_shape = tuple(jnp.shape(x))
    _args.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    if isinstance(output_size, (tuple, list)) and len(output_size) == 2:
        output_size = tuple(n if o is None else o for o, n in zip(output_size, x_shape[1:3]))
    oh, ow = _args.pair(output_size, "output_size", op)
    n, h, w, c = x_shape
    if h % oh == 0 and w % ow == 0:
        # Equal, non-overlapping bins: a reshape and a mean.
        return jnp.mean(x.reshape(n, oh, h // oh, ow, w // ow, c), axis=(2, 4))
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.einsum("ph,nhwc,qw->npqc", _bin_matrix(h, oh, acc), x.astype(acc),
                   _bin_matrix(w, ow, acc), precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def global_avg_pool2d(x, keepdims=False):
    """Mean over the spatial axes of an NHWC image.

    Arguments:
        x: input ``(N, H, W, C)``.
        keepdims: keep the spatial axes as size 1.

    Returns:
        ``(N, C)``, or ``(N, 1, 1, C)`` with ``keepdims``.
    """
    _args.check_rank("global_avg_pool2d", "x", tuple(jnp.shape(x)), 4, "(N, H, W, C)")
    return jnp.mean(x, axis=(1, 2), keepdims=keepdims)
