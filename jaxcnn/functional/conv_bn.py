"""Convolution with BatchNorm fused in (the Hopper Mosaic GPU kernels), and when to use it.

:func:`conv2d_bn` is ``relu?(conv(x_in, w) + b)`` where ``x_in`` is ``x`` or, with
``input_scale``/``input_shift``, the folded BatchNorm + ReLU of ``x`` applied inside
the kernel, and which can also return the output's batch mean and variance from the
kernel's epilogue (:mod:`pallas_kernels.mgpu_fused`).  The layers use it for
``Conv -> BatchNorm -> ReLU`` chains (:mod:`jaxcnn.layers.fusion`) when asked.

:func:`use_fusion` decides per convolution, a pure lookup like ``impl="auto"``:

- ``"off"``: never;
- ``"mosaic"``: wherever the kernels can run the call (dense, 16-bit, channels a
  multiple of 8, ...); off a GPU that is GPU interpret mode (slow: for tests);
- ``"auto"``: only on a Hopper GPU, and only where the autotune cache (the user's,
  over the shipped ``tuned.json``) holds a measured training-step win of the fused
  op for this call (``scripts/bench_mgpu.py --fused --tune`` measures it, after tuning the
  fused kernels' tiles, which the kernels look up themselves: tuned tiles alone fuse
  nothing).  Nothing has been measured yet, so ``"auto"`` fuses nothing today.

:mod:`pallas_kernels` is imported only where a kernel may run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcnn import _geometry as geo
from jaxcnn.functional import _dispatch

FUSIONS = ("auto", "off", "mosaic")
TUNED_OP = "conv_bn"  # the autotune cache's op name for a fused call's verdict
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def check_fusion(where: str, fusion: str) -> str:
    """Returns ``fusion`` after checking it is one of :data:`FUSIONS`."""
    if fusion not in FUSIONS:
        raise ValueError(f"{where}: conv_bn must be one of {FUSIONS}, got {fusion!r}")
    return fusion


def tuned_static(x_shape, w_shape, *, stride, padding, dilation, prologue: bool,
                 stats: bool) -> dict:
    """The keyword form a fused call's verdict is cached under (explicit pads)."""
    stride, dilation, pads, _ = geo.conv_geometry("conv2d_bn", x_shape, w_shape, stride,
                                                  padding, dilation)
    return dict(stride=stride, padding=pads, dilation=dilation, prologue=bool(prologue),
                stats=bool(stats))


def use_fusion(fusion: str, x, w, *, stride, padding, dilation, groups, prologue: bool,
               stats: bool) -> bool:
    """Whether this convolution runs fused (see the module docstring): a lookup, safe while
    tracing; ``x`` and ``w`` are the arrays as the convolution would get them."""
    check_fusion("use_fusion", fusion)
    if fusion == "off" or groups != 1 or jnp.dtype(x.dtype) not in _DTYPES:
        return False
    if x.dtype != w.dtype or not (prologue or stats):
        return False
    static = tuned_static(x.shape, w.shape, stride=stride, padding=padding,
                          dilation=dilation, prologue=prologue, stats=stats)
    if fusion == "auto":
        if _dispatch._platform() != "gpu":
            return False
        from pallas_kernels import autotune, mgpu_conv
        if not mgpu_conv.is_hopper(autotune.device_kind(), mgpu_conv.device_capability()):
            return False
        arrays = (jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(w.shape, w.dtype))
        verdict = autotune.verdict(TUNED_OP, arrays, static)
        if verdict is None or not verdict[1]:  # a measured win of forward + backward
            return False
    from jaxcnn.errors import KernelUnsupported
    from pallas_kernels import mgpu_conv
    try:
        mgpu_conv.check_supported(x.shape, w.shape, x.dtype, stride=static["stride"],
                                  pads=static["padding"])
    except KernelUnsupported:
        return False
    return True


def conv2d_bn(x, w, b=None, *, stride=1, padding=0, dilation=1, relu=False, input_scale=None,
              input_shift=None, stats=False):
    """The fused convolution (:func:`pallas_kernels.mgpu_fused.conv2d`), PyTorch-style
    arguments; in GPU interpret mode off a GPU.

    Arguments:
        x: ``(N, H, W, C_in)``; w: ``(KH, KW, C_in, C_out)``, bfloat16 or float16.
        b: optional ``(C_out,)`` bias.
        stride, padding, dilation: as in :func:`jaxcnn.functional.conv2d`.
        relu: ReLU on the output.
        input_scale, input_shift: optional ``(C_in,)``: ``x_in = relu(x * input_scale +
            input_shift)`` in the kernel, padding applying to ``x_in``.
        stats: also return the output's per-channel ``(mean, var)`` (float32, biased).

    Returns:
        ``y`` or ``(y, mean, var)``.
    """
    stride, dilation, pads, _ = geo.conv_geometry("conv2d_bn", x.shape, w.shape, stride,
                                                  padding, dilation)
    from pallas_kernels import mgpu_fused
    return mgpu_fused.conv2d(x, w, b, stride=stride, padding=pads, dilation=dilation,
                             relu=relu, input_scale=input_scale, input_shift=input_shift,
                             stats=stats, interpret=_dispatch._platform() != "gpu")
