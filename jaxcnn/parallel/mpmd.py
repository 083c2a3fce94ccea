"""Pipeline stages as one program per stage (MPMD): ``engine="mpmd"`` of a :class:`Pipeline`.

:class:`MPMD` gives each stage its own devices (the mesh's devices at its ``pipe`` index)
and its own compiled programs (forward, recomputing backward, update), which a Python
driver dispatches in the schedule's order (GPipe or 1F1B). Promises:

* the numbers of the SPMD engine (:mod:`jaxcnn.parallel.pipeline`) up to the order of
  float sums: every program is a ``shard_map`` over its stage's ``data`` axis with the same
  per-device semantics;
* a device holds only its own stage's parameters, optimiser state, gradient accumulator and
  stash: no buffer is padded to another stage's size;
* the state is the canonical ``TrainState`` (each leaf placed on its stage's devices), so
  checkpoints resume across layouts and engines;
* global-norm clipping, the finiteness check and loss scaling see the whole model's
  gradients (``make_train_step(clip_norm=)``); the optimiser must otherwise treat leaves
  separately.

One process only. What runs where and when: ``docs/design/mpmd.md``.
"""
from __future__ import annotations

import collections
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxcnn.errors import SettingError
from jaxcnn.parallel.mesh import DATA
from jaxcnn.parallel.pipeline import BACKWARD, FORWARD, Pipeline, _get, _set, one_f_one_b, stash_per_stage
from jaxcnn.parallel.strategies import CPU_MAX_IN_FLIGHT


def stage_meshes(mesh: Mesh, axis: str) -> list[Mesh]:
    """Each stage's devices as a one-axis ``data`` mesh (the mesh's devices at that ``pipe``
    index, in ``data`` order; every other axis must have size 1)."""
    names = list(mesh.axis_names)
    devices = np.moveaxis(mesh.devices, [names.index(axis), names.index(DATA)], [0, 1])
    if devices[0].size != devices.shape[1]:
        raise SettingError("pipeline.engine", f"mpmd runs on a data x pipe mesh, got {dict(mesh.shape)}")
    return [Mesh(devices[s].reshape(-1), (DATA,)) for s in range(devices.shape[0])]


def _keys(path) -> tuple | None:
    """The dict keys at the end of a key path (the parameter path inside an optimiser state),
    or None when it does not end in a dict key."""
    out = []
    for k in reversed(path):
        if not isinstance(k, jax.tree_util.DictKey):
            break
        out.append(k.key)
    return tuple(reversed(out)) or None


