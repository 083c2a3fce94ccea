"""The run's model, optimiser, precision policy and first state (pure helpers of the run
function's sections "model, optimiser and policy" and "restore or init").

`build_run` turns a validated config (and its opened data, `jaxcnn.train._data.build_data`)
into a `Run`; `load_init_from` reads ``model.init_from`` against the model; `initial_params`
and `init_state` make a fresh run's state; `abstract_state` its shapes. Nothing here
allocates parameters or runs a step, except `init_state` when it is called to.
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcnn import interop, models
from jaxcnn import precision as P
from jaxcnn.data.files import check_regular_file
from jaxcnn.data.mix import MixSpec
from jaxcnn.errors import ConfigError, DataError
from jaxcnn.interop.arrays import PARAMETER_FILE_TYPES, tree_items, unflatten, unknown_file_type
from jaxcnn.train import prune
from jaxcnn.train._data import DataSetup, build_data, check_augment, data_seed
from jaxcnn.train.config import resolve_duration, train_steps
from jaxcnn.train.ema import ema
from jaxcnn.train.optim import build_optimizer
from jaxcnn.train.rundir import RunDir
from jaxcnn.train.state import MasterCopyState, TrainState, create_train_state


class Run(NamedTuple):
    """Everything a run builds from its config before the first step (`build_run`): in the run
    function its local ``run``. A bundle because others build it without training and read it
    whole: ``jaxcnn-eval`` and ``jaxcnn-export`` (evaluation, preprocessing), the per-step
    evaluation helpers (`jaxcnn.train._loop.evaluate`) and the tests."""

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


def check_names(cfg) -> None:
    """``model.name`` and ``precision.policy``, each a one-line ``ConfigError`` when it names
    nothing known: checked before any data file is read."""
    _check_model_name(cfg)
    _policy(cfg)


def build_run(cfg, data: DataSetup | None = None) -> Run:
    """Build model, data, optimiser, policy and loss scale from a validated config.

    ``data``: the run's data when the caller has opened them already (`check_names`, then
    `jaxcnn.train._data.build_data`, as the run function's data section does); by default
    they are opened here, after the same checks.

    Raises ``ConfigError`` (or ``jaxcnn.data.DataError``) for anything the
    config asks that cannot be done, before any computation.
    """
    if data is None:
        check_names(cfg)
        data = build_data(cfg, data_seed(cfg))
    policy = _policy(cfg)
    model = _build_model(cfg, data.num_classes, data.image_shape)
    check_augment(cfg, data)
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
               data_seed(cfg), data.images)


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


def matmul_precision(cfg):
    """``precision.matmul_precision`` as a context for tracing; "default" leaves JAX's setting."""
    name = cfg.precision.matmul_precision
    return P.matmul_precision_context(None if name == "default" else name)
