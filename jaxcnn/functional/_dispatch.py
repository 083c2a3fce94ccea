"""Which implementation runs an op call: XLA, a CPU rewrite or a Pallas kernel.

:func:`choose` is the one place that decides, and it only looks things up:
the ``impl`` argument (an argument, never a scope, so a cached trace cannot
hold a stale choice), the platform, and on
a GPU the tuned verdicts (:func:`pallas_kernels.autotune.verdict`, the
user's cache over the shipped table, keyed by device kind).  It never times
or compiles anything, so it is safe inside any trace; tuning runs only when
asked (:mod:`jaxcnn.functional.tuning`, ``scripts/bench_kernels.py --tune``).
:mod:`pallas_kernels` is imported only where a kernel can run: on a GPU, or
for ``impl="pallas"``.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxcnn import _geometry as geo
from jaxcnn.functional import _channels, _cpu_lowering

IMPLS = ("auto", "xla", "pallas")

_recorders: list = []


def check_impl(op: str, impl: str) -> str:
    """Returns ``impl`` after checking it is one of :data:`IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    return impl


def layer_impl(impl: str) -> str:
    """The ops' ``impl`` argument for a layer-level choice (``Choices.impl``).

    ``"auto"`` and ``"pallas"`` pass through.  ``"xla"`` at the layer level rules out
    the kernels only: on the CPU it is the ops' ``"auto"`` (XLA with the CPU
    lowerings of :mod:`._cpu_lowering`, never a kernel there), elsewhere the ops'
    ``"xla"`` (no tuned-kernel lookup).
    """
    check_impl("Choices", impl)
    if impl == "xla" and _platform() == "cpu":
        return "auto"
    return impl


@contextlib.contextmanager
def recording():
    """Within the block, every call that :func:`choose` would look up in the tuned
    table is appended to the yielded list as ``(op, arrays, static)``, in the form
    the lookup uses (how :mod:`jaxcnn.functional.tuning` learns a function's calls)."""
    seen: list = []
    _recorders.append(seen)
    try:
        yield seen
    finally:
        _recorders.remove(seen)


def choose(op: str, impl: str, arrays, static: dict):
    """The function that runs this call of ``op``, or None for XLA's plain lowering.

    Arguments:
        op: ``"conv2d"``, ``"max_pool2d"`` or ``"avg_pool2d"``.
        impl: the call's ``impl`` argument.
        arrays: the op's array arguments (``(x, w, b)`` or ``(x,)``).
        static: its validated keyword arguments, one form per call (the cache key).

    Returns:
        A function of ``arrays``: the Pallas kernel (for ``"pallas"``, or
        ``"auto"`` on a GPU where the tuned verdict says it is faster, split
        between inference and training when only one of them wins), the CPU
        rewrite (``"auto"`` on a CPU, for the shapes :mod:`._cpu_lowering`
        covers), or None.
    """
    if check_impl(op, impl) == "pallas":
        return _kernel(op, static)
    if impl != "auto":
        return None
    for seen in _recorders:
        seen.append((op, tuple(arrays), dict(static)))
    if not _recorders and _platform() == "gpu":
        kernel = _tuned_kernel(op, arrays, static)
        if kernel is not None:
            return kernel
    if _platform() == "cpu":
        return _cpu_rewrite(op, arrays, static)
    return None


def _platform() -> str:
    return jax.default_backend()


def _kernel(op: str, static: dict):
    import pallas_kernels  # only here: where a kernel runs
    return functools.partial(getattr(pallas_kernels, op), **static)


def _tuned_kernel(op: str, arrays, static: dict):
    """The kernel where the tuned verdict for this call on this device kind prefers it.

    A verdict names the kernel backend it measured: entries keyed with
    ``backend="mosaic"`` (the Hopper kernels) are looked up first, then the plain
    entries, which measured the Triton kernels and so pin ``backend="triton"``: no
    kernel is chosen without a measurement of that kernel.  (The Mosaic kernels take
    16-bit floats only: other calls have no Mosaic entry to look up.)
    """
    from pallas_kernels import autotune
    mosaic = {**static, "backend": "mosaic"}
    verdict = None
    if jnp.dtype(arrays[0].dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        verdict = autotune.verdict(op, arrays, mosaic)
    static = mosaic if verdict is not None else {**static, "backend": "triton"}
    if verdict is None:
        verdict = autotune.verdict(op, arrays, {k: v for k, v in static.items()
                                                 if k != "backend"})
    if verdict is None or verdict == (False, False):
        return None
    forward, training = verdict
    kernel = _kernel(op, static)
    if forward and training:
        return kernel
    from jaxcnn import functional  # the XLA form of the same call
    xla_static = {k: v for k, v in static.items() if k != "backend"}
    xla = functools.partial(getattr(functional, op), **xla_static, impl="xla")
    return _split_by_use(kernel if forward else xla, xla if forward else kernel)


def _split_by_use(primal, trained):
    """Runs ``primal`` where the op is not differentiated, and ``trained`` with its own
    backward where it is (each chosen where the tuner measured it faster)."""
    @jax.custom_vjp
    def run(*arrays):
        return primal(*arrays)

    def run_fwd(*arrays):
        return jax.vjp(trained, *arrays)  # the VJP closure is a pytree of residuals

    def run_bwd(vjp, ct):
        return vjp(ct)

    run.defvjp(run_fwd, run_bwd)
    return run


def _cpu_rewrite(op: str, arrays, static: dict):
    if op == "conv2d":
        x, w, _ = arrays
        conv = _cpu_lowering.conv2d_rewrite(x, w, stride=static["stride"], pads=static["padding"],
                                            dilation=static["dilation"], groups=static["groups"])
        return None if conv is None else lambda x, w, b: _channels.add_bias(conv(x, w), b)
    if op == "max_pool2d":
        (x,) = arrays
        kernel, stride, dilation, _, run_pads, out_hw = geo.pool_geometry(
            op, x.shape, static["kernel_size"], static["stride"], static["padding"],
            static["dilation"], static["ceil_mode"])
        return _cpu_lowering.max_pool2d_rewrite(x, kernel, stride, dilation, run_pads, out_hw)
    return None


def batch_norm_kernels(impl: str, x, *, relu: bool = False) -> tuple[bool, bool]:
    """Whether training BatchNorm's explicit form takes ``(its statistics, its backward
    sums)`` of ``x`` from the Mosaic GPU kernels (:mod:`pallas_kernels.mgpu_bn`).

    Only on a Hopper GPU with jax >= 0.11, for a supported dtype and row width; elsewhere
    neither, whatever ``impl`` (off a GPU the Mosaic GPU interpreter cannot run them under
    ``jax.checkpoint`` or on several devices at once, both of which a model's BatchNorm
    meets; :mod:`pallas_kernels.mgpu_bn` runs them in interpret mode when called directly).
    There, ``"xla"``: neither; ``"pallas"``: both; ``"auto"``: each where the tuned verdict
    for op ``"batch_norm"`` at ``x``'s shape and dtype (keyed ``backend="mosaic"`` and
    ``relu``: the backward's sums differ with the mask) says the kernel was measured faster
    (forward: the statistics; training: the sums).  A pure lookup, safe inside any trace;
    nothing is recorded for tuning (the GPU check measures these calls,
    ``scripts/_gpu_check_stages.py``).
    """
    if check_impl("batch_norm_train", impl) == "xla" or _platform() != "gpu":
        return False, False
    from jaxcnn.errors import KernelUnsupported
    from pallas_kernels import mgpu_bn, mgpu_window  # only here: where a kernel may run
    if not mgpu_window.on_hopper():
        return False, False
    try:
        mgpu_bn.check_supported("batch_norm_train", jnp.shape(x), x.dtype)
    except KernelUnsupported:
        return False, False
    if impl == "pallas":
        return True, True
    from pallas_kernels import autotune
    return autotune.verdict("batch_norm", (x,), {"backend": "mosaic", "relu": bool(relu)}) \
        or (False, False)
