#!/usr/bin/env python3
"""Every GPU figure that matters, from one time-boxed command (run from the repository root).

    python scripts/gpu_check.py [--budget 480] [--out DIR] [--stages env,correct,...]
    python scripts/gpu_check.py --dry-run --out /tmp/check   # the same code on the CPU, tiny
    python scripts/gpu_check.py --plan-tiles                 # rewrite gpu_check_tiles.json
    python scripts/gpu_check.py --merge DIR/autotune.json    # into pallas_kernels/tuned.json

The stages run in priority order (:data:`STAGES`), each in its own process, with a time
limit of its share of what remains of the budget (so time a stage leaves unused goes to the
ones after it, and the limits add up to the budget).  A stage that overruns is killed and
recorded as a timeout; one that fails is recorded with its log's tail; the next stage runs
either way.  Within a stage, a unit (a kernel family, a step variant, a shape) that raises
ends its process, and the stage starts again for the units left while its limit allows
(``scripts/_gpu_check_stages.py``).

Everything goes to ``--out`` (default ``$OUT``, else ``gpu_check_out``):

- ``gpu_check.jsonl``: each figure, appended (and fsynced) the moment it is measured;
- ``gpu_check.md``: a section for ``docs/BENCHMARKS.md`` (device, driver, CUDA, cuDNN, jax,
  Triton and torch versions, the command, every table, every failure), written at the end;
- ``autotune.json``: the tiles and verdicts ``impl="auto"`` and ``conv_bn="auto"`` read, in
  ``pallas_kernels/tuned.json``'s format (``--merge`` puts them there);
- ``gpu_check.log``: every stage's output, a header line before each process.

``--resume EARLIER.jsonl`` carries over what an earlier check on the same device kind and
versions finished (its figures, marked with its date), so a check cut short is finished by
the next lent session instead of measured again from the start; the repository keeps each
run's records in ``docs/gpu_check/``.

No tile sweeps: each Mosaic kernel launch is timed with at most three tile configurations,
chosen on the CPU and kept in ``scripts/gpu_check_tiles.json`` (``_gpu_check_tiles.py``).
``scripts/gpu_session.sh`` keeps the long, sweeping stages for a longer lease.
"""
from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
try:
    import _gpu_check_report as report  # noqa: E402 (no JAX: the parent starts no backend)
finally:
    sys.path.pop(0)

# Priority order: (name, share of the budget in seconds at the default budget).  Sized from
# the H200 run of 2026-11-29 (docs/BENCHMARKS.md): compiling is most of every unit (a
# ResNet-50 step 15-40 s, one dense shape's three kernels with three tiles each 75 s), and
# torch.compile's first ResNet-50 step took more than 95 s.  The BatchNorm reductions'
# race (simple kernels, quick to compile) takes a small share before the auto step, which
# then runs with its verdicts.
STAGES = (("env", 15), ("correct", 50), ("resnet50", 70), ("torch", 130), ("dense", 70),
          ("resnet50_more", 35), ("fused", 25), ("window", 25), ("batchnorm", 25),
          ("resnet50_auto", 35))
DEFAULT_BUDGET = 480.0
RESERVE = 3.0  # seconds kept for the summary at the end
LOG = "gpu_check.log"
MIN_RELAUNCH = 10.0  # no new process for a stage with less than this left
# The torch stage starts JAX too (the device check): JAX must not take 75% of the GPU first.
STAGE_ENV = {"torch": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}}


def stage_limit(remaining: float, share: float, shares_left: float) -> float:
    """A stage's time limit: its share of what remains, among the stages still to run."""
    return max(0.0, remaining * share / shares_left) if shares_left > 0 else 0.0


