"""The records of ``scripts/gpu_check.py`` and the summary made from them (no JAX here: the
parent process reads and writes these without starting a backend on the GPU).

Each line of ``gpu_check.jsonl`` is one JSON record with ``stage``, ``kind`` and ``time``:

- ``run``: the command, budget and versions of the check itself (the parent);
- ``stage``: a stage's end: ``status`` ``ok``, ``failed`` (with the exit status and the
  log's tail) or ``timeout``, its ``seconds`` and ``limit_s``, and its ``launches``;
- ``unit``: a unit ``started``, ``done``, ``failed`` (with the error) or ``crashed``;
- ``env``, ``correct``, ``step``, ``conv``, ``fused``, ``window``, ``batchnorm``,
  ``bandwidth``: figures;
- ``skip``: a unit not run, and why.

A figure or finished unit carried over from an earlier check (``--resume``) has
``carried``: that check's date.

:func:`summary` turns them into ``gpu_check.md``, a section ready for ``docs/BENCHMARKS.md``.
"""
from __future__ import annotations

import datetime
import json
import os

JSONL = "gpu_check.jsonl"
RELAUNCH = 3  # a stage's exit status asking the parent to start it again


FIGURES = ("correct", "step", "conv", "fused", "window", "batchnorm", "bandwidth")
# What must be equal for an earlier check's figures to stand for this one's.
SAME_RUN = ("device_kind", "compute_capability", "jax", "jaxlib", "triton", "torch")


def env_of(records) -> dict:
    """The ``env`` records merged: the device and versions the check ran on."""
    env = {}
    for r in records:
        if r.get("kind") == "env":
            env.update(r)
    return env


def carries(record: dict) -> bool:
    """Whether ``--resume`` carries ``record`` over: a figure, or a unit that finished."""
    kind = record.get("kind")
    return kind in FIGURES or (kind == "unit" and record.get("status") == "done")


def _label(record: dict, text: str) -> str:
    """``text``, with the date of the check it was carried over from."""
    return f"{text} ({record['carried']})" if record.get("carried") else text


def read_records(path: str) -> list:
    """The records of a ``gpu_check.jsonl``; a torn last line (the writer killed mid-line) is
    left out."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def append_record(path: str, record: dict) -> None:
    """Appends one record and makes it durable before returning (fsync): a kill right after
    loses nothing already measured."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _f(v, fmt: str = ".2f") -> str:
    return "n/a" if v is None else format(v, fmt)


def _table(header, rows) -> list:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def _of(records, kind) -> list:
    return [r for r in records if r.get("kind") == kind]


def _env_lines(records) -> list:
    env = env_of(records)
    run = (_of(records, "run") or [{}])[0]
    smi = env.get("nvidia_smi", "not run")
    return [
        f"Device: {env.get('device_kind', 'unknown')} x{env.get('device_count', '?')} "
        f"(compute capability {env.get('compute_capability')}; nvidia-smi: {smi}). "
        f"CUDA runtime {env.get('cuda_runtime')}, driver {env.get('cuda_driver')}, "
        f"cuDNN {env.get('cudnn')}.",
        f"Software: Python {env.get('python')}, jax {env.get('jax')}, jaxlib "
        f"{env.get('jaxlib')}, Triton {env.get('triton')}, torch {env.get('torch')} "
        f"(CUDA {env.get('torch_cuda')}, cuDNN {env.get('torch_cudnn')}), flax "
        f"{env.get('flax')}, optax {env.get('optax')}; Mosaic GPU: {env.get('mosaic')}.",
        "", f"    {run.get('command', 'python scripts/gpu_check.py')}", ""] + (
        ["Rows with a date in brackets were measured by the check of that date on the same "
         "device and versions, carried over (`--resume`), not measured again.", ""]
        if any(r.get("carried") for r in records) else [])


def _stage_lines(records) -> list:
    rows = [(r["stage"], r["status"], _f(r.get("seconds"), ".0f"), _f(r.get("limit_s"), ".0f"),
             r.get("launches", 1)) for r in _of(records, "stage")]
    return _table(("stage", "status", "seconds", "limit s", "processes"), rows)


def _correct_lines(records) -> list:
    rows = [(_label(r, r["family"]), "ok" if r.get("ok") else "**WRONG**", _f(r.get("fwd_err"), ".1e"),
             ", ".join(_f(e, ".1e") for e in r.get("grad_errs", [])) or r.get("error", "")[:80])
            for r in _of(records, "correct")]
    return _table(("family", "verdict", "forward error", "gradient errors"), rows)


