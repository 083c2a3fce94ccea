"""Depthwise convolution for Hopper (sm_90a) in Pallas **Mosaic GPU**: forward and both gradients.

The op of :mod:`pallas_kernels.depthwise` (``groups == C_in == C_out``, filters
``(KH, KW, 1, C)``), bfloat16/float16 in, float32 accumulation, written on the window
kernel of :mod:`pallas_kernels.mgpu_window`: TMA copies of each tap's input window into
shared memory, an mbarrier pipeline over the taps, TMA stores.  Channels a multiple of
8 (TMA's 16-byte strides), stride up to 4, any padding and dilation.

- **Forward** (:func:`depthwise_forward`): the input split into its stride phases
  (zeros at the top/left; the bottom/right padding is TMA zero fill); per tap, the
  ``(64 pixels, block_c)`` window times that tap's filter row, summed in float32; the
  filters (and the bias, as one more row) are TMA-loaded once per CTA as float32.
  Bias and ReLU are applied on the accumulator.
- **Input gradient** (:func:`depthwise_dgrad`): per stride phase of the padded input,
  the taps reaching it (the phase decomposition of :mod:`pallas_kernels.mgpu_pool`),
  each reading ``dy`` (padded at the top/left) times its filter row; XLA interleaves the
  phases (one pass over ``dx``).
- **Weight gradient** (:func:`depthwise_wgrad`): ``dw[tap, c] = sum_p x_tap[p, c] *
  dy[p, c]``.  A CTA owns one tap, ``block_c`` channels and one of ``config.split``
  shares of the output tiles; per tile it TMA-loads the tap's input window and ``dy``
  (pipelined over ``stages`` slots) and adds their product to a float32
  ``(64, block_c)`` accumulator in shared memory.  Each CTA writes that partial, and
  XLA sums the splits and the 64 rows in a fixed order: deterministic, no atomics.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn.errors import KernelUnsupported
from pallas_kernels import mgpu_conv as mc
from pallas_kernels import mgpu_pool as mp
from pallas_kernels import mgpu_window as mw

F32 = jnp.float32
BACKWARDS = ("mosaic", "xla")
DIMS = ("NHWC", "HWIO", "NHWC")


def check_supported(x_shape, w_shape, dtype, *, stride=(1, 1), pads=((0, 0), (0, 0))) -> None:
    """Raises :class:`~jaxcnn.errors.KernelUnsupported` (one line) where the Mosaic GPU
    depthwise kernels cannot run this convolution; returns None where they can."""
    op = "Mosaic GPU depthwise conv"
    mw.check_supported(op, x_shape, dtype, stride)
    if tuple(w_shape[2:]) != (1, x_shape[3]):
        raise KernelUnsupported(f"{op}: w shape {tuple(w_shape)} is not depthwise for "
                                f"x shape {tuple(x_shape)}")
    if any(p < 0 for pair in pads for p in pair):
        raise KernelUnsupported(f"{op}: negative padding {pads} unsupported")


def select_backend(x_shape, w_shape, dtype, stride, pads, has_residual, config, interpret,
                   device_kind: str | None = None) -> str:
    """``"mosaic"`` where these kernels take a depthwise call by default, else ``"triton"``
    (:func:`pallas_kernels.conv_op.select_backend` asks this for depthwise calls): a real
    GPU run on a Hopper device kind, a 16-bit float input whose channels TMA can address,
    stride <= 4, no residual (the Triton kernel's epilogue has it), no Triton config."""
    if interpret or has_residual or (config is not None and not isinstance(
            config, mw.WindowConfig) and not (isinstance(config, dict) and all(
                isinstance(v, mw.WindowConfig) for v in config.values()))):
        return "triton"
    if jnp.dtype(dtype) not in mw.DTYPES or not mw.on_hopper(device_kind):
        return "triton"
    try:
        check_supported(x_shape, w_shape, dtype, stride=stride, pads=pads)
    except KernelUnsupported:
        return "triton"
    return "mosaic"


def _out_hw(x_shape, kernel_hw, stride, pads, dilation):
    return mc._out_hw(x_shape[1:3], kernel_hw, stride, pads, dilation)


def tuning_calls(x_shape, w_shape, dtype, *, stride, pads, dilation) -> dict:
    """``{"fwd", "dgrad", "wgrad"}``: the :class:`~pallas_kernels.mgpu_window.WindowCall` whose
    tiles each kernel of a depthwise call looks up and the tuner times."""
    kernel_hw = tuple(w_shape[:2])
    out_hw = _out_hw(x_shape, kernel_hw, stride, pads, dilation)
    return {part: mw.WindowCall(f"mgpu_depthwise_{part}", tuple(x_shape), kernel_hw,
                                tuple(stride), tuple(map(tuple, pads)), tuple(dilation),
                                tuple(out_hw), jnp.dtype(dtype).name)
            for part in ("fwd", "dgrad", "wgrad")}


def _weights(rows, c, cfg):
    """``rows`` (``(R, C)``) as the float32, ``block_c``-padded table the window kernel loads."""
    return mw.pad_channels(rows.astype(F32), mw.block_c(c, cfg))


def depthwise_forward(x, w, b=None, *, relu=False, stride=(1, 1), pads=((0, 0), (0, 0)),
                      dilation=(1, 1), config=None, interpret=False, detect_races=False):
    """``relu?(depthwise_conv(x, w) + b)``: ``(N, OH, OW, C)`` in ``x.dtype``.

    Arguments:
        x: ``(N, H, W, C)``; w: ``(KH, KW, 1, C)``; b: optional ``(C,)``.
        stride, pads (``((top, bottom), (left, right))``), dilation: pairs.
        config: a :class:`~pallas_kernels.mgpu_window.WindowConfig`, or None.
    """
    check_supported(x.shape, w.shape, x.dtype, stride=stride, pads=pads)
    cfg = config or mw.DEFAULT
    kh, kw, _, c = w.shape
    taps = kh * kw
    out_hw = _out_hw(x.shape, (kh, kw), stride, pads, dilation)
    if min(out_hw) < 1:
        raise ValueError(f"Mosaic GPU depthwise conv: empty output {out_hw} for x {x.shape}, "
                         f"w {w.shape}")
    rows = w.reshape(taps, c)
    if b is not None:
        rows = jnp.concatenate([rows.astype(F32), b.reshape(1, c).astype(F32)])

    def combine(t, acc, vals, w_row, pos):
        return (acc[0] + vals[0].astype(F32) * w_row(t),)

    def finish(acc, pos, w_row):
        y = acc[0] + w_row(taps) if b is not None else acc[0]  # the bias: the table's last row
        return (jnp.maximum(y, 0.0) if relu else y,)

    (pt, _), (pleft, _) = pads
    xp = mw.phases(x, ((pt, 0), (pleft, 0)), stride, 0)
    (y,) = mw.tap_reduce(
        [xp], mw.forward_taps((kh, kw), stride, dilation), n=x.shape[0], out_hw=out_hw, c=c,
        out_dtypes=(x.dtype,), init=lambda shape, layout: (jnp.zeros(shape, F32),),
        combine=combine, finish=finish, weights=_weights(rows, c, cfg), config=cfg,
        interpret=interpret, detect_races=detect_races, name="jaxcnn_mgpu_depthwise_fwd")
    return y


def depthwise_dgrad(dy, w, *, x_shape, stride=(1, 1), pads=((0, 0), (0, 0)), dilation=(1, 1),
                    config=None, interpret=False, detect_races=False):
    """Input gradient ``(N, H, W, C)`` (``dy.dtype``) of :func:`depthwise_forward`."""
    check_supported(x_shape, w.shape, dy.dtype, stride=stride, pads=pads)
    cfg = config or mw.DEFAULT
    kh, kw, _, c = w.shape
    rows = w.reshape(kh * kw, c)

    def make(taps):
        def combine(t, acc, vals, w_row, pos):
            return (acc[0] + vals[0].astype(F32) * w_row(t),)
        table = _weights(rows[jnp.asarray([tap for tap, _, _ in taps])], c, cfg)
        return (lambda shape, layout: (jnp.zeros(shape, F32),)), combine, \
            (lambda acc, pos, w_row: acc), table

    return mp.input_gradient(
        [dy], (0,), x_shape=tuple(x_shape), kernel=(kh, kw), stride=tuple(stride),
        dilation=tuple(dilation), run_pads=((pads[0][0], 0), (pads[1][0], 0)),
        make=make, config=cfg, interpret=interpret, detect_races=detect_races,
        name="jaxcnn_mgpu_depthwise_dgrad")


def depthwise_wgrad(x, dy, *, kernel_hw, stride=(1, 1), pads=((0, 0), (0, 0)), dilation=(1, 1),
                    config=None, interpret=False, detect_races=False):
    """Filter gradient ``(KH, KW, 1, C)`` in float32 of :func:`depthwise_forward`."""
    check_supported(x.shape, (*kernel_hw, 1, x.shape[3]), x.dtype, stride=stride, pads=pads)
    if x.dtype != dy.dtype:
        raise ValueError(f"Mosaic GPU depthwise wgrad: x and dy dtypes differ ({x.dtype}, "
                         f"{dy.dtype})")
    plgpu = mc._plgpu()
    from jax.experimental import pallas as pl
    cfg = config or mw.DEFAULT
    n, _, _, c = x.shape
    kh, kw = kernel_hw
    oh, ow = dy.shape[1:3]
    if (oh, ow) != _out_hw(x.shape, kernel_hw, stride, pads, dilation):
        raise ValueError(f"Mosaic GPU depthwise wgrad: dy {dy.shape} does not match x {x.shape}")
    (pt, _), (pleft, _) = pads
    xp = mw.phases(x, ((pt, 0), (pleft, 0)), stride, 0, view=False)  # 4-D: dynamic taps
    bc = mw.block_c(c, cfg)
    tw = mw.tile_w(ow, bc, cfg, jnp.dtype(x.dtype).itemsize)
    th = mw.TILE_M // tw
    tiles_h, tiles_w = mw.cdiv(oh, th), mw.cdiv(ow, tw)
    tiles = n * tiles_h * tiles_w
    split = min(cfg.split, tiles)
    per_split = mw.cdiv(tiles, split)
    stages = max(cfg.stages, 1)
    cp = mw.cdiv(c, bc) * bc  # partials padded: every store in bounds
    layout = plgpu.Layout.WGMMA
    (sh, sw), (dh, dw) = stride, dilation

    def body(x_ref, dy_ref, o_ref, x_buf, dy_buf, acc_smem, bars):
        tap, ci, si = (lax.axis_index(a) for a in ("tap", "c", "s"))
        rh, rw = (tap // kw) * dh, (tap % kw) * dw
        phase, qh, qw = (rh % sh) * sw + rw % sw, rh // sh, rw // sw
        c0 = ci * bc
        first = si * per_split
        count = jnp.minimum(per_split, tiles - first)

        issue = mc.wgrad_tile_copies(plgpu, x_ref, dy_ref, x_buf, dy_buf, bars, n=n,
                                     tap=(phase, qh, qw), tiles_hw=(tiles_h, tiles_w),
                                     tile_hw=(th, tw), chans=(pl.ds(c0, bc), pl.ds(c0, bc)))
        # Every thread owns the same elements of the accumulator throughout (one layout).
        mc.smem_store(plgpu, acc_smem, plgpu.layout_cast(jnp.zeros((mw.TILE_M, bc), F32), layout),
                      swizzled=False)

        def step(s, slot):
            plgpu.barrier_wait(bars.at[slot])
            xv = plgpu.load(x_buf.at[slot], layout=layout, optimized=False)
            dv = plgpu.load(dy_buf.at[slot], layout=layout, optimized=False)
            acc = plgpu.load(acc_smem, layout=layout, optimized=False)
            mc.smem_store(plgpu, acc_smem, acc + xv.astype(F32) * dv.astype(F32), swizzled=False)
            plgpu.commit_smem()  # every thread has read the slot: refill it

            @pl.when(s + stages < count)
            def _refill():
                issue(first + s + stages, slot)

        mc.wgrad_tile_loop(issue, step, first=first, count=count, stages=stages,
                           per_split=per_split)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(acc_smem, o_ref.at[si, tap, :, pl.ds(c0, bc)])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((split, kh * kw, mw.TILE_M, cp), F32),
        grid=(kh * kw, cp // bc, split),
        grid_names=("tap", "c", "s"),
        scratch_types=[
            plgpu.SMEM((stages, mw.TILE_M, bc), x.dtype),
            plgpu.SMEM((stages, mw.TILE_M, bc), dy.dtype),
            plgpu.SMEM((mw.TILE_M, bc), F32),
            plgpu.Barrier(num_arrivals=2 * th, num_barriers=stages),
        ],
        compiler_params=mc._lane_params(plgpu),
        interpret=mc._interpret_params(plgpu, interpret, detect_races),
        kernel_name="jaxcnn_mgpu_depthwise_wgrad",
    )
    partial = kernel(xp, dy)
    # Fixed order: the splits one after another, then the 64 rows of each partial.
    total = functools.reduce(lambda a, b: a + b, [partial[i] for i in range(split)])
    return jnp.sum(total, axis=1)[:, :c].reshape(kh, kw, 1, c)


# --- the differentiable op ---------------------------------------------------------------

def conv2d(x, w, b=None, *, stride=(1, 1), padding=((0, 0), (0, 0)), dilation=(1, 1),
           relu=False, backward="mosaic", config=None, interpret=False, detect_races=False):
    """``relu?(depthwise_conv(x, w) + b)`` on the Mosaic GPU kernels, with a ``custom_vjp``.

    The structure of :func:`pallas_kernels.conv2d`'s depthwise path: the forward kernel,
    then the input- and weight-gradient kernels (``backward="mosaic"``) or XLA's
    convolution gradients (``"xla"``).

    Arguments:
        x: ``(N, H, W, C)``; w: ``(KH, KW, 1, C)``; b: optional ``(C,)``; bfloat16 or
            float16, ``C`` a multiple of 8.
        stride, padding (``((top, bottom), (left, right))``), dilation: int pairs.
        config: one :class:`~pallas_kernels.mgpu_window.WindowConfig` for all three kernels,
            or ``{"fwd"|"dgrad"|"wgrad": WindowConfig}``; a kernel not given takes its tuned
            tiles (:func:`~pallas_kernels.mgpu_window.tuned_config`), else the defaults.

    Raises:
        KernelUnsupported: where the kernels cannot run the call (:func:`check_supported`).
    """
    if backward not in BACKWARDS:
        raise ValueError(f"Mosaic GPU depthwise conv2d: backward must be one of {BACKWARDS}, "
                         f"got {backward!r}")
    pads = tuple(tuple(int(p) for p in pair) for pair in padding)
    stride, dilation = tuple(int(v) for v in stride), tuple(int(v) for v in dilation)
    check_supported(x.shape, w.shape, x.dtype, stride=stride, pads=pads)
    if x.dtype != w.dtype:
        raise ValueError(f"Mosaic GPU depthwise conv2d: x and w dtypes differ ({x.dtype}, "
                         f"{w.dtype})")
    cfgs = mw.part_configs("Mosaic GPU depthwise conv2d", config, tuning_calls(
        x.shape, w.shape, x.dtype, stride=stride, pads=pads, dilation=dilation))
    static = (stride, pads, dilation, bool(relu), backward, cfgs, bool(interpret),
              bool(detect_races))
    return _conv(static, x, w, b)


def _forward(static, x, w, b):
    stride, pads, dilation, relu, _, (cfg, _, _), interpret, races = static
    return depthwise_forward(x, w, b, relu=relu, stride=stride, pads=pads, dilation=dilation,
                             config=cfg, interpret=interpret, detect_races=races)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, x, w, b):
    return _forward(static, x, w, b)


def _conv_fwd(static, x, w, b):
    y = _forward(static, x, w, b)
    return y, (x, w, b, y if static[3] else None)


def _conv_bwd(static, saved, dy):
    stride, pads, dilation, relu, backward, (_, cfg_d, cfg_w), interpret, races = static
    x, w, b, y = saved
    if relu:
        dy = jnp.where(y > 0, dy, jnp.zeros_like(dy))
    db = None if b is None else jnp.sum(dy.astype(F32), axis=(0, 1, 2)).astype(b.dtype)
    if backward == "xla":
        conv = functools.partial(lax.conv_general_dilated, window_strides=stride, padding=pads,
                                 rhs_dilation=dilation, dimension_numbers=DIMS,
                                 feature_group_count=x.shape[3])
        dx, dw = jax.vjp(conv, x, w)[1](dy)
        return dx, dw, db
    dy = dy.astype(x.dtype)
    dx = depthwise_dgrad(dy, w, x_shape=x.shape, stride=stride, pads=pads, dilation=dilation,
                         config=cfg_d, interpret=interpret, detect_races=races)
    dw = depthwise_wgrad(x, dy, kernel_hw=w.shape[:2], stride=stride, pads=pads,
                         dilation=dilation, config=cfg_w, interpret=interpret,
                         detect_races=races)
    return dx.astype(x.dtype), dw.astype(w.dtype), db


_conv.defvjp(_conv_fwd, _conv_bwd)
