"""Everything a run builds before its first step, and the checks that it can run.

:func:`build_run` turns a validated config into a :class:`Run` (data, model, optimiser,
precision policy, loss scale); :func:`prepare` adds the mesh and parallel plan, the wrapped
train and eval steps (compiled from abstract inputs) and the memory checks. ``jaxcnn-train``
and ``jaxcnn-train --dry-run`` both go through :func:`prepare`, so a dry run builds exactly what
the run builds. Nothing here allocates parameters or runs a step.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcnn import interop, models, parallel
from jaxcnn._cli import name_list
from jaxcnn import precision as P
from jaxcnn.data import (SyntheticSpec, load_dataset, steps_per_epoch, synthetic_batch,
                         synthetic_dataset, train_batch)
from jaxcnn.data.files import check_regular_file
from jaxcnn.data.synthetic import NOISE_MEAN, NOISE_STD
from jaxcnn.errors import ConfigError, DataError, SettingError
from jaxcnn.data.mix import MixSpec
from jaxcnn.interop.arrays import PARAMETER_FILE_TYPES, tree_items, unflatten, unknown_file_type
from jaxcnn.layers import Choices
from jaxcnn.train import prune
from jaxcnn.train.ema import ema
from jaxcnn.train.config import resolve_duration, train_steps
from jaxcnn.train.memory import (available_memory, check_bytes, check_state_memory, check_step_memory,
                                 local_devices)
from jaxcnn.train.optim import build_optimizer
from jaxcnn.train.rundir import RunDir
from jaxcnn.train.state import MasterCopyState, TrainState, create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step


# Synthetic training sets up to this many bytes (uint8 pixels) are generated once and
# held in memory; larger ones (ImageNet-shaped throughput runs) are made per step.
_SYNTHETIC_IN_MEMORY_BYTES = 256 * 2**20


# The config key of each argument the trainer gives jaxcnn.parallel (make_mesh's axes are
# named mesh.<axis>, as their keys are; a mapping argument's keys follow it: pipeline.split).
_PARALLEL_KEYS = {
    "strategy": "parallel.strategy", "fsdp": "parallel.fsdp", "rules": "parallel.rules",
    "sync_batch_norm": "parallel.sync_batch_norm", "pipeline": "parallel.pipeline",
    "spatial_until": "parallel.spatial.until", "spatial_remat": "parallel.spatial.remat",
    "spatial_halo": "parallel.spatial.halo", "batch_size": "data.batch_size",
    **{k: f"distributed.{k}" for k in ("mode", "coordinator_address", "num_processes", "process_id",
                                        "timeout_s")},
}


def _config_key(setting: str) -> str:
    """The config key the trainer took a :class:`SettingError`'s argument from ("" if none)."""
    head, _, rest = setting.partition(".")
    if head == "mesh":
        return setting
    if setting in _PARALLEL_KEYS:
        return _PARALLEL_KEYS[setting]
    return f"{_PARALLEL_KEYS[head]}.{rest}" if head in _PARALLEL_KEYS and rest else ""


@contextlib.contextmanager
def parallel_config_errors():
    """Around the trainer's calls into :mod:`jaxcnn.parallel`, which takes every setting as an
    argument: a :class:`SettingError` naming an argument becomes a :class:`ConfigError`
    naming the config key the trainer passed there (so ``jaxcnn-train`` prints one line and
    exits 2). Any other error passes as it is."""
    try:
        yield
    except SettingError as e:
        key = _config_key(e.setting)
        problem = e.phrase(lambda setting: _config_key(setting) or setting)
        raise ConfigError(f"{key or e.setting}: {problem}", path=key) from None


def config_mesh(cfg, *, devices=None):
    """``parallel.make_mesh`` of the config's ``mesh`` section."""
    return parallel.make_mesh(cfg.mesh.data, cfg.mesh.model, devices=devices, pipe=cfg.mesh.pipe,
                              spatial=cfg.mesh.spatial, order=cfg.mesh.order)


