"""A per-layer table of a model: output shapes, parameter counts and MACs.

:func:`summary` initialises the model abstractly (``jax.eval_shape``, so even
a 138M-parameter VGG costs no memory) inside :func:`~jaxcnn.layers.base.record_layers`,
which reports every leaf layer's path, kind, shapes and parameters.  The MACs
(multiply-accumulates) of a leaf are counted from the jaxpr of its ``apply``,
not from its kind: every ``dot_general`` and ``conv_general_dilated`` it runs
contributes, so a new layer type is counted without teaching this module
about it.  Elementwise work (activations, normalisation, pooling) is not
counted, as usual for MAC tables.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxcnn.layers.base import Layer, record_layers


class Row(NamedTuple):
    """One leaf layer of a :class:`Summary`."""

    name: str                 # dotted path, e.g. "layer1.0.conv1"
    kind: str                 # e.g. "conv2d"
    output_shape: tuple
    params: int               # trainable parameters
    state: int                # non-trained variables (BatchNorm running statistics)
    macs: int                 # multiply-accumulates for the whole input batch


class Summary(NamedTuple):
    """What :func:`summary` returns; ``str(summary)`` is an aligned table.

    Arguments:
        rows: one :class:`Row` per leaf layer, in ``init`` order.
        input_shape: the input shape the model was summarised at.
        output_shape: the model's output shape.
    """

    rows: tuple
    input_shape: tuple
    output_shape: tuple

    @property
    def total_params(self) -> int:
        return sum(r.params for r in self.rows)

    @property
    def total_state(self) -> int:
        return sum(r.state for r in self.rows)

    @property
    def total_macs(self) -> int:
        """MACs of one forward pass over the whole input batch."""
        return sum(r.macs for r in self.rows)

    @property
    def macs_per_sample(self) -> float:
        """MACs of one forward pass per example (``total_macs / batch``)."""
        return self.total_macs / self.input_shape[0]

    def __str__(self) -> str:
        header = ("Layer", "Kind", "Output shape", "Params", "MACs")
        cells = [(r.name or "(root)", r.kind, str(r.output_shape), f"{r.params:,}", f"{r.macs:,}")
                 for r in self.rows]
        widths = [max(len(c[i]) for c in [header, *cells]) for i in range(5)]

        def line(c):
            return "  ".join([c[0].ljust(widths[0]), c[1].ljust(widths[1]),
                              c[2].ljust(widths[2]), c[3].rjust(widths[3]),
                              c[4].rjust(widths[4])]).rstrip()

        rule = "-" * len(line(header))
        batch = self.input_shape[0]
        return "\n".join([
            line(header), rule, *map(line, cells), rule,
            f"Input shape: {self.input_shape}   Output shape: {self.output_shape}",
            f"Trainable params: {self.total_params:,}   "
            f"Non-trainable state: {self.total_state:,}",
            f"Total MACs: {self.total_macs:,} ({self.total_macs / 1e9:.3f} G) for batch {batch}; "
            f"per sample: {self.macs_per_sample:,.0f} ({self.macs_per_sample / 1e9:.3f} G)",
        ])


# Dense peak FLOP/s by device-kind substring: (bfloat16, float32 run as TF32).
PEAK_FLOPS = {"H100": (989e12, 494e12), "H200": (989e12, 494e12), "A100": (312e12, 156e12)}


def peak_flops(device_kind: str, bf16: bool) -> float | None:
    """The dense peak FLOP/s of a device kind (e.g. ``"NVIDIA H100 80GB HBM3"``) for
    bfloat16 or TF32 matrix work, or None for a kind not in :data:`PEAK_FLOPS`."""
    peak = next((p for k, p in PEAK_FLOPS.items() if k in device_kind), None)
    return None if peak is None else peak[0 if bf16 else 1]


def _size(tree) -> int:
    return sum(math.prod(leaf.shape) for leaf in jax.tree_util.tree_leaves(tree))


def _abstract(tree):
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def summary(model: Layer, input_shape, *, dtype=jnp.float32) -> Summary:
    """Summarise ``model`` at ``input_shape`` without allocating its parameters.

    Arguments:
        model: any Layer (a zoo model, a ``serial`` stack, a single leaf).
        input_shape: full input shape including the batch, e.g. ``(1, 224, 224, 3)``.
        dtype: input dtype used when tracing each layer's ``apply``.

    Returns:
        A :class:`Summary`: one row per leaf layer with its dotted name, kind,
        output shape, trainable parameter count, state size and MACs (for the
        whole batch; ``macs_per_sample`` divides by the batch size).
    """
    input_shape = tuple(int(d) for d in input_shape)
    key = jax.random.PRNGKey(0)
    out_shape = []

    def init(k):
        params, state, shape = model.init(k, input_shape)
        out_shape.append(shape)
        return params, state

    with record_layers() as records:
        jax.eval_shape(init, key)
    rows = []
    for rec in records:
        params, state = _abstract(rec.params), _abstract(rec.state)
        x = jax.ShapeDtypeStruct(rec.input_shape, dtype)
        macs = count_macs(lambda p, s, v, layer=rec.layer: layer.apply(p, s, v)[0],
                          params, state, x)
        rows.append(Row(rec.path, rec.kind, rec.output_shape, _size(params), _size(state), macs))
    return Summary(tuple(rows), input_shape, tuple(out_shape[0]))


def count_macs(fn, *args) -> int:
    """Multiply-accumulates of the ``dot_general`` and ``conv_general_dilated``
    operations ``fn(*args)`` performs.

    Arguments:
        fn: a jax-traceable function.
        *args: its arguments: arrays or ``jax.ShapeDtypeStruct`` pytrees.

    Returns:
        The MAC count, a Python int.  A convolution counts
        ``output elements x kernel taps x input features per group``, taps in
        the zero padding included (the usual convention, e.g. 4.09 GMACs for
        ResNet-50), except that for an input-dilated convolution (how a strided
        transposed convolution is lowered) taps on the inserted zeros are not
        counted.  A transposed convolution thus counts as the direct
        convolution it equals.  A ``dot_general`` counts ``output elements x
        contracted size``.  ``scan`` bodies are multiplied by their length,
        ``cond`` takes its most expensive branch.
    """
    return _jaxpr_macs(jax.make_jaxpr(fn)(*args))


def _sub_jaxprs(value):
    if isinstance(value, (jex.Jaxpr, jex.ClosedJaxpr)):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _jaxpr_macs(jaxpr) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            total += _dot_macs(eqn)
        elif name == "conv_general_dilated":
            total += _conv_macs(eqn)
        elif name == "cond":
            total += max(_jaxpr_macs(b) for b in eqn.params["branches"])
        else:
            inner = sum(_jaxpr_macs(j) for v in eqn.params.values() for j in _sub_jaxprs(v))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


def _dot_macs(eqn) -> int:
    lhs = eqn.invars[0].aval.shape
    (lhs_contract, _), _ = eqn.params["dimension_numbers"]
    out = eqn.outvars[0].aval.shape
    return math.prod(out) * math.prod(lhs[d] for d in lhs_contract)


def _conv_macs(eqn) -> int:
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    out = eqn.outvars[0].aval.shape
    in_features = rhs[dn.rhs_spec[1]]
    taps = [rhs[d] for d in dn.rhs_spec[2:]]
    out_spatial = [out[d] for d in dn.out_spec[2:]]
    batch_x_out_features = math.prod(out) // math.prod(out_spatial)
    # Per spatial axis, the (output position, tap) pairs; with an input
    # dilation (a strided transposed convolution) the pairs that land on an
    # inserted zero are left out: they are an artefact of the lowering.
    pairs = 1
    for ax, (size_out, k) in enumerate(zip(out_spatial, taps)):
        dil = p["lhs_dilation"][ax]
        if dil == 1:
            pairs *= size_out * k
            continue
        span = (lhs[dn.lhs_spec[2 + ax]] - 1) * dil          # last real input position
        pos = (np.arange(size_out)[:, None] * p["window_strides"][ax]
               + np.arange(k)[None, :] * p["rhs_dilation"][ax] - p["padding"][ax][0])
        inserted_zero = (pos > 0) & (pos < span) & (pos % dil != 0)
        pairs *= int(np.sum(~inserted_zero))
    return batch_x_out_features * pairs * in_features
