#!/usr/bin/env python3
"""Training-step time of jaxcnn against PyTorch (and Flax), and the input pipeline.

    python scripts/bench_train.py                          # CPU: mnist_cnn and resnet18-CIFAR
    python scripts/bench_train.py --models resnet50        # GPU: ResNet-50, batch 256, 224x224, bf16
    python scripts/bench_train.py --json out.json          # also write the rows as JSON

Every framework trains the same network (same layers, initialised its own
way) on the same batch with the same optimiser (SGD, momentum 0.9, lr 0.01),
in float32 on the CPU.  A step is forward, backward and the optimiser update;
compilation is excluded (jaxcnn and Flax compile ahead of timing, torch.compile
gets warm-up steps), and the reported step time is the median over ``--reps``
runs of ``--steps`` back-to-back steps each, with one host synchronisation at
the end of each run (as the trainer runs: no host sync inside the loop).

Frameworks: jaxcnn (``impl="auto"``, so the CPU lowerings of
``jaxcnn.functional._cpu_lowering`` apply); PyTorch eager (NCHW, its CPU
default); on a GPU also torch.compile with channels-last and bf16 autocast;
Flax (linen) when installed.  ``jaxcnn.cpu.configure()``, called first, puts the
XLA:CPU flag of ``_cpu_lowering`` in place for every JAX framework in this process,
Flax too, and on a CPU jaxcnn's glibc malloc settings (``jaxcnn._host_memory``) for
everything in this process, PyTorch too.  So where those settings are on,
PyTorch eager is timed twice: in this process ("torch eager +jaxcnn malloc")
and in a fresh process with glibc's defaults ("torch eager"), as PyTorch runs
without jaxcnn (that process still imports JAX, idle); each row's ``malloc``
says which.

On a GPU the table adds MFU: 3 x 2 x the forward MACs from ``jaxcnn.summary``
per image (forward 1x, backward 2x), divided by the step time and the
device's peak (dense bf16 for bf16 runs, else TF32 where known).

The input pipeline is timed on its own: images/s that ``train_batch`` makes
from the packaged MNIST (as the mnist_cnn config feeds the trainer) and that
``synthetic_batch`` makes at ImageNet shapes (224x224x3 uint8 bytes, which
the trainer's step normalises on the device), each put on the device, each as
the ratio to the matching step's images/s (goal >= 1.5x: the prefetch thread
keeps ahead of the step).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import jaxcnn.cpu
jaxcnn.cpu.configure()  # first: the XLA:CPU flag and malloc settings, before JAX starts

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np
import optax

from jaxcnn import _host_memory
from jaxcnn import functional as F
from jaxcnn import layers as L
from jaxcnn.functional.conv_bn import FUSIONS
from jaxcnn import models, summary
from jaxcnn.summary import peak_flops
from jaxcnn import precision as P
from jaxcnn.data import SyntheticSpec, load_mnist, synthetic_batch, train_batch
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_train_step

LR, MOMENTUM = 0.01, 0.9
# name -> (zoo model, options, batch, (H, W, C), classes, GPU only); bf16 for resnet50 on a GPU
CASES = {
    "mnist_cnn": ("mnist_cnn", {}, 128, (28, 28, 1), 10, False),
    "resnet18_cifar": ("resnet18", {"cifar_stem": True}, 128, (32, 32, 3), 10, False),
    "resnet50": ("resnet50", {}, 256, (224, 224, 3), 1000, True),
}


def median_step(run_steps, steps: int, reps: int, warmup: int) -> float:
    """Median seconds per step over ``reps`` runs of ``steps`` steps (after ``warmup`` runs)."""
    for _ in range(warmup):
        run_steps(steps)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run_steps(steps)
        times.append((time.perf_counter() - t0) / steps)
    return statistics.median(times)


def median_jitted_step(step, carry, data, args) -> float:
    """:func:`median_step` for a compiled ``step(carry, data) -> (carry, out)``; the carry
    is threaded through every call (its buffers are donated) and ``out`` is waited on once
    per run."""
    holder = [carry]

    def run_steps(n):
        c = holder[0]
        for _ in range(n):
            c, out = step(c, data)
        jax.block_until_ready(out)
        holder[0] = c

    return median_step(run_steps, args.steps, args.reps, args.warmup)


def host_batch(case, batch, seed=0):
    _, _, _, hwc, classes, _ = CASES[case]
    return synthetic_batch(SyntheticSpec(hwc, classes), 0, seed=seed, batch_size=batch)


# ---- jaxcnn ---------------------------------------------------------------------------------

def case_batch(case, args) -> int:
    return args.batch or CASES[case][2]


def bench_jaxcnn(case, args, bf16, impl="auto", bn_grad="auto", conv_bn="auto"):
    name, options, _, hwc, classes, _ = CASES[case]
    batch = case_batch(case, args)
    model = models.get(name, num_classes=classes, **options)
    policy = P.get_policy("bf16" if bf16 else "fp32")
    tx = optax.sgd(LR, momentum=MOMENTUM)
    state = create_train_state(model, tx, jax.random.PRNGKey(0), (batch, *hwc),
                               loss_scale=P.make_loss_scale("none"), policy=policy)
    data = jax.device_put(host_batch(case, batch))
    choices = L.Choices(impl=impl, batch_norm_grad=bn_grad, conv_bn=conv_bn)
    step = jax.jit(make_train_step(model, tx, policy=policy, choices=choices).step, donate_argnums=0)
    step = step.lower(state, data).compile()
    return median_jitted_step(step, state, data, args)


# ---- PyTorch --------------------------------------------------------------------------------

def torch_model(case):
    import torch.nn as nn

    name, _, _, (_, _, c), classes, _ = CASES[case]
    if name == "mnist_cnn":
        return nn.Sequential(nn.Conv2d(c, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                             nn.MaxPool2d(2), nn.Dropout(0.25), nn.Flatten(),
                             nn.Linear(9216, 128), nn.ReLU(), nn.Dropout(0.5),
                             nn.Linear(128, classes))

    class Block(nn.Module):
        def __init__(self, cin, planes, stride, expansion):
            super().__init__()
            cout = planes * expansion
            if expansion == 1:
                self.main = nn.Sequential(
                    nn.Conv2d(cin, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes),
                    nn.ReLU(), nn.Conv2d(planes, planes, 3, 1, 1, bias=False), nn.BatchNorm2d(planes))
            else:
                self.main = nn.Sequential(
                    nn.Conv2d(cin, planes, 1, bias=False), nn.BatchNorm2d(planes), nn.ReLU(),
                    nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes),
                    nn.ReLU(), nn.Conv2d(planes, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())
            self.relu = nn.ReLU()

        def forward(self, x):
            return self.relu(self.main(x) + self.down(x))

    blocks, expansion = ((2, 2, 2, 2), 1) if name == "resnet18" else ((3, 4, 6, 3), 4)
    if CASES[case][1].get("cifar_stem"):
        layers = [nn.Conv2d(c, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    else:
        layers = [nn.Conv2d(c, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                  nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for i, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks)):
        for j in range(count):
            layers.append(Block(cin, planes, 2 if i and not j else 1, expansion))
            cin = planes * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def bench_torch(case, args, compiled, backend="inductor"):
    """Median seconds of a PyTorch step: eager, or with ``compiled`` ``torch.compile`` of the
    whole step (``backend``: ``"inductor"``, or ``"eager"`` for a quick check of this code)
    with channels-last and bfloat16 autocast."""
    import torch

    torch.manual_seed(0)
    device = "cuda" if jax.default_backend() == "gpu" and torch.cuda.is_available() else "cpu"
    model = torch_model(case).to(device).train()
    host = host_batch(case, case_batch(case, args))
    x = torch.from_numpy(np.ascontiguousarray(host["image"].transpose(0, 3, 1, 2))).to(device)
    y = torch.from_numpy(host["label"].astype(np.int64)).to(device)
    if compiled:
        model = model.to(memory_format=torch.channels_last)
        x = x.contiguous(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    loss_fn = torch.nn.functional.cross_entropy

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=compiled):
            loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    if compiled:
        step = torch.compile(step, backend=backend)

    def run_steps(n):
        for _ in range(n):
            loss = step()
        loss.item()  # one host synchronisation per run

    return median_step(run_steps, args.steps, args.reps, args.warmup + (2 if compiled else 0))


# ---- Flax -----------------------------------------------------------------------------------

def malloc_label() -> str:
    """How this process's malloc is set: ``jaxcnn``, ``environment`` (``MALLOC_*``,
    ``GLIBC_TUNABLES``, ``LD_PRELOAD``) or ``default``."""
    if _host_memory.configured():
        return "jaxcnn"
    return "environment" if _host_memory.environment_reason() else "default"


def bench_torch_default_malloc(case, args) -> float:
    """:func:`bench_torch` (eager) in a fresh Python with ``JAXCNN_CPU_MALLOC=0``: PyTorch
    with glibc's default malloc, as it runs without jaxcnn in the process."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import bench_train as B; "
            "assert not B._host_memory.configured(), 'malloc settings on in the child'; "
            "args = B.build_parser().parse_args(sys.argv[3:]); "
            "print('STEP_S', B.bench_torch(sys.argv[2], args, compiled=False))")
    argv = ["--steps", str(args.steps), "--reps", str(args.reps), "--warmup", str(args.warmup)]
    if args.batch:
        argv += ["--batch", str(args.batch)]
    done = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__)),
                           case, *argv], env={**os.environ, "JAXCNN_CPU_MALLOC": "0"},
                          capture_output=True, text=True, check=False, timeout=3600)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("STEP_S ")]
    if done.returncode or not lines:
        raise RuntimeError(f"torch eager in a fresh process failed (exit {done.returncode}):\n"
                           f"{done.stderr[-2000:]}")
    return float(lines[-1].split()[1])