def make_plan(cfg, model, input_shape, abstract_state, *, devices=None) -> parallel.ParallelPlan:
    """The :class:`jaxcnn.parallel.ParallelPlan` of a validated config (its ``mesh`` and
    ``parallel`` sections; the micro-batches from ``train.accumulate_steps`` when
    ``parallel.pipeline.microbatches`` is unset).

    Raises:
        ConfigError: naming the key (called inside :func:`parallel_config_errors`): mesh sizes
            that do not fit the devices, a batch that does not divide over the data axis, a
            strategy that cannot run the config, or (several processes) a device layout whose
            processes do not each hold a contiguous block of data shards.
    """
    mesh = config_mesh(cfg, devices=devices)
    parallel.batch_share(mesh)  # the rows each process loads: a layout the trainer cannot feed fails here
    return parallel.ParallelPlan(
        mesh, model, input_shape, abstract_state, strategy=cfg.parallel.strategy,
        rules=dict(cfg.parallel.rules), fsdp=cfg.parallel.fsdp, sync_batch_norm=cfg.parallel.sync_batch_norm,
        spatial_until=cfg.parallel.spatial.until, spatial_remat=cfg.parallel.spatial.remat,
        spatial_halo=cfg.parallel.spatial.halo, pipeline=pipeline_spec(cfg))


def pipeline_spec(cfg) -> dict:
    """``parallel.pipeline`` as ``ParallelPlan(pipeline=...)`` takes it; the micro-batches are
    ``train.accumulate_steps`` when ``parallel.pipeline.microbatches`` is unset."""
    spec = {k: getattr(cfg.parallel.pipeline, k)
            for k in ("microbatches", "split", "balance", "schedule", "remat", "engine")}
    if spec["microbatches"] is None and cfg.train.accumulate_steps > 1:
        spec["microbatches"] = cfg.train.accumulate_steps
    if cfg.mesh.pipe > 1 and spec["microbatches"] is None:
        raise ConfigError(f"parallel.pipeline.microbatches: required with mesh.pipe={cfg.mesh.pipe} "
                          f"(e.g. {2 * cfg.mesh.pipe}; or train.accumulate_steps)",
                          path="parallel.pipeline.microbatches")
    return spec


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
    images: Any = None      # a jaxcnn.data.ImageData for data.source folder/records, else None


def _model_defaults(name: str):
    try:
        return models.default_input_shape(name)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"model.name: {e}", path="model.name") from None


class DataSetup(NamedTuple):
    """The training data a config asks for (:func:`build_data`)."""

    dataset: Any            # a jaxcnn.data.Dataset, or None for on-the-fly synthetic batches
    synthetic: Any          # SyntheticSpec when batches are generated per step, else None
    image_shape: tuple      # (H, W, C)
    num_classes: int        # what the model predicts: model.num_classes, else the data's
    steps_per_epoch: int
    images: Any = None      # a jaxcnn.data.ImageData (folder/records): batches made by grain workers


def build_data(cfg, data_seed: int) -> DataSetup:
    """Load (or describe, for per-step synthetic batches) the data ``cfg.data`` names.

    Raises:
        ConfigError: a batch larger than the training set, a missing ``data.path``, a model
            with fewer classes than the data; DataError: a malformed data file.
    """
    batch_size = cfg.data.batch_size
    if cfg.data.source == "synthetic":
        return _synthetic_data(cfg, data_seed)
    if cfg.data.source in ("folder", "records"):
        return _image_data(cfg, data_seed)
    path = cfg.data.path
    if path is not None and not os.path.exists(path):
        where = ("; CIFAR-10's binary version (data_batch_1.bin ... test_batch.bin) is cifar-10-binary.tar.gz "
                 "from https://www.cs.toronto.edu/~kriz/cifar.html, extracted" if cfg.data.source == "cifar10" else "")
        raise ConfigError(f"data.path: {path!r} does not exist{where}", path="data.path")
    if cfg.data.source == "npz":  # a device or FIFO is never data: /dev/zero ran into the OOM killer
        check_regular_file(path, "data.path")
    dataset = load_dataset(cfg.data.source, path)
    num_classes = dataset.num_classes
    if cfg.model.num_classes is not None and cfg.model.num_classes < num_classes:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is smaller than the "
                          f"dataset's {num_classes} classes", path="model.num_classes")
    if len(dataset.x_train) < batch_size:
        raise ConfigError(f"data.batch_size: {batch_size} is larger than the training set "
                          f"({len(dataset.x_train)} images)", path="data.batch_size")
    return DataSetup(dataset, None, tuple(dataset.image_shape), cfg.model.num_classes or num_classes,
                     steps_per_epoch(len(dataset.x_train), batch_size))


