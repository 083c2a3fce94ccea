"""CPU lowerings behind ``impl="auto"``: convolution weight gradients, 2x2-style max pooling,
per-channel reductions, and the XLA flag that keeps convolutions off YNNPACK.

Each is a rewrite of what JAX would emit into a form XLA:CPU runs faster, with the same
values, and each keeps forward- and reverse-mode differentiation (``jax.custom_jvp`` or
plain JAX ops, never ``custom_vjp``):

* the weight gradient as im2col patches times the output gradient, only where XLA's own
  choice for it is YNNPACK (:func:`xla_wgrad_uses_ynnpack`, a pure lookup: nothing is
  compiled while the user's function is traced);
* max pooling that keeps the index of each window's winning tap (int8), so its gradient is
  elementwise selects instead of select-and-scatter;
* :func:`jaxcnn.cpu.configure` adds ``--xla_cpu_experimental_ynn_fusion_type=individual_dot``
  to ``XLA_FLAGS`` when asked (importing this module changes nothing).

Which of these runs for a call is decided by :mod:`jaxcnn.functional._dispatch`. Why, and
the cases left alone: ``docs/design/cpu_lowering.md``; measurements: ``docs/BENCHMARKS.md``.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero

from jaxcnn import _geometry as geo
from jaxcnn._fence import stored

# Convolutions smaller than this many multiply-adds (forward) keep XLA's lowering:
# the difference is a fraction of a millisecond and the shape check costs a compile.
MIN_MACS = 2 ** 24

# Float32 max pooling over more elements than this keeps ``reduce_window`` for its value
# where it is not differentiated (faster there: :func:`max_pool2d_rewrite`).
POOL_TAPS_MAX_ELEMENTS = 2 ** 23


# Keeps YNNPACK for matrix multiplications only (XLA's default also gives it some
# convolutions and the reductions); the jaxlib minor versions where this flag was checked
# (0.12.0.1 too: XLA knows it, and it keeps the fusions that
# tests/functional/test_functional_conv_cpu.py measures as they are on 0.11.2).
XLA_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type=individual_dot"
_FLAG_CHECKED_JAXLIB = ((0, 10), (0, 11), (0, 12))


def xla_flags_skip_reason(environ=os.environ) -> str | None:
    """Why :func:`configure_xla_flags` would leave ``environ["XLA_FLAGS"]`` alone, or None."""
    import jaxlib

    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:2])
    if environ.get("JAXCNN_CPU_XLA_FLAGS", "1") == "0":
        return "JAXCNN_CPU_XLA_FLAGS=0"
    if "xla_cpu_experimental_ynn_fusion_type" in environ.get("XLA_FLAGS", ""):
        return "XLA_FLAGS already sets xla_cpu_experimental_ynn_fusion_type"
    if version not in _FLAG_CHECKED_JAXLIB:
        return f"jaxlib {jaxlib.__version__}: the flag was not checked there"
    return None


def configure_xla_flags(environ=os.environ) -> bool:
    """Adds :data:`XLA_CPU_FLAG` to ``environ["XLA_FLAGS"]`` where it is safe
    (:func:`xla_flags_skip_reason`).  Nothing calls it at import: :func:`jaxcnn.cpu.configure`
    does, when asked.

    Returns True when the flag was added.  See the module docstring for when
    it takes effect.
    """
    if xla_flags_skip_reason(environ) is not None:
        return False
    environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {XLA_CPU_FLAG}".strip()
    return True


def _backends_started() -> bool:
    """Whether JAX has created its backends, which is when XLA reads ``XLA_FLAGS``."""
    from jax._src import xla_bridge
    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else bool(getattr(xla_bridge, "_backends", None))


# The XLA_FLAGS that XLA read: known at import if JAX's backends already exist (so a flag
# added later came too late), else at the first need after they start.  Without jaxcnn's
# flag (jaxcnn.cpu.configure not called), XLA's default may give convolutions to YNNPACK,
# and ynnpack_takes_convolutions says so.
_xla_flags_read = os.environ.get("XLA_FLAGS", "") if _backends_started() else None


def _flags_xla_read() -> str:
    global _xla_flags_read
    if _xla_flags_read is None:
        flags = os.environ.get("XLA_FLAGS", "")
        if not _backends_started():
            return flags  # what XLA will read when the backends start
        _xla_flags_read = flags
    return _xla_flags_read


def ynnpack_takes_convolutions(xla_flags: str | None = None) -> bool:
    """Whether XLA:CPU may give convolutions to YNNPACK, from the ``XLA_FLAGS`` XLA read
    (or ``xla_flags``): the last ``--xla_cpu_experimental_ynn_fusion_type`` lists
    ``individual_convolution``, or the flag is absent (XLA's default in the jaxlibs of
    :data:`_FLAG_CHECKED_JAXLIB` includes it).  A string lookup; nothing is compiled.
    """
    flags = _flags_xla_read() if xla_flags is None else xla_flags
    value = None
    for part in flags.split():
        name, _, v = part.lstrip("-").partition("=")
        if name == "xla_cpu_experimental_ynn_fusion_type":
            value = v
    if value is None:
        return True
    return "individual_convolution" in (t.strip().lower() for t in value.split(","))


def _xla_conv(x, w, stride, pads, dilation):
    return lax.conv_general_dilated(x, w, window_strides=stride, padding=pads,
                                    rhs_dilation=dilation, dimension_numbers=geo.DIMS)


def patches(x, kernel_hw, stride, pads, dilation):
    """The im2col matrix of ``x`` for a convolution, tap-major.

    Arguments:
        x: input ``(N, H, W, C)``.
        kernel_hw: ``(KH, KW)``.
        stride, dilation: ``(sh, sw)``, ``(dh, dw)``.
        pads: ``((top, bottom), (left, right))``, non-negative.

    Returns:
        ``(N, OH, OW, KH * KW * C)`` where entry ``(n, i, j, (a * KW + b) * C + c)``
        is the padded input at ``(n, i * sh + a * dh, j * sw + b * dw, c)``,
        so ``patches @ w.reshape(KH * KW * C, C_out)`` is the convolution.
    """
    (kh, kw), (sh, sw), (dh, dw) = kernel_hw, stride, dilation
    oh, ow = geo.output_hw(x.shape[1:3], pads, geo.dilated(kernel_hw, dilation), stride)
    xp = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    n, _, _, c = xp.shape
    taps = [lax.slice(xp, (0, a * dh, b * dw, 0),
                      (n, a * dh + (oh - 1) * sh + 1, b * dw + (ow - 1) * sw + 1, c),
                      (1, sh, sw, 1))
            for a in range(kh) for b in range(kw)]
    return jnp.concatenate(taps, axis=-1) if len(taps) > 1 else taps[0]


def _patches_matmul(x, w, stride, pads, dilation):
    """The convolution as ``patches(x) @ w``, accumulated in at least float32."""
    kh, kw, c, o = w.shape
    cols = patches(x, (kh, kw), stride, pads, dilation)
    acc = jnp.promote_types(w.dtype, jnp.float32)
    y = lax.dot_general(cols, w.reshape(kh * kw * c, o), (((3,), (0,)), ((), ())),
                        preferred_element_type=acc)
    return y.astype(jnp.result_type(x.dtype, w.dtype))


def _conv_with_weight_tangent(weight_tangent):
    """XLA's convolution, value and input tangent, with its weight tangent replaced.

    Returns ``conv(x, w, stride, pads, dilation)``, a ``jax.custom_jvp`` whose tangent is
    ``conv(dx, w) + weight_tangent(x, dw, stride, pads, dilation)``; both terms are linear
    in the tangents, so the gradient is their transpose and forward mode works too.
    """
    @functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
    def conv(x, w, stride, pads, dilation):
        return _xla_conv(x, w, stride, pads, dilation)

    def conv_jvp(stride, pads, dilation, primals, tangents):
        x, w = primals
        dx, dw = tangents
        y = _xla_conv(x, w, stride, pads, dilation)
        parts = []
        if not isinstance(dx, SymbolicZero):
            parts.append(_xla_conv(dx, w, stride, pads, dilation))
        if not isinstance(dw, SymbolicZero):
            parts.append(weight_tangent(x, dw, stride, pads, dilation))
        return y, functools.reduce(jnp.add, parts) if parts else jnp.zeros_like(y)

    conv.defjvp(conv_jvp, symbolic_zeros=True)
    return conv


# The weight gradient as ``patches(x)^T @ dy`` (for shapes XLA gives to YNNPACK).
_conv_patch_wgrad = _conv_with_weight_tangent(_patches_matmul)


def _fence(x):
    """``x``, stored: XLA cannot fuse the computation of ``x`` into what reads the result
    (:func:`jaxcnn._fence.stored`, its predicate read from ``x``; one copy of ``x``)."""
    return stored(x, after=x)


# XLA's own weight gradient, reading a fenced copy of the input.  XLA:CPU computes a
# weight gradient as a convolution over transposed copies of ``x`` and ``dy``, and fuses
# the elementwise chain that produced ``x`` (BatchNorm, ReLU, the residual add: up to three
# blocks' worth in a ResNet) into that transpose, recomputing it with a strided access
# pattern (several times the cost of transposing a stored array: docs/BENCHMARKS.md).
_conv_stored_input = _conv_with_weight_tangent(
    lambda x, dw, stride, pads, dilation: _xla_conv(_fence(x), dw, stride, pads, dilation))


def xla_wgrad_uses_ynnpack(x_shape, w_shape, dtype, stride, pads, dilation) -> bool:
    """Whether XLA:CPU lowers this convolution's weight gradient to YNNPACK.

    A pure lookup, safe inside any trace (``jit``, ``pmap``, ``shard_map``): no
    program is lowered or compiled.  False when the ``XLA_FLAGS`` XLA read keep
    convolutions off YNNPACK (:func:`ynnpack_takes_convolutions`); otherwise XLA's
    own rule (``IsConvolutionOpSupportedByYnn``) applied to the weight gradient as
    XLA forms it, a convolution of ``x`` (batch as input features) with ``dy``
    (``(OH, OW)`` as its window) giving ``(KH, KW)``: taken when the batch or the
    output channels exceed 16 and neither ``(KH, KW)`` nor ``(OH, OW)`` exceeds the
    input's ``(H, W)``.  Checked against the compiled HLO for jaxlib 0.10.2 and
    0.11.2 in tests/functional/test_functional_conv_cpu.py; a wrong answer costs
    speed only (both lowerings give the same values).  ``dtype`` is unused: those
    jaxlibs give every float type to YNNPACK.
    """
    del dtype
    if not ynnpack_takes_convolutions():
        return False
    (n, h, wd, _), (kh, kw, _, o) = x_shape, w_shape
    oh, ow = geo.output_hw((h, wd), pads, geo.dilated((kh, kw), dilation), stride)
    return max(n, o) > 16 and kh <= h and kw <= wd and oh <= h and ow <= wd


def conv2d_rewrite(x, w, *, stride, pads, dilation, groups):
    """The CPU form of ``conv2d`` without bias for this call, or None for plain XLA.

    :mod:`jaxcnn.functional._dispatch` asks this on a CPU only, for ``impl="auto"``.

    Arguments:
        x: input ``(N, H, W, C_in)``; w: kernel ``(KH, KW, C_in // groups, C_out)``.
        stride, dilation: ``(sh, sw)``, ``(dh, dw)``; pads: explicit
            ``((top, bottom), (left, right))``, as validated by ``conv2d``.
        groups: feature groups.

    Returns:
        A function ``(x, w) -> (N, OH, OW, C_out)``, or None when this shape keeps
        XLA's lowering (grouped, non-float, small, negative pads, or a weight
        gradient XLA does not give to YNNPACK).
    """
    if groups != 1:
        return None
    if not all(isinstance(d, int) for d in (*x.shape, *w.shape)):
        return None  # symbolic dimensions (jax.export with a dynamic batch) keep XLA's lowering
    if not (jnp.issubdtype(x.dtype, jnp.floating) and x.dtype == w.dtype):
        return None
    pads = tuple(tuple(int(p) for p in pair) for pair in pads)
    if any(p < 0 for pair in pads for p in pair):
        return None
    kh, kw, c, o = w.shape
    n = x.shape[0]
    oh, ow = geo.output_hw(x.shape[1:3], pads, geo.dilated((kh, kw), dilation), stride)
    if n * oh * ow * kh * kw * c * o < MIN_MACS:
        return None
    if not xla_wgrad_uses_ynnpack(tuple(x.shape), tuple(w.shape), np.dtype(x.dtype),
                                  stride, pads, dilation):
        conv = _conv_stored_input
    else:
        conv = _conv_patch_wgrad
    return lambda x, w: conv(x, w, stride, pads, dilation)


def max_pool2d_rewrite(x, kernel, stride, dilation, run_pads, out_hw):
    """Max pooling without select-and-scatter, for ``impl="auto"`` on the CPU.

    XLA:CPU's ``reduce_window`` backward (select-and-scatter) is slow (an order
    of magnitude for mnist_cnn's pool; docs/BENCHMARKS.md), and for ResNet's stem
    pool it also keeps ``s32`` index buffers of the input's size.  Two forms:

    - stride equal to the window, no dilation, no padding: the windows tile the
      (cropped) input, so a reshape exposes each window's taps; a running ``where``
      over them in row-major order keeps the first maximum (a later tap wins only if
      strictly greater, or NaN where the best so far is not), so the gradient goes to
      the first maximum as in PyTorch, and NaN propagates as in ``lax.max``
      (:func:`_tiled_max_pool`).
    - overlapping windows (kernel > stride on an axis) or padding, no dilation: the
      ``kh * kw`` strided taps of the input padded with the lowest value, the gradient's
      tap chosen exactly as XLA's select-and-scatter chooses it, ties, -inf, NaN and
      padding included (:func:`_strided_max_pool`).  It was measured faster than XLA's,
      forward and backward, in float32 and bfloat16 (docs/BENCHMARKS.md, CPU item 3), and
      forward alone too except for float32 inputs over :data:`POOL_TAPS_MAX_ELEMENTS`,
      where the undifferentiated value stays ``reduce_window``.  Windows over 9
      taps, float16, and strides above the window without padding (gaps, no
      overlap) were not measured and keep XLA.

    Arguments:
        x: input ``(N, H, W, C)``.
        kernel, stride, dilation: validated ``(h, w)`` pairs.
        run_pads: the pads ``max_pool2d`` would run with; out_hw: ``(OH, OW)``.

    Returns:
        A function ``x -> (N, OH, OW, C)``, or None when this pooling keeps XLA's
        lowering (asked on a CPU only, by :mod:`jaxcnn.functional._dispatch`).
    """
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return None
    if tuple(dilation) != (1, 1):
        return None
    kernel, stride = tuple(int(k) for k in kernel), tuple(int(s) for s in stride)
    run_pads = tuple(tuple(int(p) for p in pair) for pair in run_pads)
    out_hw = tuple(int(o) for o in out_hw)
    padded = any(p for pair in run_pads for p in pair)
    if stride == kernel and not padded:
        (kh, kw), (oh, ow) = kernel, out_hw
        return lambda x: _tiled_max_pool(x[:, :oh * kh, :ow * kw], (kh, kw))
    if not all(isinstance(d, int) for d in x.shape):
        return None  # symbolic dimensions (jax.export with a dynamic batch) keep XLA's lowering
    overlap = any(k > s for k, s in zip(kernel, stride))
    if x.dtype not in (jnp.float32, jnp.bfloat16) or kernel[0] * kernel[1] > 9:
        return None
    if not (overlap or padded):
        return None
    return lambda x: _strided_max_pool(x, kernel, stride, run_pads, out_hw)


def _windows(x, kernel):
    (kh, kw), (n, h, w, c) = kernel, x.shape
    return x.reshape(n, h // kh, kh, w // kw, kw, c)


def _tiled_max_and_tap(x, kernel):
    """The maximum of each window and the row-major index of its first maximum."""
    kh, kw = kernel
    windows = _windows(x, kernel)
    y = windows[:, :, 0, :, 0]
    tap_dtype = jnp.int8 if kh * kw <= 127 else jnp.int32
    first = jnp.zeros(y.shape, tap_dtype)
    for a in range(kh):
        for b in range(kw):
            if a or b:
                tap = windows[:, :, a, :, b]
                later_wins = (tap > y) | (jnp.isnan(tap) & ~jnp.isnan(y))
                y = jnp.where(later_wins, tap, y)
                first = jnp.where(later_wins, jnp.asarray(a * kw + b, tap_dtype), first)
    return y, first


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _tiled_max_pool(x, kernel):
    return _tiled_max_and_tap(x, kernel)[0]


def _tiled_max_pool_jvp(kernel, primals, tangents):
    """The tangent is the input tangent at each window's first maximum, written as a
    masked sum over the window axes: its transpose (the gradient) is then one
    elementwise pass, ``dx = where(tap == first, dy, 0)``, reading the stored int8 tap
    index rather than re-deriving the select chain from ``x`` (a fifth of mnist_cnn's
    step before; docs/BENCHMARKS.md)."""
    (x,), (dx,) = primals, tangents
    kh, kw = kernel
    y, first = _tiled_max_and_tap(x, kernel)
    taps = jnp.arange(kh * kw, dtype=first.dtype).reshape(1, 1, kh, 1, kw, 1)
    hit = first[:, :, None, :, None, :] == taps
    dy = jnp.sum(jnp.where(hit, _windows(dx, kernel), jnp.zeros((), dx.dtype)), axis=(2, 4))
    return y, dy


_tiled_max_pool.defjvp(_tiled_max_pool_jvp)


def _strided_max_and_tap(x, kernel, stride, run_pads, out_hw):
    """The maximum of each (padded, possibly overlapping) window and the row-major index
    of the tap XLA's reduce_window gradient gives it to.

    XLA's gradient (select-and-scatter with ``>=``) walks each window row-major, padding
    included as the lowest value, and moves to a later tap unless the current one is
    ``>=`` it: the first maximum without NaN; with NaN, ``!(a >= b)`` holds either way, so
    it moves on past and onto NaN (measured on jaxlib 0.10.2 and 0.11.2, tested in
    tests/functional/test_functional_conv_cpu.py).  The value is ``lax.max``'s, which
    propagates NaN; a tap landing in the padding gets no gradient.
    """
    xp = jnp.pad(x, ((0, 0), *run_pads, (0, 0)), constant_values=geo.lowest(x.dtype))
    taps = geo.window_taps(xp, kernel, stride, (1, 1), out_hw)
    tap_dtype = jnp.int8 if len(taps) <= 127 else jnp.int32
    y = best = taps[0]
    first = jnp.zeros(y.shape, tap_dtype)
    for t, tap in enumerate(taps[1:], 1):
        later = ~(best >= tap)
        best = jnp.where(later, tap, best)
        first = jnp.where(later, jnp.asarray(t, tap_dtype), first)
        y = lax.max(y, tap)
    return y, first


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3, 4))
def _strided_max_pool(x, kernel, stride, run_pads, out_hw):
    if x.dtype == jnp.float32 and x.size > POOL_TAPS_MAX_ELEMENTS:
        return geo.xla_max_pool(x, kernel, stride, (1, 1), run_pads, out_hw)
    xp = jnp.pad(x, ((0, 0), *run_pads, (0, 0)), constant_values=geo.lowest(x.dtype))
    return functools.reduce(lax.max, geo.window_taps(xp, kernel, stride, (1, 1), out_hw))


def _strided_max_pool_jvp(kernel, stride, run_pads, out_hw, primals, tangents):
    """The tangent is the masked sum of the strided taps of the input tangent: its
    transpose (the gradient) is ``kh * kw`` elementwise selects of ``dy`` by the stored
    tap index, each put back by the transpose of a strided slice (``lax.pad`` with
    interior padding) and summed: no select-and-scatter, no scatter.

    A bfloat16 input is compared and its tangent summed in float32 (the comparisons are
    exact; an input's gradient, the sum of the cotangents of the windows that chose it,
    rounds once, where XLA's select-and-scatter rounds after each add), and its tap
    index is fenced (stored, not recomputed in the backward): XLA:CPU runs bfloat16
    elementwise chains several times slower, and without both the bfloat16 gradient
    measured slower than XLA's (with both, faster: docs/BENCHMARKS.md).
    """
    (x,), (dx,) = primals, tangents
    wide = x.dtype != jnp.float32
    y, first = _strided_max_and_tap(x.astype(jnp.float32) if wide else x,
                                    kernel, stride, run_pads, out_hw)
    if wide:
        y, first = y.astype(x.dtype), _fence_index(first, kernel[0] * kernel[1] - 1)
    dx = _fence_tangent(dx, first)
    acc = jnp.float32 if wide else dx.dtype
    dtaps = geo.window_taps(jnp.pad(dx.astype(acc), ((0, 0), *run_pads, (0, 0))),
                            kernel, stride, (1, 1), out_hw)
    zero = jnp.zeros((), acc)
    dy = functools.reduce(jnp.add, [jnp.where(first == t, d, zero) for t, d in enumerate(dtaps)])
    return y, dy.astype(dx.dtype)


def _fence_index(index, top):
    """``index`` (values in ``[0, top]``), stored (:func:`jaxcnn._fence.stored`); the branch
    never taken clips to ``[0, top]`` (the identity here, which XLA cannot prove)."""
    return stored(index, after=index, other=lambda v: jnp.clip(v, 0, top).astype(v.dtype))


def _fence_tangent(t, index):
    """``t`` (the input tangent of a max pool), stored, and so is its transpose (the
    input's gradient) in the backward: a conditional XLA cannot fuse through, linear in
    ``t`` so that JAX transposes it into the same conditional on the cotangent.  The
    predicate (never true) is read from ``index`` (the tap index, a primal, values >= 0);
    the branch never taken doubles ``t`` so that XLA cannot see the branches are equal.

    Without it XLA:CPU fuses the gradient's sum of ``kh * kw`` interior-padded taps into
    every consumer of the input's gradient (a BatchNorm backward has three: its two
    channel sums and the input gradient) and stores each padded tap whole for them:
    nine ``(N, H + 2, W + 2, C)`` buffers for ResNet's stem pool (the pipelined ResNet-50
    step's regression in docs/BENCHMARKS.md).  Stored, the gradient is one fused pass into
    one buffer plus the conditional's copy, which took less memory and time in the same
    benchmark.
    """
    return stored(t, after=index, other=lambda v: v * jnp.asarray(2, v.dtype))


_strided_max_pool.defjvp(_strided_max_pool_jvp)
