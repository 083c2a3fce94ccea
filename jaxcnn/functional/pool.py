"""Max, average, adaptive and global pooling over NHWC images (PyTorch semantics)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn.functional import _dispatch, _halo


def max_pool2d(x, kernel_size, *, stride=None, padding=0, dilation=1, ceil_mode=False,
               impl="auto", height_axis=None):
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
        height_axis: the name of a mapped axis over which the image's rows are split
            in equal blocks, in order (as for :func:`jaxcnn.functional.conv2d`): ``x``
            is this device's block, the result its block of the whole image's output,
            on XLA.

    Returns:
        ``(N, H_out, W_out, C)``.

    Raises:
        ValueError: on a wrong rank, a window larger than the padded input, or
            malformed arguments.
    """
    op = "max_pool2d"
    if height_axis is not None:
        return _halo.max_pool2d(x, kernel_size, stride=stride, padding=padding, dilation=dilation,
                                ceil_mode=ceil_mode, axis_name=height_axis)
    kernel, stride, dilation, pads, run_pads, out_hw = geo.pool_geometry(
        op, jnp.shape(x), kernel_size, stride, padding, dilation, ceil_mode)
    run = _dispatch.choose(op, impl, (x,), dict(  # one form per call: the tuning-cache key
        kernel_size=kernel, stride=stride, padding=padding if isinstance(padding, str) else pads,
        dilation=dilation, ceil_mode=ceil_mode))
    if run is not None:
        return run(x)
    return geo.xla_max_pool(x, kernel, stride, dilation, run_pads, out_hw)


def avg_pool2d(x, kernel_size, *, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, impl="auto", height_axis=None):
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
        height_axis: the name of a mapped axis over which the image's rows are split
            in equal blocks, in order (as for :func:`jaxcnn.functional.conv2d`): ``x``
            is this device's block, the result its block of the whole image's output,
            on XLA.

    Returns:
        ``(N, H_out, W_out, C)``.

    Raises:
        ValueError: on a wrong rank, a window larger than the padded input, or
            malformed arguments.
    """
    op = "avg_pool2d"
    if height_axis is not None:
        return _halo.avg_pool2d(x, kernel_size, stride=stride, padding=padding, ceil_mode=ceil_mode,
                                count_include_pad=count_include_pad, axis_name=height_axis)
    kernel, stride, _, pads, run_pads, out_hw = geo.pool_geometry(
        op, jnp.shape(x), kernel_size, stride, padding, 1, ceil_mode)
    run = _dispatch.choose(op, impl, (x,), dict(
        kernel_size=kernel, stride=stride,
        padding=padding if isinstance(padding, str) else pads, ceil_mode=ceil_mode,
        count_include_pad=count_include_pad))
    if run is not None:
        return run(x)
    return geo.xla_avg_pool(x, kernel, stride, pads, run_pads, out_hw, count_include_pad)


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
    geo.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    if isinstance(output_size, (tuple, list)) and len(output_size) == 2:
        output_size = tuple(n if o is None else o for o, n in zip(output_size, x_shape[1:3]))
    oh, ow = geo.pair(output_size, "output_size", op)
    n, h, w, c = x_shape
    if h % oh == 0 and w % ow == 0:
        # Equal, non-overlapping bins: a reshape and a mean.
        return jnp.mean(x.reshape(n, oh, h // oh, ow, w // ow, c), axis=(2, 4))
    acc = jnp.promote_types(x.dtype, jnp.float32)
    y = jnp.einsum("ph,nhwc,qw->npqc", _bin_matrix(h, oh, acc), x.astype(acc),
                   _bin_matrix(w, ow, acc), precision=lax.Precision.HIGHEST)
    return y.astype(x.dtype)


def _adaptive_bins(n: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """``(start, end)`` of PyTorch's adaptive bins: ``[floor(i*n/out), ceil((i+1)*n/out))``."""
    i = np.arange(out)
    return (i * n) // out, -((-(i + 1) * n) // out)


