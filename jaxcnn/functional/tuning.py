"""Tuning the kernel-vs-XLA choice of ``impl="auto"`` for a model's calls, when asked.

``impl="auto"`` only reads the verdicts :mod:`pallas_kernels.autotune`
stores (:mod:`jaxcnn.functional._dispatch`); this module writes them.  It
finds the convolution and pooling calls a function makes, in the form the
ops look them up, and hands :func:`pallas_kernels.autotune.tune_op` each call
with its XLA form to race against.  Run it once per device kind, outside any
trace::

    from jaxcnn.functional import tuning
    tuning.tune_calls(lambda p, s, x: model.apply(p, s, x, train=True), params, state, x)

``scripts/bench_kernels.py --tune`` does the same for the benchmark shapes.
Importing this module imports :mod:`pallas_kernels`.
"""
from __future__ import annotations

import functools

import jax

from jaxcnn import functional
from jaxcnn.functional import _dispatch
from pallas_kernels import autotune


def _abstract(arrays):
    return [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def _calls(fn, *args) -> list:
    """``[(op, arrays, static)]``: the calls ``fn(*args)`` would look up, traced abstractly."""
    with _dispatch.recording() as seen:
        jax.eval_shape(lambda *a: fn(*a), *args)  # a fresh function: never a cached trace
    return seen


def canonical_call(op: str, arrays, static: dict):
    """``(arrays, static)`` as :mod:`jaxcnn.functional`'s ``op`` hands them to the kernel.

    ``jaxcnn.functional.conv2d(x, w, padding=1)`` asks about ``(x, w, None)``
    with ``padding=((1, 1), (1, 1))``, ``stride=(1, 1)``, ...: the form cache
    keys must use, whatever form the caller wrote.  Found by tracing the
    functional op abstractly; calls it does not look up come back unchanged.
    """
    try:
        seen = _calls(lambda *a: getattr(functional, op)(*a, **static, impl="auto"),
                      *_abstract(arrays))
    except (TypeError, ValueError):
        return arrays, static
    for name, got_arrays, got_static in seen:
        if name == op:
            return got_arrays, got_static
    return arrays, static


def tune_op(op: str, arrays, static: dict, **tune_kwargs) -> dict:
    """:func:`pallas_kernels.autotune.tune_op` for a call written in any form the
    functional op accepts, raced against that op's XLA form.

    Arguments:
        op: ``"conv2d"``, ``"max_pool2d"`` or ``"avg_pool2d"``.
        arrays, static: the call's arrays (concrete or abstract) and keyword arguments.
        tune_kwargs: ``timer``, ``candidate_fn`` (see the tuner).

    Returns:
        The op's cache entry, saved under the key ``impl="auto"`` looks up.
    """
    arrays, static = canonical_call(op, arrays, static)
    xla = functools.partial(getattr(functional, op), **static, impl="xla")
    return autotune.tune_op(op, arrays, static, xla=xla, **tune_kwargs)


def tuned_here(op: str, arrays, static: dict) -> bool:
    """Whether the user's cache (not the shipped table) holds a verdict for this op call on
    this device kind: what a resumed tuning run can skip."""
    arrays, static = canonical_call(op, arrays, static)
    mine = autotune.load_cache().get(autotune.device_kind(), {})
    return autotune.op_key(op, arrays, static) in mine.get("ops", {})


def tune_calls(fn, *args, force: bool = False, **tune_kwargs) -> dict:
    """Tunes every convolution and pooling call ``fn(*args)`` makes with ``impl="auto"``.

    ``fn`` is traced abstractly (``jax.eval_shape``; ``args`` may be
    ``jax.ShapeDtypeStruct``), its op calls are collected in the form
    :mod:`jaxcnn.functional` looks them up, and each one with a kernel and
    without a cached verdict (every one with ``force``) is tuned with
    :func:`tune_op`.

    Returns:
        ``{op key: cache entry}`` of the calls tuned now.
    """
    tuned: dict = {}
    for op, arrays, static in _calls(fn, *args):
        key = autotune.op_key(op, arrays, static)
        if key in tuned or not autotune.supported(op, arrays, static):
            continue
        if force or autotune.verdict(op, arrays, static) is None:
            xla = functools.partial(getattr(functional, op), **static, impl="xla")
            tuned[key] = autotune.tune_op(op, arrays, static, xla=xla, **tune_kwargs)
    return tuned
