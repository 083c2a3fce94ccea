"""Per-shape block-size tuning, cached in a JSON file per device kind.

Every Triton kernel launch asks :func:`config_for` for its :class:`BlockConfig`,
keyed by the kernel's name and static geometry.  The answer comes from, in
order: an active :func:`override` (used while tuning), the cache entry for
this device kind, or a heuristic default.  The Mosaic GPU (Hopper) kernels look
their tiles up the same way, through one protocol (:func:`mosaic_config`,
:func:`mosaic_part_configs`): each launch is a "Mosaic call" (the dense convolution's
:class:`~pallas_kernels.mgpu_conv.DenseCall`, the pooling and depthwise kernels'
:class:`~pallas_kernels.mgpu_window.WindowCall`) with a ``key``, a ``kernel`` name, a
``dtype``, and ``fit``, ``smem_bytes`` and ``candidates`` for its configuration class
(``MgpuConfig``, ``WindowConfig``: ``to_dict``/``from_dict``); their defaults otherwise.

:func:`tune_op` times candidate configs for each kernel an op launches (it
finds them by tracing the op and recording the lookups), keeps the fastest,
then times the tuned op against the XLA form its caller hands it, forward and
forward+backward, and stores the verdict, which :func:`verdict` reads back.
The caller-facing side (finding a model's calls in the form
:mod:`jaxcnn.functional` looks them up, tuning each once) is
:mod:`jaxcnn.functional.tuning`; this module knows nothing of
:mod:`jaxcnn.functional`.  Nothing here runs unless asked: ``impl="auto"``
only reads :func:`verdict`.

The cache lives at ``$JAXCNN_AUTOTUNE_CACHE`` (default
``~/.cache/jaxcnn/autotune.json``); it is written atomically (temporary file
+ rename) and a corrupt file is ignored with a warning.  Below it,
``pallas_kernels/tuned.json`` ships the measurements of
``scripts/bench_kernels.py --tune`` on the device kinds we have run it on.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import statistics
import tempfile
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import BlockConfig, ConvGeometry, pow2_block

_VERSION = 1
_SMS = 132  # streaming multiprocessors of an H100; only sizes the default split
_memo: dict = {}
_overrides: dict = {}
_recorders: list = []


def cache_path() -> str:
    """The cache file: ``$JAXCNN_AUTOTUNE_CACHE`` or ``~/.cache/jaxcnn/autotune.json``."""
    return os.environ.get("JAXCNN_AUTOTUNE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxcnn", "autotune.json")


def device_kind() -> str:
    """The device kind the cache is keyed by (e.g. ``"NVIDIA H100 80GB HBM3"``, ``"cpu"``)."""
    return jax.devices()[0].device_kind


def load_cache(path: str | None = None) -> dict:
    """The cache as ``{device_kind: {"kernels": {...}, "ops": {...}}}``; {} if absent or corrupt."""
    path = path or cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"autotune cache {path} is unreadable ({e}); ignoring it", stacklevel=2)
        return {}
    ok = (isinstance(data, dict) and data.get("version") == _VERSION
          and isinstance(data.get("devices"), dict)
          and all(isinstance(v, dict) and isinstance(v.get("kernels", {}), dict)
                  and isinstance(v.get("ops", {}), dict) for v in data["devices"].values()))
    if not ok:
        warnings.warn(f"autotune cache {path} has an unexpected layout; ignoring it",
                      stacklevel=2)
        return {}
    return data["devices"]


def save_cache(devices: dict, path: str | None = None) -> None:
    """Writes the cache atomically: a temporary file in the same folder, then a rename."""
    path = path or cache_path()
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".autotune-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"version": _VERSION, "devices": devices}, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    for key in [k for k in _memo if k[0] == path]:
        del _memo[key]


SHIPPED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned.json")


def _entries() -> dict:
    """This device kind's entries: the user's cache over the shipped measurements."""
    path, kind = cache_path(), device_kind()
    if (path, kind) not in _memo:  # merged once: every op asks at trace time
        shipped, user = (load_cache(f).get(kind, {}) for f in (SHIPPED, path))
        _memo[path, kind] = {part: {**shipped.get(part, {}), **user.get(part, {})}
                             for part in ("kernels", "ops")}
    return _memo[path, kind]


def kernel_key(kernel: str, g: ConvGeometry, co: int, dtype) -> str:
    """Cache key of one kernel launch: its name, geometry, output channels, dtype."""
    dims = ",".join(f"{k}={v}" for k, v in g._asdict().items())
    return f"{kernel}|{dims},co={co}|{jnp.dtype(dtype).name}"


def default_config(kernel: str, g: ConvGeometry, co: int, interpret: bool) -> BlockConfig:
    """Heuristic tiles. The interpreter favours few, large blocks (each grid step is slow)."""
    family, part = kernel.rsplit("_", 1)
    bm = 128 if interpret else 64
    hi = 128 if interpret else 64
    if family == "dense":
        c_out, c_red = (g.c, co) if part == "dgrad" else (co, g.c)
        cfg = BlockConfig(block_m=bm, block_n=pow2_block(c_out, 16, hi),
                          block_k=pow2_block(c_red, 16, 64 if interpret else 32))
    else:
        cfg = BlockConfig(block_m=bm, block_n=pow2_block(g.c, 16, hi), block_k=16)
    if part == "wgrad":
        chunks = -(-g.m_out // cfg.block_m)
        if family == "dense":  # a program per (tap, C_in tile, C_out tile, split)
            tiles = g.taps * -(-co // cfg.block_n) * -(-g.c // cfg.block_k)
        else:  # depthwise: a program per (channel tile, split), every tap in it
            tiles = -(-co // cfg.block_n)
        # About two programs per SM; depthwise may have a single channel tile to split.
        want = 2 if interpret else pow2_block(-(-2 * _SMS // tiles), 1,
                                              64 if family == "dense" else 256)
        cfg = BlockConfig(**{**cfg.to_dict(), "split": max(1, min(want, chunks))})
    return cfg


def lookup(key: str, launch: tuple):
    """Records ``launch`` (``(kernel, g, co, dtype)``) under ``key`` for :func:`tune_op`, then
    returns the :func:`override` for ``key``, else this device kind's cached entry (a
    dict), else None.  A pure lookup: safe inside any trace.

    ``g`` is a :class:`ConvGeometry` for the Triton kernels, a Mosaic call (see the module
    docstring) for the Mosaic GPU kernels, which look their tiles up through here too
    (:func:`mosaic_config`) and list their own candidates."""
    for rec in _recorders:
        rec[key] = launch
    if key in _overrides:
        return _overrides[key]
    return _entries().get("kernels", {}).get(key)


def config_for(kernel: str, g: ConvGeometry, co: int, dtype, interpret: bool) -> BlockConfig:
    """The tiles for one kernel launch: override, else cached, else default."""
    key = kernel_key(kernel, g, co, dtype)
    cached = lookup(key, (kernel, g, co, jnp.dtype(dtype)))
    if cached is not None and not isinstance(cached, dict):  # an override
        return cached
    if cached is not None:
        try:
            return BlockConfig.from_dict(cached)
        except (TypeError, ValueError) as e:
            warnings.warn(f"autotune cache entry {key!r} is invalid ({e}); using the default")
    return default_config(kernel, g, co, interpret)


def mosaic_config(call, cls):
    """The tuned ``cls`` (``MgpuConfig``, ``WindowConfig``) of one Mosaic GPU launch ``call``
    on this device kind: an active :func:`override`, else the cached entry (the user's cache
    over ``tuned.json``), else None.  A malformed entry warns, naming its key, and gives
    None (the caller's default).  The launch is recorded for :func:`tune_op`, which times
    ``call.candidates()``.  A pure lookup: safe inside any trace."""
    found = lookup(call.key, (call.kernel, call, None, jnp.dtype(call.dtype)))
    if found is None or isinstance(found, cls):
        return found
    try:
        if not isinstance(found, dict):
            raise TypeError(f"{type(found).__name__}, not a {cls.__name__}")
        return cls.from_dict(found)
    except (TypeError, ValueError) as e:
        warnings.warn(f"autotune cache entry {call.key!r} is invalid ({e}); using the default",
                      stacklevel=3)
        return None


def mosaic_part_configs(op: str, config, calls: dict, cls, default) -> tuple:
    """The tiles of each part of a Mosaic GPU op, in the order of ``calls`` (``{part: Mosaic
    call}``): ``config`` (one ``cls`` for all parts, or a dict by part) wins; a part not
    given takes its tuned tiles (:func:`mosaic_config`), else ``default``."""
    if isinstance(config, cls):
        return (config,) * len(calls)
    config = dict(config or {})
    unknown = set(config) - set(calls)
    if unknown:
        raise ValueError(f"{op}: unknown config keys {sorted(unknown)}")
    return tuple(config.get(part) or mosaic_config(call, cls) or default
                 for part, call in calls.items())


@contextlib.contextmanager
def override(configs: dict):
    """Within the block, :func:`config_for` returns ``configs[key]`` for those keys."""
    saved = dict(_overrides)
    _overrides.update(configs)
    try:
        yield
    finally:
        _overrides.clear()
        _overrides.update(saved)


@contextlib.contextmanager
def _recording():
    rec: dict = {}
    _recorders.append(rec)
    try:
        yield rec
    finally:
        _recorders.remove(rec)


def candidates(kernel: str, g: ConvGeometry, co: int) -> list:
    """Configs worth timing for one kernel (deduplicated after fitting the shape).

    A Mosaic GPU kernel's launch (``g`` a Mosaic call, recorded by its lookup: a
    :class:`~pallas_kernels.mgpu_conv.DenseCall` or
    :class:`~pallas_kernels.mgpu_window.WindowCall`) lists its own fitted candidates;
    :func:`tune_op` leaves out those over the device's shared memory
    (:func:`launch_smem_bytes`)."""
    if not isinstance(g, ConvGeometry):
        return g.candidates()
    family, part = kernel.rsplit("_", 1)
    base = default_config(kernel, g, co, interpret=False)
    if family == "dense":  # implicit GEMM: wide reduction chunks feed the tensor cores
        tiles = [(64, 64, 32, 4, 2), (128, 64, 32, 4, 3), (128, 64, 64, 4, 3),
                 (128, 128, 64, 8, 3), (64, 128, 64, 4, 3), (256, 64, 64, 8, 3),
                 (64, 64, 64, 4, 4), (128, 128, 32, 8, 4),
                 # Hopper-sized tiles (two warpgroups, deeper pipelines), for wide layers.
                 (128, 128, 64, 4, 4), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3)]
    else:  # depthwise and pooling: elementwise over (pixels, channels) tiles
        tiles = [(32, 32, 16, 4, 2), (64, 32, 16, 4, 2), (128, 32, 16, 4, 2),
                 (64, 64, 16, 4, 2), (256, 32, 16, 8, 2), (32, 128, 16, 4, 2),
                 (256, 64, 16, 8, 2)]
    # Weight gradients: the default split and four times it (more programs, shorter sums).
    splits = (base.split, 4 * base.split) if part == "wgrad" else (base.split,)
    out = []
    for bm, bn, bk, warps, stages in tiles:
        if family == "dense":
            c_out, c_red = (g.c, co) if part == "dgrad" else (co, g.c)
        else:
            c_out, c_red = g.c, 16
        widest = 256 if family == "dense" else 128
        bn, bk = min(bn, pow2_block(c_out, 16, widest)), min(bk, pow2_block(c_red, 16, 64))
        if kernel == "depthwise_wgrad" and bm * bn > 32 * 32 * warps:
            continue  # every tap's tile is live at once: past 32 values a thread, it spills
        for split in splits:
            split = max(1, min(split, -(-g.m_out // bm), 512))
            cfg = BlockConfig(bm, bn, bk, warps, stages, split)
            if cfg not in out:
                out.append(cfg)
    return out


# The most shared memory one program may use (the opt-in maximum), by CUDA compute
# capability; other GPUs get the smallest current figure.
_SHARED_MEMORY = {(8, 0): 163 * 1024, (8, 7): 163 * 1024, (9, 0): 227 * 1024,
                  (10, 0): 227 * 1024, (10, 3): 227 * 1024}
_SHARED_MEMORY_OTHER = 99 * 1024


def shared_memory_limit() -> int | None:
    """Bytes of shared memory a kernel program may use on the default device (None off GPUs)."""
    if jax.default_backend() != "gpu":
        return None
    capability = getattr(jax.devices()[0], "compute_capability", "")
    try:
        major, minor = (int(v) for v in str(capability).split("."))
    except ValueError:
        return _SHARED_MEMORY_OTHER
    return _SHARED_MEMORY.get((major, minor), _SHARED_MEMORY_OTHER)


def shared_memory_estimate(kernel: str, cfg: BlockConfig, dtype) -> int:
    """Bytes of shared memory Triton gives a kernel's pipelined GEMM operand tiles.

    ``num_stages`` copies of both operand tiles: ``(block_m, block_k)`` and
    ``(block_k, block_n)`` for the forward and input-gradient GEMMs,
    ``(block_m, block_k)`` and ``(block_m, block_n)`` for the weight gradient.
    The elementwise kernels (depthwise, pooling) stage nothing. It equals
    what Triton 3.6 allocates for sm_90 in every config checked, or exceeds
    it (``tests/pallas/test_pallas_ptx.py``).
    """
    family, part = kernel.rsplit("_", 1)
    if family != "dense":
        return 0
    a = cfg.block_m * cfg.block_k
    b = cfg.block_m * cfg.block_n if part == "wgrad" else cfg.block_k * cfg.block_n
    return cfg.num_stages * (a + b) * jnp.dtype(dtype).itemsize


def launch_smem_bytes(kernel: str, g, cfg, dtype) -> int:
    """Shared memory of one recorded launch with ``cfg``: :func:`shared_memory_estimate` for
    the Triton kernels, the kernel's own count (``g.smem_bytes``) for the Mosaic ones
    (``g`` a Mosaic call)."""
    if isinstance(g, ConvGeometry):
        return shared_memory_estimate(kernel, cfg, dtype)
    return g.smem_bytes(cfg)


def time_call(fn, *args, repeats: int = 5) -> float:
    """Median wall time (seconds) of ``fn(*args)`` after a compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _random_like(args, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for a in args:
        if a is None:
            out.append(None)
        elif jnp.issubdtype(a.dtype, jnp.floating):
            out.append(jnp.asarray(rng.standard_normal(a.shape), a.dtype))
        else:
            out.append(jnp.asarray(rng.integers(-8, 8, a.shape), a.dtype))
    return out


def _loss_grad(fn, args):
    """``jit(grad(loss))`` of ``sum(out ** 2)`` over every floating output of ``fn``, with
    respect to every floating argument of ``args`` (the concrete arguments): each gradient
    kernel's result is used, so none is dropped as dead code (jit drops the Mosaic weight
    gradients unless ``w`` is among the arguments differentiated)."""
    argnums = tuple(i for i, a in enumerate(args)
                    if a is not None and jnp.issubdtype(a.dtype, jnp.floating))

    def loss(*a):
        return sum(jnp.sum(o.astype(jnp.float32) ** 2) for o in jax.tree.leaves(fn(*a))
                   if jnp.issubdtype(o.dtype, jnp.floating))
    return jax.jit(jax.grad(loss, argnums=argnums))


def compile_threads() -> int:
    """Threads compiling candidate configs at once: ``$JAXCNN_AUTOTUNE_COMPILE_THREADS``, else
    the CPU count up to 8.  Compiling (XLA, Triton, ptxas) dominates tuning and runs
    outside Python's lock; the timing itself stays sequential."""
    env = os.environ.get("JAXCNN_AUTOTUNE_COMPILE_THREADS")
    if env is None:
        return max(1, min(8, os.cpu_count() or 1))
    try:
        n = int(env)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"JAXCNN_AUTOTUNE_COMPILE_THREADS must be a positive integer, got {env!r}")
    return n


