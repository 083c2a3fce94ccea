"""Window ops over images whose height is split over a mapped axis, with explicit halos.

Inside ``shard_map`` (or ``pmap``) over an axis whose devices hold an image's rows in
equal blocks, in order (device ``i`` of ``S`` holds rows ``[i*h, (i+1)*h)`` of the
``S*h``-row image), :func:`rows_for_windows` brings each device the rows its share of a
window op's outputs reads: the last rows of the block above and the first rows of the block
below (``lax.ppermute``, one exchange each way, of the largest count any block needs), the
rows outside the image filled as the op pads.  Output rows are split the same way (device
``i`` computes rows ``[i*ho, (i+1)*ho)``), so every op below returns its block of the
output of the same op on the whole image, and its gradients (``ppermute`` transposes to the
opposite exchange) are those of the whole image's.

The ops' public forms (``conv2d``, ``max_pool2d``, ``avg_pool2d`` and ``group_norm`` with
``height_axis=``) call these; the geometry (padding, ``"SAME"``, ``ceil_mode``, output size)
is always that of the whole image.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn import _geometry as geo


def _blocks(x, axis_name):
    """``(shards, index, global shape)`` of ``x``'s block of an image split along height."""
    shards = lax.axis_size(axis_name)
    n, h, w, c = jnp.shape(x)
    return shards, lax.axis_index(axis_name), (n, h * shards, w, c)


def window_halo(height: int, out_height: int, shards: int, kernel: int, stride: int,
                pads: tuple[int, int], dilation: int = 1) -> int:
    """Rows one shard of a window op's input needs from a neighbour (the larger side,
    over all shards), with input and output both split evenly into ``shards`` blocks.

    Output row ``o`` reads input rows ``o*stride - lo + j*dilation`` for ``j < kernel``
    (rows outside the image are padding, no one's); shard ``i`` holds input rows
    ``[i*h, (i+1)*h)`` and computes output rows ``[i*ho, (i+1)*ho)``.
    """
    h = height // shards
    need = 0
    for i in range(shards):
        rows = tapped_rows(height, out_height, shards, i, kernel, stride, pads[0], dilation)
        if rows:
            need = max(need, i * h - min(rows), max(rows) - ((i + 1) * h - 1))
    return need


def tapped_rows(height: int, out_height: int, shards: int, i: int, kernel: int, stride: int, lo: int,
                dilation: int) -> list:
    """The image rows (padding left out) that block ``i``'s output rows' window taps read."""
    ho = out_height // shards
    return [r for o in range(i * ho, (i + 1) * ho) for j in range(kernel)
            if 0 <= (r := o * stride - lo + j * dilation) < height]


def halo_sizes(height: int, shards: int, kernel: int, dilation: int, stride: int, lo: int,
               out_height: int):
    """``(above, below, neighbour_above, neighbour_below)``: rows a block's windows span
    before its first and after its last row (the largest over blocks, padding included),
    and how many of those a neighbour sends (the rest are padding, or rows the dilated
    taps skip).

    Raises:
        ValueError: when a block's windows' taps read real rows beyond its neighbours' blocks.
    """
    h, ho = height // shards, out_height // shards
    extent = (kernel - 1) * dilation + 1
    above = below = 0
    for i in range(shards):
        first = i * ho * stride - lo
        last = first + (ho - 1) * stride + extent - 1
        above, below = max(above, i * h - first), max(below, last - ((i + 1) * h - 1))
        read = tapped_rows(height, out_height, shards, i, kernel, stride, lo, dilation)
        if read and (min(read) < (i - 1) * h or max(read) > (i + 2) * h - 1):
            raise ValueError(f"block {i} of {shards} reads rows {min(read)}..{max(read)} "
                             f"of the {height}-row image, beyond its neighbours' {h}-row blocks")
    above, below = max(above, 0), max(below, 0)
    return above, below, min(above, h), min(below, h)


def rows_for_windows(x, axis_name, *, kernel: int, dilation: int, stride: int, lo: int, out_height: int,
                     fill):
    """The rows of the whole image that this block's ``out_height // shards`` output rows of
    a window op read, ``((ho - 1) * stride + extent)`` of them from row ``i*ho*stride - lo``
    (``extent = (kernel - 1) * dilation + 1``),
    rows outside the image equal to ``fill``.

    Arguments:
        x: this device's block ``(N, h, W, C)``.
        axis_name: the mapped axis the height is split over.
        kernel, dilation: the window's height in taps and their spacing.
        stride: its vertical stride.
        lo: its padding above the image.
        out_height: the whole image's output height (divisible by the shards).
        fill: the padding value (0, or the dtype's lowest for max pooling).
    """
    shards, i, (_, height, _, _) = _blocks(x, axis_name)
    h, ho = height // shards, out_height // shards
    above, below, from_above, from_below = halo_sizes(height, shards, kernel, dilation, stride, lo,
                                                      out_height)
    extent = (kernel - 1) * dilation + 1
    fill = jnp.asarray(fill, x.dtype)
    parts = []
    if above:
        if from_above:
            sent = lax.ppermute(x[:, h - from_above:], axis_name, [(j, j + 1) for j in range(shards - 1)])
            parts += [jnp.where(i == 0, fill, sent)]  # the first block's rows above are padding
        parts.insert(0, jnp.full((x.shape[0], above - from_above, *x.shape[2:]), fill))
    parts.append(x)
    if below:
        if from_below:
            sent = lax.ppermute(x[:, :from_below], axis_name, [(j + 1, j) for j in range(shards - 1)])
            parts.append(jnp.where(i == shards - 1, fill, sent))
        parts.append(jnp.full((x.shape[0], below - from_below, *x.shape[2:]), fill))
    extended = jnp.concatenate([p for p in parts if p.shape[1]], axis=1)
    # extended row r is image row i*h - above + r; this block's windows start at i*ho*stride - lo
    start = above - lo + i * (ho * stride - h)
    return lax.dynamic_slice_in_dim(extended, start, (ho - 1) * stride + extent, axis=1)


