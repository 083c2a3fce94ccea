"""Argument normalisation and validation shared by the functional ops.

Every helper takes the op's name so that an error says which call was wrong
(``"conv2d: ..."``).  All checks run on static Python values and shapes, so
they fire at trace time.
"""
from __future__ import annotations

import contextlib
import functools
import numbers
import threading

import jax
import numpy as np

IMPLS = ("auto", "xla", "pallas")

Pads = tuple[tuple[int, int], tuple[int, int]]


def is_int(value) -> bool:
    # bool is an Integral too, but `stride=True` is surely a mistake.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_int_pair(value) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(is_int(v) for v in value)


def pair(value, name: str, op: str, *, minimum: int = 1) -> tuple[int, int]:
    """``(a, b)`` from an int or a pair of ints, each at least ``minimum``."""
    if is_int(value):
        out = (int(value), int(value))
    elif _is_int_pair(value):
        out = (int(value[0]), int(value[1]))
    else:
        raise ValueError(f"{op}: {name} must be an int or a pair of ints, got {value!r}")
    if min(out) < minimum:
        raise ValueError(f"{op}: {name} must be >= {minimum}, got {value!r}")
    return out


def padding_spec(padding, op: str, *, allow_strings: bool = True) -> str | Pads:
    """``"SAME"``, ``"VALID"`` or explicit ``((top, bottom), (left, right))``.

    Accepts an int (all four sides), ``(ph, pw)`` (symmetric per axis), the
    explicit nested form, or the strings ``"SAME"``/``"VALID"`` (any case).
    """
    if isinstance(padding, str):
        if allow_strings and padding.upper() in ("SAME", "VALID"):
            return padding.upper()
    elif is_int(padding) or _is_int_pair(padding):
        ph, pw = pair(padding, "padding", op, minimum=0)
        return ((ph, ph), (pw, pw))
    elif (isinstance(padding, (tuple, list)) and len(padding) == 2
          and all(_is_int_pair(p) for p in padding)):
        pads = tuple((int(lo), int(hi)) for lo, hi in padding)
        if min(min(p) for p in pads) < 0:
            raise ValueError(f"{op}: padding must be non-negative, got {padding!r}")
        return pads
    forms = "an int, (ph, pw), ((top, bottom), (left, right))"
    forms += ", 'SAME' or 'VALID'" if allow_strings else ""
    raise ValueError(f"{op}: padding must be {forms}; got {padding!r}")


def explicit_pads(spec: str | Pads, in_hw, window_hw, stride_hw) -> Pads:
    """Resolves ``"SAME"``/``"VALID"`` to per-side pads with XLA's meaning.

    ``"SAME"`` gives ``ceil(size / stride)`` outputs, padding the total needed
    split with the extra element (if odd) at the end; ``window_hw`` is the
    dilated window extent.
    """
    if spec == "VALID":
        return ((0, 0), (0, 0))
    if spec == "SAME":
        pads = []
        for n, k, s in zip(in_hw, window_hw, stride_hw):
            out = -(-n // s)
            total = max((out - 1) * s + k - n, 0)
            pads.append((total // 2, total - total // 2))
        return tuple(pads)
    return spec


def dilated(kernel_hw, dilation_hw) -> tuple[int, int]:
    """Extent of a dilated window: ``(k - 1) * d + 1`` per axis."""
    return tuple((k - 1) * d + 1 for k, d in zip(kernel_hw, dilation_hw))


def check_window_fits(op: str, x_shape, window_hw, pads: Pads, what: str = "window") -> None:
    """Raises if the (dilated) window is larger than the padded input."""
    padded = tuple(n + lo + hi for n, (lo, hi) in zip(x_shape[1:3], pads))
    if any(k > p for k, p in zip(window_hw, padded)):
        raise ValueError(
            f"{op}: {what} {tuple(window_hw)} (dilated extent) is larger than the padded "
            f"input {padded} (x shape {tuple(x_shape)}, padding {pads})")


def check_rank(op: str, name: str, shape, rank: int, layout: str) -> None:
    """Raises unless ``shape`` has ``rank`` dimensions."""
    if len(shape) != rank:
        raise ValueError(f"{op}: {name} must have rank {rank} {layout}, got shape {tuple(shape)}")


def check_impl(op: str, impl: str) -> str:
    """Returns ``impl`` after checking it is one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    return impl


_scope = threading.local()


@contextlib.contextmanager
def scoped_default(name: str, value: str):
    """Within the block, :func:`scoped` ``(name)`` is ``value`` (per thread, nestable)."""
    saved = scoped(name)
    setattr(_scope, name, value)
    try:
        yield
    finally:
        setattr(_scope, name, saved)


def scoped(name: str) -> str:
    """The innermost :func:`scoped_default` value of ``name`` in this thread, or ``"auto"``."""
    return getattr(_scope, name, "auto")


@contextlib.contextmanager
def default_impl(impl: str):
    """Within the block (at trace time), ops called with ``impl="auto"`` use ``impl``.

    Lets a whole model, whose layers call the ops with the default ``"auto"``,
    be traced with ``"xla"`` or ``"pallas"`` kernels, e.g. to compare the two::

        with F.default_impl("xla"):
            step = jax.jit(train_step).lower(state, batch).compile()

    An explicit ``impl="xla"`` or ``"pallas"`` in a call is left as given.  On
    the CPU, ``"xla"`` here also keeps the CPU lowerings of ``"auto"``.  A function
    JAX has already traced with the same argument shapes outside the block keeps its
    cached trace: trace a fresh function object to compare.
    """
    check_impl("default_impl", impl)
    with scoped_default("impl", impl):
        yield


def pallas_op(op: str, impl: str, arrays, static: dict):
    """The Pallas kernel to run for this call, or None to run XLA.

    ``"pallas"`` always picks ``pallas_kernels.<op>`` (interpreted off GPUs);
    ``"auto"`` picks it only where its autotuner measured it faster than XLA
    for this shape on this GPU kind (never on CPU), unless :func:`default_impl`
    says otherwise; ``"xla"`` never does.
    """
    if check_impl(op, impl) == "auto":
        impl = scoped("impl")
    if impl == "xla":
        return None
    # Imported here: pallas_kernels itself imports jaxcnn.functional.
    import pallas_kernels
    kernel = functools.partial(getattr(pallas_kernels, op), **static)
    if impl == "pallas":
        return kernel
    forward, training = pallas_kernels.autotune.prefers_pallas(op, arrays, static)
    if forward == training:
        return kernel if forward else None
    from jaxcnn import functional  # the XLA form of the same call
    xla = functools.partial(getattr(functional, op), **static, impl="xla")
    return _split_by_use(kernel if forward else xla, xla if forward else kernel)


def _split_by_use(primal, trained):
    """Runs ``primal`` where the op is not differentiated, and ``trained`` with its own
    backward where it is (each chosen where the autotuner measured it faster)."""
    @jax.custom_vjp
    def run(*arrays):
        return primal(*arrays)

    def run_fwd(*arrays):
        return jax.vjp(trained, *arrays)  # the VJP closure is a pytree of residuals

    def run_bwd(vjp, ct):
        return vjp(ct)

    run.defvjp(run_fwd, run_bwd)
    return run


def lowest(dtype):
    """The identity of ``max`` for ``dtype``: -inf for floats, the minimum for ints."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return np.array(np.iinfo(dtype).min, dtype)
    return np.array(-np.inf, dtype)