def _image_data(cfg, data_seed: int) -> DataSetup:
    """An image folder or record directory, opened (file lists, record counts, class names,
    the ``data.val_split`` drawn from ``data_seed``), its images read by the loader's workers
    as batches need them."""
    from jaxcnn.train.image_input import open_images

    images = open_images(cfg, _model_defaults(cfg.model.name)[1:3], data_seed)
    if cfg.model.num_classes is not None and cfg.model.num_classes < images.num_classes:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is smaller than the "
                          f"{images.num_classes} classes of {cfg.data.path}", path="model.num_classes")
    more = cfg.model.num_classes is not None and cfg.model.num_classes > images.num_classes
    if more and not cfg.model.extra_outputs:
        raise ConfigError(f"model.num_classes: {cfg.model.num_classes} is more than the {images.num_classes} "
                          f"classes of {cfg.data.path} ({name_list(images.class_names)}): outputs "
                          f"{images.num_classes}-{cfg.model.num_classes - 1} would be classes no image has, "
                          "which predictions could name; leave it null (the data's count), or set "
                          "model.extra_outputs=true if the larger head is on purpose", path="model.num_classes")
    if len(images.train) < cfg.data.batch_size:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is larger than the training set "
                          f"({len(images.train)} images)", path="data.batch_size")
    return DataSetup(None, None, images.image_shape, cfg.model.num_classes or images.num_classes,
                     steps_per_epoch(len(images.train), cfg.data.batch_size), images)


def _synthetic_data(cfg, data_seed: int) -> DataSetup:
    """Synthetic data: a fixed in-memory set the model can fit (with a test split) when small,
    else fresh images every step, never materialised (throughput runs)."""
    image_shape = tuple(cfg.data.image_size or _model_defaults(cfg.model.name)[1:])
    num_classes = cfg.data.num_classes or cfg.model.num_classes or 10
    spec = SyntheticSpec(image_shape=image_shape, num_classes=num_classes)
    image_bytes = int(np.prod(image_shape))
    dataset, synthetic = None, None
    if cfg.data.num_train * image_bytes <= _SYNTHETIC_IN_MEMORY_BYTES:
        if (cfg.data.num_train + cfg.data.num_eval) * image_bytes > 2 * _SYNTHETIC_IN_MEMORY_BYTES:
            raise ConfigError(f"data.num_eval: {cfg.data.num_eval} synthetic test images of shape "
                              f"{image_shape} would take more than the "
                              f"{2 * _SYNTHETIC_IN_MEMORY_BYTES >> 20} MiB held in memory",
                              path="data.num_eval")
        dataset = synthetic_dataset(spec, num_train=cfg.data.num_train,
                                    num_test=cfg.data.num_eval, seed=data_seed)
    else:
        synthetic = spec
    if cfg.data.num_train < cfg.data.batch_size:
        raise ConfigError(f"data.batch_size: {cfg.data.batch_size} is larger than the training set "
                          f"(data.num_train={cfg.data.num_train})", path="data.batch_size")
    return DataSetup(dataset, synthetic, image_shape, num_classes,
                     max(1, cfg.data.num_train // cfg.data.batch_size))


def _check_model_name(cfg) -> None:
    if cfg.model.name not in models.names():
        from difflib import get_close_matches
        close = get_close_matches(cfg.model.name, models.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"model.name: unknown model {cfg.model.name!r}{hint}; expected one of "
                          f"{models.names()}", path="model.name")


def _policy(cfg):
    try:
        return P.get_policy(cfg.precision.policy, dict(cfg.precision.overrides))
    except ValueError as e:
        raise ConfigError(f"precision.policy: {e}", path="precision.policy") from None


def _build_model(cfg, num_classes: int, image_shape: tuple):
    """The zoo model, checked (from shapes only) to take the run's images: a too-small image
    fails here, not as a traceback from inside a layer."""
    try:
        model = models.get(cfg.model.name, num_classes=num_classes, **dict(cfg.model.options))
    except (TypeError, ValueError) as e:  # unknown or ill-typed options
        raise ConfigError(f"model.options: {e}", path="model.options") from None
    try:
        jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0),
                                          (cfg.data.batch_size,) + tuple(image_shape)))
    except ValueError as e:
        raise ConfigError(_too_small(cfg, tuple(image_shape), e), path=_image_size_key(cfg)) from None
    return model