def flax_model(case):
    from flax import linen as nn

    name, options, _, _, classes, _ = CASES[case]
    if name == "mnist_cnn":
        class MnistCNN(nn.Module):
            @nn.compact
            def __call__(self, x, train):
                x = nn.relu(nn.Conv(32, (3, 3), padding="VALID")(x))
                x = nn.relu(nn.Conv(64, (3, 3), padding="VALID")(x))
                x = nn.max_pool(x, (2, 2), (2, 2))
                x = nn.Dropout(0.25, deterministic=not train)(x)
                x = nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))
                x = nn.Dropout(0.5, deterministic=not train)(x)
                return nn.Dense(classes)(x)
        return MnistCNN()

    def bn(train):
        return nn.BatchNorm(use_running_average=not train, momentum=0.9, epsilon=1e-5)

    class Block(nn.Module):
        planes: int
        stride: int
        expansion: int

        @nn.compact
        def __call__(self, x, train):
            cout = self.planes * self.expansion
            s = (self.stride, self.stride)
            if self.expansion == 1:
                h = nn.relu(bn(train)(nn.Conv(self.planes, (3, 3), s, padding=1, use_bias=False)(x)))
                h = bn(train)(nn.Conv(self.planes, (3, 3), padding=1, use_bias=False)(h))
            else:
                h = nn.relu(bn(train)(nn.Conv(self.planes, (1, 1), use_bias=False)(x)))
                h = nn.relu(bn(train)(nn.Conv(self.planes, (3, 3), s, padding=1, use_bias=False)(h)))
                h = bn(train)(nn.Conv(cout, (1, 1), use_bias=False)(h))
            if self.stride != 1 or x.shape[-1] != cout:
                x = bn(train)(nn.Conv(cout, (1, 1), s, use_bias=False)(x))
            return nn.relu(h + x)

    blocks, expansion = ((2, 2, 2, 2), 1) if name == "resnet18" else ((3, 4, 6, 3), 4)

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x, train):
            if options.get("cifar_stem"):
                x = nn.relu(bn(train)(nn.Conv(64, (3, 3), padding=1, use_bias=False)(x)))
            else:
                x = nn.relu(bn(train)(nn.Conv(64, (7, 7), (2, 2), padding=3, use_bias=False)(x)))
                x = nn.max_pool(x, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for i, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks)):
                for j in range(count):
                    x = Block(planes, 2 if i and not j else 1, expansion)(x, train)
            return nn.Dense(classes)(jnp.mean(x, axis=(1, 2)))

    return ResNet()


