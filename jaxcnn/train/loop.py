"""The training loop: config -> data -> model -> step -> loop.

Read top to bottom, :func:`train` is one training run: it builds a
:class:`Run` (model, data, optimiser, policy, loss scale) from a validated
config, restores or initialises the :class:`TrainState`, and loops over pure
``train_step`` calls, logging, evaluating and checkpointing between them.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from jaxcnn import _host_memory, interop, models, parallel
from jaxcnn import precision as P
from jaxcnn.data import (Prefetcher, SyntheticSpec, eval_batches, load_dataset, steps_per_epoch,
                         synthetic_batch, synthetic_dataset, train_batch)
from jaxcnn.data.files import check_regular_file
from jaxcnn.data.dataset import DataError
from jaxcnn.errors import WorkdirError  # importable from here too, where it was defined before
from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD
from jaxcnn.train.checkpoint import (CheckpointManager, check_resume_config, record_run_config,
                                     restore_for_resume)
from jaxcnn.train.config import ConfigError, resolve_duration, to_dict, train_steps
from jaxcnn.train.metrics import MetricsWriter, Progress
from jaxcnn.train.optim import build_optimizer
from jaxcnn.train.state import MasterCopyState, TrainState, create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step


# Synthetic training sets up to this many bytes (uint8 pixels) are generated once and
# held in memory; larger ones (ImageNet-shaped throughput runs) are made per step.
_SYNTHETIC_IN_MEMORY_BYTES = 256 * 2**20


_CONFIG_KEY = re.compile(r"[a-z_][a-z0-9_]*(\.[A-Za-z0-9_]+)+")


def _raised_in_parallel(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_globals.get("__name__", "").startswith("jaxcnn.parallel")


@contextlib.contextmanager
def parallel_config_errors():
    """Around the trainer's calls into :mod:`jaxcnn.parallel`: its ``ValueError``s become
    :class:`ConfigError`s.

    ``jaxcnn.parallel`` knows nothing of configs; a setting it cannot run is a plain
    ``ValueError`` raised there, whose message starts with the config key at fault
    (``"mesh.model: 3 does not divide the 8 available devices"``). Here it becomes a
    :class:`ConfigError` with that message and ``path`` (so ``jaxcnn-train`` prints one line
    and exits 2); any other error, a ``ValueError`` from deeper down included, passes as it is.
    """
    try:
        yield
    except ValueError as e:
        if isinstance(e, ConfigError) or not _raised_in_parallel(e):
            raise
        message = str(e)
        key = message.split(":", 1)[0]
        raise ConfigError(message, path=key if _CONFIG_KEY.fullmatch(key) else "") from None


class TrainingStopped(RuntimeError):
    """Training stopped early: a non-finite loss under ``nan_policy: stop``."""


class Run(NamedTuple):
    """Everything a run builds from its config before the first step."""

    cfg: Any
    model: Any
    dataset: Any            # a jaxcnn.data.Dataset, or None for on-the-fly synthetic batches
    synthetic: Any          # SyntheticSpec when batches are generated per step, else None
    input_shape: tuple      # (global batch, H, W, C)
    num_classes: int
    steps_per_epoch: int
    total_steps: int
    tx: Any
    schedule: Any
    policy: Any
    loss_scale: Any
    data_seed: int


def _model_defaults(name: str):
    try:
        return models.default_input_shape(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"model.name: {e}", path="model.name") from None


def build_run(cfg) -> Run:
    """Build model, data, optimiser, policy and loss scale from a validated config.

    Raises ``ConfigError`` (or ``jaxcnn.data.DataError``) for anything the
    config asks that cannot be done, before any computation.
    """
    if cfg.model.name not in models.names():
        from difflib import get_close_matches
        close = get_close_matches(cfg.model.name, models.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"model.name: unknown model {cfg.model.name!r}{hint}; expected one of "
                          f"{models.names()}", path="model.name")
    try:
        policy = P.get_policy(cfg.precision.policy, dict(cfg.precision.overrides))
    except ValueError as e:
        raise ConfigError(f"precision.policy: {e}", path="precision.policy") from None
    data_seed = cfg.train.seed if cfg.data.seed is None else cfg.data.seed
    batch_size = cfg.data.batch_size

    dataset, synthetic = None, None
    if cfg.data.source == "synthetic":
        image_shape = tuple(cfg.data.image_size or _model_defaults(cfg.model.name)[1:])
        num_classes = cfg.data.num_classes or cfg.model.num_classes or 10
        spec = SyntheticSpec(image_shape=image_shape, num_classes=num_classes)
        image_bytes = int(np.prod(image_shape))
        if cfg.data.num_train * image_bytes <= _SYNTHETIC_IN_MEMORY_BYTES:
            if (cfg.data.num_train + cfg.data.num_eval) * image_bytes > 2 * _SYNTHETIC_IN_MEMORY_BYTES:
                raise ConfigError(f"data.num_eval: {cfg.data.num_eval} synthetic test images of shape "
                                  f"{image_shape} would take more than the "
                                  f"{2 * _SYNTHETIC_IN_MEMORY_BYTES >> 20} MiB held in memory",
                                  path="data.num_eval")
            # Small enough to hold: a fixed set the model can fit, with a test split to evaluate.
            dataset = synthetic_dataset(spec, num_train=cfg.data.num_train,
                                        num_test=cfg.data.num_eval, seed=data_seed)
        else:
            synthetic = spec  # throughput runs: fresh images every step, never materialised
        if cfg.data.num_train < batch_size:
            raise ConfigError(f"data.batch_size: {batch_size} is larger than the training set "
                              f"(data.num_train={cfg.data.num_train})", path="data.batch_size")
        per_epoch = max(1, cfg.data.num_train // batch_size)
    else:
        path = cfg.data.path
        if path is not None and not os.path.exists(path):
            raise ConfigError(f"data.path: {path!r} does not exist", path="data.path")
        if cfg.data.source == "npz":  # a device or FIFO is never data: /dev/zero ran into the OOM killer
            check_regular_file(path, "data.path")
        dataset = load_dataset(cfg.data.source, path)
        image_shape = dataset.image_shape
        num_classes = dataset.num_classes
        if cfg.model.num_classes is not None and cfg.model.num_classes < num_classes:
            raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is smaller than the "
                              f"dataset's {num_classes} classes", path="model.num_classes")
        num_classes = cfg.model.num_classes or num_classes
        if len(dataset.x_train) < batch_size:
            raise ConfigError(f"data.batch_size: {batch_size} is larger than the training set "
                              f"({len(dataset.x_train)} images)", path="data.batch_size")
        per_epoch = steps_per_epoch(len(dataset.x_train), batch_size)

    try:
        model = models.get(cfg.model.name, num_classes=num_classes, **dict(cfg.model.options))
    except (TypeError, ValueError) as e:  # unknown or ill-typed options
        raise ConfigError(f"model.options: {e}", path="model.options") from None
    try:  # shape-only: a too-small image fails here, not as a traceback from inside a layer
        jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), (batch_size,) + tuple(image_shape)))
    except ValueError as e:
        raise ConfigError(f"model {cfg.model.name!r} cannot take {tuple(image_shape)} images "
                          f"(data.image_size or the dataset): {e}", path="data.image_size") from None
    pad = cfg.data.augment.crop_padding
    if pad and pad >= min(image_shape[0], image_shape[1]):  # padded batches grew to terabytes
        raise ConfigError(f"data.augment.crop_padding: {pad} must be smaller than the image side "
                          f"({min(image_shape[0], image_shape[1])} for {tuple(image_shape)} images)",
                          path="data.augment.crop_padding")
    total = train_steps(cfg.train, per_epoch)
    for key in ("train.eval_every", "checkpoint.every", "logging.log_every"):  # epochs: checked here, before any compute
        section, name = key.split(".")
        resolve_duration(cfg[section][name], per_epoch, key=key)
    tx, schedule = build_optimizer(cfg.optim, total_steps=total, steps_per_epoch=per_epoch)
    if cfg.prune.amount > 0:  # pruned weights get no updates; the masks live in the state
        from jaxcnn.train.prune import mask_updates
        tx = optax.chain(tx, mask_updates())
    kind = cfg.precision.loss_scale
    if kind == "auto":
        kind = policy.default_loss_scale
    hparams = {}
    if kind in ("static", "dynamic"):
        hparams["scale"] = cfg.precision.loss_scale_init
    if kind == "dynamic":
        hparams.update(growth_interval=cfg.precision.growth_interval,
                       growth_factor=cfg.precision.growth_factor,
                       backoff_factor=cfg.precision.backoff_factor,
                       min_scale=cfg.precision.min_scale, max_scale=cfg.precision.max_scale)
    loss_scale = P.make_loss_scale(kind, **hparams)
    return Run(cfg, model, dataset, synthetic, (batch_size,) + tuple(image_shape), num_classes,
               per_epoch, total, tx, schedule, policy, loss_scale, data_seed)


def batch_fn(run: Run):
    """``step -> batch`` (host numpy arrays) for the run's training data."""
    cfg = run.cfg
    share = {"process_index": jax.process_index(), "process_count": jax.process_count()}
    if run.synthetic is not None:  # bytes: the train step normalises them on the device
        return lambda step: synthetic_batch(run.synthetic, step, seed=run.data_seed,
                                            batch_size=cfg.data.batch_size, image_dtype="uint8",
                                            **share)
    augment = {"crop_padding": cfg.data.augment.crop_padding, "flip": cfg.data.augment.flip}
    dataset = run.dataset
    if not cfg.data.normalize:  # unit scale only, as in evaluate()
        channels = dataset.image_shape[-1]
        dataset = dataset._replace(mean=np.zeros(channels, np.float32), std=np.ones(channels, np.float32))
    return lambda step: train_batch(dataset, step, seed=run.data_seed,
                                    batch_size=cfg.data.batch_size, augment=augment, **share)