def conv2d(x, w, b, *, stride, padding, dilation, groups, axis_name, run):
    """``run`` (the plain convolution) over this block's rows, padding of the whole image."""
    shards, _, shape = _blocks(x, axis_name)
    stride, dilation, pads, out_hw = geo.conv_geometry("conv2d", shape, jnp.shape(w), stride, padding,
                                                       dilation)
    _check_split("conv2d", shape, out_hw, shards)
    def windows(x, w, b):
        rows = rows_for_windows(x, axis_name, kernel=jnp.shape(w)[0], dilation=dilation[0],
                                stride=stride[0], lo=pads[0][0], out_height=out_hw[0], fill=0)
        return run(rows, w, b, stride=stride, padding=((0, 0), pads[1]), dilation=dilation,
                   groups=groups, impl="xla")
    return _unkept(windows)(x, w, b)


def max_pool2d(x, kernel_size, *, stride, padding, dilation, ceil_mode, axis_name):
    op = "max_pool2d"
    shards, _, shape = _blocks(x, axis_name)
    kernel, stride, dilation, _, run_pads, out_hw = geo.pool_geometry(
        op, shape, kernel_size, stride, padding, dilation, ceil_mode)
    _check_split(op, shape, out_hw, shards)
    def windows(x):
        rows = rows_for_windows(x, axis_name, kernel=kernel[0], dilation=dilation[0], stride=stride[0],
                                lo=run_pads[0][0], out_height=out_hw[0], fill=geo.lowest(x.dtype))
        return geo.xla_max_pool(rows, kernel, stride, dilation, ((0, 0), run_pads[1]),
                                (out_hw[0] // shards, out_hw[1]))
    return _unkept(windows)(x)


def avg_pool2d(x, kernel_size, *, stride, padding, ceil_mode, count_include_pad, axis_name):
    op = "avg_pool2d"
    shards, i, shape = _blocks(x, axis_name)
    kernel, stride, _, pads, run_pads, out_hw = geo.pool_geometry(
        op, shape, kernel_size, stride, padding, 1, ceil_mode)
    _check_split(op, shape, out_hw, shards)
    ho = out_hw[0] // shards
    summed = geo.window_sums(rows_for_windows(x, axis_name, kernel=kernel[0], dilation=1, stride=stride[0],
                                              lo=run_pads[0][0], out_height=out_hw[0], fill=0),
                             kernel, stride, ((0, 0), run_pads[1]))
    divisor = geo.avg_divisor(shape[1:3], pads, kernel, stride, out_hw, count_include_pad)
    mine = lax.dynamic_slice_in_dim(jnp.asarray(divisor.astype(summed.dtype)), i * ho, ho, axis=0)
    return (summed / mine[None, :, :, None]).astype(x.dtype)


def _unkept(fn):
    """``fn`` whose backward makes its halo-extended rows again from the block (one more
    exchange of the halo rows) instead of keeping them: they are a copy of the whole block,
    which the layer before usually keeps already."""
    return jax.checkpoint(fn, policy=jax.checkpoint_policies.nothing_saveable)


def _check_split(op: str, shape, out_hw, shards: int) -> None:
    if out_hw[0] % shards:
        raise ValueError(f"{op}: the output height {out_hw[0]} of the {shape[1]}-row image "
                         f"(x shape {tuple(shape)} whole) does not divide into {shards} blocks")


def group_moments(xg, axes, axis_name):
    """Mean and biased variance of ``xg`` over ``axes`` and the blocks on ``axis_name``
    (equal-sized blocks: the mean of the blocks' means, and of their variances plus their
    means' spread)."""
    mean = jnp.mean(xg, axis=axes, keepdims=True)
    var = jnp.mean(jnp.square(xg - mean), axis=axes, keepdims=True)
    if axis_name is None:
        return mean, var
    whole = lax.pmean(mean, axis_name)
    return whole, lax.pmean(var + jnp.square(mean - whole), axis_name)

