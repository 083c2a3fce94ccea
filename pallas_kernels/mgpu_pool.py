"""Max and average pooling for Hopper (sm_90a) in Pallas **Mosaic GPU**, with PyTorch semantics.

The same ops as :mod:`pallas_kernels.pool` (output sizes, ``ceil_mode`` overhang and the
average divisor from :mod:`jaxcnn._geometry`; the max-pool gradient to each window's
first maximum in row-major tap order), written on the window kernel of
:mod:`pallas_kernels.mgpu_window` (TMA copies of each tap's window into shared memory,
an mbarrier pipeline over the taps, TMA stores).  bfloat16/float16 only (float32 and
integers stay on the Triton kernels), channels a multiple of 8 (TMA's 16-byte
strides), stride up to 4.

- **Forward.**  The input is split into its stride phases (:func:`mgpu_window.phases`:
  one XLA copy; none at stride 1 without padding, nor for an unpadded strided window on
  sizes the stride divides, a 2x2/2 pool, whose phases are a free reshape), padded
  with ``-inf`` for max (every padded or ``ceil_mode`` position) and with zeros at the
  top/left for average (the bottom/right is TMA's zero fill).  Max compares in float32 with a
  strict ``>`` (the first maximum wins) and, under differentiation, also writes the
  winning tap's index as ``int16`` (the narrowest type TMA can store at the same
  strides as 16-bit data); average sums in float32 and divides by the divisor computed
  per element from its output row and column (the rule of :func:`geo.window_counts`,
  ``count_include_pad`` and ``ceil_mode`` included), so no divisor array is read.
- **Backward.**  A gather, not a scatter: the input gradient is computed per stride
  phase ``(a, b)`` of the padded input, whose pixels receive only the taps ``i`` with
  ``i * dh % sh == a`` (and likewise for columns), each from the output pixel
  ``(i * dh) // sh`` rows above.  ``dy`` (and the max pool's index) is padded at the
  top/left so those reads are stride-1 windows, the window kernel sums the taps
  (max: ``dy`` where the recorded index equals the tap; average: ``dy`` over its
  window's divisor), and XLA interleaves the phases and crops the padding (one pass
  over ``dx``).  Deterministic, no atomics.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxcnn import _geometry as geo
from jaxcnn.errors import KernelUnsupported
from pallas_kernels import mgpu_window as mw

F32 = jnp.float32
BACKWARDS = ("mosaic", "xla")
INDEX_DTYPE = jnp.int16


def check_supported(op: str, x_shape, dtype, kernel, stride) -> None:
    """Raises :class:`~jaxcnn.errors.KernelUnsupported` (one line) where the Mosaic GPU pooling
    kernels cannot run this call."""
    mw.check_supported(op, x_shape, dtype, stride)
    if kernel[0] * kernel[1] > 32767:
        raise KernelUnsupported(f"{op}: window {kernel} has more taps than int16 indexes")


def select_backend(x_shape, dtype, kernel, stride, config, interpret,
                   device_kind: str | None = None) -> str:
    """``"mosaic"`` where these kernels take a pooling call by default, else ``"triton"``: a
    pure lookup, as :func:`pallas_kernels.conv_op.select_backend`.  Mosaic needs a real
    GPU run (not interpret mode) on a Hopper device kind, jax >= 0.11, a 16-bit float
    input whose channels TMA can address, stride <= 4, and no Triton ``BlockConfig``."""
    parts = config.values() if isinstance(config, dict) else [config]
    if interpret or not all(c is None or isinstance(c, mw.WindowConfig) for c in parts):
        return "triton"
    if jnp.dtype(dtype) not in mw.DTYPES or not mw.on_hopper(device_kind):
        return "triton"
    try:
        check_supported("pool", x_shape, dtype, kernel, stride)
    except KernelUnsupported:
        return "triton"
    return "mosaic"


def _setup(op, x, kernel_size, stride, padding, dilation, ceil_mode, backward, config):
    if backward not in BACKWARDS:
        raise ValueError(f"{op}: backward must be one of {BACKWARDS}, got {backward!r}")
    mw.check_config(op, config)
    geom = geo.pool_geometry(op, x.shape, kernel_size, stride, padding, dilation, ceil_mode)
    check_supported(op, x.shape, x.dtype, geom[0], geom[1])
    return geom


def tuning_calls(name: str, x_shape, dtype, kernel, stride, dilation, run_pads, out_hw) -> dict:
    """``{"fwd", "bwd"}``: the :class:`~pallas_kernels.mgpu_window.WindowCall` whose tiles each
    kernel of a ``name`` (``"max"``/``"avg"``) pooling call looks up and the tuner times."""
    return {part: mw.WindowCall(f"mgpu_{name}_pool_{part}", tuple(x_shape), tuple(kernel),
                                tuple(stride), tuple(map(tuple, run_pads)), tuple(dilation),
                                tuple(out_hw), jnp.dtype(dtype).name)
            for part in ("fwd", "bwd")}


def _phase_taps(kernel, stride, dilation):
    """Per stride phase ``(a, b)`` of the padded input: ``[(tap, k, l)]``, the taps reaching
    it and how many output rows/columns above/left of the phase pixel they read from;
    with ``(kmax, lmax)``, the largest ``k`` and ``l`` over all taps."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    out = {(a, b): [] for a in range(sh) for b in range(sw)}
    for i in range(kh):
        for j in range(kw):
            out[(i * dh % sh, j * dw % sw)].append((i * kw + j, i * dh // sh, j * dw // sw))
    return out, ((kh - 1) * dh // sh, (kw - 1) * dw // sw)


def input_gradient(srcs, fills, *, x_shape, kernel, stride, dilation, run_pads, make, config,
                   interpret, detect_races, name):
    """``dx`` ``(N, H, W, C)`` by phases of the padded input (see the module docstring).

    ``srcs`` are ``(N, OH, OW, C)`` operands (``dy`` first), padded here at the top/left
    with ``fills``; ``make(phase_taps)`` returns the window kernel's ``(init, combine, finish,
    weights)`` for one phase's ``[(tap, k, l)]``, whose ``combine`` receives the phase-local
    tap number.
    """
    n, h, w, c = x_shape
    (pt, pb), (pleft, pr) = run_pads
    sh, sw = stride
    per_phase, (kmax, lmax) = _phase_taps(kernel, stride, dilation)
    mh, mw_ = mw.cdiv(h + pt + pb, sh), mw.cdiv(w + pleft + pr, sw)
    padded = [jnp.pad(s, ((0, 0), (kmax, 0), (lmax, 0), (0, 0)), constant_values=f)
              for s, f in zip(srcs, fills)]
    dtype = srcs[0].dtype
    rows = []
    for a in range(sh):
        cols = []
        for b in range(sw):
            taps = per_phase[(a, b)]
            if not taps:  # no window reaches these pixels
                cols.append(jnp.zeros((n, mh, mw_, c), dtype))
                continue
            init, combine, finish, weights = make(taps)
            (out,) = mw.tap_reduce(
                padded, [(0, kmax - k, lmax - l) for _, k, l in taps], n=n, out_hw=(mh, mw_),
                c=c, out_dtypes=(dtype,), init=init, combine=combine, finish=finish,
                weights=weights, config=config, interpret=interpret,
                detect_races=detect_races, name=name)
            cols.append(out)
        rows.append(jnp.stack(cols))
    if sh == sw == 1:
        dx = rows[0][0]
    else:  # (sh, sw, N, mh, mw, C): padded row m * sh + a, column m' * sw + b
        dx = jnp.stack(rows).transpose(2, 3, 0, 4, 1, 5).reshape(n, mh * sh, mw_ * sw, c)
    return dx[:, pt:pt + h, pleft:pleft + w]


# --- max pooling ---------------------------------------------------------------------------

def max_pool2d(x, kernel_size, *, stride=None, padding=0, dilation=1, ceil_mode=False,
               backward="mosaic", config=None, interpret=False, detect_races=False):
    """Max pooling as :func:`jaxcnn.functional.max_pool2d` on the Mosaic GPU kernels.

    Arguments:
        x: ``(N, H, W, C)`` bfloat16/float16, ``C`` a multiple of 8.
        kernel_size, stride, padding, dilation, ceil_mode: as in
            :func:`jaxcnn.functional.max_pool2d`.
        backward: ``"mosaic"`` (the gather kernel) or ``"xla"``.
        config: a :class:`~pallas_kernels.mgpu_window.WindowConfig` for both kernels, or
            ``{"fwd"|"bwd": WindowConfig}``; a kernel not given takes its tuned tiles
            (:func:`~pallas_kernels.mgpu_window.tuned_config`), else the defaults.
        interpret: Mosaic GPU interpret mode; detect_races: its race detector.

    Returns:
        ``(N, H_out, W_out, C)`` in ``x.dtype``.

    Raises:
        KernelUnsupported: where the kernels cannot run the call (:func:`check_supported`).
    """
    op = "Mosaic GPU max_pool2d"
    kernel, stride, dilation, _, run_pads, out_hw = _setup(
        op, x, kernel_size, stride, padding, dilation, ceil_mode, backward, config)
    cfgs = mw.part_configs(op, config, tuning_calls("max", x.shape, x.dtype, kernel, stride,
                                                    dilation, run_pads, out_hw))
    static = (kernel, stride, dilation, run_pads, out_hw, backward, cfgs, bool(interpret),
              bool(detect_races))
    return _max_pool(static, x)


def _max_forward(static, x, with_index):
    kernel, stride, dilation, run_pads, out_hw, _, (cfg, _), interpret, races = static
    lowest = float(geo.lowest(x.dtype))

    def init(shape, layout):
        return (jnp.full(shape, lowest, F32), jnp.zeros(shape, jnp.int32))

    def combine(t, acc, vals, w_row, pos):
        best, arg = acc
        v = vals[0].astype(F32)
        better = v > best  # strict: the first maximum (row-major taps) keeps the index
        return jnp.where(better, v, best), (jnp.where(better, t, arg) if with_index else arg)

    def finish(acc, pos, w_row):
        return (acc[0], acc[1].astype(INDEX_DTYPE)) if with_index else (acc[0],)

    xp = mw.phases(x, run_pads, stride, lowest)
    outs = mw.tap_reduce(
        [xp], mw.forward_taps(kernel, stride, dilation), n=x.shape[0], out_hw=out_hw,
        c=x.shape[3], out_dtypes=(x.dtype, INDEX_DTYPE) if with_index else (x.dtype,),
        init=init, combine=combine, finish=finish, config=cfg, interpret=interpret,
        detect_races=races,
        name="jaxcnn_mgpu_max_pool_fwd" if with_index else "jaxcnn_mgpu_max_pool_infer")
    return outs if with_index else (outs[0], None)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _max_pool(static, x):
    return _max_forward(static, x, with_index=False)[0]


def _max_pool_fwd(static, x):
    y, idx = _max_forward(static, x, with_index=True)
    return y, (x, idx)


def _max_pool_bwd(static, saved, dy):
    kernel, stride, dilation, run_pads, out_hw, backward, (_, cfg), interpret, races = static
    x, idx = saved
    if backward == "xla":
        xla = functools.partial(geo.xla_max_pool, kernel=kernel, stride=stride,
                                dilation=dilation, run_pads=run_pads, out_hw=out_hw)
        return jax.vjp(xla, x)[1](dy)

    def make(taps):
        def combine(t, acc, vals, w_row, pos):
            d, arg = vals
            return (acc[0] + jnp.where(arg == taps[t][0], d.astype(F32), 0.0),)
        return (lambda shape, layout: (jnp.zeros(shape, F32),)), combine, \
            (lambda acc, pos, w_row: acc), None

    dx = input_gradient([dy.astype(x.dtype), idx], (0, -1), x_shape=x.shape, kernel=kernel,
                        stride=stride, dilation=dilation, run_pads=run_pads, make=make,
                        config=cfg, interpret=interpret, detect_races=races,
                        name="jaxcnn_mgpu_max_pool_bwd")
    return (dx.astype(x.dtype),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


# --- average pooling -----------------------------------------------------------------------

def avg_pool2d(x, kernel_size, *, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, backward="mosaic", config=None, interpret=False,
               detect_races=False):
    """Average pooling as :func:`jaxcnn.functional.avg_pool2d` on the Mosaic GPU kernels.

    Arguments and errors as :func:`max_pool2d`, plus ``count_include_pad``; sums in
    float32, the result in ``x.dtype``.
    """
    op = "Mosaic GPU avg_pool2d"
    kernel, stride, _, pads, run_pads, out_hw = _setup(
        op, x, kernel_size, stride, padding, 1, ceil_mode, backward, config)
    cfgs = mw.part_configs(op, config, tuning_calls("avg", x.shape, x.dtype, kernel, stride,
                                                    (1, 1), run_pads, out_hw))
    static = (kernel, stride, pads, run_pads, out_hw, bool(count_include_pad), backward, cfgs,
              bool(interpret), bool(detect_races), tuple(x.shape))
    return _avg_pool(static, x)


def _count(o, n, lo, hi, k, s, include_pad):
    """:func:`geo.window_counts` on a tile of output indices ``o`` (int32), at least 1 (tiles
    past the output compute a divisor they never store)."""
    first, last = (-lo, n + hi) if include_pad else (0, n)
    start = o * s - lo
    return jnp.maximum(jnp.minimum(start + k, last) - jnp.maximum(start, first), 1)


def _divisor(static, oh, ow):
    kernel, stride, pads, _, _, include, *_, x_shape = static
    ch = _count(oh, x_shape[1], *pads[0], kernel[0], stride[0], include)
    cw = _count(ow, x_shape[2], *pads[1], kernel[1], stride[1], include)
    return (ch * cw).astype(F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool(static, x):
    kernel, stride, pads, run_pads, out_hw, _, _, (cfg, _), interpret, races, _ = static
    (pt, _), (pleft, _) = pads

    def combine(t, acc, vals, w_row, pos):
        return (acc[0] + vals[0].astype(F32),)

    # Zeros at the top/left; the bottom/right padding and ceil_mode overhang are TMA zero fill.
    xp = mw.phases(x, ((pt, 0), (pleft, 0)), stride, 0)
    (y,) = mw.tap_reduce(
        [xp], mw.forward_taps(kernel, stride), n=x.shape[0], out_hw=out_hw, c=x.shape[3],
        out_dtypes=(x.dtype,), init=lambda shape, layout: (jnp.zeros(shape, F32),),
        combine=combine, finish=lambda acc, pos, w_row: (acc[0] / _divisor(static, *pos),),
        config=cfg, interpret=interpret, detect_races=races, name="jaxcnn_mgpu_avg_pool_fwd")
    return y


def _avg_pool_fwd(static, x):
    return _avg_pool(static, x), None


def _avg_pool_bwd(static, _, dy):
    kernel, stride, pads, run_pads, out_hw, include, backward, (_, cfg), interpret, races, \
        x_shape = static
    if backward == "xla":
        xla = functools.partial(geo.xla_avg_pool, kernel=kernel, stride=stride, pads=pads,
                                run_pads=run_pads, out_hw=out_hw, count_include_pad=include)
        return jax.vjp(xla, jnp.zeros(x_shape, dy.dtype))[1](dy)

    def make(taps):
        def combine(t, acc, vals, w_row, pos):
            _, k, l = taps[t]
            oh, ow = pos  # this dx pixel's phase row/column: dy row oh - k, column ow - l
            return (acc[0] + vals[0].astype(F32) / _divisor(static, oh - k, ow - l),)
        return (lambda shape, layout: (jnp.zeros(shape, F32),)), combine, \
            (lambda acc, pos, w_row: acc), None

    dx = input_gradient([dy], (0,), x_shape=x_shape, kernel=kernel, stride=stride,
                        dilation=(1, 1), run_pads=run_pads, make=make, config=cfg,
                        interpret=interpret, detect_races=races,
                        name="jaxcnn_mgpu_avg_pool_bwd")
    return (dx.astype(dy.dtype),)


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)