def init_state(run: Run, start=None, keep=None) -> TrainState:
    """A fresh :class:`TrainState` from ``train.seed``.

    Arguments:
        run: from :func:`build_run`.
        start: ``(params, model_state)`` to start from instead of the random
            initialisation (see :func:`initial_params`), or None.
        keep: the pruning masks (a params-shaped tree of 0/1) for the optimiser
            state's ``PruneMask`` (``prune.amount > 0``), or None.
    """
    model = run.model
    if start is not None:  # the same state, with the model's init giving these trees
        model = model._replace(init=lambda key, shape: (start[0], start[1], None))
    state = create_train_state(model, run.tx, jax.random.PRNGKey(run.cfg.train.seed),
                               run.input_shape, loss_scale=run.loss_scale, policy=run.policy)
    if keep is not None:
        from jaxcnn.train.prune import with_keep
        state = state._replace(opt_state=with_keep(state.opt_state, keep))
    return state


_PARAM_FILES = ("params.npz", "params.safetensors")


def load_init_from(run: Run):
    """Read ``model.init_from`` and check it against the model, before any compute.

    Returns:
        ``(params, model_state)`` as NumPy trees in the model's dtypes.

    Raises:
        ConfigError: naming the file and the missing, unexpected, mis-shaped
            or non-float key.
    """
    path = run.cfg.model.init_from

    def fail(message):
        raise ConfigError(f"model.init_from: {message}", path="model.init_from")

    if os.path.isdir(path):
        found = [os.path.join(path, f) for f in _PARAM_FILES if os.path.isfile(os.path.join(path, f))]
        if not found:
            fail(f"{path!r} is a directory without {' or '.join(_PARAM_FILES)}; has its training "
                 "finished?")
        path = found[0]
    else:  # a FIFO (it hung), device or link to one is never a parameter file
        try:
            check_regular_file(path, "model.init_from")
        except DataError as e:
            raise ConfigError(str(e), path="model.init_from") from None
    like = jax.eval_shape(lambda: run.model.init(jax.random.PRNGKey(0), run.input_shape)[:2])
    load = {".npz": interop.load_npz, ".safetensors": interop.load_safetensors}.get(
        os.path.splitext(path)[1])
    if load is None:
        fail(f"{path!r}: expected a .npz or .safetensors parameter file or a run directory")
    try:
        trees = load(path, like=like)
    except (ValueError, OSError) as e:
        fail(str(e))

    def cast(keypath, x, want):
        if jnp.issubdtype(want.dtype, jnp.floating) != jnp.issubdtype(x.dtype, jnp.floating):
            where = "params" if keypath[0].idx == 0 else "state"
            fail(f"{path}: key '{where}/{'.'.join(str(k.key) for k in keypath[1:])}' has dtype "
                 f"{x.dtype}, expected {want.dtype}")
        return np.asarray(x, want.dtype)

    return jax.tree_util.tree_map_with_path(cast, trees, tuple(like))


