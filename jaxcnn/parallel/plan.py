"""One object that knows how a run is spread over devices.

A :class:`ParallelPlan` is built from a mesh, the model, the global input shape and the
state's shapes, with every setting an argument, and gives the training loop all it needs::

    plan = ParallelPlan(make_mesh(-1, 1), model, input_shape, abstract_state, strategy="shard_map")
    train_step = plan.wrap_step(make_train_step(plan.step_model, ..., axis_name=plan.step_axis_name,
                                                sync_batch_norm=plan.sync_batch_norm))
    state = plan.shard_state(init_state(run))    # or manager.restore(target=plan.abstract_state)
    index, count = plan.batch_share              # the rows of every batch this process loads
    make_batch = lambda step: train_batch(data, step, ..., process_index=index, process_count=count)
    prefetch = Prefetcher(make_batch, device_put=plan.put_batch)
    state, metrics = train_step(state, batch)

With several processes, ``plan.batch_share`` is read from the mesh: each process loads the
rows of the data shards its devices hold, so ``(jax.process_index(), jax.process_count())``
when each data shard's devices are in one process, and the same rows on every process that
holds devices of a data shard when ``pipe`` (``mesh.order: [pipe]``), ``model`` or
``spatial`` spans processes; :func:`jaxcnn.parallel.batch_share` refuses, in one line naming
``mesh.data``, a layout in which a process's data shards are not one contiguous block.

A setting the plan cannot run is a :class:`jaxcnn.errors.SettingError` naming the argument
(``strategy``, ``pipeline.microbatches``, ``spatial_until``, or an axis of the mesh given:
``mesh.pipe``); the trainer turns it into an error naming its config key.
"""
from __future__ import annotations

import contextlib

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcnn.errors import SettingError
from jaxcnn.parallel import rules as R
from jaxcnn.parallel import spatial as SP
from jaxcnn.parallel import strategies as S
from jaxcnn.parallel.distributed import batch_share, global_batch
from jaxcnn.parallel.mesh import DATA, MODEL, PIPE, SPATIAL, axis_size, check_batch
from jaxcnn.parallel.mpmd import MPMD
from jaxcnn.parallel.pipeline import Pipeline

