"""Shape-only layers: :func:`Flatten` and :func:`Identity`."""
from __future__ import annotations

from jaxcnn.layers._common import cast_in, check_min_rank, prod, whole_images_only
from jaxcnn.layers.base import Layer, leaf


def Flatten() -> Layer:
    """Flatten all axes but the batch axis, row-major: NHWC ``(N, H, W, C) -> (N, H*W*C)``.

    Note the order differs from PyTorch's ``nn.Flatten`` on NCHW tensors
    (``C*H*W``); a Linear layer after it has its input rows in HWC order.

    Returns:
        A Layer of kind ``"flatten"``; no params.
    """
    def init(key, input_shape):
        del key
        check_min_rank("Flatten", input_shape, 1)
        return {}, {}, (input_shape[0], prod(input_shape[1:]))

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng
        whole_images_only("Flatten", choices)
        x, _ = cast_in(policy, "flatten", x)
        return x.reshape(x.shape[0], -1), state

    return leaf("flatten", init, apply, {})


def Identity() -> Layer:
    """Return the input unchanged (not even cast by a policy).

    Returns:
        A Layer of kind ``"identity"``; no params.
    """
    def init(key, input_shape):
        del key
        return {}, {}, tuple(input_shape)

    def apply(params, state, x, *, train=False, rng=None, policy=None, choices=None):
        del params, train, rng, policy
        return x, state

    return leaf("identity", init, apply, {})