def initial_params(run: Run, loaded=None):
    """What a fresh run starts from: the loaded ``model.init_from`` trees, pruned
    as the ``prune`` section says (from the random initialisation when nothing
    was loaded).

    Returns:
        ``(start, keep)``: ``(params, model_state)`` host trees or None (plain
        random init), and the pruning masks for :func:`init_state` or None.
    """
    cfg = run.cfg
    if cfg.prune.amount == 0:
        return loaded, None
    from jaxcnn.errors import ExportError
    from jaxcnn.train.prune import keep_tree, magnitude_prune
    if loaded is None:
        fresh = jax.jit(lambda: init_state(run))()
        params = fresh.opt_state.master if isinstance(fresh.opt_state, MasterCopyState) else fresh.params
        loaded = jax.device_get((params, fresh.state))
    try:
        params, masks = magnitude_prune(run.model, loaded[0], cfg.prune.amount, scope=cfg.prune.scope,
                                        structure=cfg.prune.structure)
    except ExportError as e:
        raise ConfigError(f"prune.amount: {e}", path="prune.amount") from None
    return (params, loaded[1]), keep_tree(params, masks)


def abstract_state(run: Run):
    """Shapes and dtypes of the :class:`TrainState`, without allocating it."""
    return jax.eval_shape(lambda: init_state(run))


def eval_batch_size(run: Run) -> int:
    """The evaluation batch: ``data.eval_batch_size`` (else ``data.batch_size``), clipped to the
    test set (rounded up to a multiple of the process count), as PyTorch's DataLoader gives a
    smaller batch: a larger one would only be padding (``data.eval_batch_size=1000000000``
    allocated 2.85 TiB of it)."""
    cfg = run.cfg
    size = cfg.data.eval_batch_size or cfg.data.batch_size
    if run.dataset is not None and size > len(run.dataset.x_test):
        procs = jax.process_count()
        size = max(procs, -(-len(run.dataset.x_test) // procs) * procs)
    return size


def check_workdir(workdir: str, what: str = "workdir") -> None:
    """Check, before any compute, that the run can write to ``workdir``; nothing is left behind
    (a missing ``workdir`` is created by the run itself once its config has passed every check).

    An existing ``workdir`` must be a directory where a file can be written; a missing one must
    be creatable under its nearest existing parent; its disk must not be full. The checks
    really write (a file, or a directory), then remove what they wrote: ``os.access`` says yes
    to root on a read-only mount's files, and knows no quota.

    Arguments:
        workdir: the run directory.
        what: how the message names it (``"--workdir"``, ``"logging.workdir"``).

    Raises:
        WorkdirError: it is a file (or a parent is), cannot be created, is not writable
            (permissions, read-only file system) or its disk is full.
    """
    import tempfile
    where = f"{what} {workdir}" if what.startswith("--") else f"{what}: {workdir}"
    if os.path.exists(workdir):
        if not os.path.isdir(workdir):
            from jaxcnn.data.files import file_kind
            kind = "a file" if os.path.isfile(workdir) else file_kind(os.stat(workdir).st_mode)
            raise WorkdirError(f"{where} is {kind}, not a directory")
        probe = None
        try:
            fd, probe = tempfile.mkstemp(prefix=".jaxcnn-write-test-", dir=workdir)
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise WorkdirError(f"{where} is not writable ({e.strerror or e})") from None
        finally:
            if probe is not None:
                try:
                    os.remove(probe)
                except OSError:
                    pass
        existing = workdir
    else:
        existing = os.path.dirname(os.path.abspath(workdir))
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise WorkdirError(f"{where} cannot be created: {existing} is not a directory")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".jaxcnn-write-test-", dir=existing))
        except OSError as e:
            raise WorkdirError(f"{where} cannot be created in {existing} ({e.strerror or e})") from None
    free = _free_disk(existing)
    if free is not None and free < _MIN_FREE_DISK:
        raise WorkdirError(f"{where} is on a full disk ({_fmt_bytes(free)} free; the run writes "
                           "checkpoints, metrics and parameters there)")