def _skipped(kernel: str, cfg: BlockConfig, e: Exception) -> None:
    warnings.warn(f"autotune: {kernel} {cfg} failed: {type(e).__name__}: {e}")


def _compile_candidates(kernel: str, key: str, cfgs, chosen: dict, bench, args):
    """``[(cfg, compiled)]`` for the candidates that lower and compile; the others are
    skipped with a warning.  Tracing reads the global overrides, so it runs here, one
    config at a time; the compilations then run on :func:`compile_threads` threads."""
    lowered = []
    for cfg in cfgs:
        with override({**chosen, key: cfg}):
            try:
                lowered.append((cfg, bench(kernel).lower(*args)))
            except Exception as e:  # a config the lowering rejects
                _skipped(kernel, cfg, e)

    def build(item):
        cfg, low = item
        try:
            return cfg, low.compile()
        except Exception as e:  # a config the compiler rejects
            return cfg, e

    threads = min(compile_threads(), len(lowered))
    if threads > 1:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            built = list(pool.map(build, lowered))
    else:
        built = [build(item) for item in lowered]
    out = []
    for cfg, result in built:
        if isinstance(result, Exception):
            _skipped(kernel, cfg, result)
        else:
            out.append((cfg, result))
    return out


def op_key(op: str, arrays, static: dict) -> str:
    """Cache key of a whole op call: its name, array shapes/dtypes and static arguments."""
    shapes = ";".join("none" if a is None else f"{jnp.dtype(a.dtype).name}{list(a.shape)}"
                      for a in arrays)
    kw = ",".join(f"{k}={static[k]!r}" for k in sorted(static))
    return f"{op}|{shapes}|{kw}"