def _image_size_key(cfg) -> str:
    """The key that sets the image size: ``data.image_size`` where the source uses it, else
    the data themselves (``data.path``; ``data.source`` for the packaged MNIST digits)."""
    if cfg.data.source in ("synthetic", "folder", "records"):
        return "data.image_size"
    return "data.path" if cfg.data.path else "data.source"


def _too_small(cfg, image_shape: tuple, error) -> str:
    """What a model that cannot take the run's images says, and what would work: a larger
    ``data.image_size`` where the source uses it; else (npz, MNIST, CIFAR-10 keep their
    images' size, ignoring ``data.image_size``) larger images or another model."""
    name = cfg.model.name
    if _image_size_key(cfg) == "data.image_size":
        return (f"data.image_size: model {name!r} cannot take {image_shape} images ({error}); "
                f"give a larger data.image_size")
    where = f"data.path={cfg.data.path}" if cfg.data.path else f"data.source={cfg.data.source}"
    return (f"model {name!r} cannot take the {image_shape} images of {where} ({error}); "
            f"data.source={cfg.data.source} keeps its images' size (data.image_size is not used): "
            f"give larger images, or a model that takes these (model.name)")


def _check_augment(cfg, data) -> None:
    from jaxcnn.train.image_input import augment_spec
    image_shape = data.image_shape
    if data.synthetic is not None and augment_spec(cfg).active:
        raise ConfigError(f"data.augment: synthetic images made per step (data.num_train={cfg.data.num_train} "
                          f"of shape {image_shape}, more than the {_SYNTHETIC_IN_MEMORY_BYTES >> 20} MiB held "
                          "in memory) are noise and never augmented; leave data.augment at its defaults",
                          path="data.augment")
    pad = cfg.data.augment.crop_padding
    if pad and pad >= min(image_shape[0], image_shape[1]):  # padded batches grew to terabytes
        raise ConfigError(f"data.augment.crop_padding: {pad} must be smaller than the image side "
                          f"({min(image_shape[0], image_shape[1])} for {tuple(image_shape)} images)",
                          path="data.augment.crop_padding")


def _loss_scale(cfg, policy):
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
    return P.make_loss_scale(kind, **hparams)


def mix_spec(cfg) -> MixSpec | None:
    """``data.augment.mixup``/``cutmix`` as a :class:`MixSpec`, or None when both are off
    (the schema has checked that their probabilities add up to at most 1)."""
    mixup, cutmix = cfg.data.augment.mixup, cfg.data.augment.cutmix
    spec = MixSpec(mixup.alpha, mixup.prob, cutmix.alpha, cutmix.prob)
    return spec if spec.enabled else None


def micro_batches(cfg) -> int:
    """Micro-batches per step: ``parallel.pipeline.microbatches`` when set (the same split
    with or without pipeline stages, so a run resumes across layouts), else
    ``train.accumulate_steps`` (the schema has checked that they do not disagree)."""
    k, m = cfg.train.accumulate_steps, cfg.parallel.pipeline.microbatches
    return k if m is None else m