def _first_max_over_bins(x, axis: int, out: int):
    """Max over the adaptive bins along ``axis`` (1 or 2 of an NHWC array), the
    first maximum (lowest index) of each bin being the one taken (and the one
    the gradient reaches).

    Each bin is gathered into ``k`` taps (``k`` the largest bin); taps beyond a
    shorter bin's end are masked to the dtype's lowest value and come after
    its real taps, so they are never the first maximum.
    """
    n = x.shape[axis]
    start, end = _adaptive_bins(n, out)
    k = int((end - start).max())
    taps_idx = start[:, None] + np.arange(k)[None, :]                 # (out, k)
    valid = taps_idx < end[:, None]
    taps = jnp.take(x, np.minimum(taps_idx, n - 1).reshape(-1), axis=axis)
    shape = x.shape[:axis] + (out, k) + x.shape[axis + 1:]
    mask = valid.reshape((1,) * axis + (out, k) + (1,) * (x.ndim - axis - 1))
    taps = jnp.where(mask, taps.reshape(shape), geo.lowest(x.dtype))
    first = jnp.argmax(taps, axis=axis + 1, keepdims=True)             # first of equal maxima
    return jnp.squeeze(jnp.take_along_axis(taps, first, axis=axis + 1), axis + 1)


def adaptive_max_pool2d(x, output_size):
    """Adaptive max pooling with PyTorch ``AdaptiveMaxPool2d`` bins, in NHWC.

    Output ``(i, j)`` is the maximum over input rows ``floor(i * H / OH)`` up
    to (not including) ``ceil((i + 1) * H / OH)`` and the columns likewise;
    bins overlap when the sizes do not divide, and any output size works,
    including ones larger than the input.

    Ties: the gradient of each output goes to one input, the first maximum of
    its bin in row-major order (lowest row, then lowest column), as PyTorch's
    kernels pick it; where bins overlap an input collects the gradients of
    every output that picked it.  A NaN in a bin makes that output NaN (as in
    PyTorch; with several NaNs PyTorch's gradient goes to the last one, ours
    to the first).  PyTorch's ``return_indices`` is not offered.

    Arguments:
        x: input ``(N, H, W, C)``, floating point or integer.
        output_size: int or ``(OH, OW)``; an entry ``None`` keeps that input size.

    Returns:
        ``(N, OH, OW, C)`` in ``x.dtype``.

    Raises:
        ValueError: on a wrong rank or an output size below 1.
    """
    op = "adaptive_max_pool2d"
    x_shape = tuple(jnp.shape(x))
    geo.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    if isinstance(output_size, (tuple, list)) and len(output_size) == 2:
        output_size = tuple(n if o is None else o for o, n in zip(output_size, x_shape[1:3]))
    oh, ow = geo.pair(output_size, "output_size", op)
    x = jnp.asarray(x)
    h, w = x_shape[1:3]
    if h % oh == 0 and w % ow == 0:
        # Equal, non-overlapping bins: a strided max-pool (its gradient also
        # goes to the first maximum in row-major order).
        window = (h // oh, w // ow)
        return geo.xla_max_pool(x, window, window, (1, 1), ((0, 0), (0, 0)), (oh, ow))
    # Columns first, then rows: the first row holding the bin's maximum, and in
    # it the first column, is the bin's first maximum in row-major order.
    return _first_max_over_bins(_first_max_over_bins(x, 2, ow), 1, oh)


def global_avg_pool2d(x, keepdims=False):
    """Mean over the spatial axes of an NHWC image.

    Arguments:
        x: input ``(N, H, W, C)``.
        keepdims: keep the spatial axes as size 1.

    Returns:
        ``(N, C)``, or ``(N, 1, 1, C)`` with ``keepdims``.
    """
    geo.check_rank("global_avg_pool2d", "x", tuple(jnp.shape(x)), 4, "(N, H, W, C)")
    return jnp.mean(x, axis=(1, 2), keepdims=keepdims)