class MPMD:
    """The MPMD engine of one :class:`~jaxcnn.parallel.pipeline.Pipeline` on one mesh.

    Arguments:
        pipeline: the stages and schedule (its ``stage_blocks``, ``schedule``, ``remat``).
        mesh: a ``data x pipe`` mesh (``mesh.model`` 1); stage ``s`` runs on its devices at
            ``pipe`` index ``s``.

    Raises:
        SettingError: naming ``pipeline.engine`` for several processes or another axis.
    """

    def __init__(self, pipeline: Pipeline, mesh: Mesh):
        if jax.process_count() > 1:
            raise SettingError("pipeline.engine", "mpmd runs in one process (a stage's output moves "
                               "between devices by jax.device_put); use engine spmd across processes")
        self.pipeline, self.mesh = pipeline, mesh
        self.meshes = stage_meshes(mesh, pipeline.axis_name)
        self.rep = [NamedSharding(m, P()) for m in self.meshes]
        self.rows = [NamedSharding(m, P(DATA)) for m in self.meshes]
        self.everywhere = NamedSharding(mesh, P())
        self.block_owner = {b.path: s for s, blocks in enumerate(pipeline.stage_blocks) for b in blocks}
        self.param_paths = None  # the parameters' dict-key paths (learn)
        self.opt_owners = {}  # optimiser-state key path -> opt_owner (asked every step)

    # ----- placement --------------------------------------------------------------------

    def owner(self, keys) -> int | None:
        """The stage whose block holds the parameter at dict-key path ``keys`` (None: no block)."""
        if keys is None:
            return None
        for n in range(len(keys), 0, -1):
            if keys[:n] in self.block_owner:
                return self.block_owner[keys[:n]]
        return None

    def learn(self, params) -> None:
        """Remember the parameters' dict-key paths (once), which optimiser-state leaves end in."""
        if self.param_paths is None:
            self.param_paths = {_keys(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]}

    def opt_owner(self, path) -> int | None:
        """The stage owning an optimiser-state leaf: the block of the parameter path its key path
        ends in (the longest such suffix: the state may hold the parameters' tree under dict keys
        of its own, as ``optax.named_chain`` does); None for a leaf that ends in none (a count)."""
        if path in self.opt_owners:
            return self.opt_owners[path]
        keys = _keys(path)
        if keys is None or self.param_paths is None:
            return self.owner(keys)
        found = self.opt_owners[path] = next(
            (self.owner(keys[i:]) for i in range(len(keys)) if keys[i:] in self.param_paths), None)
        return found

    def leaf_owner(self, field: str, path) -> int | None:
        """The stage owning a ``TrainState`` leaf: ``field`` its field name, ``path`` its key path
        inside it (params and model state by their block; an optimiser state leaf by
        :meth:`opt_owner`; anything else None)."""
        if field in ("params", "state"):
            return self.owner(_keys(path))
        return self.opt_owner(path) if field == "opt_state" else None

    def shardings(self, abstract_state):
        """A ``TrainState`` of shardings: every owned leaf replicated over its stage's devices,
        every other leaf over all devices."""
        self.learn(abstract_state.params)
        out = {}
        for field in abstract_state._fields:
            tree = getattr(abstract_state, field)
            out[field] = jax.tree_util.tree_map_with_path(
                lambda path, _, f=field: self._sharding(self.leaf_owner(f, path)), tree)
        return type(abstract_state)(**out)

    def _sharding(self, stage):
        return self.everywhere if stage is None else self.rep[stage]

    def stage_tree(self, tree, s):
        """The part of a params-like tree (nested dicts) that stage ``s``'s blocks hold."""
        out = {}
        for b in self.pipeline.stage_blocks[s]:
            v = _get(tree, b.path)
            if v:
                out = _set(out, b.path, v)
        return out

    def merge(self, tree, parts):
        """``tree`` with each stage's part (:meth:`stage_tree`) put back."""
        for s, part in enumerate(parts):
            for b in self.pipeline.stage_blocks[s]:
                v = _get(part, b.path)
                if v:
                    tree = _set(tree, b.path, v)
        return tree

    def stage_opt(self, whole, template, s):
        """Stage ``s``'s optimiser state (shaped as ``template``, ``tx.init`` of its
        parameters) from the whole one (``whole``: its leaves by key path): the leaves with the
        same key path; the unowned ones (counts) copied to its devices."""
        paths, treedef = jax.tree_util.tree_flatten_with_path(template)
        leaves = []
        for path, _ in paths:
            if path not in whole:
                raise SettingError("pipeline.engine", f"the optimiser state of stage {s} has a leaf at "
                                   f"{jax.tree_util.keystr(path)} that the whole model's has not; mpmd "
                                   f"needs an optimiser whose state follows the parameters leaf by leaf")
            x = whole[path]
            if self.opt_owner(path) != s:  # a count: a copy on this stage's devices
                x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self.rep[s]) \
                    if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, self.rep[s])
            leaves.append(x)
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def merge_opt(self, opt_state, parts):
        """The whole optimiser state from the stages' (:meth:`stage_opt`): each owned leaf from its
        stage, each unowned one (a count, the same on every stage) from stage 0's, on every device."""
        found = [dict(jax.tree_util.tree_flatten_with_path(p)[0]) for p in parts]
        paths, treedef = jax.tree_util.tree_flatten_with_path(opt_state)
        leaves = []
        for path, _ in paths:
            s = self.opt_owner(path)
            leaves.append(found[s][path] if s is not None else jax.device_put(found[0][path], self.everywhere))
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def create(self, fn, *args):
        """``fn(*args)`` (a ``TrainState``) made in place: one program per stage computes that
        stage's leaves on its devices (XLA drops the rest of ``fn``), one more the unowned
        leaves on every device; no device holds another stage's parameters."""
        abstract = jax.eval_shape(fn, *args)
        self.learn(abstract.params)
        paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
        owners = [self.leaf_owner(path[0].name, path[1:]) for path, _ in paths]
        leaves = [None] * len(paths)
        for group in [None] + list(range(self.pipeline.stages)):
            idx = [i for i, o in enumerate(owners) if o == group]
            if not idx:
                continue
            part = jax.jit(lambda *a, idx=tuple(idx): [jax.tree_util.tree_leaves(fn(*a))[i] for i in idx],
                           out_shardings=self._sharding(group))(*args)
            for i, x in zip(idx, part):
                leaves[i] = x
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def batch_sharding(self, key: str) -> NamedSharding:
        """Where a batch's ``key`` goes: the images to stage 0's devices, the rest (labels,
        mask) to the last stage's, split over ``data``."""
        return self.rows[0] if key == "image" else self.rows[-1]

    def build_eval(self, eval_step):
        """``evaluate(params, model_state, batch) -> sums`` stage by stage (each stage's blocks in
        inference mode on its devices, the sums on the last), from ``make_eval_step``'s step
        (its ``prepare`` on the first, ``sums``, ``policy`` and ``choices``)."""
        S, blocks = self.pipeline.stages, self.pipeline.stage_blocks

        def program(s):
            def f(params, mstate, x, rest):
                if s == 0:
                    x = eval_step.prepare(x)
                for b in blocks[s]:
                    x, _ = b.layer.apply(_get(params, b.path), _get(mstate, b.path), x, train=False,
                                         policy=eval_step.policy, choices=eval_step.choices)
                return eval_step.sums(x, rest) if s == S - 1 else x
            return jax.jit(f, out_shardings=self.rep[s] if s == S - 1 else self.rows[s])

        programs = [program(s) for s in range(S)]

        def run(params, model_state, batch):
            x = jax.device_put(batch["image"], self.rows[0])
            rest = {k: jax.device_put(v, self.rows[-1]) for k, v in batch.items() if k != "image"}
            for s in range(S):
                x = programs[s](self.stage_tree(params, s), self.stage_tree(model_state, s), x,
                                rest if s == S - 1 else None)
                if s < S - 1:
                    x = jax.device_put(x, self.rows[s + 1])
            return jax.device_put(x, self.everywhere)

        def memory(params, model_state, batch) -> int:
            """The evaluation's bytes on the busiest device (shapes in; XLA's compile-time
            ``memory_analysis`` of each stage's program): its stage's parameters and statistics,
            its input and what its program adds (temporaries and outputs)."""
            x = _on(batch["image"], self.rows[0])
            rest = {k: _on(v, self.rows[-1]) for k, v in batch.items() if k != "image"}
            peak = 0
            for s in range(S):
                args = (_on(self.stage_tree(params, s), self.rep[s]), _on(self.stage_tree(model_state, s), self.rep[s]),
                        x, rest if s == S - 1 else None)
                compiled = programs[s].lower(*args).compile()
                peak = max(peak, _per_device(args) + _prog(compiled))
                if s < S - 1:
                    x = _on(jax.eval_shape(programs[s], *args), self.rows[s + 1])
            return peak

        return _StagedEval(run, memory)

    # ----- the step ---------------------------------------------------------------------

    def build_step(self, *, head, prepare, policy, choices, init_opt, update, finish, select_nonfinite,
                   sync_batch_norm: bool = True, donate: bool = True):
        """``step(state, batch) -> (state, metrics)`` of the canonical ``TrainState``.

        Arguments:
            head: ``head(logits, labels, loss_scale) -> (scaled loss, (loss, top1))``.
            prepare: stage 0's input from a micro-batch's images.
            policy, choices: passed to every block (``choices.axis_name``: ``data`` to sync
                BatchNorm over the data shards).
            init_opt: the optimiser state of some parameters (run abstractly, for the shape of
                each stage's).
            update: ``update(params, opt_state, grads, norm) -> (grads as applied, params,
                opt_state)`` of one stage's leaves, ``norm`` the global norm of every stage's
                gradients (for global-norm clipping).
            finish: ``finish((step, loss_scale, skipped), finite, grad_norm, loss, top1) ->
                (step, loss_scale, skipped, metrics)`` (run on every device).
            select_nonfinite: ``select_nonfinite(state)``: keep each stage's parameters,
                optimiser and model state when any gradient is not finite.
            sync_batch_norm: False: each data shard's own statistics, their running values
                averaged over ``data``.
            donate: the step reuses the buffers of the state it is given.
        """
        return _Driver(self, head=head, prepare=prepare, policy=policy, choices=choices, init_opt=init_opt,
                       update=update, finish=finish, select_nonfinite=select_nonfinite,
                       sync_batch_norm=sync_batch_norm, donate=donate)