def _check_accumulate(cfg, plan) -> None:
    k = micro_batches(cfg)
    if plan.pipeline is not None and mix_spec(cfg) is not None:
        raise ConfigError("data.augment.mixup.prob: mixup/CutMix is not supported with mesh.pipe > 1",
                          path="data.augment.mixup.prob")
    key = "train.accumulate_steps" if cfg.parallel.pipeline.microbatches is None else "parallel.pipeline.microbatches"
    per_device = cfg.data.batch_size // plan.mesh.shape["data"]
    if per_device % k:
        raise ConfigError(f"{key}: {k} does not divide the {per_device} examples of "
                          f"each device's batch (data.batch_size={cfg.data.batch_size} over "
                          f"{plan.mesh.shape['data']} devices)", path=key)


def build_run(cfg) -> Run:
    """Build model, data, optimiser, policy and loss scale from a validated config.

    Raises ``ConfigError`` (or ``jaxcnn.data.DataError``) for anything the
    config asks that cannot be done, before any computation.
    """
    _check_model_name(cfg)
    policy = _policy(cfg)
    data_seed = cfg.train.seed if cfg.data.seed is None else cfg.data.seed
    data = build_data(cfg, data_seed)
    model = _build_model(cfg, data.num_classes, data.image_shape)
    _check_augment(cfg, data)
    per_epoch = data.steps_per_epoch
    total = train_steps(cfg.train, per_epoch)
    for key in ("train.eval_every", "checkpoint.every", "logging.log_every"):  # epochs: checked here, before any compute
        section, name = key.split(".")
        resolve_duration(cfg[section][name], per_epoch, key=key)
    tx, schedule = build_optimizer(cfg.optim, total_steps=total, steps_per_epoch=per_epoch)
    tx = prune.prune_optimizer(tx, cfg.prune.amount)  # pruned weights get no updates
    if cfg.train.ema_decay > 0:  # last: it averages the parameters the update produces
        tx = optax.chain(tx, ema(cfg.train.ema_decay))
    if cfg.train.early_stopping.patience is not None and (
            cfg.train.eval_every is None or (data.dataset is None and data.images is None)):
        why = ("train.eval_every is null" if cfg.train.eval_every is None
               else "the data has no test set (per-step synthetic data)")
        raise ConfigError(f"train.early_stopping.patience: early stopping watches evaluations, and "
                          f"{why}", path="train.early_stopping.patience")
    return Run(cfg, model, data.dataset, data.synthetic, (cfg.data.batch_size,) + data.image_shape,
               data.num_classes, per_epoch, total, tx, schedule, policy, _loss_scale(cfg, policy),
               data_seed, data.images)


def process_share(share=None) -> dict:
    """The input makers' ``process_index``/``process_count`` for the rows of every batch this
    process loads: ``share`` is ``(index, count)`` (``plan.batch_share``: the rows of the data
    shards this process's devices hold); None: ``(jax.process_index(), jax.process_count())``,
    which is the plan's share when each data shard's devices are in one process."""
    index, count = (jax.process_index(), jax.process_count()) if share is None else share
    return {"process_index": index, "process_count": count}


def batch_fn(run: Run, share=None):
    """``step -> batch`` (host numpy arrays) for the run's training data: the rows ``share``
    (``plan.batch_share``; see :func:`process_share`) names. For an image source the
    loop runs these makers in grain workers (:class:`jaxcnn.train.image_input.TrainInput`); this
    one makes them in turn, without the bookkeeping keys."""
    cfg = run.cfg
    share = process_share(share)
    if run.images is not None:  # uint8: the train step normalises them on the device
        from jaxcnn.data.loader import split_info
        maker = run.images.train_batches(seed=run.data_seed, batch_size=cfg.data.batch_size, **share)
        return lambda step: split_info(maker(step))[0]
    if run.synthetic is not None:  # bytes: the train step normalises them on the device
        return lambda step: synthetic_batch(run.synthetic, step, seed=run.data_seed,
                                            batch_size=cfg.data.batch_size, image_dtype="uint8",
                                            **share)
    from jaxcnn.train.image_input import augment_spec
    augment = augment_spec(cfg)
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
        state = state._replace(opt_state=prune.with_keep(state.opt_state, keep))
    return state


