"""Max and average pooling kernels, forward and backward, with PyTorch semantics.

Output sizes, ``ceil_mode`` overhang and the average divisor come from
:mod:`jaxcnn._geometry`, as for :mod:`jaxcnn.functional`'s pooling, so both
implementations agree by construction on the arithmetic.

Each program owns ``(block_m pixels, block_n channels)`` and loops over the
window's taps in row-major order.  Under differentiation, max pooling also
writes the tap index of the first maximum (a strict ``>`` keeps the earliest
on ties, as PyTorch and XLA do), as ``int8`` for windows of up to 127 taps;
the forward pass alone writes the output only.  The backward is a gather, not a scatter: every input pixel sums the
incoming gradients of the windows whose recorded tap points at it, so no
atomics are needed and the result is deterministic.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxcnn import _geometry as geo
from pallas_kernels import _common as cm
from pallas_kernels import autotune, mgpu_pool, mgpu_window
from pallas_kernels._common import F32, BlockConfig, ConvGeometry
from pallas_kernels.conv_op import BACKENDS, BACKWARDS


def _grid(rows: int, g: ConvGeometry, cfg: BlockConfig):
    return (pl.cdiv(rows, cfg.block_m), pl.cdiv(g.c, cfg.block_n))


def _max_kernel(x_ref, y_ref, arg_ref=None, *, g: ConvGeometry, cfg: BlockConfig, lowest):
    (n, oh, ow), _, m_ok, cols, col_ok = cm.channel_tile(cfg, g)
    shape = (cfg.block_m, cfg.block_n)

    def step(tap, carry):
        best, arg = carry
        rows, mask = cm.tap_rows((n, oh, ow), tap, m_ok, col_ok, g)
        v = cm.gather(x_ref, rows[:, None], cols[None, :], mask, lowest)
        better = v > best
        if arg_ref is None:  # inference: the maximum alone
            return jnp.where(better, v, best), arg
        return jnp.where(better, v, best), jnp.where(better, tap, arg)

    init = (jnp.full(shape, lowest, x_ref.dtype), jnp.zeros(shape, jnp.int32))
    best, arg = lax.fori_loop(0, g.taps, step, init)
    cm.store_block(y_ref, best, m_ok, col_ok)
    if arg_ref is not None:
        cm.store_block(arg_ref, arg, m_ok, col_ok)


def index_dtype(taps: int):
    """The narrowest integer type holding a window's tap index (and -1)."""
    return jnp.int8 if taps <= 127 else jnp.int16 if taps <= 32767 else jnp.int32


def _max_backward_kernel(dy_ref, arg_ref, dx_ref, *, g: ConvGeometry, cfg: BlockConfig):
    (n, ih, iw), _, r_ok, cols, col_ok = cm.channel_tile(cfg, g, inverse=True)

    def step(tap, acc):
        rows, mask = cm.tap_rows((n, ih, iw), tap, r_ok, col_ok, g, inverse=True)
        arg = cm.gather(arg_ref, rows[:, None], cols[None, :], mask, -1)
        d = cm.gather(dy_ref, rows[:, None], cols[None, :], mask, 0.0)
        return acc + jnp.where(arg == tap, d.astype(F32), 0.0)

    acc = lax.fori_loop(0, g.taps, step, jnp.zeros((cfg.block_m, cfg.block_n), F32))
    cm.store_block(dx_ref, acc, r_ok, col_ok)


def _avg_kernel(x_ref, div_ref, y_ref, *, g: ConvGeometry, cfg: BlockConfig):
    (n, oh, ow), _, m_ok, cols, col_ok = cm.channel_tile(cfg, g)

    def step(tap, acc):
        rows, mask = cm.tap_rows((n, oh, ow), tap, m_ok, col_ok, g)
        v = cm.gather(x_ref, rows[:, None], cols[None, :], mask, 0.0)
        return acc + v.astype(F32)

    acc = lax.fori_loop(0, g.taps, step, jnp.zeros((cfg.block_m, cfg.block_n), F32))
    div = cm.gather1d(div_ref, oh * g.ow + ow, m_ok, 1.0)
    cm.store_block(y_ref, acc / div[:, None], m_ok, col_ok)


def _avg_backward_kernel(dy_ref, div_ref, dx_ref, *, g: ConvGeometry, cfg: BlockConfig):
    (n, ih, iw), _, r_ok, cols, col_ok = cm.channel_tile(cfg, g, inverse=True)

    def step(tap, acc):
        rows, ok = cm.output_rows(n, ih, iw, *cm.divmod_static(tap, g.kw), g)
        ok = ok & r_ok
        d = cm.gather(dy_ref, rows[:, None], cols[None, :], ok[:, None] & col_ok[None, :], 0.0)
        div = cm.gather1d(div_ref, cm.divmod_static(rows, g.oh * g.ow)[1], ok, 1.0)
        return acc + d.astype(F32) / div[:, None]

    acc = lax.fori_loop(0, g.taps, step, jnp.zeros((cfg.block_m, cfg.block_n), F32))
    cm.store_block(dx_ref, acc, r_ok, col_ok)


