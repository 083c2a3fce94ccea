"""glibc ``malloc`` settings that keep XLA:CPU's per-step buffers mapped.

XLA:CPU allocates every intermediate of a step in one large block on each run and frees it
after; glibc maps and unmaps blocks that large, so every step faults its pages in again.
:func:`configure_malloc` asks glibc (``mallopt``) to keep that memory: one arena
(``M_ARENA_MAX = 1``), large blocks from the heap (``M_MMAP_MAX = 0``) and trimming only
beyond ``2 GiB - 1``. The price is a caching allocator's, for every host allocation in the
process: its peak heap stays resident.

It acts only where it helps: Linux with glibc, JAX on the CPU only, before any JAX backend
exists, and not when the environment already tunes malloc (``MALLOC_*``, ``GLIBC_TUNABLES``,
``LD_PRELOAD``) or sets ``JAXCNN_CPU_MALLOC=0``. Nothing calls it at import:
:func:`jaxcnn.cpu.configure` does, when asked (the command-line tools and benchmark scripts
ask). This is the one malloc policy of jaxcnn. Why each setting, and when it backfires:
``docs/design/host_memory.md``; what it saves: ``docs/BENCHMARKS.md``.
"""
from __future__ import annotations

import ctypes
import os
import sys

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8

SETTINGS = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2 ** 31 - 1))

_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_",
               "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")

_configured = False
_skipped: str | None = None  # why the last configure_malloc call left malloc alone


def configured() -> bool:
    """Whether :func:`configure_malloc` changed this process's malloc settings."""
    return _configured


def _glibc():
    """The C library as a ``ctypes.CDLL`` if it is glibc, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc
    except (OSError, AttributeError):
        return None


def _backends_initialized() -> bool:
    """Whether a JAX backend already exists (True when that cannot be told)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):
        return True


def _accelerator_plugin() -> bool:
    """Whether a JAX accelerator plugin (CUDA, ROCm, TPU) is installed."""
    import importlib.metadata
    import importlib.util

    try:
        if any(importlib.util.find_spec(m) is not None for m in ("jax_plugins", "libtpu")):
            return True
        return bool(importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # noqa: BLE001  (a broken installation must not break the import)
        return True


def environment_reason(environ=os.environ) -> str | None:
    """How the environment already sets up malloc (``MALLOC_*`` or ``glibc.malloc``
    tunables, or ``LD_PRELOAD`` bringing another allocator), or None."""
    if any(k in environ for k in _MALLOC_ENV) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return "the environment already tunes malloc"
    if environ.get("LD_PRELOAD"):
        return "LD_PRELOAD is set (another allocator?)"
    return None


def skip_reason(environ=os.environ) -> str | None:
    """Why :func:`configure_malloc` would leave malloc alone here, or None."""
    if environ.get("JAXCNN_CPU_MALLOC", "1") == "0":
        return "JAXCNN_CPU_MALLOC=0"
    tuned = environment_reason(environ)
    if tuned is not None:
        return tuned
    platforms = environ.get("JAX_PLATFORMS", "")
    if platforms and [p.strip() for p in platforms.split(",") if p.strip()] != ["cpu"]:
        return f"JAX_PLATFORMS={platforms}"
    if _glibc() is None:
        return "not Linux with glibc"
    if _backends_initialized():
        return "a JAX backend already exists"
    if not platforms and _accelerator_plugin():
        return "an accelerator plugin is installed"
    return None


def configure_malloc(environ=os.environ, mallopt=None) -> bool:
    """Applies :data:`SETTINGS` with ``mallopt`` unless :func:`skip_reason` gives a reason.

    Arguments:
        environ: the environment to read.
        mallopt: ``mallopt(param, value) -> int`` to call (default: glibc's).

    Returns:
        True when every setting was applied.
    """
    global _configured
    if skip_reason(environ) is not None:
        return False
    if mallopt is None:
        mallopt = _glibc().mallopt
    ok = all([mallopt(param, value) == 1 for param, value in SETTINGS])
    _configured = _configured or ok
    return ok


def give_back_free_memory() -> bool:
    """Returns the heap's free pages to the system (glibc ``malloc_trim(0)``) when
    :func:`configure_malloc` changed this process's malloc; otherwise does nothing (glibc's
    defaults give large blocks back by themselves).

    For work that interleaves large short-lived allocations with XLA's runs: between two
    forward passes ``jaxcnn-predict`` decodes photos of tens of MB each, which land in the
    holes XLA's freed buffer left, so the next buffer grows the heap; nothing above is ever
    trimmed, and 1,000 12-megapixel photos took 1.26 GB where 10 took 0.52 GB. Called after
    each batch, it keeps the resident memory where 10 photos put it, at no measurable cost
    (``docs/design/host_memory.md``).

    Returns:
        Whether it trimmed.
    """
    if not _configured:
        return False
    _glibc().malloc_trim(0)
    return True


def apply(environ=os.environ) -> str:
    """:func:`configure_malloc` for :func:`jaxcnn.cpu.configure`: ``"jaxcnn"`` when the
    settings were applied (now or before), else why not."""
    global _skipped
    if _configured:
        return "jaxcnn"
    reason = skip_reason(environ)
    if reason is None:
        reason = None if configure_malloc(environ) else "glibc refused a mallopt setting"
    _skipped = reason
    return reason or "jaxcnn"


def status(environ=os.environ) -> str:
    """How this process's malloc is set: ``"jaxcnn"`` (applied), why :func:`apply` left it
    alone, the environment's opt-out or own tuning, or ``"default"`` (never asked)."""
    if _configured:
        return "jaxcnn"
    if _skipped is not None:
        return _skipped
    if environ.get("JAXCNN_CPU_MALLOC", "1") == "0":
        return "JAXCNN_CPU_MALLOC=0"
    return environment_reason(environ) or "default"