def load_init_from(run: Run):
    """Read ``model.init_from`` and check it against the model, before any compute.

    The file is a jaxcnn parameter file (``params/...``, ``state/...`` keys), a run directory's,
    or a PyTorch ``state_dict`` saved as ``.safetensors`` (torchvision/timm names, recognised by
    its keys; converted by :func:`jaxcnn.interop.load_torch_safetensors`). The layers
    ``model.init_from_skip`` names are left out: :func:`initial_params` initialises them
    from ``train.seed``.

    Returns:
        ``(params, model_state)`` as NumPy trees in the model's dtypes, without the skipped
        layers.

    Raises:
        ConfigError: naming the file and the missing, unexpected, mis-shaped
            or non-float key (with both shapes), or a skip entry that names no layer.
    """
    path = run.cfg.model.init_from
    skip = tuple(run.cfg.model.init_from_skip or ())

    def fail(message, key="model.init_from"):
        raise ConfigError(f"{key}: {message}", path=key)

    if os.path.isdir(path):
        found = RunDir(path).find_params()
        if found is None:
            fail(f"{path!r} is a directory without {' or '.join(RunDir.PARAM_FILES)}; has its "
                 "training finished?")
        path = found
    else:  # a FIFO (it hung), device or link to one is never a parameter file
        try:
            check_regular_file(path, "model.init_from")
        except DataError as e:
            raise ConfigError(str(e), path="model.init_from") from None
    like = jax.eval_shape(lambda: run.model.init(jax.random.PRNGKey(0), run.input_shape)[:2])
    ext = os.path.splitext(path)[1]
    if ext not in PARAMETER_FILE_TYPES:
        fail(f"{path!r}: {unknown_file_type(path, or_run_dir=True)}")
    trees = _read_init_from(run, path, like, skip, fail)
    likes = [dict(tree_items(t)) for t in like]
    out = []
    for where, tree, want_tree in zip(("params", "state"), trees, likes):
        flat = {}
        for key, x in tree_items(tree):
            want = want_tree[key]
            if jnp.issubdtype(want.dtype, jnp.floating) != jnp.issubdtype(x.dtype, jnp.floating):
                fail(f"{path}: key '{where}/{key}' has dtype {x.dtype}, expected {want.dtype}")
            flat[key] = np.asarray(x, want.dtype)
        out.append(unflatten(flat))
    return tuple(out)


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _read_init_from(run: Run, path: str, like, skip: tuple, fail):
    """The ``(params, state)`` trees of ``path``, a jaxcnn parameter file or a torch-named
    safetensors state dict, checked against ``like`` without the ``skip`` layers."""
    torch_named = path.endswith(".safetensors") and interop.is_torch_safetensors(path)
    if not torch_named:
        names = [k for t in like for k, _ in tree_items(t)]
        unknown = [p for p in skip if not any(_under(n, (p,)) for n in names)]
        if unknown:
            fail(f"{unknown} names no layer of model {run.cfg.model.name!r}",
                 "model.init_from_skip")
    try:
        if torch_named:
            return interop.load_torch_safetensors(path, run.model, input_shape=run.input_shape,
                                                  skip=skip)
        load = interop.load_npz if path.endswith(".npz") else interop.load_safetensors
        return load(path, like=like, skip=skip)
    except (ValueError, OSError) as e:
        message = str(e).replace(f"{path}: {run.model.kind}: ", f"{path}: {run.cfg.model.name}: ", 1)
        message = message.replace(":\n  ", ": ", 1).replace("\n  ", "; ")  # the listed problems, on one line
        if torch_named and " names no layer " in message:
            fail(message, "model.init_from_skip")
        if "has shape" in message and not skip:
            message += " (model.init_from_skip: [LAYER] re-initialises a layer instead of loading it)"
        fail(message)


def _fresh_params(run: Run):
    """The random initialisation from ``train.seed`` as host trees: what a run without
    ``model.init_from`` starts from (the master copy under a mixed-precision policy)."""
    fresh = jax.jit(lambda: init_state(run))()
    params = fresh.opt_state.master if isinstance(fresh.opt_state, MasterCopyState) else fresh.params
    return jax.device_get((params, fresh.state))


