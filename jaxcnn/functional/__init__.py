"""Stateless ops on arrays: convolution, pooling, normalisation, activations, losses.

Everything here is a pure, jit-able function of arrays and static arguments.
Images are NHWC, convolution kernels HWIO ``(KH, KW, C_in // groups, C_out)``,
dense weights ``(in, out)``.  Semantics follow PyTorch wherever PyTorch has the
op (integer padding, ``ceil_mode``, ``count_include_pad``, first-max-wins in
max-pool gradients, label smoothing); shape errors are ``ValueError`` raised at
trace time, naming the op and the shapes.

Convolution and pooling take ``impl="auto"|"xla"|"pallas"``: ``"pallas"`` runs
the :mod:`pallas_kernels` kernels (interpreted off GPUs), ``"auto"`` runs XLA
except on a GPU where the autotuner measured the kernel faster for the shape
(a lookup; :mod:`jaxcnn.functional.tuning` measures, when asked);
a layer's kernels are chosen by its ``apply(..., choices=)`` argument
(:class:`jaxcnn.layers.Choices`), never by a scope a cached trace could miss.

Typical use::

    from jaxcnn import functional as F
    y = F.relu(F.conv2d(x, w, b, padding=1))
"""
from jaxcnn.functional.activation import (
    elu, gelu, hardsigmoid, hardswish, leaky_relu, log_softmax, relu, relu6, sigmoid, silu,
    softmax, tanh)
from jaxcnn.functional.conv import conv2d, conv_transpose2d
from jaxcnn.functional.dropout import STOCHASTIC_DEPTH_MODES, dropout, stochastic_depth
from jaxcnn.functional.linear import linear
from jaxcnn.functional.loss import cross_entropy, top_k_accuracy, top_k_correct
from jaxcnn.functional.norm import (
    BATCH_NORM_GRADS, batch_norm, batch_norm_train, group_norm, layer_norm)
from jaxcnn.functional.pool import (
    adaptive_avg_pool2d, adaptive_max_pool2d, avg_pool2d, global_avg_pool2d, max_pool2d)

__all__ = [
    "conv2d", "conv_transpose2d",
    "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool2d",
    "global_avg_pool2d",
    "linear",
    "batch_norm", "batch_norm_train", "layer_norm", "group_norm",
    "BATCH_NORM_GRADS",
    "dropout", "stochastic_depth", "STOCHASTIC_DEPTH_MODES",
    "relu", "relu6", "leaky_relu", "elu", "gelu", "silu", "hardswish", "hardsigmoid", "sigmoid",
    "tanh",
    "softmax", "log_softmax",
    "cross_entropy", "top_k_correct", "top_k_accuracy",
]