def _step_lines(records) -> list:
    steps = _of(records, "step")
    base = next((r["step_ms"] for r in steps if r.get("framework") == "jaxcnn"), None)
    rows = []
    for r in steps:
        name = r["framework"] if r["framework"] != "jaxcnn" else (
            f"jaxcnn impl={r['impl']} bn_grad={r['bn_grad']} conv_bn={r['conv_bn']}")
        rows.append((_label(r, name), _f(r["step_ms"]), _f(r["img_s"], ",.0f"),
                     "n/a" if r.get("mfu") is None else f"{100 * r['mfu']:.1f}%",
                     _f(r["step_ms"] / base) if base else "n/a"))
    title = f"{steps[0]['model']}, batch {steps[0]['batch']}, bfloat16" if steps else ""
    return [title, ""] + _table(("step", "ms", "img/s", "MFU", "time / first row"), rows)


def _race_lines(records, kind) -> list:
    rows = []
    for r in _of(records, kind):
        label = _label(r, " ".join(str(r[k]) for k in ("name", "form") if k in r))
        extra = (f"{_f(r.get('mosaic_tflops'), '.0f')} / {_f(r.get('mosaic_grad_tflops'), '.0f')}"
                 if kind == "conv" else
                 _f(r.get("mosaic_bandwidth_fraction")) if kind == "window" else
                 f"{_f(r.get('mosaic_gb_s'), ',.0f')} / {_f(r.get('mosaic_grad_gb_s'), ',.0f')}"
                 if kind == "batchnorm" else "")
        rows.append((label, _f(r["mosaic_ms"], ".3f"), _f(r["xla_ms"], ".3f"),
                     _f(r["fwd_ratio"]), _f(r.get("mosaic_grad_ms"), ".3f"),
                     _f(r.get("xla_grad_ms"), ".3f"), _f(r.get("grad_ratio")), extra,
                     "; ".join(f"{k.split('|')[0]} {v}" for k, v in r.get("tiles", {}).items())))
    extra = {"conv": "TFLOP/s fwd / fwd+bwd", "window": "of bandwidth", "fused": "",
             "batchnorm": "GB/s stats / sums"}[kind]
    return _table(("shape", "fwd ms", "XLA ms", "XLA/ours", "fwd+bwd ms", "XLA ms",
                   "XLA/ours", extra, "tiles"), rows)


def _problem_lines(records) -> list:
    lines = []
    for r in records:
        if r.get("kind") == "unit" and r["status"] in ("failed", "crashed"):
            lines.append(f"- {r['stage']} / {r['unit']}: {r['status']}"
                         + (f": {r['error'].splitlines()[0][:300]}" if r.get("error") else ""))
        elif r.get("kind") == "skip":
            lines.append(f"- {r['stage']} / {r['unit']}: skipped: {r['reason']}")
        elif r.get("kind") == "stage" and r["status"] != "ok":
            lines.append(f"- stage {r['stage']}: {r['status']}"
                         + (f" (exit {r['rc']})" if r.get("rc") is not None else ""))
    return lines or ["None."]


def summary(records, date: str | None = None) -> str:
    """``gpu_check.md``: a dated section for ``docs/BENCHMARKS.md`` made from the records."""
    env = env_of(records)
    date = date or datetime.date.today().isoformat()
    parts = [f"## {env.get('device_kind', 'unknown device')} (scripts/gpu_check.py, {date})", ""]
    parts += _env_lines(records)
    parts += ["### Stages", ""] + _stage_lines(records) + [""]
    parts += ["### Correctness on the device (bfloat16 against float32 XLA)", ""]
    parts += _correct_lines(records) + [""]
    parts += ["### Training step", ""] + _step_lines(records) + [""]
    parts += ["### Dense convolution against XLA (cuDNN)", ""] + _race_lines(records, "conv")
    parts += ["", "### BatchNorm fused into the convolution against the unfused XLA chain", ""]
    parts += _race_lines(records, "fused")
    parts += ["", "### Pooling and depthwise against XLA", ""] + _race_lines(records, "window")
    parts += ["", "### Training BatchNorm's reductions against XLA (fwd: statistics; "
              "fwd+bwd columns: the backward's sums)", ""] + _race_lines(records, "batchnorm")
    parts += ["", "### Failures, timeouts and skips", ""] + _problem_lines(records) + [""]
    return "\n".join(parts)