# Below this much free space in the run directory a run is refused before it starts.
_MIN_FREE_DISK = 1 << 20


def _free_disk(path):
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


def _fmt_bytes(n: float) -> str:
    """``4.0 TB``, ``23 GB``, ``512 MB`` (decimal units)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} bytes"


def available_memory(devices):
    """Memory a run can use: ``(bytes, scope)`` where scope is ``"per device"`` (accelerators:
    the device's limit less what is in use) or ``"host"`` (CPU devices share the host's memory:
    MemAvailable, the cgroup's limit if lower); None where it cannot be told."""
    devices = list(devices)
    if devices[0].platform != "cpu":
        free = []
        for d in devices:
            try:
                stats = d.memory_stats()
            except Exception:  # a backend without memory statistics: no check
                return None
            if not stats or "bytes_limit" not in stats:
                return None
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
        return min(free), "per device"
    candidates = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    candidates.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    if not candidates:
        try:
            candidates.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (OSError, ValueError, AttributeError):
            pass
    try:  # cgroup v2: a container's limit
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current", encoding="ascii") as f:
                candidates.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    return (min(candidates), "host") if candidates else None


def _local_devices(plan) -> list:
    """This process's devices of the mesh: the memory it checks (its host's, or theirs)."""
    return [d for d in plan.mesh.devices.flat if d.process_index == jax.process_index()]


def _size_keys(run: Run, shape=None) -> list:
    """The config keys that size the model and its data, as ``key=value``: the class count and
    the image size; for a parameter of ``shape``, the class count if it has that many rows or
    columns, else the image size."""
    cfg, keys = run.cfg, []
    by_classes = shape is not None and run.num_classes in tuple(shape)
    if shape is None or by_classes:
        key = "model.num_classes" if cfg.model.num_classes else "data.num_classes"
        if cfg.model.num_classes or cfg.data.num_classes:
            keys.append(f"{key}={run.num_classes}")
    if not by_classes and cfg.data.source == "synthetic" and cfg.data.image_size:
        keys.append(f"data.image_size={list(cfg.data.image_size)}")
    return keys


def check_state_memory(run: Run, plan, available) -> int:
    """The training state's bytes (per device, or on the host for CPU devices), from the
    shapes alone: a state that cannot fit is refused before anything is allocated.

    Raises:
        ConfigError: naming the keys that size it (``model.num_classes=1000000000 ...``).
    """
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract_state)
    per_device = 0
    for _, x in leaves:
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        per_device += math.prod(shape) * np.dtype(x.dtype).itemsize
    if available is None:
        return per_device
    free, scope = available
    need = per_device * (len(_local_devices(plan)) if scope == "host" else 1)
    if need > free:
        params = jax.tree_util.tree_leaves_with_path(plan.abstract_state.params)
        path, big = max(params, key=lambda kv: math.prod(kv[1].shape))
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        keys = _size_keys(run, big.shape) or [f"model.name={run.cfg.model.name}"]
        count = sum(math.prod(x.shape) for _, x in params)
        raise ConfigError(f"{', '.join(keys)}: the model's {count:,} parameters and their optimiser "
                          f"state need {_fmt_bytes(need)} (largest: {name} {tuple(big.shape)}); this "
                          f"machine has {_fmt_bytes(free)} available"
                          f"{' per device' if scope == 'per device' else ''}", path=keys[0].split("=")[0])
    return need


def _compile(lowered):
    """``lowered.compile()``: XLA's executable of a step, which jit's cache then holds for the
    step's first call; its ``memory_analysis`` is what the memory check reads."""
    return lowered.compile()


def _step_bytes(compiled):
    """Arguments + outputs + temporaries (less the donated buffers counted twice) of a compiled
    program, per device; None where the backend does not say."""
    if compiled is None:
        return None
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend or wrapper implements it
        return None
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    return max(0, int(stats.argument_size_in_bytes) + int(stats.output_size_in_bytes)
               + int(stats.temp_size_in_bytes) - int(stats.alias_size_in_bytes))


