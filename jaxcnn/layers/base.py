"""The Layer protocol: a named pair of pure functions.

A ``Layer`` is, in the spirit of optax's ``GradientTransformation``, a
NamedTuple of two pure functions::

    init(key, input_shape) -> (params, state, output_shape)
    apply(params, state, x, *, train=False, rng=None, policy=None, choices=None)
        -> (y, new_state)

``input_shape`` and ``output_shape`` are full shapes including the batch
dimension, e.g. ``(N, H, W, C)`` for images (NHWC).  ``init`` is shape driven:
it never runs a forward pass.  ``params`` holds trained arrays, ``state`` the
non-trained ones (BatchNorm running statistics); both are nested dicts with
readable keys, and a layer without any returns ``{}``.  ``policy`` is a
:class:`jaxcnn.precision.Policy`, a name the config's ``precision.policy`` takes
(``"bf16"``, ``"p=f32,c=bf16,o=f32"``: see :func:`jaxcnn.precision.as_policy`) or
None (no casting).  ``choices`` (a
:class:`Choices` or None) picks the kernels, the BatchNorm backward and the
axis BatchNorm syncs over; like ``policy`` it is an argument, passed down by
the combinators, so a traced function that closes over it can never keep a
trace made with another choice.

Besides the two functions a Layer carries a little static description that
tools (``jaxcnn.summary``, interop, export) read: ``kind`` (``"conv2d"``,
``"batch_norm"``, ``"serial"``...), ``config`` (its hyper-parameters as a
plain dict) and ``children`` (``(name, Layer)`` pairs for combinators).

While a :func:`record_layers` context is active, every leaf layer created
with :func:`leaf` reports each ``init`` call (its dotted path, kind, config,
shapes and parameters), which is how the summary and the PyTorch name mapping
see inside a model without running it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Callable, NamedTuple

import jax

Shape = tuple[int, ...]
Params = dict
State = dict


class Layer(NamedTuple):
    """A layer: ``init``/``apply`` pure functions plus a static description.

    Arguments:
        init: ``(key, input_shape) -> (params, state, output_shape)``.
        apply: ``(params, state, x, *, train=False, rng=None, policy=None,
            choices=None) -> (y, new_state)``.
        kind: short name of the layer type, e.g. ``"conv2d"``; combinators use
            ``"serial"``, ``"residual"``, ``"parallel"``.
        config: the layer's hyper-parameters as a plain dict (read-only).
        children: ``(name, Layer)`` pairs for combinators, ``()`` for leaves.
    """

    init: Callable[..., tuple[Params, State, Shape]]
    apply: Callable[..., tuple[Any, State]]
    kind: str = "layer"
    config: dict | None = None
    children: tuple = ()


@dataclasses.dataclass(frozen=True)
class Choices:
    """Trace-time choices of how layers compute, given to ``apply(..., choices=)``.

    Frozen and hashable (a static argument of ``jax.jit`` if need be); a bad
    name fails when it is built, naming the field.  ``Choices()`` (or None) is
    every default.

    Arguments:
        impl: kernels of the convolution and pooling layers and of the training
            BatchNorm's reductions: ``"auto"`` (the ops' own choice), ``"xla"`` (never
            a Pallas kernel; on the CPU the ops' CPU lowerings stay) or ``"pallas"``.
        batch_norm_grad: BatchNorm's training form (``F.batch_norm_train``'s
            ``grad``): ``"auto"`` (``"explicit"`` on the CPU and GPUs, ``"autodiff"`` elsewhere),
            ``"explicit"``, ``"autodiff"`` or ``"closed_form"``.
        axis_name: the mapped axis (``shard_map``/``pmap``) that BatchNorm layers
            built without ``axis_name`` sync their statistics over, or None.
        conv_bn: ``Conv -> BatchNorm [-> ReLU]`` chains in training
            (:mod:`jaxcnn.layers.fusion`): ``"auto"`` (fused only where the autotune
            cache holds a measured win on this Hopper GPU: none yet), ``"off"`` or
            ``"mosaic"`` (fused wherever the Mosaic GPU kernels run the convolution;
            GPU interpret mode off a GPU).  Same values and gradients either way.
        height_axis: the mapped axis (``shard_map``) whose devices hold each image's
            rows in equal blocks, in order, or None: convolution and pooling layers
            then bring the halo rows their windows need from the neighbouring blocks
            and GroupNorm reduces its statistics over it (the ops' ``height_axis``;
            BatchNorm's go by ``axis_name``, which must then include this axis).  Layers
            that cannot compute their share from one block (global and adaptive
            pooling, flatten, transposed convolution, a LayerNorm over the rows) raise.
    """

    impl: str = "auto"
    batch_norm_grad: str = "auto"
    axis_name: str | None = None
    conv_bn: str = "auto"
    height_axis: str | None = None

    def __post_init__(self):
        from jaxcnn.functional import _dispatch
        from jaxcnn.functional.conv_bn import check_fusion
        from jaxcnn.functional.norm import check_batch_norm_grad
        _dispatch.check_impl("Choices", self.impl)
        check_batch_norm_grad("Choices", self.batch_norm_grad)
        check_fusion("Choices", self.conv_bn)
        if self.axis_name is not None and not isinstance(self.axis_name, (str, tuple)):
            raise ValueError(f"Choices: axis_name must be an axis name (a string or a tuple of "
                             f"them) or None, got {self.axis_name!r}")
        if self.height_axis is not None and not isinstance(self.height_axis, str):
            raise ValueError(f"Choices: height_axis must be an axis name (a string) or None, "
                             f"got {self.height_axis!r}")


DEFAULT_CHOICES = Choices()


def choices_or_default(choices) -> Choices:
    """``choices``, or :data:`DEFAULT_CHOICES` for None; anything else is a TypeError."""
    if choices is None:
        return DEFAULT_CHOICES
    if not isinstance(choices, Choices):
        raise TypeError(f"choices must be a jaxcnn.layers.Choices or None, got "
                        f"{type(choices).__name__}")
    return choices


class LayerRecord(NamedTuple):
    """What one leaf layer's ``init`` reported while recording."""

    path: str            # dotted path, e.g. "layer1.0.conv1" ("" for the root)
    kind: str
    config: dict
    input_shape: Shape
    output_shape: Shape
    params: Params
    state: State
    layer: Layer


class _Recorder(threading.local):
    def __init__(self):
        self.scopes: list[str] = []
        self.records: list[LayerRecord] | None = None


_REC = _Recorder()


@contextlib.contextmanager
def name_scope(name: str):
    """Push ``name`` on the path used for records; combinators wrap children's
    ``init`` calls in it so records carry dotted paths like ``layer1.0.conv1``."""
    _REC.scopes.append(str(name))
    try:
        yield
    finally:
        _REC.scopes.pop()


@contextlib.contextmanager
def record_layers():
    """Collect a :class:`LayerRecord` for every leaf ``init`` run inside.

    Usage::

        with record_layers() as records:
            jax.eval_shape(lambda k: model.init(k, shape)[:2], key)
        for r in records: ...
    """
    outer_records, outer_scopes = _REC.records, _REC.scopes
    _REC.records, _REC.scopes = [], []
    try:
        yield _REC.records
    finally:
        _REC.records, _REC.scopes = outer_records, outer_scopes


def current_path() -> str:
    """The dotted path of the layer being initialised or applied inside a combinator
    (``"classifier.0"``), ``""`` outside any."""
    return ".".join(_REC.scopes)


def where(name: str) -> str:
    """``name`` for an error message, with the layer's path when it has one:
    ``"Linear at 'classifier.0'"``, as the combinators name theirs."""
    path = current_path()
    return f"{name} at {path!r}" if path else name


def leaf(kind: str, init: Callable, apply: Callable, config: dict | None = None) -> Layer:
    """Build a leaf Layer whose ``init`` reports itself to :func:`record_layers`."""
    config = dict(config or {})

    def recorded_init(key, input_shape):
        input_shape = tuple(int(d) for d in input_shape)
        params, state, output_shape = init(key, input_shape)
        output_shape = tuple(int(d) for d in output_shape)
        if _REC.records is not None:
            _REC.records.append(
                LayerRecord(current_path(), kind, config, input_shape, output_shape,
                            params, state, layer))
        return params, state, output_shape

    layer = Layer(recorded_init, apply, kind, config, ())
    return layer


def split_rng(rng, n: int):
    """``n`` independent keys derived from ``rng`` (``None`` stays ``None``)."""
    if rng is None:
        return [None] * n
    return [jax.random.fold_in(rng, i) for i in range(n)]
