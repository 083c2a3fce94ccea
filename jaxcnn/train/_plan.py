"""The run's mesh, parallel plan and compiled steps (pure helpers of the run function's
sections "parallel plan" and "steps").

`make_plan` builds the :class:`jaxcnn.parallel.ParallelPlan` of a config inside
`parallel_config_errors` (a `SettingError` of :mod:`jaxcnn.parallel` becomes a `ConfigError`
naming the config key); `abstract_batch`/`abstract_eval_batch` are the batches the wrapped
steps take, as shapes; `measure_steps` compiles the steps from them and checks their memory.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np

from jaxcnn import parallel
from jaxcnn.errors import ConfigError, SettingError
from jaxcnn.train._build import matmul_precision, micro_batches, mix_spec
from jaxcnn.train._data import eval_set_size
from jaxcnn.train._memory import check_bytes, check_step_memory


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


def check_accumulate(cfg, plan) -> None:
    """The micro-batches (`micro_batches`) divide each device's batch; no mixup/CutMix with
    pipeline stages."""
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


def size_keys(run, shape=None) -> list:
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


def abstract_batch(run, plan):
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


def abstract_eval_batch(run, plan, batch_size: int):
    """An evaluation batch as ``plan.put_eval_batch`` gives it to the eval step, as shapes."""
    rows = plan.eval_rows(batch_size)
    sharding = plan.batch_sharding()
    image = np.uint8 if run.images is not None else np.float32  # an image source's: normalised on the device
    return {"image": jax.ShapeDtypeStruct((rows,) + tuple(run.input_shape[1:]), image,
                                          sharding=sharding),
            "label": jax.ShapeDtypeStruct((rows,), np.int32, sharding=sharding),
            "mask": jax.ShapeDtypeStruct((rows,), np.bool_, sharding=sharding)}


def measure_steps(cfg, run, plan, train_step, eval_step, eval_size: int, available):
    """Each wrapped step compiled from abstract inputs (``.lower().compile()``: the run's first
    call reuses that executable; traced under ``precision.matmul_precision`` as the loop traces
    it) and its ``memory_analysis`` checked against the memory ``available``
    (:func:`jaxcnn.train._memory.available_memory`). Under mpmd (one program per stage) each
    step is checked by its largest stage's peak. Without a test set (synthetic throughput runs)
    nothing evaluates, and the eval step is not compiled.

    Returns:
        ``({"train_step": bytes, "eval_step": bytes or None}, the train step's output shapes)``
        (bytes None where not known).

    Raises:
        ConfigError: a step that cannot fit, naming the keys that size it.
    """
    state, batch = plan.abstract_state, abstract_batch(run, plan)
    train_keys = [f"data.batch_size={cfg.data.batch_size}"] + size_keys(run)
    evaluates = eval_set_size(run) is not None
    if evaluates:
        key = "data.eval_batch_size" if cfg.data.eval_batch_size else "data.batch_size"
        eval_keys = [f"{key}={eval_size}"] + size_keys(run)
        eval_batch = abstract_eval_batch(run, plan, eval_size)
    memory = {"train_step": None, "eval_step": None}
    if plan.mpmd is not None:
        with matmul_precision(cfg):
            report = train_step.memory(state, batch)
        memory["train_step"] = check_bytes(report["per_device"], plan, available, train_keys, "train step")
        if evaluates:
            memory["eval_step"] = check_bytes(eval_step.memory(state.params, state.state, eval_batch),
                                              plan, available, eval_keys, "eval step")
        return memory, train_step.out_shapes(state)
    with matmul_precision(cfg):
        lowered = train_step.lower(state, batch)
        memory["train_step"] = check_step_memory(_compile(lowered), plan, available, train_keys, "train step")
        if evaluates:
            compiled_eval = _compile(eval_step.lower(state.params, state.state, eval_batch))
            memory["eval_step"] = check_step_memory(compiled_eval, plan, available, eval_keys, "eval step")
    return memory, lowered.out_info