def _is_forward(kernel: str) -> bool:
    """Whether a tuned kernel runs in the forward pass (``dense_fwd``, ``mgpu_max_pool_fwd``,
    the fused ``mgpu_conv_fwd_bnrelu_stats``): timed without a gradient."""
    return "fwd" in kernel.split("_")


def tune_kernels(run, arrays, *, timer=time_call, candidate_fn=candidates) -> dict:
    """Times the candidate configs of every kernel ``run(*arrays)`` looks up (found by
    tracing it and recording the lookups) and returns ``{key: fastest config}``.

    A forward kernel is timed by the forward alone, another by ``jit(grad)`` of a loss of
    every floating output of ``run`` with respect to every floating argument.  Kernels are
    tuned one after the other, each timed with the ones before it at their chosen configs.
    Nothing is saved (:func:`store_kernels`).

    Arguments:
        run: a function of the arrays launching the kernels (the op with its keywords).
        arrays: concrete or abstract arrays; only shapes and dtypes are used, random data
            is timed.
        timer, candidate_fn: as :func:`tune_op`'s.
    """
    args = _random_like(arrays)
    differentiable = jnp.issubdtype(args[0].dtype, jnp.floating)

    def bench(kernel):
        # A fresh function each time, so the trace sees the current override.
        if _is_forward(kernel) or not differentiable:
            return jax.jit(lambda *a: run(*a))
        return _loss_grad(lambda *a: run(*a), args)

    with _recording() as launched:
        jax.eval_shape(run, *args)
    chosen: dict = {}
    limit = shared_memory_limit()
    for key, (kernel, g, co, dtype) in sorted(launched.items()):
        # A config whose pipelined tiles overflow shared memory would fail to launch.
        cfgs = [c for c in candidate_fn(kernel, g, co)
                if limit is None or launch_smem_bytes(kernel, g, c, dtype) <= limit]
        best = None
        for cfg, compiled in _compile_candidates(kernel, key, cfgs, chosen, bench, args):
            with override({**chosen, key: cfg}):
                try:
                    t = timer(compiled, *args)
                except Exception as e:  # e.g. a launch the device refuses
                    _skipped(kernel, cfg, e)
                    continue
            if best is None or t < best[0]:
                best = (t, cfg)
        if best is not None:
            chosen[key] = best[1]
    return chosen


