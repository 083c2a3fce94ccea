#!/usr/bin/env python3
"""Images per second of the image input pipeline alone: read, decode, augment, batch.

    python scripts/bench_data.py                      # 512 generated 224x224 JPEGs, batch 64
    python scripts/bench_data.py --workers 1,2,4      # the worker counts to time
    python scripts/bench_data.py --json out.json      # also write the rows as JSON

Writes ``--images`` JPEGs of ``--size`` x ``--size`` pixels (smooth gradients, shapes and
mild noise, quality 90: about the bytes per pixel of ImageNet's photos) to a temporary
image folder, then times, in this one run:

* ``plain loop``: one process, no jaxcnn: for each image of a batch, read the file, decode it
  with Pillow, convert to RGB, random-resized crop (torchvision's rule) with a bilinear
  resize to 224x224, random flip, into a ``uint8`` batch array. The baseline.
* ``jaxcnn workers=N``: `jaxcnn.data.Loader` over `TrainBatches` (the trainer's pipeline:
  the same work, with the full-decode check and per-example generators) with N grain worker
  processes (0: in this process).

The rows are timed in turn, ``--repeats`` rounds, and each reports its best round. Each
pipeline first makes enough batches to fill its workers' buffers (start-up, and the
batches made during it, are not counted), then is timed over ``--steps`` batches. Ratios:
each row against the plain loop, and 2 workers against 1 (the goals are >= 0.9x and >= 1.8x
on 2 idle cores). ``CPU ms/img here`` is the CPU time of this process per image: for the
plain loop and 0 workers the whole cost of an image, which other work on the machine does
not inflate as it does wall time. The per-core figure is 1 worker's images/s; the cores a GPU needs at
``--target`` images/s is the target over it. The load average is printed: on a machine other
work shares, the multi-worker figures are an underestimate.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import platform
import random
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def write_jpegs(root, count, size, seed=0, classes=4):
    """``count`` JPEGs of ``size`` x ``size`` in ``root/train/<class>/``; returns their paths."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    paths = []
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for n in range(count):
        folder = os.path.join(root, "train", f"c{n % classes}")
        os.makedirs(folder, exist_ok=True)
        a, b, c = rng.uniform(0, 255, size=(3, 3))
        base = np.stack([a[i] * xx + b[i] * yy + c[i] * (1 - xx) for i in range(3)], -1) / 2
        base += rng.normal(0, 6, size=base.shape)
        image = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for _ in range(4):
            x0, y0 = (int(v) for v in rng.integers(0, size - 20, 2))
            x1, y1 = x0 + int(rng.integers(10, size - x0)), y0 + int(rng.integers(10, size - y0))
            draw.ellipse((x0, y0, x1, y1), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
        path = os.path.join(folder, f"{n:06d}.jpg")
        image.save(path, quality=90)
        paths.append(path)
    return paths


def plain_loop(paths, batch_size, steps, out_size, seed=0):
    """The baseline: a single-process Pillow loop doing the pipeline's work.
    Returns (images/s, CPU seconds per image)."""
    from PIL import Image

    rnd = random.Random(seed)
    order = list(range(len(paths)))
    log_lo, log_hi = math.log(3 / 4), math.log(4 / 3)

    def crop_box(width, height):
        area = width * height
        for _ in range(10):
            target = area * rnd.uniform(0.08, 1.0)
            aspect = math.exp(rnd.uniform(log_lo, log_hi))
            w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                top, left = rnd.randint(0, height - h), rnd.randint(0, width - w)
                return left, top, left + w, top + h
        return 0, 0, width, height

    t0 = c0 = None
    for step in range(steps + 1):  # the first batch warms up (Pillow's decoders load lazily): untimed
        if step == 1:
            t0, c0 = time.perf_counter(), time.process_time()
        rnd.shuffle(order) if step * batch_size % len(paths) == 0 else None
        batch = np.empty((batch_size, out_size, out_size, 3), np.uint8)
        for k in range(batch_size):
            with open(paths[order[(step * batch_size + k) % len(paths)]], "rb") as f:
                image = Image.open(io.BytesIO(f.read()))
                image.load()
            image = image.convert("RGB")
            array = np.asarray(image.crop(crop_box(*image.size)).resize((out_size, out_size), Image.BILINEAR))
            batch[k] = array[:, ::-1] if rnd.random() < 0.5 else array
    return batch_size * steps / (time.perf_counter() - t0), (time.process_time() - c0) / (batch_size * steps)


def pipeline(root, batch_size, steps, out_size, workers, buffer=2, shared_memory=True):
    """jaxcnn's loader with ``workers`` processes. Returns (images/s, start-up seconds, CPU
    seconds per image of this process: the whole cost with 0 workers)."""
    from jaxcnn.data.folder import FolderSource, scan_split
    from jaxcnn.data.loader import Loader, TrainBatches

    source = FolderSource(scan_split(root, "train"))
    maker = TrainBatches(source, seed=0, batch_size=batch_size, image_size=(out_size, out_size))
    warm = max(1, workers * (buffer + 1))
    t_start = time.perf_counter()
    with Loader(maker, 0, warm + steps, workers=workers, buffer=buffer, shared_memory=shared_memory) as loader:
        for _ in range(warm):
            next(loader)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            batch = next(loader)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    assert batch["image"].shape == (batch_size, out_size, out_size, 3)
    return batch_size * steps / elapsed, t0 - t_start, cpu / (batch_size * steps)


def versions():
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for name in ("pillow", "numpy", "grain", "array-record"):
        try:
            out[name] = version(name)
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--size", type=int, default=224, help="side of the generated JPEGs")
    parser.add_argument("--crop", type=int, default=224, help="side of the training crops")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8, help="timed batches per pipeline")
    parser.add_argument("--workers", default=None, help="comma-separated worker counts (default 0,1,2,ncpu)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each row reports its best")
    parser.add_argument("--pipes", action="store_true",
                        help="workers hand batches over pickled through pipes, not the shared-memory ring "
                             "(Loader's shared_memory=False)")
    parser.add_argument("--target", type=float, default=7000.0, help="images/s a GPU consumes")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cores = os.cpu_count() or 1
    workers = ([0, 1, 2] + ([cores] if cores > 2 else [])) if args.workers is None else \
        [int(w) for w in args.workers.split(",")]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"bench_data: {args.images} JPEGs {args.size}x{args.size} -> crops {args.crop}x{args.crop}, batch "
          f"{args.batch}, {args.steps} timed batches; {cores} cores, load average {load:.2f} at start; "
          f"{json.dumps(versions())}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxcnn-bench-data-") as root:
        paths = write_jpegs(root, args.images, args.size)
        mb = sum(os.path.getsize(p) for p in paths) / len(paths) / 1e3
        print(f"  mean JPEG {mb:.1f} kB")
        rates = {None: []} | {w: [] for w in workers}
        cpus = {None: []} | {w: [] for w in workers}
        startups = {w: [] for w in workers}
        for _ in range(args.repeats):  # interleaved, so a burst of other work hits every row alike
            rate, cpu = plain_loop(paths, args.batch, args.steps, args.crop)
            rates[None].append(rate)
            cpus[None].append(cpu)
            for w in workers:
                rate, startup, cpu = pipeline(root, args.batch, args.steps, args.crop, w,
                                              shared_memory=not args.pipes)
                rates[w].append(rate)
                cpus[w].append(cpu)
                startups[w].append(startup)
        plain = max(rates[None])
        rows.append({"name": "plain loop", "workers": None, "images_per_s": plain, "all": rates[None],
                     "cpu_ms_per_image": 1e3 * min(cpus[None])})
        for w in workers:
            rows.append({"name": f"jaxcnn workers={w}", "workers": w, "images_per_s": max(rates[w]),
                         "all": rates[w], "startup_s": min(startups[w]), "cpu_ms_per_image": 1e3 * min(cpus[w])})
    one = next((r["images_per_s"] for r in rows if r["workers"] == 1), None)
    print(f"{'pipeline':<22}{'images/s':>10}{'vs plain':>10}{'vs 1 worker':>13}{'start-up s':>12}"
          f"{'CPU ms/img here':>17}")
    for r in rows:
        r["vs_plain"] = r["images_per_s"] / plain
        r["vs_one_worker"] = r["images_per_s"] / one if one else None
        print(f"{r['name']:<22}{r['images_per_s']:>10.1f}{r['vs_plain']:>9.2f}x"
              f"{'' if r['vs_one_worker'] is None else format(r['vs_one_worker'], '.2f') + 'x':>13}"
              f"{'' if 'startup_s' not in r else format(r['startup_s'], '.1f'):>12}"
              f"{r['cpu_ms_per_image']:>17.3f}")
    load_end = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    summary = {"cores": cores, "load_average_start": load, "load_average_end": load_end,
               "versions": versions(), "args": vars(args), "rows": rows}
    if one:
        summary["per_core_images_per_s"] = one
        summary["cores_for_target"] = args.target / one
        print(f"per core (1 worker): {one:.0f} images/s; {args.target:.0f} images/s needs about "
              f"{math.ceil(args.target / one)} such cores; load average {load_end:.2f} at the end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
