"""Pallas kernels for jaxcnn's convolution and pooling ops (NHWC, HWIO).

Written for the Pallas Triton lowering (NVIDIA GPUs); on other backends the
same kernels run in the Pallas interpreter (``interpret=True``), which is for
testing, not speed.  Every op is a ``jax.custom_vjp`` with Pallas backward
kernels and an XLA backward selectable with ``backward="xla"``.

- :func:`conv2d`: implicit-GEMM convolution (groups=1) or depthwise
  (groups == channels), float32/bfloat16 with float32 accumulation, any
  stride/padding/dilation, fused bias + residual + ReLU epilogue and an
  optional fused BatchNorm-apply + ReLU on the input.
- :func:`bn_relu_conv2d`, :func:`bn_relu_conv2d_train`, :func:`fold_batch_norm`:
  the BatchNorm+ReLU+conv fusion, inference and training forms.
- :func:`max_pool2d`, :func:`avg_pool2d`: PyTorch pooling semantics.
- :mod:`pallas_kernels.autotune`: per-shape tile choice and the
  kernel-vs-XLA verdict behind ``impl="auto"`` in :mod:`jaxcnn.functional`.
- :mod:`pallas_kernels.mgpu_conv`: the dense convolution (forward and both
  gradients) in Pallas **Mosaic GPU** for Hopper (TMA, mbarrier pipeline,
  ``wgmma``; jax >= 0.11).  :func:`conv2d` runs it on an H100/H200 for the
  calls it supports (``backend=None``; see
  :func:`pallas_kernels.conv_op.select_backend`) and the Triton kernels
  everywhere else; ``backend="triton"``/``"mosaic"`` pins one.
- :mod:`pallas_kernels.mgpu_fused`: BatchNorm fused into the Mosaic GPU
  convolution (training statistics from the epilogue, BatchNorm + ReLU in the
  input prologue), differentiable; the layers' ``Choices(conv_bn=...)`` use it.
- :mod:`pallas_kernels.mgpu_pool` and :mod:`pallas_kernels.mgpu_depthwise`: max/average
  pooling and depthwise convolution (forward and gradients) in Mosaic GPU, on the TMA
  window kernel of :mod:`pallas_kernels.mgpu_window`; :func:`max_pool2d`,
  :func:`avg_pool2d` and :func:`conv2d` (depthwise) choose them the same way.
- :mod:`pallas_kernels.mgpu_bn`: training BatchNorm's statistics and backward sums in Mosaic
  GPU, one read of each input (``jaxcnn.functional.batch_norm_train(impl=...)``).

Kernels never import :mod:`jaxcnn.functional` or :mod:`jaxcnn.layers` (which
sit above them); argument forms, padding and output sizes come from the leaf
:mod:`jaxcnn._geometry` that :mod:`jaxcnn.functional` uses too.
"""
from pallas_kernels import autotune
from pallas_kernels._common import BlockConfig
from pallas_kernels.conv_op import conv2d
from pallas_kernels.fused import bn_relu_conv2d, bn_relu_conv2d_train, fold_batch_norm
from pallas_kernels.pool import avg_pool2d, max_pool2d

__all__ = ["conv2d", "bn_relu_conv2d", "bn_relu_conv2d_train", "fold_batch_norm",
           "max_pool2d", "avg_pool2d", "BlockConfig", "autotune"]
