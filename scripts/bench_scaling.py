"""Data-parallel scaling: training throughput on 1, 2, 4, 8 devices and the
efficiency relative to one device.

    python scripts/bench_scaling.py [--model mnist_cnn] [--strategy shard_map]
        [--devices 1,2,4,8] [--per-device-batch 32] [--mode weak|strong] [--steps 10]

On a CPU-only machine the devices are emulated
(``--xla_force_host_platform_device_count``) and all share the same cores, so
the numbers measure the overhead of the parallel program (collectives,
partitioning), not a real speed-up: ideal efficiency is then about
``cores / devices`` at best.  On real accelerators the same command measures
true scaling.  Weak scaling (default) keeps the per-device batch fixed; strong
scaling keeps the global batch fixed (``--per-device-batch`` x the largest count).

``--layout spatial`` puts each count's devices on the ``spatial`` axis instead
(``jit``, images split along height, ``data`` 1) with the global batch fixed at
``--per-device-batch``; ``--layout data_spatial`` splits them as data 2 x spatial
n/2.  Every row also reports the compiled step's memory per device (XLA's
``memory_analysis``: arguments + outputs + temporaries - donated) and the
collectives in its HLO; ``--compile-only`` stops there (no step is run), which
is how the ResNet-50 224x224 memory table in docs/BENCHMARKS.md was made::

    python scripts/bench_scaling.py --model resnet50 --num-classes 1000 --layout spatial \
        --devices 1,2,4 --per-device-batch 8 --compile-only

``--pipe 1,2,4`` measures pipeline stages instead (one data shard, the batch
``--per-device-batch``, ``--microbatches`` micro-batches; ``pipe 1`` is one device
accumulating the same micro-batches): each count's compiled step's per-device memory
(XLA's ``memory_analysis``: the arguments, the temporaries and the total, arguments +
outputs + temporaries - aliased, each with its ratio to the first count), the
pipeline's bubble fraction and the step time (``--steps 0``: compile only)::

    python scripts/bench_scaling.py --model resnet50 --pipe 1,2,4 --per-device-batch 16 \
        --microbatches 4 --steps 2

``--split 5,2,4,11`` gives the blocks per stage by hand (``parallel.pipeline.split``),
``--remat`` sets ``parallel.pipeline.remat`` (``parallel.spatial.remat`` for a spatial
layout), ``--halo explicit`` ``parallel.spatial.halo`` (halo rows by ``shard_map`` +
``ppermute`` instead of XLA's partitioner) and ``--precision bf16`` the precision policy of every layout
(for ``--pipe`` its compute dtype is the dtype of the stash and of what crosses the stages).

``--schedule gpipe,1f1b`` measures each stage count above 1 under each pipeline schedule
(``parallel.pipeline.schedule``; the table's ``stash`` column: the stage inputs each device
keeps for the backward)::

    python scripts/bench_scaling.py --model resnet50 --pipe 4 --per-device-batch 64 \
        --microbatches 8 --steps 0 --schedule gpipe,1f1b

``--engine spmd,mpmd`` measures each stage count above 1 under each pipeline engine
(``parallel.pipeline.engine``).  An ``mpmd`` step is one program per stage, so its memory is
the largest stage's peak from each stage program's ``memory_analysis``
(``MPMD``'s ``memory``: ``args`` its state and batch, ``temp`` the rest: gradient
accumulator, stash, and the larger of its programs' temporaries and outputs); the stages'
peaks follow the table::

    python scripts/bench_scaling.py --model resnet50 --pipe 1,2,4 --per-device-batch 64 \
        --microbatches 4 --steps 0 --schedule 1f1b --balance memory --remat --engine spmd,mpmd
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="mnist_cnn", help="a jaxcnn.models name")
    p.add_argument("--options", default="{}", help="model options as JSON, e.g. '{\"cifar_stem\": true}'")
    p.add_argument("--image-size", default=None, help="H,W,C (default: the model's own)")
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--strategy", default="shard_map", choices=("shard_map", "pmap", "jit"))
    p.add_argument("--devices", default="1,2,4,8", help="comma-separated device counts")
    p.add_argument("--per-device-batch", type=int, default=32)
    p.add_argument("--mode", default="weak", choices=("weak", "strong"))
    p.add_argument("--steps", type=int, default=10, help="timed steps per device count")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (compilation) per device count")
    p.add_argument("--layout", default="data", choices=("data", "spatial", "data_spatial"),
                   help="which mesh axis the devices go on (spatial: jit, global batch fixed)")
    p.add_argument("--halo", default="partitioner",
                   help="spatial layouts: parallel.spatial.halo, partitioner (XLA's SPMD partitioner) or "
                        "explicit (shard_map + ppermute); 'partitioner,explicit' measures each count "
                        "under both, one after the other")
    p.add_argument("--compile-only", action="store_true",
                   help="compile each step and report its memory and collectives; run nothing")
    p.add_argument("--plain-channel-sums", action="store_true",
                   help="per-channel sums as plain jnp.sum, as off the CPU (the CPU's folded form "
                        "reshapes (N, H, W, C) to (rows, lanes), which the partitioner can only do "
                        "by gathering a height-split activation)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    p.add_argument("--pipe", default=None, help="comma-separated pipeline stage counts (see above)")
    p.add_argument("--microbatches", type=int, default=4, help="--pipe: micro-batches per step")
    p.add_argument("--balance", default="macs", choices=("macs", "params", "activations", "memory"),
                   help="--pipe: what the stages' split evens out")
    p.add_argument("--split", default=None,
                   help="--pipe: blocks per stage, comma-separated, for every stage count above 1 "
                        "(parallel.pipeline.split; default: the --balance split)")
    p.add_argument("--precision", default="f32",
                   help="the precision policy (a jaxcnn.precision preset or spec: f32, bf16, ...)")
    p.add_argument("--remat", action="store_true",
                   help="--pipe: parallel.pipeline.remat; --layout spatial/data_spatial: "
                        "parallel.spatial.remat (each unit's activations recomputed in its backward)")
    p.add_argument("--schedule", default="gpipe",
                   help="--pipe: comma-separated pipeline schedules (gpipe, 1f1b), each measured")
    p.add_argument("--engine", default="spmd",
                   help="--pipe: comma-separated pipeline engines (spmd, mpmd), each measured")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _parse_args(argv)
    counts = [int(c) for c in (args.pipe or args.devices).split(",")]
    if not os.environ.get("JAX_PLATFORMS") or os.environ["JAX_PLATFORMS"] == "cpu":
        # Emulate devices on the CPU; must be set before jax is imported.
        flag = f"--xla_force_host_platform_device_count={max(counts)}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    import jaxcnn.cpu
    jaxcnn.cpu.configure()  # before JAX starts: the XLA:CPU flag and malloc settings
    import re

    import jax
    import numpy as np
    import optax

    from jaxcnn import models
    from jaxcnn import precision as P
    from jaxcnn.parallel import ParallelPlan, make_mesh
    from jaxcnn.train._memory import _step_bytes, fmt_bytes
    from jaxcnn.train.state import create_train_state
    from jaxcnn.train.step import make_train_step

    if args.plain_channel_sums:
        from jaxcnn.functional import _channels
        _channels.WIDE_LANES = 0  # this process only: _fold then never folds
    if max(counts) > jax.device_count():
        print(f"bench_scaling: asked for {max(counts)} devices, only {jax.device_count()} exist",
              file=sys.stderr)
        return 2
    model = models.get(args.model, num_classes=args.num_classes, **json.loads(args.options))
    image = (tuple(int(x) for x in args.image_size.split(",")) if args.image_size
             else models.default_input_shape(args.model)[1:])
    tx = optax.sgd(0.01, momentum=0.9)
    try:
        policy = P.get_policy(args.precision)
    except ValueError as e:
        print(f"bench_scaling: --precision: {e}", file=sys.stderr)
        return 2
    if args.pipe:
        return _pipeline_rows(args, counts, model, image, tx, policy)
    halos = args.halo.split(",")
    if not halos or any(h not in ("partitioner", "explicit") for h in halos):
        print(f"bench_scaling: --halo: expected partitioner and/or explicit, got {args.halo!r}",
              file=sys.stderr)
        return 2
    rows = []
    strategy = "jit" if args.layout != "data" else args.strategy
    runs = []
    for n in counts:
        data, spatial = {"data": (n, 1), "spatial": (1, n),
                         "data_spatial": (min(n, 2), max(1, n // 2))}[args.layout]
        runs += [(n, data, spatial, halo) for halo in (halos if spatial > 1 else halos[:1])]
    for n, data, spatial, halo in runs:
        if args.layout == "data":
            batch = args.per_device_batch * (n if args.mode == "weak" else max(counts))
        else:
            batch = args.per_device_batch * data
        shape = (batch,) + image

        def init(shape=shape):
            return create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=policy,
                                      loss_scale=P.make_loss_scale("none"))

        try:
            plan = ParallelPlan(make_mesh(data, 1, spatial=spatial, devices=jax.devices()[:n]), model,
                                shape, jax.eval_shape(init), strategy=strategy,
                                spatial_remat=args.remat, spatial_halo=halo)
        except ValueError as e:
            print(f"bench_scaling: {n} devices: {e}", file=sys.stderr)
            return 2
        step = plan.wrap_step(make_train_step(plan.step_model, tx, axis_name=plan.step_axis_name,
                                              policy=policy))
        rng = np.random.default_rng(0)
        host = {"image": rng.normal(size=shape).astype(np.float32),
                "label": rng.integers(0, args.num_classes, batch).astype(np.int32)}
        placed = plan.put_batch(host)
        t0 = time.perf_counter()
        compiled = step.lower(plan.abstract_state, placed).compile()
        hlo = compiled.as_text()
        row = {"devices": n, "data": data, "spatial": spatial, "global_batch": batch,
               "halo": halo if spatial > 1 else "-",
               "split_through": plan.spatial.gather_after if plan.spatial else None,
               "step_bytes": _step_bytes(compiled), "lower_compile_s": time.perf_counter() - t0}
        try:  # the temporaries (activations and their gradients) are what spatial shards divide
            row["temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        except Exception:  # not every backend implements memory_analysis
            row["temp_bytes"] = None
        for op in ("collective-permute", "all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
            row[op] = len(re.findall(rf"^\s*(?:ROOT )?\S+ = .* {op}(?:-start)?\(", hlo, re.M))
        if args.compile_only:
            rows.append(row)
            continue
        state = jax.jit(init, out_shardings=plan.state_shardings)()
        t0 = time.perf_counter()
        for _ in range(args.warmup):
            state, m = step(state, placed)
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            state, m = step(state, placed)
        jax.block_until_ready((state, m))
        step_s = (time.perf_counter() - t0) / args.steps
        rows.append(dict(row, step_ms=step_s * 1e3, img_per_s=batch / step_s, compile_s=compile_s))
    print(f"model {args.model} {image}  strategy {strategy}  layout {args.layout}  "
          f"{args.mode if args.layout == 'data' else 'fixed-batch'} scaling  "
          f"per-device batch {args.per_device_batch}  backend {jax.default_backend()} "
          f"({os.cpu_count()} host cores){'  plain channel sums' if args.plain_channel_sums else ''}"
          f"{'  remat' if args.remat else ''}  precision {args.precision}")
    if args.compile_only:
        print(f"{'devices':>7} {'data':>4} {'spatial':>7} {'halo':>11} {'batch':>6} {'mem/device':>11} "
              f"{'vs 1st':>6} {'temp':>9} {'vs 1st':>6} {'permutes':>8} {'gathers':>7} {'reduces':>7}  "
              f"split through")
        for r in rows:
            mem, temp = r["step_bytes"] or 0, r["temp_bytes"] or 0
            print(f"{r['devices']:>7} {r['data']:>4} {r['spatial']:>7} {r['halo']:>11} {r['global_batch']:>6} "
                  f"{fmt_bytes(mem):>11} {mem / (rows[0]['step_bytes'] or 1):>6.2f} "
                  f"{fmt_bytes(temp):>9} {temp / (rows[0]['temp_bytes'] or 1):>6.2f} "
                  f"{r['collective-permute']:>8} {r['all-gather']:>7} {r['all-reduce']:>7}  "
                  f"{r['split_through'] or '-'}")
        if args.json:
            for r in rows:
                print(json.dumps(r))
        return 0
    base = rows[0]["img_per_s"] / rows[0]["devices"]
    for r in rows:
        r["speedup"] = r["img_per_s"] / rows[0]["img_per_s"]
        # Weak scaling: throughput vs n x one device; strong: time-to-batch vs n x faster.
        r["efficiency"] = r["img_per_s"] / (base * r["devices"])
    print(f"{'devices':>7} {'data':>4} {'spatial':>7} {'halo':>11} {'batch':>6} {'step ms':>9} {'img/s':>9} "
          f"{'speedup':>8} {'efficiency':>10} {'mem/device':>11}")
    for r in rows:
        print(f"{r['devices']:>7} {r['data']:>4} {r['spatial']:>7} {r['halo']:>11} {r['global_batch']:>6} "
              f"{r['step_ms']:>9.1f} "
              f"{r['img_per_s']:>9.1f} {r['speedup']:>8.2f} {r['efficiency']:>10.2f} "
              f"{fmt_bytes(r['step_bytes'] or 0):>11}")
    if args.json:
        for r in rows:
            print(json.dumps(r))
    return 0


def _pipeline_rows(args, counts, model, image, tx, policy) -> int:
    """``--pipe``: memory, bubble and step time of each stage count on one data shard."""
    import jax
    import numpy as np

    from jaxcnn import precision as P
    from jaxcnn.parallel import ParallelPlan, SettingError, make_mesh
    from jaxcnn.parallel.pipeline import ENGINES, SCHEDULES
    from jaxcnn.train.state import create_train_state
    from jaxcnn.train.step import make_train_step

    shape, m = (args.per_device_batch,) + image, args.microbatches
    schedules = args.schedule.split(",")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad:
        print(f"bench_scaling: --schedule: expected a comma-separated list of {SCHEDULES}, got {bad[0]!r}",
              file=sys.stderr)
        return 2
    engines = args.engine.split(",")
    if [e for e in engines if e not in ENGINES]:
        print(f"bench_scaling: --engine: expected a comma-separated list of {ENGINES}, got {args.engine!r}",
              file=sys.stderr)
        return 2
    runs = [(pipe, schedule, engine) for pipe in counts for schedule in (schedules if pipe > 1 else schedules[:1])
            for engine in (engines if pipe > 1 else engines[:1])]
    try:
        split = None if args.split is None else [int(v) for v in args.split.split(",")]
    except ValueError:
        print(f"bench_scaling: --split: expected comma-separated block counts, got {args.split!r}", file=sys.stderr)
        return 2

    def init():
        return create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=policy,
                                  loss_scale=P.make_loss_scale("none"))

    rng = np.random.default_rng(0)
    host = {"image": rng.normal(size=shape).astype(np.float32),
            "label": rng.integers(0, args.num_classes, shape[0]).astype(np.int32)}
    rows = []
    for pipe, schedule, engine in runs:
        try:
            plan = ParallelPlan(make_mesh(1, 1, pipe=pipe, devices=jax.devices()[:pipe]), model, shape,
                                jax.eval_shape(init), pipeline={"microbatches": m, "balance": args.balance,
                                                                "schedule": schedule, "remat": args.remat,
                                                                "split": split if pipe > 1 else None,
                                                                "engine": engine})
        except SettingError as e:  # the plan's pipeline.<key> is this script's --<key>
            flag = "--" + e.setting.partition(".")[2] if e.setting.startswith("pipeline.") else e.setting
            print(f"bench_scaling: {flag}: {e.problem}", file=sys.stderr)
            return 2
        step = plan.wrap_step(make_train_step(model, tx, policy=policy, axis_name=plan.step_axis_name,
                                              accumulate=m, pipeline=plan.pipeline))
        placed = plan.put_batch(host)
        t0 = time.perf_counter()
        row = {"pipe": pipe, "microbatches": m, "batch": shape[0],
               "bubble": 0.0 if plan.pipeline is None else plan.pipeline.bubble_fraction,
               "split": None if plan.pipeline is None else plan.pipeline.split,
               "step_ms": None, "schedule": schedule if plan.pipeline else "-",
               "engine": engine if plan.pipeline else "-",
               "stash": plan.pipeline.stash_slots if plan.pipeline else None}
        if plan.mpmd is not None:  # one program per stage: the largest stage's peak
            report = step.memory(plan.abstract_state, placed)
            peak = max(report["stages"], key=lambda st: st["peak"])
            row.update(memory_mib=peak["peak"] / 2**20, args_mib=(peak["state"] + peak["batch"]) / 2**20,
                       temp_mib=(peak["peak"] - peak["state"] - peak["batch"]) / 2**20,
                       out_mib=0.0, alias_mib=0.0, stage_mib=[round(st["peak"] / 2**20, 1) for st in report["stages"]])
            compiled = step
        else:
            compiled = step.lower(plan.abstract_state, placed).compile()
            mem = compiled.memory_analysis()
            per_device = (mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
                          - mem.alias_size_in_bytes)
            row.update(memory_mib=per_device / 2**20, args_mib=mem.argument_size_in_bytes / 2**20,
                       temp_mib=mem.temp_size_in_bytes / 2**20, out_mib=mem.output_size_in_bytes / 2**20,
                       alias_mib=mem.alias_size_in_bytes / 2**20)
        row["compile_s"] = time.perf_counter() - t0
        if args.steps:
            state = plan.create_state(init)
            for _ in range(args.warmup):
                state, metrics = compiled(state, placed)
            jax.block_until_ready(state)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, metrics = compiled(state, placed)
            jax.block_until_ready((state, metrics))
            row["step_ms"] = (time.perf_counter() - t0) / args.steps * 1e3
        rows.append(row)
        print(json.dumps(row) if args.json else
              f"pipe {pipe} {row['schedule']} {row['engine']}: {row['memory_mib']:.0f} MiB per device", flush=True)
    print(f"model {args.model} {image}  batch {shape[0]} in {m} micro-batches  balance {args.balance}"
          f"{'  remat' if args.remat else ''}  precision {args.precision}  backend "
          f"{jax.default_backend()} ({os.cpu_count()} host cores)")
    print("MiB per device (XLA's memory_analysis): args = the state and batch the step takes, temp = "
          "its temporaries, total = args + outputs + temp - donated; vs = the ratio to the first row; "
          "stash = the stage inputs a device keeps; mpmd: the largest stage's peak (every stage's after the blocks)")
    print(f"{'pipe':>4} {'schedule':>8} {'engine':>6} {'stash':>5} {'args':>7} {'vs':>5} {'temp':>7} {'vs':>5} {'total':>7} "
          f"{'vs':>5} {'bubble':>7} {'step ms':>9}  blocks per stage")
    first = rows[0]
    for r in rows:
        step_ms = "-" if r["step_ms"] is None else f"{r['step_ms']:.0f}"
        ratio = lambda k: r[k] / first[k] if first[k] else float("nan")  # noqa: E731
        print(f"{r['pipe']:>4} {r['schedule']:>8} {r['engine']:>6} {r['stash'] or '-':>5} {r['args_mib']:>7.1f} "
              f"{ratio('args_mib'):>5.2f} {r['temp_mib']:>7.1f} {ratio('temp_mib'):>5.2f} {r['memory_mib']:>7.1f} "
              f"{ratio('memory_mib'):>5.2f} {r['bubble']:>7.2f} {step_ms:>9}  {r['split'] or '-'}"
              f"{'  stages ' + str(r['stage_mib']) + ' MiB' if r.get('stage_mib') else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