def store_kernels(chosen: dict) -> None:
    """Saves :func:`tune_kernels`' ``{key: config}`` in the user's cache under this device
    kind, where :func:`config_for` and :func:`mosaic_config` find them."""
    devices = load_cache()
    mine = devices.setdefault(device_kind(), {"kernels": {}, "ops": {}})
    mine.setdefault("kernels", {}).update({k: c.to_dict() for k, c in chosen.items()})
    save_cache(devices)


def tune_op(op: str, arrays, static: dict, *, xla, timer=time_call,
            candidate_fn=candidates) -> dict:
    """Tunes every kernel ``pallas_kernels.<op>`` launches, then races it against ``xla``.

    Arguments:
        op: ``"conv2d"``, ``"max_pool2d"`` or ``"avg_pool2d"``.
        arrays: the op's array arguments (concrete or abstract; only shapes and
            dtypes are used, random data is timed).
        static: its keyword arguments, in the form the cache is keyed by
            (:func:`jaxcnn.functional.tuning.tune_op` puts any call in that form).
            ``backend="mosaic"`` in ``static`` times the Mosaic GPU (Hopper) kernels
            and keys the entry so (the dense convolution's forward, input- and
            weight-gradient tiles, the pooling and depthwise window kernels' tiles);
            without it the Triton kernels run.
        xla: the XLA form of the same call, a function of ``arrays``.
        timer: ``timer(fn, *args) -> seconds``; ``fn`` is a compiled executable
            for each candidate config (compiled ahead, several at once), a jitted
            function for the final race against XLA.
        candidate_fn: ``candidate_fn(kernel, g, co) -> [config]``: ``BlockConfig`` s for the
            Triton kernels; for the Mosaic kernels, whose launches record a Mosaic call as
            ``g`` (``co`` None), ``MgpuConfig`` s or ``WindowConfig`` s.

    Returns:
        The op's cache entry ``{"pallas_s", "xla_s", "pallas_grad_s", "xla_grad_s",
        "fwd_faster", "grad_faster", "pallas_faster"}``; kernel choices and this
        entry are saved to the cache under :func:`op_key`.  The gradient times are of
        every floating argument's gradient (the weights' included).
    """
    import pallas_kernels  # the ops import this module

    # An entry without "backend" is a measurement of the Triton kernels (what impl="auto"
    # reads it as); one keyed with backend="mosaic" times the Hopper kernels.
    run_static = {"backend": "triton", **static}

    def run_pallas(*a):
        return getattr(pallas_kernels, op)(*a, **run_static)

    chosen = tune_kernels(run_pallas, arrays, timer=timer, candidate_fn=candidate_fn)
    args = _random_like(arrays)
    differentiable = jnp.issubdtype(args[0].dtype, jnp.floating)
    with override(chosen):
        entry = {"pallas_s": timer(jax.jit(lambda *a: run_pallas(*a)), *args),
                 "xla_s": timer(jax.jit(xla), *args)}
        if differentiable:
            entry["pallas_grad_s"] = timer(_loss_grad(lambda *a: run_pallas(*a), args), *args)
            entry["xla_grad_s"] = timer(_loss_grad(xla, args), *args)
    entry["fwd_faster"] = bool(entry["pallas_s"] < entry["xla_s"])
    entry["grad_faster"] = bool(entry["pallas_grad_s"] < entry["xla_grad_s"]) if (
        differentiable) else entry["fwd_faster"]
    entry["pallas_faster"] = entry["fwd_faster"] and entry["grad_faster"]
    store_kernels(chosen)
    devices = load_cache()
    devices.setdefault(device_kind(), {"kernels": {}, "ops": {}}).setdefault(
        "ops", {})[op_key(op, arrays, static)] = entry
    save_cache(devices)
    return entry


