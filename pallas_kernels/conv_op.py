"""``conv2d``: the Pallas convolution with its fused epilogue/prologue and custom VJP.

Dense (groups=1) convolutions run the implicit-GEMM kernels of
:mod:`pallas_kernels.conv` and :mod:`pallas_kernels.conv_grad`; depthwise ones
(groups == C_in == C_out) those of :mod:`pallas_kernels.depthwise`.  Pallas
calls cannot be differentiated by JAX, so the whole op is a
``jax.custom_vjp`` whose backward runs the Pallas dgrad/wgrad kernels
(``backward="pallas"``) or XLA's convolution gradients (``backward="xla"``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn.errors import KernelUnsupported
from pallas_kernels import _common as cm
from pallas_kernels import autotune, mgpu_conv, mgpu_depthwise, mgpu_window
from pallas_kernels.conv import conv_forward
from pallas_kernels.conv_grad import conv_dgrad, conv_wgrad
from pallas_kernels.depthwise import depthwise_dgrad, depthwise_forward, depthwise_wgrad

BACKWARDS = ("pallas", "xla")
BACKENDS = (None, "triton", "mosaic")


def conv2d(x, w, b=None, *, stride=1, padding=0, dilation=1, groups=1, residual=None,
           relu=False, input_scale=None, input_shift=None, backward="pallas", config=None,
           interpret=None, precision=None, backend=None):
    """Convolution (PyTorch ``Conv2d`` semantics, NHWC/HWIO) run by Pallas kernels.

    Computes ``relu?(conv(x_in, w) + b + residual)`` where
    ``x_in = relu(x * input_scale + input_shift)`` when the fused input
    BatchNorm+ReLU is given (padding applied after it, so padded zeros stay
    zero), else ``x``.  Accumulation is float32; the result has ``x.dtype``.

    Arguments:
        x: ``(N, H, W, C_in)``, float32 or bfloat16 (float16: the Mosaic kernels only).
        w: ``(KH, KW, C_in // groups, C_out)``, same dtype as ``x``.
        b: optional ``(C_out,)`` bias.
        stride, padding, dilation: as in :func:`jaxcnn.functional.conv2d`.
        groups: 1, or ``C_in`` with ``C_out == C_in`` (depthwise).
        residual: optional ``(N, H_out, W_out, C_out)`` added before the ReLU.
        relu: apply ReLU to the result.
        input_scale, input_shift: optional ``(C_in,)`` each (both or neither).
        backward: ``"pallas"`` (dgrad/wgrad kernels) or ``"xla"``.
        config: a :class:`~pallas_kernels.BlockConfig` for every kernel, or a
            dict ``{"fwd"|"dgrad"|"wgrad": BlockConfig}``; None takes the
            autotuner's cached choice or a default.
        interpret: run in the Pallas interpreter; None means "unless on a GPU".
        precision: ``jax.lax.Precision`` for the in-kernel dots (GPU float32
            dots default to TF32; ``HIGHEST`` asks for full float32).
        backend: ``"triton"`` (the kernels of this module), ``"mosaic"`` (the
            Hopper kernels of :mod:`pallas_kernels.mgpu_conv`, or of
            :mod:`pallas_kernels.mgpu_depthwise` for depthwise calls; ``config`` is then
            an :class:`~pallas_kernels.mgpu_conv.MgpuConfig` (depthwise:
            :class:`~pallas_kernels.mgpu_window.WindowConfig`) or a dict of them, and
            ``interpret`` means Mosaic GPU interpret mode), or None: Mosaic on a
            Hopper GPU for the calls it supports (:func:`select_backend`), else Triton.

    Returns:
        ``(N, H_out, W_out, C_out)`` in ``x.dtype``.

    Raises:
        ValueError: on malformed arguments or mismatched shapes/dtypes.
        NotImplementedError: for grouped convolutions other than depthwise.
        KernelUnsupported: ``backend="mosaic"`` for a call the Mosaic kernels cannot run.
    """
    op = "pallas_kernels.conv2d"
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    geo.check_rank(op, "x", x_shape, 4, "(N, H, W, C)")
    geo.check_rank(op, "w", w_shape, 4, "(KH, KW, C_in // groups, C_out)")
    if x.dtype != w.dtype or x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"{op}: x and w must share a dtype, float32, bfloat16 or float16; got "
                         f"{x.dtype} and {w.dtype}")
    if backward not in BACKWARDS:
        raise ValueError(f"{op}: backward must be one of {BACKWARDS}, got {backward!r}")
    if (input_scale is None) != (input_shift is None):
        raise ValueError(f"{op}: give both input_scale and input_shift, or neither")
    kind = _kind(op, x_shape, w_shape, groups)
    co = w_shape[3]
    stride, dilation, pads, out_hw = geo.conv_geometry(op, x_shape, w_shape, stride, padding,
                                                       dilation)
    for name, v, shape in (("b", b, (co,)), ("residual", residual, (x_shape[0], *out_hw, co)),
                           ("input_scale", input_scale, (x_shape[3],)),
                           ("input_shift", input_shift, (x_shape[3],))):
        if v is not None and tuple(jnp.shape(v)) != shape:
            raise ValueError(f"{op}: {name} must have shape {shape}, got {tuple(jnp.shape(v))}")
    interpret = cm.interpret_default(interpret)
    if backend not in BACKENDS:
        raise ValueError(f"{op}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend is None:
        backend = select_backend(x.dtype, kind, stride, x_shape, w_shape, pads,
                                 input_scale is not None, precision, config, interpret,
                                 has_residual=residual is not None)
    if backend == "mosaic":
        if input_scale is not None or precision is not None:
            raise KernelUnsupported(f"{op}: the Mosaic GPU kernels run convolutions without the "
                                    "fused input BatchNorm or a precision override")
        return _mosaic(op, kind, x, w, b, residual, stride=stride, pads=pads, dilation=dilation,
                       relu=relu, backward=backward, config=config, interpret=interpret)
    _check_triton_call(op, x.dtype, config, backend)
    g = cm.geometry(x_shape, w_shape[:2], stride, dilation, pads, out_hw)
    cfgs = _configs(kind, g, co, x.dtype, config, interpret)
    static = (kind, g, pads, cfgs, bool(relu), backward, interpret, precision)
    return _conv(static, x, w, b, residual, input_scale, input_shift)


def _kind(op: str, x_shape, w_shape, groups) -> str:
    """``"dense"`` (groups 1) or ``"depthwise"`` (groups == C_in == C_out); no other grouping
    has kernels."""
    c, co = x_shape[3], w_shape[3]
    if groups == 1 and w_shape[2] == c:
        return "dense"
    if groups == c and co == c and w_shape[2] == 1:
        return "depthwise"
    raise NotImplementedError(
        f"{op}: only groups=1 and depthwise (groups == C_in == C_out) have kernels; got "
        f"groups={groups!r}, x shape {x_shape}, w shape {w_shape}")


def _mosaic(op, kind, x, w, b, residual, *, stride, pads, dilation, relu, backward, config, interpret):
    """:func:`conv2d` on the Mosaic GPU kernels (dense or depthwise)."""
    x_shape, w_shape = tuple(jnp.shape(x)), tuple(jnp.shape(w))
    kernels = "mosaic" if backward == "pallas" else "xla"
    if kind == "depthwise":
        if residual is not None:
            raise KernelUnsupported(f"{op}: the Mosaic GPU depthwise kernels run convolutions "
                                    "without a residual")
        mgpu_depthwise.check_supported(x_shape, w_shape, x.dtype, stride=stride, pads=pads)
        return mgpu_depthwise.conv2d(x, w, b, stride=stride, padding=pads, dilation=dilation,
                                     relu=relu, backward=kernels, config=config, interpret=interpret)
    mgpu_conv.check_supported(x_shape, w_shape, x.dtype, stride=stride, pads=pads)
    return mgpu_conv.conv2d(x, w, b, stride=stride, padding=pads, dilation=dilation, residual=residual,
                            relu=relu, backward=kernels, config=config, interpret=interpret)


def _check_triton_call(op: str, dtype, config, backend) -> None:
    """What the Triton kernels cannot take: a Mosaic configuration, or float16."""
    given = list(config.values()) if isinstance(config, dict) else [config]
    mosaic = [type(v).__name__ for v in given
              if isinstance(v, (mgpu_conv.MgpuConfig, mgpu_window.WindowConfig))]
    if mosaic:
        raise ValueError(f"{op}: config holds an {mosaic[0]}, but this call runs the Triton "
                         f"kernels (backend={backend!r}); pass backend='mosaic' or a "
                         "BlockConfig")
    if dtype == jnp.float16:
        raise ValueError(f"{op}: float16 runs on the Mosaic GPU kernels only (a Hopper GPU, or "
                         f"backend='mosaic'); the Triton kernels take float32 or bfloat16 "
                         f"(backend={backend!r})")


def select_backend(dtype, kind, stride, x_shape, w_shape, pads, has_input_bn, precision, config,
                   interpret, device_kind=None, has_residual=False) -> str:
    """``"mosaic"`` where the Hopper kernels take this call, else ``"triton"``: a pure lookup.

    Mosaic needs: a real GPU run (not interpret mode) on a Hopper device kind
    (H100/H200, sm_90), jax >= 0.11, bfloat16 or float16 (float32 stays on Triton, whose
    TF32 path is tested), a dense convolution whose channels TMA can address (strides
    above 1 by phase decomposition) or a depthwise one without a residual
    (:func:`pallas_kernels.mgpu_depthwise.select_backend`),
    no fused input BatchNorm or precision override, and no Triton ``BlockConfig``.
    """
    if interpret or has_input_bn or precision is not None:
        return "triton"
    if kind == "depthwise":
        return mgpu_depthwise.select_backend(x_shape, w_shape, dtype, stride, pads, has_residual,
                                             config, interpret, device_kind)
    if isinstance(config, cm.BlockConfig) or (
            isinstance(config, dict) and any(isinstance(v, cm.BlockConfig)
                                             for v in config.values())):
        return "triton"
    if jnp.dtype(dtype) not in mgpu_conv.DTYPES:
        return "triton"
    if device_kind is None:
        hopper = mgpu_conv.is_hopper(autotune.device_kind(), mgpu_conv.device_capability())
    else:
        hopper = mgpu_conv.is_hopper(device_kind)
    if not hopper:
        return "triton"
    try:
        mgpu_conv.check_supported(x_shape, w_shape, dtype, stride=stride, pads=pads)
    except KernelUnsupported:
        return "triton"
    return "mosaic"


def _configs(kind, g, co, dtype, config, interpret):
    if isinstance(config, cm.BlockConfig):
        return (config,) * 3
    config = dict(config or {})
    unknown = set(config) - {"fwd", "dgrad", "wgrad"}
    if unknown:
        raise ValueError(f"pallas_kernels.conv2d: unknown config keys {sorted(unknown)}")
    return tuple(config.get(part) or autotune.config_for(f"{kind}_{part}", g, co, dtype, interpret)
                 for part in ("fwd", "dgrad", "wgrad"))


def _forward(static, x, w, b, residual, scale, shift):
    kind, g, _, (cfg, _, _), relu, _, interpret, precision = static
    if kind == "dense":
        return conv_forward(x, w, b, residual, scale, shift, g=g, cfg=cfg, relu=relu,
                            interpret=interpret, precision=precision)
    return depthwise_forward(x, w, b, residual, scale, shift, g=g, cfg=cfg, relu=relu,
                             interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _conv(static, x, w, b, residual, scale, shift):
    return _forward(static, x, w, b, residual, scale, shift)


def _conv_fwd(static, x, w, b, residual, scale, shift):
    y = _forward(static, x, w, b, residual, scale, shift)
    return y, (x, w, b, residual, scale, shift, y if static[4] else None)


def _conv_bwd(static, saved, dy):
    kind, g, pads, (_, cfg_d, cfg_w), relu, backward, interpret, precision = static
    x, w, b, residual, scale, shift, y = saved
    if relu:
        dy = jnp.where(y > 0, dy, jnp.zeros_like(dy))
    db = None if b is None else jnp.sum(dy.astype(cm.F32), axis=(0, 1, 2)).astype(b.dtype)
    dres = None if residual is None else dy.astype(residual.dtype)
    if backward == "xla":
        x_in = x if scale is None else _bn_relu(x, scale, shift).astype(x.dtype)
        conv = functools.partial(
            lax.conv_general_dilated, window_strides=(g.sh, g.sw), padding=pads,
            rhs_dilation=(g.dh, g.dw), dimension_numbers=geo.DIMS,
            feature_group_count=1 if kind == "dense" else g.c)
        _, vjp = jax.vjp(conv, x_in, w)
        dx, dw = vjp(dy)
    elif kind == "dense":
        dx = conv_dgrad(dy, w, g=g, cfg=cfg_d, interpret=interpret, precision=precision)
        dw = conv_wgrad(x, dy, scale, shift, g=g, cfg=cfg_w, interpret=interpret,
                        precision=precision)
    else:
        dx = depthwise_dgrad(dy, w, g=g, cfg=cfg_d, interpret=interpret)
        dw = depthwise_wgrad(x, dy, scale, shift, g=g, cfg=cfg_w, interpret=interpret)
    dw = dw.astype(w.dtype)
    if scale is None:
        return dx, dw, db, dres, None, None
    # Through relu(x * scale + shift), elementwise; cheap next to the convolution.
    dx_pre = jnp.where(_bn_relu(x, scale, shift) > 0, dx.astype(cm.F32), 0.0)
    dscale = jnp.sum(dx_pre * x.astype(cm.F32), axis=(0, 1, 2)).astype(scale.dtype)
    dshift = jnp.sum(dx_pre, axis=(0, 1, 2)).astype(shift.dtype)
    return (dx_pre * scale.astype(cm.F32)).astype(x.dtype), dw, db, dres, dscale, dshift


def _bn_relu(x, scale, shift):
    return jnp.maximum(x.astype(cm.F32) * scale.astype(cm.F32) + shift.astype(cm.F32), 0.0)


_conv.defvjp(_conv_fwd, _conv_bwd)