def _with_skipped(run: Run, loaded):
    """``loaded`` with the layers ``model.init_from_skip`` left out filled in from the seed's
    random initialisation."""
    fresh = _fresh_params(run)
    out = []
    for have, init in zip(loaded, fresh):
        flat = dict(tree_items(init))
        flat.update(tree_items(have))
        out.append(unflatten(flat))
    return tuple(out)


def initial_params(run: Run, loaded=None):
    """What a fresh run starts from: the loaded ``model.init_from`` trees (the layers of
    ``model.init_from_skip`` initialised from ``train.seed``), pruned as the ``prune`` section
    says (from the random initialisation when nothing was loaded).

    Returns:
        ``(start, keep)``: ``(params, model_state)`` host trees or None (plain
        random init), and the pruning masks for :func:`init_state` or None.
    """
    cfg = run.cfg
    if loaded is not None and cfg.model.init_from_skip:
        loaded = _with_skipped(run, loaded)
    if cfg.prune.amount == 0:
        return loaded, None
    if loaded is None:
        loaded = _fresh_params(run)
    return prune.prune_start(run.model, loaded, amount=cfg.prune.amount, scope=cfg.prune.scope,
                             structure=cfg.prune.structure)


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
    count = eval_set_size(run)
    if count is not None and size > count:
        procs = jax.process_count()
        size = max(procs, -(-count // procs) * procs)
    return size


def eval_set_size(run: Run):
    """The number of evaluation images (the test split, or an image source's ``val``), or None
    when there is none (synthetic batches made per step)."""
    if run.images is not None:
        return len(run.images.val)
    return None if run.dataset is None else len(run.dataset.x_test)


def train_image_norm(run: Run):
    """``(mean, std)`` the train step normalises ``uint8`` batches with on the device, or None
    for sources whose batches arrive normalised."""
    if run.synthetic is not None:
        return NOISE_MEAN, NOISE_STD
    if run.images is not None:
        from jaxcnn.train.image_input import image_norm
        return image_norm(run.cfg)
    return None


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
    if not by_classes and cfg.data.source in ("synthetic", "folder", "records") and cfg.data.image_size:
        keys.append(f"data.image_size={list(cfg.data.image_size)}")
    return keys


def _compile(lowered):
    """``lowered.compile()``: XLA's executable of a step, which jit's cache then holds for the
    step's first call; its ``memory_analysis`` is what the memory check reads."""
    return lowered.compile()


def abstract_batch(run: Run, plan):
    """The training batch as the wrapped step takes it (``plan.put_batch``'s output), as shapes."""
    batch, rest = run.input_shape[0], tuple(run.input_shape[1:])
    # synthetic and image sources: bytes, normalised on the device
    image = np.uint8 if run.synthetic is not None or run.images is not None else np.float32
    if plan.strategy == "pmap":
        n = plan.mesh.devices.size
        return {"image": jax.ShapeDtypeStruct((n, batch // n) + rest, image),
                "label": jax.ShapeDtypeStruct((n, batch // n), np.int32)}
    sharding = plan.batch_sharding()
    return {"image": jax.ShapeDtypeStruct(run.input_shape, image, sharding=sharding),
            "label": jax.ShapeDtypeStruct((batch,), np.int32, sharding=sharding)}


def abstract_eval_batch(run: Run, plan, batch_size: int):
    """An evaluation batch as ``plan.put_eval_batch`` gives it to the eval step, as shapes."""
    rows = plan.eval_rows(batch_size)
    sharding = plan.batch_sharding()
    image = np.uint8 if run.images is not None else np.float32  # an image source's: normalised on the device
    return {"image": jax.ShapeDtypeStruct((rows,) + tuple(run.input_shape[1:]), image,
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


def prepare(cfg, check_run=None) -> Prepared:
    """Build everything a run needs and check it, before any parameter is allocated.

    :func:`build_run` (config and data), ``model.init_from``, the mesh and parallel plan, the
    wrapped train and eval steps, then the memory the run would need: the training state from
    its shapes, and each step compiled (``.lower().compile()``, with abstract inputs; the real
    run's first call reuses that executable) and measured by ``memory_analysis``, against the
    memory available (the devices', or the host's for CPU devices).

    ``check_run(run)``, when given, runs once the data are open, before anything is compiled
    (the trainer's check that a resumed run's data did not change).

    Raises:
        ConfigError / DataError: as :func:`build_run` and :func:`make_plan`; a state or step
            that cannot fit in memory names the keys that size it.
    """
    run = build_run(cfg)
    if check_run is not None:
        check_run(run)
    loaded = load_init_from(run) if cfg.model.init_from else None
    with parallel_config_errors():
        plan = make_plan(cfg, run.model, run.input_shape, abstract_state(run))
    _check_accumulate(cfg, plan)
    available = available_memory(local_devices(plan))
    memory = {"available": available[0] if available else None, "train_step": None, "eval_step": None}
    memory["state"] = check_state_memory(
        plan, available, lambda shape: _size_keys(run, shape) or [f"model.name={cfg.model.name}"])
    train_step = plan.wrap_step(make_train_step(
        plan.step_model, run.tx, policy=run.policy, label_smoothing=cfg.optim.label_smoothing,
        schedule=run.schedule, skip_nonfinite=cfg.train.nan_policy == "skip",
        axis_name=plan.step_axis_name, sync_batch_norm=plan.sync_batch_norm,
        image_norm=train_image_norm(run), choices=Choices(
            impl=cfg.model.impl, batch_norm_grad=cfg.model.batch_norm_grad, conv_bn=cfg.model.conv_bn),
        mix=mix_spec(cfg), accumulate=micro_batches(cfg), pipeline=plan.pipeline,
        # mpmd: each stage's tx sees its own gradients, so the step clips by the whole model's
        # norm first (tx's own clip_by_global_norm then finds every stage within it)
        clip_norm=cfg.optim.grad_clip_norm if plan.mpmd is not None else None))
    eval_step = plan.wrap_eval(make_eval_step(plan.step_model, policy=run.policy,
                                              choices=Choices(impl=cfg.model.impl),
                                              image_norm=train_image_norm(run)))
    eval_size = eval_batch_size(run)
    if plan.mpmd is not None:  # one program per stage: checked by its largest stage's peak
        with matmul_precision(cfg):
            report = train_step.memory(plan.abstract_state, abstract_batch(run, plan))
        memory["train_step"] = check_bytes(report["per_device"], plan, available,
                                           [f"data.batch_size={cfg.data.batch_size}"] + _size_keys(run),
                                           "train step")
        if eval_set_size(run) is not None:
            key = "data.eval_batch_size" if cfg.data.eval_batch_size else "data.batch_size"
            memory["eval_step"] = check_bytes(
                eval_step.memory(plan.abstract_state.params, plan.abstract_state.state,
                                 abstract_eval_batch(run, plan, eval_size)),
                plan, available, [f"{key}={eval_size}"] + _size_keys(run), "eval step")
        return Prepared(run, plan, loaded, train_step, eval_step, eval_size, memory,
                        train_step.out_shapes(plan.abstract_state))
    with matmul_precision(cfg):  # traced as the loop traces it, so the loop reuses the executable
        lowered = train_step.lower(plan.abstract_state, abstract_batch(run, plan))
        compiled = _compile(lowered)
        memory["train_step"] = check_step_memory(
            compiled, plan, available, [f"data.batch_size={cfg.data.batch_size}"] + _size_keys(run),
            "train step")
        if eval_set_size(run) is not None:  # without a test set (synthetic throughput runs) nothing evaluates
            compiled_eval = _compile(eval_step.lower(plan.abstract_state.params, plan.abstract_state.state,
                                                     abstract_eval_batch(run, plan, eval_size)))
            key = "data.eval_batch_size" if cfg.data.eval_batch_size else "data.batch_size"
            memory["eval_step"] = check_step_memory(compiled_eval, plan, available,
                                                    [f"{key}={eval_size}"] + _size_keys(run), "eval step")
    return Prepared(run, plan, loaded, train_step, eval_step, eval_size, memory, lowered.out_info)


def matmul_precision(cfg):
    """``precision.matmul_precision`` as a context for tracing; "default" leaves JAX's setting."""
    name = cfg.precision.matmul_precision
    return P.matmul_precision_context(None if name == "default" else name)
