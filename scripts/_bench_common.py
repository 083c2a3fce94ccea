"""What the kernel benchmark and inspection scripts share.

``bench_kernels.py``, ``bench_mgpu.py``, ``bench_mgpu_window.py`` and ``inspect_kernels.py``
take the same options for choosing shapes, refuse (or, with ``--force``, smoke-test) a CPU
backend the same way, time a forward or forward + backward the same way, and report a
shape that failed as a row and go on.  Each imports this module as a sibling::

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    try:
        import _bench_common as bc
    finally:
        sys.path.pop(0)

(``scripts/`` is on the path only while it does: the tests load the scripts by file.)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import autotune

HERE = os.path.dirname(os.path.abspath(__file__))


def load_script(name: str):
    """``scripts/<name>.py`` as a module (e.g. ``bench_kernels``, for its shapes)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def add_options(parser: argparse.ArgumentParser, groups, *, timing: bool = True) -> None:
    """``--groups`` (a comma-separated subset of ``groups``), ``--batch`` and ``--json``; with
    ``timing``, also ``--force`` (time on a CPU backend), ``--repeats`` and ``--no-grad``."""
    if timing:
        parser.add_argument("--force", action="store_true", help="run even on a CPU backend")
    parser.add_argument("--groups", default=",".join(groups),
                        help=f"comma-separated subset of {groups}")
    parser.add_argument("--batch", type=int, help="batch size N of every shape")
    if timing:
        parser.add_argument("--repeats", type=int, default=20)
        parser.add_argument("--no-grad", action="store_true", help="time the forward pass only")
    parser.add_argument("--json", help="also write the rows here")


def chosen_groups(parser: argparse.ArgumentParser, opts, groups) -> list:
    """The groups ``--groups`` names; an unknown one is a usage error (exit 2)."""
    chosen = [g for g in opts.groups.split(",") if g]
    unknown = sorted(set(chosen) - set(groups))
    if unknown:
        parser.error(f"unknown group(s) {unknown}; choose from {groups}")
    return chosen


def not_a_benchmark(force: bool, runs_in: str) -> bool:
    """Whether to stop (having said why): the default backend is no GPU, so the kernels would
    run in ``runs_in`` (an interpreter), and ``--force`` was not given."""
    backend = jax.default_backend()
    if backend == "gpu" or force:
        return False
    print(f"backend is {backend!r}: the kernels would run in {runs_in}, which is not a "
          "benchmark. Pass --force to time it anyway.")
    return True


def mosaic_preflight(script: str, force: bool) -> int | None:
    """None where a Mosaic GPU benchmark may go on; else its exit status, having said why: 2
    where this jax cannot build the kernels or the GPU is not a Hopper one, 0 on a CPU
    backend without ``--force``."""
    from pallas_kernels import mgpu_conv as mc
    reason = mc.unavailable_reason()
    if reason is not None:
        print(f"{script}: {reason}", file=sys.stderr)
        return 2
    if not_a_benchmark(force, "interpret mode"):
        return 0
    kind = autotune.device_kind()
    if jax.default_backend() == "gpu" and not mc.is_hopper(kind):
        print(f"{script}: {kind} is not a Hopper GPU; the Mosaic kernels need sm_90",
              file=sys.stderr)
        return 2
    return None


def versions(kind: str, dtype) -> str:
    """The header line naming the device kind, the jax and Python versions and the dtype."""
    return (f"device: {kind}  jax {jax.__version__}  python {platform.python_version()}  "
            f"dtype: {jnp.dtype(dtype).name}")


def grad_of(fn, argnums):
    """Jitted gradient, with respect to ``argnums``, of the sum of squares of ``fn``'s output
    (in float32): the forward and backward of ``fn``."""
    def loss(*a):
        return jnp.sum(fn(*a).astype(jnp.float32) ** 2)
    return jax.jit(jax.grad(loss, argnums=tuple(argnums)))


def time_fn(fn, args, repeats: int, grad: bool) -> float:
    """Median seconds of ``jit(fn)(*args)``, or with ``grad`` of its forward and backward
    with respect to every argument (:func:`pallas_kernels.autotune.time_call`)."""
    f = grad_of(fn, range(len(args))) if grad else jax.jit(fn)
    return autotune.time_call(f, *args, repeats=repeats)


def rel_err(got, ref) -> float:
    """Largest difference of ``got`` from ``ref`` relative to ``ref``'s largest value."""
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def failure(label: str, e: Exception, **row) -> dict:
    """Prints ``label FAILED: <error>`` (its first line) and returns ``row`` with the error:
    one shape's failure reported, the others still run."""
    first = (str(e).splitlines() or [""])[0]
    print(f"{label} FAILED: {type(e).__name__}: {first[:200]}")
    return {**row, "error": f"{type(e).__name__}: {e}"[:2000]}


def write_json(path: str | None, data: dict) -> None:
    """Writes ``data`` to ``path`` (``--json``), if given."""
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