def bench_flax(case, args, bf16):
    model = flax_model(case)
    host = host_batch(case, case_batch(case, args))
    data = jax.device_put(host)
    dtype = jnp.bfloat16 if bf16 else jnp.float32
    variables = model.init({"params": jax.random.PRNGKey(0)}, data["image"][:1], train=False)
    params, stats = variables["params"], variables.get("batch_stats", {})
    tx = optax.sgd(LR, momentum=MOMENTUM)

    def train_step(carry, batch):
        params, stats, opt_state, key = carry
        key, dropout_key = jax.random.split(key)

        def loss_fn(params):
            logits, updates = model.apply(
                {"params": params, "batch_stats": stats}, batch["image"].astype(dtype), train=True,
                rngs={"dropout": dropout_key}, mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), batch["label"]).mean()
            return loss, updates.get("batch_stats", {})

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), new_stats, opt_state, key), loss

    carry = (params, stats, tx.init(params), jax.random.PRNGKey(1))
    step = jax.jit(train_step, donate_argnums=0).lower(carry, data).compile()
    return median_jitted_step(step, carry, data, args)


# ---- input pipeline -------------------------------------------------------------------------

def pipeline_rate(make_batch, batch_size: int, seconds: float) -> float:
    """Images/s one thread sustains calling ``make_batch(step)`` for about ``seconds``."""
    make_batch(0)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds or steps < 3:
        steps += 1
        make_batch(steps)
    return steps * batch_size / (time.perf_counter() - t0)