def _call(kernel, ops, out_shapes, rows, g, cfg, interpret, name):
    spec = cm.block2d(cfg.block_m, cfg.block_n)
    return pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid=_grid(rows, g, cfg),
        in_specs=[cm.ANY] * len(ops),
        out_specs=[spec] * len(out_shapes) if isinstance(out_shapes, list) else spec,
        compiler_params=cfg.compiler_params(),
        interpret=interpret,
        name=name,
    )(*ops)


def _setup(op, x, kernel_size, stride, padding, dilation, ceil_mode, backward, config,
           interpret):
    if backward not in BACKWARDS:
        raise ValueError(f"{op}: backward must be one of {BACKWARDS}, got {backward!r}")
    kernel, stride, dilation, pads, run_pads, out_hw = geo.pool_geometry(
        op, x.shape, kernel_size, stride, padding, dilation, ceil_mode)
    g = cm.geometry(tuple(x.shape), kernel, stride, dilation, run_pads, out_hw)
    interpret = cm.interpret_default(interpret)
    name = op.split(".")[-1]
    if isinstance(config, BlockConfig):
        cfgs = (config, config)
    else:
        cfgs = tuple(autotune.config_for(f"{name}_{part}", g, g.c, x.dtype, interpret)
                     for part in ("fwd", "bwd"))
    return g, (kernel, stride, dilation, pads, run_pads, out_hw), cfgs, interpret


def _mosaic(op, x, kernel_size, stride, padding, dilation, ceil_mode, backward, config,
            interpret, backend):
    """Whether this call runs the Mosaic GPU kernels (:mod:`pallas_kernels.mgpu_pool`):
    ``backend="mosaic"``, or None where :func:`mgpu_pool.select_backend` picks them."""
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"{op}: backward must be one of {BACKWARDS}, got {backward!r}")
    if backend is None:
        kernel, stride, *_ = geo.pool_geometry(op, jnp.shape(x), kernel_size, stride, padding,
                                               dilation, ceil_mode)
        backend = mgpu_pool.select_backend(jnp.shape(x), x.dtype, kernel, stride, config,
                                           cm.interpret_default(interpret))
    if backend == "mosaic":
        return True
    parts = config.values() if isinstance(config, dict) else [config]
    if any(isinstance(c, mgpu_window.WindowConfig) for c in parts):
        raise ValueError(f"{op}: config is a WindowConfig, but this call runs the Triton "
                         f"kernels (backend={backend!r}); pass backend='mosaic' or a BlockConfig")
    return False