def store_op_entry(op: str, arrays, static: dict, entry: dict) -> str:
    """Saves a measured race ``entry`` (``fwd_faster``, ``grad_faster`` and the timings) for
    this op call under this device kind in the user's cache, where :func:`verdict` finds
    it; returns the key.  For ops timed outside :func:`tune_op` (the fused BatchNorm
    convolutions of ``scripts/bench_mgpu.py --fused --tune``)."""
    key = op_key(op, arrays, static)
    devices = load_cache()
    mine = devices.setdefault(device_kind(), {"kernels": {}, "ops": {}})
    mine.setdefault("ops", {})[key] = dict(entry)
    save_cache(devices)
    return key


def verdict(op: str, arrays, static: dict) -> tuple[bool, bool] | None:
    """``(forward faster, forward+backward faster)`` cached for this op call on this
    device kind (the user's cache, then the shipped table), or None if never measured.
    A pure lookup: safe inside any trace."""
    entry = _entries().get("ops", {}).get(op_key(op, arrays, static))
    if entry is None:
        return None
    return bool(entry.get("fwd_faster", False)), bool(entry.get("grad_faster", False))


def any_win(op: str) -> bool:
    """Whether this device kind's cache holds a forward + backward win of any call of ``op``:
    a cheap check before looking calls up one by one (a pure lookup, safe inside any trace)."""
    prefix = op + "|"
    return any(k.startswith(prefix) and entry.get("grad_faster", False)
               for k, entry in _entries().get("ops", {}).items())


def supported(op: str, arrays, static: dict) -> bool:
    """Whether a kernel exists for this call (e.g. not for grouped, non-depthwise convs)."""
    import pallas_kernels
    abstract = [None if a is None else jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
    try:
        jax.eval_shape(lambda *a: getattr(pallas_kernels, op)(*a, **static), *abstract)
    except (NotImplementedError, ValueError):
        return False
    return True