class _StagedEval(NamedTuple):
    """``evaluate(params, model_state, batch) -> sums`` stage by stage, and ``memory`` (the same
    arguments, as shapes): its bytes on the busiest device."""

    run: Callable
    memory: Callable

    def __call__(self, params, model_state, batch):
        return self.run(params, model_state, batch)


def _floating(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def _acc_dtype(x):
    return jnp.promote_types(x.dtype, jnp.float32)


class _Driver:
    """The compiled stage programs and the Python loop that runs them in the schedule's order."""

    def __init__(self, engine: MPMD, *, head, prepare, policy, choices, init_opt, update, finish,
                 select_nonfinite, sync_batch_norm, donate):
        self.e, self.p = engine, engine.pipeline
        self.head, self.prepare, self.policy, self.choices = head, prepare, policy, choices
        self.init_opt, self.update, self.finish = init_opt, update, finish
        self.select, self.sync = select_nonfinite, sync_batch_norm
        self.donate = donate
        S, D = self.p.stages, engine.mesh.shape[DATA]
        self.fwd = [self._forward(s) for s in range(S)]
        self.bwd = [self._backward(s) for s in range(S)]
        self.grads = [self._grads(s) for s in range(S)]
        self.apply = {}  # (stage, select) -> program
        zeros = lambda t: jax.tree_util.tree_map(lambda x: jnp.zeros((D,) + x.shape, _acc_dtype(x)), t)  # noqa: E731
        self.zeros = [jax.jit(zeros, out_shardings=engine.rows[s]) for s in range(S)]
        # the global scalars from every stage's: finite, norm, mean loss and accuracy
        self.finish_jit = jax.jit(lambda scalars, fins, sqs, losses, top1s: finish(
            scalars, jnp.all(jnp.stack(fins)), jnp.sqrt(jnp.sum(jnp.stack(sqs))), jnp.mean(jnp.stack(losses)),
            jnp.mean(jnp.stack(top1s))), out_shardings=engine.everywhere)
        self.schedule = self.order()  # dispatch order, the same every step
        self.templates = {}  # stage -> its optimiser state's shape
        # emulated CPU devices: wait for the step CPU_MAX_IN_FLIGHT calls back, as the SPMD steps do
        self.pending = collections.deque()
        self.max_in_flight = CPU_MAX_IN_FLIGHT if engine.mesh.devices.flat[0].platform == "cpu" else None

    # ----- per-device pieces (inside shard_map over the stage's data axis) --------------------

    def _key(self, rng, step, m):
        key = jax.random.fold_in(jax.random.wrap_key_data(rng), jax.lax.axis_index(DATA))
        return jax.random.fold_in(jax.random.fold_in(key, step), m)

    def _micro(self, x, m):
        """Micro-batch ``m`` of this device's rows: examples ``m, m + M, ...``."""
        M = self.p.microbatches
        n = x.shape[0]
        self.p.check_batch(n)
        return jax.lax.dynamic_index_in_dim(x.reshape((n // M, M) + x.shape[1:]), m, 1, keepdims=False)

    def _run(self, s, params, mstate, x, key):
        return self.p._run_stage(s, params, mstate, x, key, policy=self.policy, choices=self.choices)

    def _shard_map(self, s, f, in_specs, out_specs):
        return jax.shard_map(f, mesh=self.e.meshes[s], in_specs=in_specs, out_specs=out_specs,
                             check_vma=False)

    def _forward(self, s):
        last, first = s == self.p.stages - 1, s == 0

        def f(params, mstate, x, labels, rng, step, m, loss_scale):
            key = self._key(rng, step, m)
            x = self.prepare(self._micro(x, m)) if first else x
            y, new = self._run(s, params, mstate, x, key)
            for path, v in new.items():
                mstate = _set(mstate, path, v)
            if not self.sync:  # each shard's statistics: their running values averaged
                mstate = jax.tree_util.tree_map(
                    lambda v: jax.lax.pmean(v, DATA) if _floating(v) else v, mstate)
            if last:
                _, (loss, top1) = self.head(y, self._micro(labels, m), loss_scale)
                out = (jax.lax.pmean(loss.astype(jnp.float32), DATA), jax.lax.pmean(top1.astype(jnp.float32), DATA))
                return out, mstate
            return y, mstate

        out_y = (P(), P()) if last else P(DATA)
        mapped = self._shard_map(s, f, (P(), P(), P(DATA), P(DATA) if last else None, P(), P(), P(), P()),
                                 (out_y, P()))
        return jax.jit(mapped)

    def _backward(self, s):
        last, first = s == self.p.stages - 1, s == 0

        def f(params, mstate, x, ct, rng, step, m, loss_scale, acc):
            key = self._key(rng, step, m)

            def g(params, x):
                y, _ = self._run(s, params, mstate, x, key)
                return self.head(y, self._micro(ct, m), loss_scale)[0] if last else y

            if first:
                out, vjp = jax.vjp(lambda p: g(p, self.prepare(self._micro(x, m))), params)
                (d_params,) = vjp(jnp.ones_like(out) if last else ct)
                d_x = None
            else:
                out, vjp = jax.vjp(g, params, x)
                d_params, d_x = vjp(jnp.ones_like(out) if last else ct)
            acc = jax.tree_util.tree_map(lambda a, d: a + d.astype(a.dtype)[None], acc, d_params)
            return acc, d_x

        mapped = self._shard_map(s, f, (P(), P(), P(DATA), P(DATA), P(), P(), P(), P(), P(DATA)),
                                 (P(DATA), None if first else P(DATA)))
        return jax.jit(mapped, donate_argnums=(8,))

    def _grads(self, s):
        """The accumulator -> this stage's unscaled gradients (averaged over micro-batches and
        ``data``, in the parameters' dtypes), their sum of squares and finiteness."""
        M = self.p.microbatches

        def f(acc, params, loss_scale):
            def mean(a, p):
                g = (a / M).astype(p.dtype)
                wide = g.astype(jnp.float32) if _floating(g) and jnp.finfo(g.dtype).bits < 32 else g
                return jnp.mean(wide, axis=0).astype(p.dtype)
            grads = loss_scale.unscale(jax.tree_util.tree_map(mean, acc, params))
            leaves = jax.tree_util.tree_leaves(grads)
            sq = sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves), jnp.zeros((), jnp.float32))
            finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in leaves] + [jnp.array(True)]))
            return grads, sq, finite

        return jax.jit(f, out_shardings=self.e.rep[s])

    def _apply(self, s, select):
        def f(params, opt_state, grads, mstate, old_mstate, sqs, finites):  # sqs, finites: every stage's
            finite = jnp.all(jnp.stack(finites))
            _, new_params, new_opt = self.update(params, opt_state, grads, jnp.sqrt(jnp.sum(jnp.stack(sqs))))
            if select:
                pick = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
                new_params, new_opt, mstate = pick(new_params, params), pick(new_opt, opt_state), pick(mstate, old_mstate)
            return new_params, new_opt, mstate

        return jax.jit(f, out_shardings=self.e.rep[s], donate_argnums=(0, 1) if self.donate else ())

    # ----- the driver -----------------------------------------------------------------

    def order(self):
        """``[(FORWARD or BACKWARD, stage, micro-batch)]`` in dispatch order: GPipe's ticks
        (every forward, then every backward), or the 1F1B timetable's, stage by stage."""
        S, M = self.p.stages, self.p.microbatches
        if self.p.schedule == "gpipe":
            ops = [(FORWARD, s, t - s) for t in range(M + S - 1) for s in range(S) if 0 <= t - s < M]
            # within a tick, stage s before s + 1: s uses its cotangent before s + 1 sends the next
            return ops + [(BACKWARD, s, t - (S - 1 - s)) for t in range(M + S - 1) for s in range(S)
                          if 0 <= t - (S - 1 - s) < M]
        table = one_f_one_b(S, M)
        return [(int(table.op[t, s]), s, int(table.micro[t, s])) for t in range(table.ticks) for s in range(S)
                if table.op[t, s] in (FORWARD, BACKWARD)]

    def memory(self, abstract_state, abstract_batch) -> dict:
        """The step's bytes per device, stage by stage, from XLA's compile-time
        ``memory_analysis`` of each stage program (nothing runs): ``{"stages": [{...}],
        "per_device": the largest stage's peak}``.  A stage's peak is the larger of

        * the schedule's: its state (parameters, optimiser state, BatchNorm statistics and the
          scalars every device keeps), its gradient accumulator, its part of the batch, its
          stash (:func:`~jaxcnn.parallel.pipeline.stash_per_stage`), plus the larger of its
          forward's and its backward's temporaries and outputs (less donated buffers), the
          backward's incoming cotangent too;
        * the update's: its state, its part of the batch and its gradients, plus the update's
          (or the gradient average's, with the accumulator still held) temporaries and outputs.
        """
        e, S, M = self.e, self.p.stages, self.p.microbatches
        views = self.views(abstract_state)
        images = jax.ShapeDtypeStruct(abstract_batch["image"].shape, abstract_batch["image"].dtype,
                                      sharding=e.rows[0])
        labels = jax.ShapeDtypeStruct(abstract_batch["label"].shape, abstract_batch["label"].dtype,
                                      sharding=e.rows[-1])
        scal = [jax.tree_util.tree_map(lambda x, s=s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=e.rep[s]),
                                       (abstract_state.rng, abstract_state.step, abstract_state.loss_scale))
                for s in range(S)]
        slots = stash_per_stage(self.p.schedule, S, M)
        m = jax.ShapeDtypeStruct((), np.int32)
        D = e.mesh.shape[DATA]
        out, x = [], images
        for s in range(S):
            params, mstate = _on(views[0][s], e.rep[s]), _on(views[1][s], e.rep[s])
            opt = _on(views[2][s], e.rep[s])
            acc = jax.eval_shape(self.zeros[s], params)
            acc = jax.tree_util.tree_map(lambda a, s=s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=e.rows[s]), acc)
            rng, step, ls = scal[s]
            last = s == S - 1
            fwd = self.fwd[s].lower(params, mstate, x, labels if last else None, rng, step, m, ls).compile()
            y = jax.eval_shape(self.fwd[s], params, mstate, x, labels if last else None, rng, step, m, ls)[0]
            ct = labels if last else jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=e.rows[s])
            bwd = self.bwd[s].lower(params, mstate, x, ct, rng, step, m, ls, acc).compile()
            grads_c = self.grads[s].lower(acc, params, ls).compile()
            grads = jax.eval_shape(self.grads[s], acc, params, ls)[0]
            vec = [jax.ShapeDtypeStruct((), np.float32, sharding=e.rep[s])] * S  # every stage's scalars
            fin = [jax.ShapeDtypeStruct((), np.bool_, sharding=e.rep[s])] * S
            select = False
            if (s, select) not in self.apply:
                self.apply[(s, select)] = self._apply(s, select)
            grads = _on(grads, e.rep[s])
            apply = self.apply[(s, select)].lower(params, opt, grads, mstate, mstate, vec, fin).compile()
            everywhere = [v for v in jax.tree_util.tree_leaves(abstract_state)
                          if getattr(v, "sharding", None) is None or len(v.sharding.device_set) > D]
            state_b = _per_device((params, mstate, opt)) + _per_device(everywhere)
            batch_b = (_per_device(images) if s == 0 else 0) + (_per_device(labels) if last else 0)
            stash_b = 0 if s == 0 else slots[s] * _per_device(x)  # x: one micro-batch
            ct_b = 0 if last else _per_device(ct)
            schedule = state_b + _per_device(acc) + batch_b + stash_b + max(_prog(fwd), _prog(bwd) + ct_b)
            update = state_b + batch_b + max(_per_device(acc) + _prog(grads_c), _per_device(grads) + _prog(apply))
            out.append({"state": state_b, "accumulator": _per_device(acc), "batch": batch_b, "stash": stash_b,
                        "forward": _prog(fwd), "backward": _prog(bwd), "update": _prog(apply),
                        "peak": max(schedule, update)})
            if not last:  # the next stage's input: one micro-batch of this stage's output
                x = jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=e.rows[s + 1])
        return {"stages": out, "per_device": max(st["peak"] for st in out)}

    def out_shapes(self, abstract_state):
        """``(state, metrics)`` as the step returns them, as shapes."""
        f32, scalars = jax.ShapeDtypeStruct((), jnp.float32), (abstract_state.step, abstract_state.loss_scale,
                                                               abstract_state.skipped)
        metrics = jax.eval_shape(self.finish, scalars, jax.ShapeDtypeStruct((), jnp.bool_), f32, f32, f32)[3]
        return abstract_state, metrics

    def views(self, state):
        """Each stage's parameters, model state and optimiser state (its own leaves, no copy)."""
        e, S = self.e, self.p.stages
        e.learn(state.params)
        params = [e.stage_tree(state.params, s) for s in range(S)]
        mstate = [e.stage_tree(state.state, s) for s in range(S)]
        for s in range(S):
            if s not in self.templates:
                self.templates[s] = jax.eval_shape(self.init_opt, params[s])
        whole = dict(jax.tree_util.tree_flatten_with_path(state.opt_state)[0])
        opt = [e.stage_opt(whole, self.templates[s], s) for s in range(S)]
        return params, mstate, opt

    def __call__(self, state, batch):
        e, S = self.e, self.p.stages
        params, old_mstate, opt = self.views(state)
        mstate = list(old_mstate)
        scalars = [jax.device_put((state.rng, state.step, state.loss_scale), e.rep[s]) for s in range(S)]
        images = jax.device_put(batch["image"], e.rows[0])
        labels = jax.device_put(batch["label"], e.rows[S - 1])
        acc = [self.zeros[s](params[s]) for s in range(S)]
        stash = [dict() for _ in range(S)]  # stage inputs, kept from their arrival to their backward
        cts = [dict() for _ in range(S)]
        losses, top1s = [], []
        for kind, s, m in self.schedule:
            rng, step, ls = scalars[s]
            mi = np.int32(m)
            x = images if s == 0 else stash[s][m]
            if kind == FORWARD:
                y, mstate[s] = self.fwd[s](params[s], mstate[s], x, labels if s == S - 1 else None,
                                           rng, step, mi, ls)
                if s == S - 1:
                    losses.append(y[0])
                    top1s.append(y[1])
                else:
                    stash[s + 1][m] = jax.device_put(y, e.rows[s + 1])
            else:
                ct = labels if s == S - 1 else cts[s].pop(m)
                acc[s], d_x = self.bwd[s](params[s], old_mstate[s], x, ct, rng, step, mi, ls, acc[s])
                if s > 0:
                    del stash[s][m]
                    cts[s - 1][m] = jax.device_put(d_x, e.rows[s - 1])
        grads, sqs, fins = zip(*[self.grads[s](acc[s], params[s], scalars[s][2]) for s in range(S)])
        del acc
        new_params, new_mstate, new_opt = [], [], []
        select = bool(self.select(state))
        for s in range(S):
            sq, fin = jax.device_put((list(sqs), list(fins)), e.rep[s])
            if (s, select) not in self.apply:
                self.apply[(s, select)] = self._apply(s, select)
            ps, os_, ms = self.apply[(s, select)](params[s], opt[s], grads[s], mstate[s], old_mstate[s], sq, fin)
            new_params.append(ps)
            new_opt.append(os_)
            new_mstate.append(ms)
        step, loss_scale, skipped, metrics = self.finish_jit(
            (state.step, state.loss_scale, state.skipped),
            *jax.device_put((list(fins), list(sqs), losses, top1s), e.everywhere))
        new_state = type(state)(
            step=step, params=e.merge(state.params, new_params), state=e.merge(state.state, new_mstate),
            opt_state=e.merge_opt(state.opt_state, new_opt), loss_scale=loss_scale, rng=state.rng,
            skipped=skipped)
        if self.max_in_flight is not None:
            self.pending.append(metrics)
            if len(self.pending) > self.max_in_flight:
                jax.block_until_ready(self.pending.popleft())
        return new_state, metrics


def _on(tree, sharding):
    """``tree``'s leaves as shapes placed by ``sharding``."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _per_device(tree) -> int:
    """Bytes of one device's shard of each leaf (arrays or placed shapes)."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        sh = getattr(x, "sharding", None)
        shape = sh.shard_shape(x.shape) if sh is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def _prog(compiled) -> int:
    """A compiled program's temporaries and outputs less the donated buffers it reuses, per device."""
    st = compiled.memory_analysis()
    if isinstance(st, (list, tuple)):
        st = st[0]
    return max(0, int(st.temp_size_in_bytes) + int(st.output_size_in_bytes) - int(st.alias_size_in_bytes))