def _run_once(argv, env, log_path, timeout):
    """Runs ``argv`` in its own session, output appended to ``log_path``; returns its exit
    status, or None when it ran past ``timeout`` (then its whole process group is killed)."""
    with open(log_path, "a", encoding="utf-8") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def _tail(path: str, lines: int = 15) -> str:
    """The last ``lines`` lines of the log (the stage that just ended wrote them)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return "\n".join(f.read().splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def run_stage(name, command, env, out, limit) -> dict:
    """Runs one stage (``command``: its argv) within ``limit`` seconds, starting it again
    while it exits ``report.RELAUNCH`` and time allows; returns its ``stage`` record.  Its
    output goes to ``gpu_check.log``, under a header line per process (one log for every
    stage: a lent machine sends back only a few files)."""
    log = os.path.join(out, LOG)
    t0 = time.monotonic()
    launches = 0
    while True:
        launches += 1
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"=== stage {name}, process {launches}, {time.strftime('%H:%M:%S')}\n")
        rc = _run_once(command, env, log, limit - (time.monotonic() - t0))
        left = limit - (time.monotonic() - t0)
        if rc == report.RELAUNCH and left >= MIN_RELAUNCH:
            continue
        break
    record = {"stage": name, "kind": "stage", "limit_s": round(limit, 1), "launches": launches,
              "seconds": round(time.monotonic() - t0, 1), "time": round(time.time(), 3)}
    if rc is None:
        record.update(status="timeout")
    elif rc == 0:
        record.update(status="ok")
    else:
        record.update(status="failed", rc=rc, tail=_tail(log))
    return record


def run_stages(out: str, stages, budget: float, command_for, env_for=lambda name: None,
               after=lambda name: None):
    """Runs ``stages`` (``[(name, share)]``) in order within ``budget`` seconds, appending each
    stage's record to ``gpu_check.jsonl``; ``command_for(name)`` is a stage's argv,
    ``env_for(name)`` its environment (None: this process's); ``after(name)`` is called
    after each stage that ran."""
    path = os.path.join(out, report.JSONL)
    deadline = time.monotonic() + budget - RESERVE
    for i, (name, share) in enumerate(stages):
        shares_left = sum(s for _, s in stages[i:])
        limit = stage_limit(deadline - time.monotonic(), share, shares_left)
        if limit < 1.0:
            report.append_record(path, {"stage": name, "kind": "stage", "status": "timeout",
                                        "limit_s": 0.0, "seconds": 0.0, "launches": 0,
                                        "time": round(time.time(), 3)})
            continue
        report.append_record(path, run_stage(name, command_for(name), env_for(name), out,
                                             limit))
        after(name)


def _child_env(out: str, name: str) -> dict:
    env = {**os.environ, **STAGE_ENV.get(name, {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env["JAXCNN_AUTOTUNE_CACHE"] = os.path.join(out, "autotune.json")
    return env


def _empty_autotune(path: str) -> None:
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write('{"devices": {}, "version": 1}\n')


def check(opts) -> int:
    """The whole check: stages, then ``gpu_check.md`` and ``autotune.json``."""
    out = os.path.abspath(opts.out)
    os.makedirs(out, exist_ok=True)
    chosen = [s for s in STAGES if opts.stages is None or s[0] in opts.stages.split(",")]
    unknown = set(opts.stages.split(",") if opts.stages else ()) - {s[0] for s in STAGES}
    if unknown:
        print(f"gpu_check: unknown stage(s) {sorted(unknown)}; choose from "
              f"{[s[0] for s in STAGES]}", file=sys.stderr)
        return 2
    if opts.resume and not any(name == "env" for name, _ in chosen):
        print("gpu_check: --resume needs the env stage (it compares this device and these versions "
              "with the earlier check's)", file=sys.stderr)
        return 2
    command = "python scripts/gpu_check.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    report.append_record(os.path.join(out, report.JSONL), {
        "stage": "run", "kind": "run", "command": command.strip(), "budget_s": opts.budget,
        "dry_run": opts.dry_run, "time": round(time.time(), 3)})

    def command_for(name):
        return [sys.executable, os.path.abspath(__file__), "--stage", name, "--out", out] + (
            ["--dry-run"] if opts.dry_run else [])

    def after(name):
        if name == "env" and opts.resume:
            carry_over(out, opts.resume)
    run_stages(out, chosen, opts.budget, command_for, lambda name: _child_env(out, name), after)
    records = report.read_records(os.path.join(out, report.JSONL))
    with open(os.path.join(out, "gpu_check.md"), "w", encoding="utf-8") as f:
        f.write(report.summary(records))
    _empty_autotune(os.path.join(out, "autotune.json"))
    bad = [r["stage"] for r in records if r.get("kind") == "stage" and r["status"] != "ok"]
    print(f"gpu_check: {len(chosen) - len(bad)} of {len(chosen)} stages ok"
          + (f"; not ok: {bad}" if bad else "") + f"; results in {out}")
    return 0


def carry_over(out: str, earlier: str) -> int:
    """Copies into this check's records what the ``earlier`` check (its ``gpu_check.jsonl``)
    measured, when both ran on the same device kind and software (:data:`report.SAME_RUN`):
    every figure and every unit it finished, each marked ``carried`` with that run's date,
    so the stages skip those units and give their time to the rest.  Units it started but
    did not finish run again.  Returns how many records were carried (0, with a ``skip``
    record saying why, when the runs differ)."""
    path = os.path.join(out, report.JSONL)
    mine, theirs = report.env_of(report.read_records(path)), report.read_records(earlier)
    differ = {k: (report.env_of(theirs).get(k), mine.get(k)) for k in report.SAME_RUN
              if report.env_of(theirs).get(k) != mine.get(k)}
    if not theirs or differ:
        why = ("it holds no records" if not theirs else "; ".join(
            f"{k} {a} there, {b} here" for k, (a, b) in differ.items()))
        report.append_record(path, {"stage": "run", "kind": "skip", "unit": "resume",
                                    "reason": f"nothing carried from {earlier}: {why}",
                                    "time": round(time.time(), 3)})
        return 0
    when = time.strftime("%Y-%m-%d", time.gmtime(theirs[0].get("time", 0)))
    carried = [{**r, "carried": r.get("carried", when)} for r in theirs if report.carries(r)]
    for r in carried:
        report.append_record(path, r)
    return len(carried)


def _stage_main(opts) -> int:
    """One stage, in this (child) process."""
    import _gpu_check_stages as stages
    ctx = stages.Context(opts.stage, os.path.abspath(opts.out), opts.dry_run)
    return stages.FUNCTIONS[opts.stage](ctx)


def _plan_tiles() -> int:
    import _gpu_check_stages as stages
    import _gpu_check_tiles as tiles
    entries = tiles.plan(stages.tile_plan_calls())
    tiles.write(entries)
    print(f"wrote {tiles.PLAN}: {len(entries)} launches, "
          f"{sum(len(v) for v in entries.values())} configurations")
    return 0


def _merge(path: str) -> int:
    """Merges an ``autotune.json`` from a check into ``pallas_kernels/tuned.json`` (its entries
    win, device kind by device kind)."""
    from pallas_kernels import autotune
    found = autotune.load_cache(path)
    if not found:
        print(f"gpu_check: {path} holds no measurements", file=sys.stderr)
        return 2
    shipped = autotune.load_cache(autotune.SHIPPED)
    for kind, parts in found.items():
        mine = shipped.setdefault(kind, {"kernels": {}, "ops": {}})
        for part in ("kernels", "ops"):
            mine.setdefault(part, {}).update(parts.get(part, {}))
    autotune.save_cache(shipped, autotune.SHIPPED)
    print(f"merged {path} into {autotune.SHIPPED}: "
          + ", ".join(f"{k}: {len(v.get('kernels', {}))} kernels, {len(v.get('ops', {}))} ops"
                      for k, v in found.items()))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                        help="wall-clock seconds for the whole check (default 480)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_check_out")
    parser.add_argument("--stages", help=f"comma-separated subset of {[s[0] for s in STAGES]}")
    parser.add_argument("--dry-run", action="store_true",
                        help="run every stage on tiny shapes (the CPU: interpret mode)")
    parser.add_argument("--resume", metavar="GPU_CHECK_JSONL",
                        help="an earlier check's records (e.g. docs/gpu_check/*.jsonl): on the "
                             "same device and versions, what it finished is carried over, not "
                             "measured again")
    parser.add_argument("--stage", choices=[s[0] for s in STAGES], help=argparse.SUPPRESS)
    parser.add_argument("--plan-tiles", action="store_true",
                        help="write scripts/gpu_check_tiles.json from the tile model")
    parser.add_argument("--merge", metavar="AUTOTUNE_JSON",
                        help="merge a check's autotune.json into pallas_kernels/tuned.json")
    opts = parser.parse_args(argv)
    sys.path.insert(0, HERE)
    if opts.stage:
        return _stage_main(opts)
    if opts.plan_tiles:
        return _plan_tiles()
    if opts.merge:
        return _merge(opts.merge)
    return check(opts)


if __name__ == "__main__":
    sys.exit(main())