def bench_pipelines(seconds: float):
    mnist = load_mnist()
    imagenet = SyntheticSpec((224, 224, 3), 1000)
    return {
        "mnist train_batch (mnist_cnn)": ("mnist_cnn", pipeline_rate(
            lambda s: jax.device_put(train_batch(mnist, s, seed=0, batch_size=128, augment=None)),
            128, seconds)),
        # As the trainer feeds throughput runs: bytes, normalised in the train step.
        "synthetic_batch 224x224x3 uint8 (resnet50)": ("resnet50", pipeline_rate(
            lambda s: jax.device_put(synthetic_batch(imagenet, s, seed=0, batch_size=256,
                                                     image_dtype="uint8")),
            256, seconds)),
    }


# ---- report ---------------------------------------------------------------------------------

def mfu(case, batch, step_s, bf16):
    peak = peak_flops(jax.devices()[0].device_kind, bf16)
    if jax.default_backend() != "gpu" or peak is None:
        return None
    name, options, _, hwc, classes, _ = CASES[case]
    macs = summary(models.get(name, num_classes=classes, **options), (batch, *hwc)).total_macs
    return 6 * macs / step_s / peak


def build_parser(gpu: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(c for c, v in CASES.items() if gpu or not v[5]),
                        help=f"comma-separated, from {list(CASES)}")
    parser.add_argument("--frameworks", default="jaxcnn,torch,torch_compile,flax")
    parser.add_argument("--impls", default="auto",
                        help="jaxcnn kernel choices to time, e.g. auto,xla (the first is the "
                             "reference 'jaxcnn' row)")
    parser.add_argument("--bn-grads", default="auto",
                        help="BatchNorm backward forms to time with each impl, from "
                             f"auto,{','.join(F.BATCH_NORM_GRADS)} (see F.batch_norm_train)")
    parser.add_argument("--conv-bn", default="auto",
                        help="Conv -> BatchNorm -> ReLU fusions to time with each of those, "
                             "from auto,off,mosaic (Choices.conv_bn; mosaic needs a Hopper GPU "
                             "to be a benchmark)")
    parser.add_argument("--batch", type=int, default=None,
                        help="override every model's batch (default: 128, resnet50 256)")
    parser.add_argument("--steps", type=int, default=5, help="steps per timed run")
    parser.add_argument("--reps", type=int, default=7, help="timed runs (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--pipeline-seconds", type=float, default=3.0)
    parser.add_argument("--json", help="also write the results here")
    return parser