def check_step_memory(compiled, plan, available, keys, what) -> int | None:
    """Refuses a compiled step whose memory (``memory_analysis``) exceeds what is available.

    Raises:
        ConfigError: ``"<keys>: one <what> needs X; this machine has Y available"``.
    """
    per_device = _step_bytes(compiled)
    if per_device is None or available is None:
        return per_device
    free, scope = available
    need = per_device * (len(_local_devices(plan)) if scope == "host" else 1)
    if need > free:
        raise ConfigError(f"{', '.join(keys)}: one {what} needs {_fmt_bytes(need)} of memory; this "
                          f"machine has {_fmt_bytes(free)} available"
                          f"{' per device' if scope == 'per device' else ''}", path=keys[0].split("=")[0])
    return need


def abstract_batch(run: Run, plan):
    """The training batch as the wrapped step takes it (``plan.put_batch``'s output), as shapes."""
    batch, rest = run.input_shape[0], tuple(run.input_shape[1:])
    image = np.uint8 if run.synthetic is not None else np.float32  # synthetic: bytes, normalised on device
    if plan.strategy == "pmap":
        n = plan.mesh.devices.size
        return {"image": jax.ShapeDtypeStruct((n, batch // n) + rest, image),
                "label": jax.ShapeDtypeStruct((n, batch // n), np.int32)}
    sharding = plan.batch_sharding()
    return {"image": jax.ShapeDtypeStruct(run.input_shape, image, sharding=sharding),
            "label": jax.ShapeDtypeStruct((batch,), np.int32, sharding=sharding)}


def abstract_eval_batch(run: Run, plan, batch_size: int):
    """An evaluation batch as ``plan.put_eval_batch`` gives it to the eval step, as shapes."""
    procs = jax.process_count()
    per_process = max(1, plan.mesh.shape["data"] // procs)
    local = batch_size // procs
    rows = (local + -local % per_process) * procs
    sharding = plan.batch_sharding()
    return {"image": jax.ShapeDtypeStruct((rows,) + tuple(run.input_shape[1:]), np.float32,
                                          sharding=sharding),
            "label": jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding),
            "mask": jax.ShapeDtypeStruct((rows,), np.bool_, sharding=sharding)}


class Prepared(NamedTuple):
    """What a training run and ``jaxcnn-train --dry-run`` both build before the first step
    (:func:`prepare`): the same mesh, plan, steps and checks."""

    run: Run
    plan: Any
    loaded: Any            # model.init_from's (params, model_state), or None
    train_step: Any        # the wrapped train step the loop calls: (state, placed batch)
    eval_step: Any         # the wrapped eval step: (params, model_state, placed eval batch)
    eval_batch_size: int
    memory: dict           # bytes: "state", "train_step", "eval_step" (None: not known), "available"
    train_out: Any         # the train step's output shapes (state, metrics)


def prepare(cfg) -> Prepared:
    """Build everything a run needs and check it, before any parameter is allocated.

    :func:`build_run` (config and data), ``model.init_from``, the mesh and parallel plan, the
    wrapped train and eval steps, then the memory the run would need: the training state from
    its shapes, and each step compiled (``.lower().compile()``, with abstract inputs; the real
    run's first call reuses that executable) and measured by ``memory_analysis``, against the
    memory available (the devices', or the host's for CPU devices).

    Raises:
        ConfigError / DataError: as :func:`build_run` and ``parallel.setup``; a state or step
            that cannot fit in memory names the keys that size it.
    """
    run = build_run(cfg)
    loaded = load_init_from(run) if cfg.model.init_from else None
    with parallel_config_errors():
        plan = parallel.setup(cfg, run.model, run.input_shape, abstract_state(run))
    available = available_memory(_local_devices(plan))
    memory = {"available": available[0] if available else None, "train_step": None, "eval_step": None}
    memory["state"] = check_state_memory(run, plan, available)
    train_step = plan.wrap_step(make_train_step(
        run.model, run.tx, policy=run.policy, label_smoothing=cfg.optim.label_smoothing,
        schedule=run.schedule, skip_nonfinite=cfg.train.nan_policy == "skip",
        axis_name=plan.step_axis_name, sync_batch_norm=plan.sync_batch_norm,
        image_norm=(NOISE_MEAN, NOISE_STD) if run.synthetic is not None else None,
        impl=cfg.model.impl, batch_norm_grad=cfg.model.batch_norm_grad))
    eval_step = plan.wrap_eval(make_eval_step(run.model, policy=run.policy, impl=cfg.model.impl))
    eval_size = eval_batch_size(run)
    with matmul_precision(cfg):  # traced as the loop traces it, so the loop reuses the executable
        lowered = train_step.lower(plan.abstract_state, abstract_batch(run, plan))
        compiled = _compile(lowered)
        memory["train_step"] = check_step_memory(
            compiled, plan, available, [f"data.batch_size={cfg.data.batch_size}"] + _size_keys(run),
            "train step")
        if run.dataset is not None:  # without a test set (synthetic throughput runs) nothing evaluates
            compiled_eval = _compile(eval_step.lower(plan.abstract_state.params, plan.abstract_state.state,
                                                     abstract_eval_batch(run, plan, eval_size)))
            key = "data.eval_batch_size" if cfg.data.eval_batch_size else "data.batch_size"
            memory["eval_step"] = check_step_memory(compiled_eval, plan, available,
                                                    [f"{key}={eval_size}"] + _size_keys(run), "eval step")
    return Prepared(run, plan, loaded, train_step, eval_step, eval_size, memory, lowered.out_info)


def evaluate(run: Run, eval_step, params, model_state) -> dict:
    """Loss, top-1 and top-5 over the whole test set (nothing dropped)."""
    if run.dataset is None:
        return {}
    cfg = run.cfg
    batch_size = eval_batch_size(run)
    mean, std = (run.dataset.mean, run.dataset.std) if cfg.data.normalize else (None, None)
    totals = None
    for batch in eval_batches(run.dataset.x_test, run.dataset.y_test, batch_size, mean=mean, std=std,
                              process_index=jax.process_index(), process_count=jax.process_count()):
        sums = eval_step(params, model_state, batch)
        totals = sums if totals is None else jax.tree_util.tree_map(jnp.add, totals, sums)
    if totals is None:
        return {}
    totals = jax.device_get(totals)
    count = max(float(totals["count"]), 1.0)
    return {"loss": float(totals["loss_sum"]) / count, "top1": float(totals["top1_sum"]) / count,
            "top5": float(totals["top5_sum"]) / count, "count": int(totals["count"])}


def run_metadata(argv, config_path) -> dict:
    """What ran, where: ``run_meta.json``."""
    def version(name):
        try:
            from importlib.metadata import version as v
            return v(name)
        except Exception:  # not installed: record the absence
            return None

    commit = None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        commit = (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "argv": list(argv or sys.argv), "config": config_path, "start_time": time.time(),
        "host": platform.node(), "python": platform.python_version(),
        "versions": {n: version(n) for n in ("jaxcnn", "jax", "jaxlib", "optax", "orbax-checkpoint",
                                             "numpy")},
        "backend": jax.default_backend(),
        # Whether jaxcnn's glibc malloc settings are on: they trade resident memory for speed.
        "host_malloc": _host_memory.status(),
        "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
        "git_commit": commit,
    }


class _StopSignal:
    """Turns SIGTERM/SIGINT into a flag read at the next step boundary."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)


def matmul_precision(cfg):
    """``precision.matmul_precision`` as a context for tracing; "default" leaves JAX's setting."""
    name = cfg.precision.matmul_precision
    return P.matmul_precision_context(None if name == "default" else name)


def _summarise(history: list[dict]) -> dict:
    """Mean loss/top-1 over the interval; last value of the rest."""
    out = {k: float(np.mean([h[k] for h in history])) for k in ("loss", "top1", "grad_norm")}
    last = history[-1]
    out.update(lr=float(last["lr"]), loss_scale=float(last["loss_scale"]),
               skipped=int(last["skipped"]))
    return out


_DTYPE_ROLES = {"p": "params", "c": "compute", "o": "output", "m": "master copy"}


def describe_precision(cfg, run) -> str:
    """``precision ...  loss scaling ...`` of the start-up output, in the config's words:
    ``precision fp32``, ``precision bf16 (params f32, compute bf16)``, ``loss scaling off``,
    ``loss scaling dynamic (from 32768)``."""
    dtypes = dict(part.split("=") for part in run.policy.to_string().split(","))
    text = f"precision {cfg.precision.policy}"
    if set(dtypes.values()) != {"f32"}:
        shown = {k: v for k, v in dtypes.items() if k in ("p", "c") or v != dtypes["p"]}
        text += " (" + ", ".join(f"{_DTYPE_ROLES[k]} {v}" for k, v in shown.items()) + ")"
    if cfg.precision.overrides:
        text += " with " + ", ".join(f"{kind} {spec}" for kind, spec in cfg.precision.overrides.items())
    kind = cfg.precision.loss_scale
    if kind == "auto":
        kind = run.policy.default_loss_scale
    scale = f"{cfg.precision.loss_scale_init:g}"
    text += {"none": "  loss scaling off", "static": f"  loss scaling static ({scale})",
             "dynamic": f"  loss scaling dynamic (from {scale})"}[kind]
    return text


def describe_devices(plan) -> str:
    """The ``devices ...`` start-up line: data parallelism always; the model axis, fsdp and the
    process count only where used."""
    n_data, n_model = plan.mesh.shape["data"], plan.mesh.shape["model"]
    text = (f"devices {jax.device_count()} ({jax.default_backend()}): data parallel over {n_data} "
            f"({plan.strategy})")
    if n_model > 1:
        text += f", model parallel over {n_model}"
    if plan.fsdp:
        text += ", parameters and optimiser state sharded over the data axis (fsdp)"
    if jax.process_count() > 1:
        text += f", {jax.process_count()} processes"
    return text


def train(cfg, workdir: str, *, argv=None, config_path=None, stream=None) -> dict:
    """Run training as ``cfg`` says, writing everything under ``workdir``.

    Returns the final evaluation metrics (and ``stopped_by`` when a signal
    ended the run early).  Raises ``ConfigError``/``DataError``/
    ``CheckpointError`` for bad input, before any compute where possible.
    """
    stream = stream or sys.stdout
    with parallel_config_errors():
        parallel.initialize(cfg.distributed)  # before anything touches a device
    # Resuming under settings that train differently stops here, before any compute, unless
    # checkpoint.on_config_change is "continue" (checkpoint.check_resume_config).
    config_changes = check_resume_config(
        workdir, to_dict(cfg), resume=cfg.checkpoint.resume if cfg.checkpoint.enabled else "never",
        on_change=cfg.checkpoint.on_config_change)
    # The same mesh, plan, steps and size checks as --dry-run; the steps are compiled here.
    t_prepare = time.perf_counter()
    prepared = prepare(cfg)
    prepare_s = time.perf_counter() - t_prepare
    run, plan, loaded = prepared.run, prepared.plan, prepared.loaded
    is_main = jax.process_index() == 0
    os.makedirs(workdir, exist_ok=True)
    if is_main:  # config.resolved.yaml: once resuming is decided (record_run_config below)
        with open(os.path.join(workdir, "run_meta.json"), "w", encoding="utf-8") as f:
            json.dump(run_metadata(argv, config_path), f, indent=2)
        # What the model expects of its input: jaxcnn-eval and jaxcnn-export read it.
        from jaxcnn.data import preprocessing
        preprocessing.write_preprocessing(os.path.join(workdir, preprocessing.PREPROCESSING_FILE),
                                          preprocessing.from_run(run))

    def say(text):
        if is_main:
            print(text, file=stream, flush=True)

    say(f"[jaxcnn] model {cfg.model.name}  data {cfg.data.source} "
        f"({'synthetic' if run.dataset is None else f'{len(run.dataset.x_train)} train / {len(run.dataset.x_test)} test'})"
        f"  batch {cfg.data.batch_size}  steps {run.total_steps} ({run.steps_per_epoch}/epoch)")
    say(f"[jaxcnn] {describe_precision(cfg, run)}"
        f"  optimiser {cfg.optim.name} lr {cfg.optim.lr:g} ({cfg.optim.schedule.name})  workdir {workdir}")
    say(f"[jaxcnn] {describe_devices(plan)}")
    say(f"[jaxcnn] model, data and compiled steps ready in {prepare_s:.1f} s")

    manager = None
    if cfg.checkpoint.enabled:
        manager = CheckpointManager(os.path.join(workdir, "checkpoints"), keep=cfg.checkpoint.keep,
                                    keep_best=cfg.checkpoint.keep_best, best_metric="eval/top1",
                                    on_error=cfg.checkpoint.on_error, step_leaf="step",
                                    log_path=os.path.join(workdir, "checkpoints.log"))
    state = None
    if manager is not None:
        restored = restore_for_resume(
            manager, plan.abstract_state, cfg.checkpoint.resume,
            config=None if cfg.checkpoint.on_config_change == "continue" else to_dict(cfg))
        if restored is not None:
            step, state = restored
            say(f"[jaxcnn] resumed from step {step}: {manager.directory}/{step}")
    if state is None:  # created in place, already sharded (no full copy on one device)
        trees, keep = initial_params(run, loaded)
        state = jax.jit(lambda t, k: init_state(run, t, k), out_shardings=plan.state_shardings)(
            trees, keep)
        if cfg.model.init_from:
            say(f"[jaxcnn] parameters from {cfg.model.init_from}")
        if keep is not None:
            leaves = jax.tree_util.tree_leaves(keep)
            say(f"[jaxcnn] prune {cfg.prune.amount:g} ({cfg.prune.scope}, {cfg.prune.structure}): "
                f"{sum(int(np.sum(k == 0)) for k in leaves)} of {sum(k.size for k in leaves)} "
                "parameters held at zero")
    start = int(state.step)
    if is_main:  # after the resume decision: a refused resume leaves it as it was
        record_run_config(workdir, to_dict(cfg), start, config_changes)

    train_step, sharded_eval = prepared.train_step, prepared.eval_step
    if cfg.data.eval_batch_size and prepared.eval_batch_size < cfg.data.eval_batch_size:
        say(f"[jaxcnn] data.eval_batch_size {cfg.data.eval_batch_size} clipped to the "
            f"{len(run.dataset.x_test)} test images: eval batch {prepared.eval_batch_size}")

    def eval_step(params, model_state, batch):
        return sharded_eval(params, model_state, plan.put_eval_batch(batch))

    def every(value, key):
        return resolve_duration(value, run.steps_per_epoch, key=key) if value is not None else None

    log_every = every(cfg.logging.log_every, "logging.log_every")
    eval_every = every(cfg.train.eval_every, "train.eval_every")
    ckpt_every = every(cfg.checkpoint.every, "checkpoint.every")
    metrics = MetricsWriter(workdir, tensorboard=cfg.logging.tensorboard, enabled=is_main,
                            resumed_at=start if start > 0 else None)
    progress = Progress(run.total_steps, start, mode=cfg.logging.progress, enabled=is_main,
                        stream=stream)
    make_batch = batch_fn(run)
    prefetch = Prefetcher(make_batch, size=max(1, cfg.data.prefetch), start=start, stop=run.total_steps,
                          device_put=plan.put_batch) if cfg.data.prefetch else None
    batches = iter(prefetch) if prefetch is not None else (
        plan.put_batch(make_batch(s)) for s in range(start, run.total_steps))

    history, last_eval, stopped_by = [], {}, None
    interval_start, interval_steps, compile_s = None, 0, None
    images_per_step = cfg.data.batch_size

    def check_finite(done):
        """Stops (nan_policy stop) at the first non-finite loss among the steps since the last check."""
        nonlocal history
        history = jax.device_get(history)
        bad = [i for i, h in enumerate(history) if not math.isfinite(float(h["loss"]))]
        if bad and cfg.train.nan_policy == "stop":
            first = done - len(history) + bad[0] + 1
            last_ckpt = manager.latest_step() if manager is not None else None
            raise TrainingStopped(
                f"non-finite loss at step {first}; train.nan_policy is 'stop'; last good "
                f"checkpoint: {'none' if last_ckpt is None else os.path.join(manager.directory, str(last_ckpt))}")

    def save(step, eval_metrics=None):
        if manager is None:
            return
        check_finite(step)
        if manager.latest_step() == step:  # a finished run resumed: this state is that checkpoint
            return
        ok = manager.save(step, state, metrics={"eval/top1": eval_metrics["top1"]} if eval_metrics else None,
                          config_dict=to_dict(cfg))
        if not ok:
            progress.message(f"[jaxcnn] warning: checkpoint at step {step} was not saved")

    try:
        with _StopSignal() as stop, matmul_precision(cfg):
            for step in range(start, run.total_steps):
                batch = next(batches)
                if compile_s is None:
                    t0 = time.perf_counter()
                    state, m = train_step(state, batch)
                    jax.block_until_ready(m)
                    compile_s = time.perf_counter() - t0
                    progress.message(f"[jaxcnn] first step took {compile_s:.1f} s")
                    interval_start, interval_steps = time.perf_counter(), 0
                else:
                    state, m = train_step(state, batch)
                    interval_steps += 1
                history.append(m)
                done = step + 1
                if done % log_every == 0 or done == run.total_steps:
                    check_finite(done)
                    now = time.perf_counter()
                    elapsed = now - interval_start
                    step_time = elapsed / interval_steps if interval_steps else float("nan")
                    img_s = images_per_step / step_time if interval_steps else float("nan")
                    values = _summarise(history)
                    values.update(epoch=done / run.steps_per_epoch, img_per_s=img_s,
                                  step_time_ms=step_time * 1000)
                    eta = (run.total_steps - done) * (step_time if interval_steps else 0.0)
                    metrics.write(done, "train", values)
                    progress.update(done, done / run.steps_per_epoch, values, img_per_s=img_s,
                                    step_time=step_time, eta_s=eta)
                    history, interval_start, interval_steps = [], time.perf_counter(), 0
                evaluated = False
                if eval_every and done % eval_every == 0 and done != run.total_steps:
                    last_eval = evaluate(run, eval_step, state.params, state.state)
                    if last_eval:
                        metrics.write(done, "eval", last_eval)
                        progress.message(f"[jaxcnn] eval at step {done}: loss {last_eval['loss']:.4f}  "
                                         f"top-1 {last_eval['top1']:.4f}  top-5 {last_eval['top5']:.4f}")
                    evaluated = True
                if ckpt_every and done % ckpt_every == 0 and done != run.total_steps:
                    save(done, last_eval if evaluated else None)
                if stop.signum is not None and done != run.total_steps:
                    stopped_by = signal.Signals(stop.signum).name
                    save(done)
                    progress.message(f"[jaxcnn] {stopped_by} received: checkpoint saved at step {done}, "
                                     "stopping")
                    break
                if evaluated or (ckpt_every and done % ckpt_every == 0):
                    # eval/save time is not step time; the interval's img/s counts the steps after it
                    interval_start, interval_steps = time.perf_counter(), 0
    finally:
        if prefetch is not None:
            prefetch.close()
        progress.close()

    result, write_error = {"step": int(state.step)}, None
    if stopped_by is None:
        with matmul_precision(cfg):
            final = evaluate(run, eval_step, state.params, state.state)
        if final and not metrics.recorded(int(state.step), "eval"):  # not again for a finished run
            metrics.write(int(state.step), "eval", final)
        save(int(state.step), final or None)
        params_host = parallel.to_host((state.params, state.state))  # all processes take part
        if is_main:
            fmt = cfg.checkpoint.format
            path = os.path.join(workdir, f"params.{fmt}")
            partial = os.path.join(workdir, f"params.partial.{fmt}")
            try:
                (interop.save_npz if fmt == "npz" else interop.save_safetensors)(partial, *params_host)
                os.replace(partial, path)
            except OSError as e:  # a full disk: the old params file (if any) is untouched
                try:
                    os.remove(partial)
                except OSError:
                    pass
                kept = "" if manager is None else f"; checkpoints in {manager.directory} are kept"
                write_error = (f"cannot write {path} ({e.strerror or e}); the partial file was "
                               f"removed{kept}")
        result.update(final)
        if final:
            say(f"[jaxcnn] final eval at step {int(state.step)}: loss {final['loss']:.4f}  "
                f"top-1 {final['top1']:.4f}  top-5 {final['top5']:.4f}  ({final['count']} images)")
    else:
        result["stopped_by"] = stopped_by
    if manager is not None:
        manager.wait()
        manager.close()
    metrics.close()
    if write_error is not None:  # after the checkpoints are written out
        raise WorkdirError(write_error)
    return result
