"""Process-wide CPU settings for speed, made only when asked: :func:`configure`.

``import jaxcnn`` changes nothing in the process.  Two settings make XLA:CPU
training faster, and both act on the whole process, so they are an explicit call,
made before any JAX computation::

    import jaxcnn.cpu
    jaxcnn.cpu.configure()   # before JAX creates its backend (the first computation)

``jaxcnn-train``, ``jaxcnn-eval``, ``jaxcnn-export`` and the benchmark scripts make it.

- ``xla_flags``: appends ``--xla_cpu_experimental_ynn_fusion_type=individual_dot`` to
  ``os.environ["XLA_FLAGS"]``, which keeps convolutions off YNNPACK
  (:mod:`jaxcnn.functional._cpu_lowering`).  Child processes inherit ``XLA_FLAGS``; an XLA
  of another version than the checked ones aborts on a flag it does not know, so the flag is
  added only for the jaxlib versions where it was checked.  Not when ``XLA_FLAGS`` already
  sets that flag, or ``JAXCNN_CPU_XLA_FLAGS=0``.  Without it, ``impl="auto"`` still rewrites
  the convolutions that XLA would give YNNPACK.
- ``malloc``: glibc ``mallopt`` settings that keep XLA:CPU's per-step buffers mapped (one
  arena, no ``mmap``, no trim below 2 GiB; :mod:`jaxcnn._host_memory` says why and what they
  cost).  Only on Linux with glibc, JAX on the CPU only, and not when the environment already
  tunes malloc or sets ``JAXCNN_CPU_MALLOC=0``.

Called after a JAX backend exists, it changes nothing (XLA has read its flags, and XLA's
threads already own their malloc arenas) and says so in its result; it never raises.
"""
from __future__ import annotations

import os

from jaxcnn import _host_memory

__all__ = ["configure"]

APPLIED = "jaxcnn"


def _configure_xla_flags(environ) -> str:
    if _host_memory._backends_initialized():
        return "a JAX backend already exists"
    from jaxcnn.functional import _cpu_lowering
    reason = _cpu_lowering.xla_flags_skip_reason(environ)
    if reason is not None:
        return reason
    return APPLIED if _cpu_lowering.configure_xla_flags(environ) else "not added"


def configure(*, malloc: bool = True, xla_flags: bool = True) -> dict:
    """Applies jaxcnn's CPU settings to this process, where they help and are safe.

    Call it once, first thing, before any JAX computation (importing JAX and jaxcnn
    before it is fine).  See the module docstring for what each setting does.

    Arguments:
        malloc: set glibc's malloc policy (``mallopt``).
        xla_flags: add jaxcnn's XLA:CPU flag to ``os.environ["XLA_FLAGS"]``.

    Returns:
        ``{"malloc": ..., "xla_flags": ...}``: ``"jaxcnn"`` for a setting that was applied,
        else why not (``"not asked"``, ``"a JAX backend already exists"``,
        ``"JAXCNN_CPU_MALLOC=0"``, ...).
    """
    environ = os.environ
    result = {}
    try:
        result["malloc"] = (_host_memory.apply(environ) if malloc else "not asked")
    except Exception as e:  # noqa: BLE001  (a speed setting must never break a program)
        result["malloc"] = f"failed: {type(e).__name__}: {e}"
    try:
        result["xla_flags"] = _configure_xla_flags(environ) if xla_flags else "not asked"
    except Exception as e:  # noqa: BLE001
        result["xla_flags"] = f"failed: {type(e).__name__}: {e}"
    return result


def malloc_status() -> str:
    """How this process's malloc is set, for ``run_meta.json``'s ``host_malloc``:
    ``"jaxcnn"`` after :func:`configure` applied it, else why not."""
    return _host_memory.status()