def main(argv=None):
    gpu = jax.default_backend() == "gpu"
    parser = build_parser(gpu)
    args = parser.parse_args(argv)
    frameworks = args.frameworks.split(",")
    for bn in args.bn_grads.split(","):
        if bn != "auto" and bn not in F.BATCH_NORM_GRADS:
            parser.error(f"--bn-grads: unknown {bn!r}; expected some of "
                         f"{['auto', *F.BATCH_NORM_GRADS]}")
    for cb in args.conv_bn.split(","):
        if cb not in FUSIONS:
            parser.error(f"--conv-bn: unknown {cb!r}; expected some of {list(FUSIONS)}")
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    try:
        import flax
        flax_version = flax.__version__
    except ImportError:
        flax_version = None

    print(f"# {platform.node()}  {jax.devices()[0].device_kind} ({jax.default_backend()}, "
          f"{jax.device_count()} device(s))  jax {jax.__version__}  torch {torch_version}  "
          f"flax {flax_version or 'not installed'}  malloc {malloc_label()}")
    rows, step_rate = [], {}
    for case in args.models.split(","):
        if case not in CASES:
            parser.error(f"--models: unknown {case!r}; expected some of {list(CASES)}")
        bf16 = gpu and case == "resnet50"
        batch = case_batch(case, args)
        variants = [(impl, bn, cb) for impl in args.impls.split(",")
                    for bn in args.bn_grads.split(",") for cb in args.conv_bn.split(",")]
        runs, settings = {}, {}
        for i, (impl, bn, cb) in enumerate(variants):
            label = "jaxcnn" if i == 0 else " ".join(
                ["jaxcnn"] + ([f"impl={impl}"] if impl != variants[0][0] else [])
                + ([f"bn={bn}"] if bn != variants[0][1] else [])
                + ([f"conv_bn={cb}"] if cb != variants[0][2] else []))
            runs[label] = lambda impl=impl, bn=bn, cb=cb: bench_jaxcnn(case, args, bf16, impl, bn,
                                                                       cb)
            settings[label] = {"impl": impl, "bn_grad": bn, "conv_bn": cb}
        if torch_version and "torch" in frameworks and not bf16:
            if _host_memory.configured():
                runs["torch eager"] = lambda: bench_torch_default_malloc(case, args)
                settings["torch eager"] = {"malloc": "default"}
                runs["torch eager +jaxcnn malloc"] = lambda: bench_torch(case, args, compiled=False)
            else:
                runs["torch eager"] = lambda: bench_torch(case, args, compiled=False)
        if torch_version and "torch_compile" in frameworks and gpu:
            runs["torch.compile cl+bf16"] = lambda: bench_torch(case, args, compiled=True)
        if flax_version and "flax" in frameworks:
            runs["flax"] = lambda: bench_flax(case, args, bf16)
        elif "flax" in frameworks and case == args.models.split(",")[0]:
            print("# flax: not installed, skipped")
        times = {}
        for fw, fn in runs.items():
            times[fw] = fn()
            row = {"model": case, "framework": fw, "batch": batch, "dtype": "bf16" if bf16 else "fp32",
                   "step_ms": times[fw] * 1e3, "img_s": batch / times[fw],
                   "vs_jaxcnn": times[fw] / times["jaxcnn"], "mfu": mfu(case, batch, times[fw], bf16),
                   "malloc": malloc_label(),
                   **settings.get(fw, {})}
            rows.append(row)
            print(f"{case:15s} {fw:26s} batch {batch:4d} {row['dtype']}  step {row['step_ms']:9.2f} ms  "
                  f"{row['img_s']:9.1f} img/s  time/jaxcnn {row['vs_jaxcnn']:5.2f}"
                  + (f"  MFU {row['mfu']:.1%}" if row["mfu"] is not None else ""), flush=True)
        step_rate[case] = batch / times["jaxcnn"]

    pipes = []
    for name, (case, rate) in bench_pipelines(args.pipeline_seconds).items():
        ratio = rate / step_rate[case] if case in step_rate else None
        pipes.append({"pipeline": name, "img_s": rate, "vs_step": ratio})
        print(f"pipeline {name:38s} {rate:10.1f} img/s  "
              + (f"{ratio:6.2f}x the jaxcnn step ({'ok' if ratio >= 1.5 else 'BELOW'} goal 1.5x)"
                 if ratio is not None else f"(no {case} step measured here)"), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "torch": torch_version, "flax": flax_version, "argv": sys.argv,
                       "steps": rows, "pipelines": pipes}, f, indent=2)


if __name__ == "__main__":
    main()