class ParallelPlan:
    """Mesh, shardings and step wrapper of one run.

    Arguments:
        mesh: the ``(data, model)`` mesh.
        model: the model Layer (its layer kinds give the parameters' logical axes).
        input_shape: the model's global input shape ``(B, H, W, C)``.
        abstract_state: the ``TrainState`` as ``ShapeDtypeStruct``s (``jax.eval_shape``
            of its initialisation); fixes where every leaf lives.
        strategy: ``"shard_map"``, ``"pmap"`` or ``"jit"``.
        rules: logical axis -> mesh axis overrides (merged over ``rules.DEFAULT_RULES``).
        fsdp: shard large parameters and optimiser moments over ``data`` too.
        sync_batch_norm: BatchNorm statistics over the global batch.
        pipeline: with a ``pipe`` axis: ``{"microbatches": M, "split": None | [blocks per
            stage], "balance": "macs" | "params" | "activations" | "memory", "schedule": "gpipe" |
            "1f1b", "remat": bool, "engine": "spmd" | "mpmd" | "auto"}``
            (all optional; ``microbatches``
            defaults to twice the stages); the plan's :attr:`pipeline` (a
            :class:`~jaxcnn.parallel.pipeline.Pipeline`) then goes to
            ``make_train_step(..., pipeline=plan.pipeline)``.  Parameters and optimiser
            moments of at least ``rules.FSDP_MIN_SIZE`` elements are then split over ``pipe``
            (as ``fsdp`` splits them over ``data``), and the step's optimiser update is a
            global program over those shards.  With ``"engine": "mpmd"`` each stage's
            leaves live whole on its own devices instead and the step is one program per
            stage (:attr:`mpmd`, :mod:`jaxcnn.parallel.mpmd`; one process); ``"auto"``: mpmd
            in one process, spmd across processes; default ``"spmd"``.
        spatial_until: with a ``spatial`` axis: how far activations stay split along
            height, ``"auto"`` or a layer path (see :func:`jaxcnn.parallel.spatial.spatial_layout`).
            Parameters and optimiser moments of at least ``rules.FSDP_MIN_SIZE`` elements
            are then split over ``spatial`` at rest (over ``data`` with ``fsdp``).
        spatial_remat: with a ``spatial`` axis: compute every unit of the model again in
            the backward from its input instead of keeping its activations (one more
            forward; see :func:`jaxcnn.parallel.spatial.constrain`).
        spatial_halo: with a ``spatial`` axis: ``"partitioner"`` (XLA's SPMD partitioner
            brings the halo rows) or ``"explicit"`` (each split unit runs per block of rows in
            ``shard_map``, halo rows by ``ppermute``; it also splits windows taller than
            their input and composes with a ``model`` axis).

    Attributes:
        step_model: the model to build the train and eval steps from: ``model`` itself,
            or under spatial partitioning the same model with its activations pinned
            height-sharded and its split parameters gathered before use
            (:func:`jaxcnn.parallel.spatial.constrain`).
        spatial: the :class:`~jaxcnn.parallel.spatial.SpatialLayout`, or None without
            a ``spatial`` axis.

    Raises:
        SettingError: for a combination the strategy cannot run, naming the argument.
    """

    def __init__(self, mesh: Mesh, model, input_shape, abstract_state, *, strategy: str = "shard_map",
                 rules=None, fsdp: bool = False, sync_batch_norm: bool = True,
                 spatial_until: str = "auto", spatial_remat: bool = False,
                 spatial_halo: str = "partitioner", pipeline=None):
        if strategy not in S.STRATEGIES:
            raise SettingError("strategy", f"expected one of {S.STRATEGIES}, got {strategy!r}")
        if strategy == "pmap" and (mesh.shape[MODEL] > 1 or fsdp or jax.process_count() > 1):
            raise SettingError("strategy", "pmap runs single-process data parallelism only "
                               f"(mesh.model={mesh.shape[MODEL]}, fsdp={fsdp}, "
                               f"{jax.process_count()} processes); use shard_map or jit", mentions=("fsdp",))
        if strategy == "jit" and not sync_batch_norm:
            raise SettingError("sync_batch_norm", "false needs strategy shard_map or pmap; jit "
                               "always normalises with the statistics of the global batch")
        check_batch(mesh, input_shape[0])
        if axis_size(mesh, PIPE) > 1 and axis_size(mesh, SPATIAL) > 1:
            raise SettingError(f"mesh.{SPATIAL}", f"{axis_size(mesh, SPATIAL)} with mesh.{PIPE}="
                               f"{axis_size(mesh, PIPE)}: spatial partitioning and pipeline stages do "
                               "not combine; use one of them")
        self.pipeline = _pipeline(mesh, model, input_shape, strategy, fsdp, pipeline or {})
        # one program per stage: each leaf of the state on its stage's devices (parallel.mpmd)
        self.mpmd = MPMD(self.pipeline, mesh) if self.pipeline is not None and self.pipeline.engine == "mpmd" \
            else None
        self.spatial, self.step_model = None, model
        if axis_size(mesh, SPATIAL) > 1:
            # spatial_layout's arguments are this plan's spatial_<name>; its shards the spatial axis
            with _named(shards=f"mesh.{SPATIAL}", until="spatial_until", halo="spatial_halo"):
                SP.check_halo(spatial_halo)
                if mesh.shape[MODEL] > 1 and spatial_halo == "partitioner":
                    raise SettingError("mesh.model", f"{mesh.shape[MODEL]} with mesh.spatial="
                                       f"{axis_size(mesh, SPATIAL)}: spatial partitioning composes with the "
                                       f"data axis only (XLA's partitioner gave wrong gradients for "
                                       f"spatial x model meshes); use mesh.model=1 or spatial_halo=explicit",
                                       mentions=("spatial_halo",))
                if strategy != "jit":
                    raise SettingError("strategy", f"mesh.spatial={axis_size(mesh, SPATIAL)} needs strategy "
                                       f"jit (one global program that XLA partitions), got {strategy!r}")
                self.spatial = SP.spatial_layout(model, input_shape, axis_size(mesh, SPATIAL),
                                                 until=spatial_until, halo=spatial_halo)
        self.mesh, self.strategy, self.fsdp, self.sync_batch_norm = mesh, strategy, fsdp, sync_batch_norm
        self.spatial_remat = bool(spatial_remat and self.spatial is not None)
        self.spatial_halo = spatial_halo if self.spatial is not None else None
        self.rules = R.merge_rules(rules)  # its errors name rules.<axis>, as the argument is
        self.params_axes, self.state_axes = R.logical_axes(model, input_shape)
        self.state_shardings = self._shardings(abstract_state)
        if self.spatial is not None:
            self.step_model = SP.constrain(model, self.spatial, mesh, params=self.state_shardings.params,
                                           remat=spatial_remat, halo=spatial_halo)
        self.abstract_state = jax.tree_util.tree_map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            abstract_state, self.state_shardings)

    @property
    def step_axis_name(self) -> str | None:
        """``axis_name`` for ``make_train_step``: ``"data"``, or None under ``jit``."""
        return S.step_axis_name(self.strategy)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def _shardings(self, abstract_state):
        # Params and model state by the rules, optimiser moments like their params,
        # everything else (step, rng, loss scale) replicated.  With pipeline stages the params
        # (and so their moments) are split over pipe as fsdp splits them over data ("ZeRO over
        # pipe"); the model state (BatchNorm statistics, small) stays replicated.
        # Under spatial partitioning they are split over spatial likewise ("ZeRO over spatial":
        # each unit of the step model gathers its own as it runs, SP.constrain), unless fsdp splits them
        # over data.
        if self.mpmd is not None:
            return self.mpmd.shardings(abstract_state)
        piped = self.pipeline is not None
        spread = self.spatial is not None and not self.fsdp
        params = R.tree_shardings(self.params_axes, abstract_state.params, self.mesh, self.rules,
                                  fsdp=self.fsdp or piped or spread,
                                  fsdp_axis=PIPE if piped else SPATIAL if spread else DATA)
        if piped:
            self.pipeline = self.pipeline.placed(self.mesh, jax.tree_util.tree_map(_pipe_dim, params))
        state = R.tree_shardings(self.state_axes, abstract_state.state, self.mesh, self.rules,
                                 fsdp=self.fsdp)
        opt = R.follow_params(abstract_state.opt_state, abstract_state.params, params, self.mesh)
        rest = {name: jax.tree_util.tree_map(lambda _: self.replicated, getattr(abstract_state, name))
                for name in abstract_state._fields if name not in ("params", "state", "opt_state")}
        return type(abstract_state)(params=params, state=state, opt_state=opt, **rest)

    def create_state(self, fn, *args):
        """``fn(*args)`` (a ``TrainState``) made where it lives, without a whole copy on one
        device: one program placing its output by :attr:`state_shardings` (under the ``mpmd``
        pipeline engine one per stage, :meth:`jaxcnn.parallel.mpmd.MPMD.create`)."""
        if self.mpmd is not None:
            return self.mpmd.create(fn, *args)
        return jax.jit(fn, out_shardings=self.state_shardings)(*args)

    def shard_state(self, state):
        """Place a (host or single-device) ``TrainState`` on the mesh."""
        return jax.device_put(state, self.state_shardings)

    def batch_sharding(self) -> NamedSharding:
        return S.batch_sharding(self.mesh)

    @property
    def batch_share(self) -> tuple[int, int]:
        """``(index, count)``: the rows of every global batch this process loads, share
        ``index`` of ``count`` (rows ``[index * B/count, (index + 1) * B/count)``): the rows of
        the data shards its devices hold.  Give them to the input makers as
        ``process_index=index, process_count=count``.  ``(jax.process_index(),
        jax.process_count())`` when each data shard's devices are in one process; ``(0, 1)``
        (the whole batch) when, say, ``data 2 x pipe 4`` over two processes puts stages 0-1
        of both data shards on one process (see :func:`jaxcnn.parallel.distributed.batch_shares`).

        Raises:
            ValueError: naming ``mesh.data``, for a layout whose processes do not each hold a
                contiguous block of data shards.
        """
        return batch_share(self.mesh)

    def put_batch(self, local_batch):
        """This process's share of a training batch (the rows :attr:`batch_share` names) ->
        what the wrapped step takes (global arrays split over ``data``; for ``pmap`` host
        arrays with a leading device axis).  Use it as the ``Prefetcher``'s ``device_put``."""
        if self.strategy == "pmap":
            return S.pmap_batch(local_batch, self.mesh.devices.size)
        if self.mpmd is not None:  # one process: the images to the first stage, the labels to the last
            return {k: jax.device_put(v, self.mpmd.batch_sharding(k)) for k, v in local_batch.items()}
        return global_batch(local_batch, self.batch_sharding())

    def eval_rows(self, batch_size: int) -> int:
        """The rows of the global arrays :meth:`put_eval_batch` makes of an evaluation batch of
        ``batch_size`` (each process's share padded to whole rows of its data shards)."""
        count = self.batch_share[1]
        local = batch_size // count
        return (local + -local % (self.mesh.shape[DATA] // count)) * count

    def put_eval_batch(self, local_batch):
        """This process's share of an evaluation batch (the rows :attr:`batch_share` names) ->
        global arrays split over ``data``.

        A share that does not split evenly over the process's data shards is padded with zero
        rows whose ``"mask"`` is False (a mask of all True is added when missing), so sums
        over masked rows, as ``make_eval_step`` takes them, are unchanged; processes that load
        the same share pad it alike, so no example is counted twice.
        """
        shards = self.mesh.shape[DATA] // self.batch_share[1]  # data shards of this process
        rows = len(local_batch["label"])
        pad = -rows % shards
        if pad or "mask" not in local_batch:
            local_batch = dict(local_batch)
            local_batch.setdefault("mask", np.ones(rows, bool))
            local_batch = {k: np.concatenate([np.asarray(v), np.zeros((pad,) + np.shape(v)[1:],
                                                                      np.asarray(v).dtype)])
                           for k, v in local_batch.items()}
        if self.mpmd is not None:  # straight to the stages that read them (one process)
            return {k: jax.device_put(v, self.mpmd.batch_sharding(k)) for k, v in local_batch.items()}
        return global_batch(local_batch, self.batch_sharding())

    def wrap_step(self, train_step, *, donate: bool = True):
        """``train_step`` (a ``TrainStep`` built with ``axis_name=self.step_axis_name``,
        ``sync_batch_norm=self.sync_batch_norm`` and ``pipeline=self.pipeline``, or a plain
        ``(state, batch) -> (state, metrics)``) distributed over the mesh."""
        pipeline = self.pipeline if callable(train_step) else train_step.pipeline
        if pipeline is not self.pipeline:
            raise SettingError("train_step", "not built with this plan's pipeline; build it with "
                               "make_train_step(..., pipeline=plan.pipeline)")
        if self.mpmd is not None:
            if callable(train_step) or train_step.stages is None:
                raise SettingError("train_step", "the plan's pipeline engine is mpmd, which runs a "
                                   "step's stages as separate programs; build it with "
                                   "make_train_step(..., pipeline=plan.pipeline)")
            S._check_batch_norm_axis(train_step, DATA if self.sync_batch_norm else None)
            return self.mpmd.build_step(**train_step.stages._asdict(), donate=donate)
        return S.wrap_train_step(train_step, self.strategy, self.mesh, self.state_shardings,
                                 sync_batch_norm=self.sync_batch_norm, donate=donate)

    def wrap_eval(self, eval_step):
        """``eval_step`` (an ``EvalStep``; a plain ``(params, model_state, batch) -> sums``
        except under the mpmd engine) jitted with the state's shardings (a global program
        under every strategy; its sums come back replicated)."""
        if self.mpmd is not None:
            return self.mpmd.build_eval(eval_step)
        sh = self.state_shardings
        return jax.jit(S.step_fn(eval_step), in_shardings=(sh.params, sh.state, self.batch_sharding()),
                       out_shardings=self.replicated)


def _pipe_dim(sharding: NamedSharding):
    """The dimension a sharding splits over ``pipe``, or None."""
    return next((i for i, a in enumerate(sharding.spec) if a == PIPE), None)


def _pipeline(mesh, model, input_shape, strategy, fsdp, spec) -> Pipeline | None:
    """The :class:`Pipeline` of a mesh with a ``pipe`` axis (None without one), its
    combinations with the other settings and the batch checked before any compute."""
    stages = axis_size(mesh, PIPE)
    unknown = set(spec) - {"microbatches", "split", "balance", "schedule", "remat", "engine"}
    if unknown:
        raise SettingError("pipeline", f"unknown key(s) {sorted(unknown)}; expected microbatches, "
                           "split, balance, schedule, remat, engine")
    if stages == 1:
        return None
    if strategy != "shard_map":
        raise SettingError("strategy", f"pipeline parallelism (mesh.pipe={stages}) runs under "
                           f"shard_map, got {strategy!r}")
    if mesh.shape[MODEL] > 1:
        raise SettingError("mesh.model", f"{mesh.shape[MODEL]} with mesh.pipe={stages}; pipeline "
                           "stages combine with the data axis only")
    if fsdp:
        raise SettingError("fsdp", f"not with pipeline parallelism (mesh.pipe={stages})")
    microbatches = spec.get("microbatches")
    shard = (input_shape[0] // mesh.shape[DATA],) + tuple(input_shape[1:])  # balance="memory" weighs it
    # Pipeline's arguments are this plan's pipeline.<key>; its stages are the mesh's pipe axis
    with _named(stages=f"mesh.{PIPE}", model="pipeline", prefix="pipeline"):
        pipe = Pipeline(model, shard, stages, 2 * stages if microbatches is None else microbatches,
                        balance=spec.get("balance") or "macs", split=spec.get("split"),
                        schedule=spec.get("schedule") or "gpipe", remat=spec.get("remat", False),
                        engine=_engine(spec.get("engine") or "spmd"))
        pipe.check_batch(input_shape[0] // mesh.shape[DATA])
    return pipe


def _engine(engine: str) -> str:
    """A pipeline spec's ``engine``: ``"auto"`` is ``"mpmd"`` in one process (each device holds
    its own stage's buffers and runs its own stage's program only: docs/BENCHMARKS.md measures
    the steps) and ``"spmd"`` across processes (mpmd moves activations between stages by
    ``jax.device_put``, within one process)."""
    if engine == "auto":
        return "mpmd" if jax.process_count() == 1 else "spmd"
    return engine


@contextlib.contextmanager
def _named(prefix: str | None = None, **names):
    """A :class:`SettingError` raised inside, named as the plan's own argument: ``names`` maps
    a callee's argument to the plan's, and the others go under ``prefix`` (when given)."""
    try:
        yield
    except SettingError as e:
        if e.setting in names:
            raise SettingError(names[e.setting], e.problem, mentions=e.mentions) from None
        if prefix is not None:
            raise e.under(prefix) from None
        raise