def max_pool2d(x, kernel_size, *, stride=None, padding=0, dilation=1, ceil_mode=False,
               backward="pallas", config=None, interpret=None, backend=None):
    """Max pooling as :func:`jaxcnn.functional.max_pool2d`, run by Pallas kernels.

    Arguments:
        x: ``(N, H, W, C)``, floating point or integer.
        kernel_size, stride, padding, dilation, ceil_mode: as in
            :func:`jaxcnn.functional.max_pool2d`.
        backward: ``"pallas"`` or ``"xla"`` (the XLA op's gradient).
        config: a :class:`~pallas_kernels.BlockConfig` for both kernels, or None.
        interpret: run in the Pallas interpreter; None means "unless on a GPU".
        backend: ``"triton"``, ``"mosaic"`` (the Hopper kernels of
            :mod:`pallas_kernels.mgpu_pool`; ``config`` is then a
            :class:`~pallas_kernels.mgpu_window.WindowConfig` or a dict of them by part,
            None taking the tuned tiles, and ``interpret`` means
            Mosaic GPU interpret mode), or None: Mosaic on a Hopper GPU for the calls it
            supports (:func:`pallas_kernels.mgpu_pool.select_backend`), else Triton.

    Returns:
        ``(N, H_out, W_out, C)`` in ``x.dtype``; the gradient goes to the
        first maximum of each window (row-major order).

    Raises:
        KernelUnsupported: ``backend="mosaic"`` for a call the Mosaic kernels cannot run.
    """
    if _mosaic("pallas_kernels.max_pool2d", x, kernel_size, stride, padding, dilation,
               ceil_mode, backward, config, interpret, backend):
        return mgpu_pool.max_pool2d(
            x, kernel_size, stride=stride, padding=padding, dilation=dilation,
            ceil_mode=ceil_mode, backward="mosaic" if backward == "pallas" else "xla",
            config=config, interpret=cm.interpret_default(interpret))
    g, (kernel, stride, dilation, _, run_pads, out_hw), cfgs, interpret = _setup(
        "pallas_kernels.max_pool2d", x, kernel_size, stride, padding, dilation, ceil_mode,
        backward, config, interpret)
    xla = functools.partial(geo.xla_max_pool, kernel=kernel, stride=stride, dilation=dilation,
                            run_pads=run_pads, out_hw=out_hw)
    return _max_pool((g, cfgs, interpret, backward, xla), x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _max_pool(static, x):
    return _max_pool_call(static, x, with_index=False)[0]


def _max_pool_call(static, x, *, with_index: bool):
    """``(y, index or None)``: the index (first maximum's tap) only when training needs it.

    The forward pass alone writes just the output: the index would add half
    again to a bfloat16 pool's memory traffic (a quarter with ``int8``).
    """
    g, (cfg, _), interpret, _, _ = static
    kernel = functools.partial(_max_kernel, g=g, cfg=cfg, lowest=geo.lowest(x.dtype))
    outs = [jax.ShapeDtypeStruct((g.m_out, g.c), x.dtype)]
    if with_index:
        outs.append(jax.ShapeDtypeStruct((g.m_out, g.c), index_dtype(g.taps)))
    res = _call(kernel, [x.reshape(g.m_in, g.c)], outs, g.m_out, g, cfg, interpret,
                "jaxcnn_max_pool_fwd" if with_index else "jaxcnn_max_pool_infer")
    return res[0].reshape(g.n, g.oh, g.ow, g.c), res[1] if with_index else None


def _max_pool_fwd(static, x):
    y, arg = _max_pool_call(static, x, with_index=True)
    return y, (x, arg)


def _max_pool_bwd(static, saved, dy):
    g, (_, cfg), interpret, backward, xla = static
    x, arg = saved
    if backward == "xla":
        return jax.vjp(xla, x)[1](dy)
    dx = _call(functools.partial(_max_backward_kernel, g=g, cfg=cfg),
               [dy.reshape(g.m_out, g.c), arg],
               jax.ShapeDtypeStruct((g.m_in, g.c), dy.dtype),
               g.m_in, g, cfg, interpret, "jaxcnn_max_pool_bwd")
    return (dx.reshape(x.shape),)


_max_pool.defvjp(_max_pool_fwd, _max_pool_bwd)


def avg_pool2d(x, kernel_size, *, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, backward="pallas", config=None, interpret=None,
               backend=None):
    """Average pooling as :func:`jaxcnn.functional.avg_pool2d`, run by Pallas kernels.

    Arguments:
        x: ``(N, H, W, C)``, floating point.
        kernel_size, stride, padding, ceil_mode, count_include_pad: as in
            :func:`jaxcnn.functional.avg_pool2d`.
        backward: ``"pallas"`` or ``"xla"``.
        config: a :class:`~pallas_kernels.BlockConfig` for both kernels, or None.
        interpret: run in the Pallas interpreter; None means "unless on a GPU".
        backend: as in :func:`max_pool2d`.

    Returns:
        ``(N, H_out, W_out, C)`` in ``x.dtype`` (sums in float32).
    """
    if _mosaic("pallas_kernels.avg_pool2d", x, kernel_size, stride, padding, 1, ceil_mode,
               backward, config, interpret, backend):
        return mgpu_pool.avg_pool2d(
            x, kernel_size, stride=stride, padding=padding, ceil_mode=ceil_mode,
            count_include_pad=count_include_pad,
            backward="mosaic" if backward == "pallas" else "xla", config=config,
            interpret=cm.interpret_default(interpret))
    op = "pallas_kernels.avg_pool2d"
    g, (kernel, stride, _, pads, run_pads, out_hw), cfgs, interpret = _setup(
        op, x, kernel_size, stride, padding, 1, ceil_mode, backward, config, interpret)
    divisor = jnp.asarray(geo.avg_divisor((g.h, g.w), pads, kernel, stride, out_hw,
                                          count_include_pad).reshape(-1), F32)
    xla = functools.partial(geo.xla_avg_pool, kernel=kernel, stride=stride, pads=pads,
                            run_pads=run_pads, out_hw=out_hw,
                            count_include_pad=count_include_pad)
    return _avg_pool((g, cfgs, interpret, backward, xla), x, divisor)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _avg_pool(static, x, divisor):
    return _avg_pool_fwd(static, x, divisor)[0]


def _avg_pool_fwd(static, x, divisor):
    g, (cfg, _), interpret, _, _ = static
    y = _call(functools.partial(_avg_kernel, g=g, cfg=cfg), [x.reshape(g.m_in, g.c), divisor],
              jax.ShapeDtypeStruct((g.m_out, g.c), x.dtype), g.m_out, g, cfg, interpret,
              "jaxcnn_avg_pool_fwd")
    return y.reshape(g.n, g.oh, g.ow, g.c), divisor


def _avg_pool_bwd(static, saved, dy):
    g, (_, cfg), interpret, backward, xla = static
    divisor, x_shape = saved, (g.n, g.h, g.w, g.c)
    if backward == "xla":
        return jax.vjp(xla, jnp.zeros(x_shape, dy.dtype))[1](dy)[0], jnp.zeros_like(divisor)
    dx = _call(functools.partial(_avg_backward_kernel, g=g, cfg=cfg),
               [dy.reshape(g.m_out, g.c), divisor],
               jax.ShapeDtypeStruct((g.m_in, g.c), dy.dtype), g.m_in, g, cfg, interpret,
               "jaxcnn_avg_pool_bwd")
    return dx.reshape(x_shape), jnp.zeros_like(divisor)


_avg_pool.defvjp(_avg_pool_fwd, _avg_pool_bwd)
