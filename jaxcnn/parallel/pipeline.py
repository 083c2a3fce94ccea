"""Pipeline parallelism: a serial model's blocks split into stages over the ``pipe`` axis.

:class:`Pipeline` reads a ``serial`` model (every zoo model) as a list of blocks
(:func:`pipeline_blocks`: its children, nested ``serial`` children opened up), assigns
contiguous runs of them to ``stages`` devices (balanced by MACs, parameters, activations or
estimated memory, or an explicit ``split``) and, through :meth:`Pipeline.gradients`, runs a
training step's forward and backward over them with a GPipe or 1F1B schedule
(:func:`one_f_one_b`) inside one ``shard_map`` over ``data`` and ``pipe``.

Promises:

* the same numbers as the step on one device with ``make_train_step(accumulate=M)``: the
  batch of each data shard is cut into ``microbatches`` micro-batches the same way, and
  BatchNorm normalises and updates its statistics per micro-batch, in order;
* parameters and optimiser state rest split over ``pipe`` ("ZeRO over pipe", placed by
  :class:`~jaxcnn.parallel.ParallelPlan`), so the optimiser that follows is the one-device
  optimiser partitioned by XLA, and checkpoints hold the canonical ``TrainState``;
* a model that cannot be split as asked is a :class:`~jaxcnn.errors.SettingError` naming
  the argument, before any compute.

This module knows nothing of losses and optimisers: ``jaxcnn.train.step`` gives
:meth:`Pipeline.gradients` the loss head and the input preparation. The schedules, what
lives where and what a device holds: ``docs/design/pipeline.md``; ``engine="mpmd"``:
:mod:`jaxcnn.parallel.mpmd`.
"""
from __future__ import annotations

import copy
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcnn._fence import stored
from jaxcnn.errors import SettingError
from jaxcnn.layers.base import Layer, split_rng
from jaxcnn.parallel.mesh import PIPE

BALANCE = ("macs", "params", "activations", "memory")
SCHEDULES = ("gpipe", "1f1b")
ENGINES = ("spmd", "mpmd")


class Block(NamedTuple):
    """One unit of stage assignment: a child of the model (or of a nested serial).

    ``path``: its names from the root (``("layer1", "0")``); ``rng_path``: the
    positions whose ``split_rng`` keys lead to it from the model's key.
    """

    path: tuple
    rng_path: tuple
    layer: Layer

    @property
    def name(self) -> str:
        return ".".join(self.path)


def pipeline_blocks(model: Layer) -> list[Block]:
    """The blocks of a serial model, in order (nested ``serial`` children opened up).

    Raises:
        SettingError: naming ``model`` when it is not a ``serial``.
    """
    if model.kind != "serial":
        raise SettingError("model", f"the model must be a serial stack of blocks to be split into "
                           f"stages, got a layer of kind {model.kind!r}")
    out = []

    def walk(layer, path, rng_path):
        for i, (name, child) in enumerate(layer.children):
            if child.kind == "serial" and child.children:
                walk(child, path + (name,), rng_path + (i,))
            else:
                out.append(Block(path + (name,), rng_path + (i, len(layer.children)), child))

    walk(model, (), ())
    return out


def block_costs(model: Layer, input_shape, blocks, balance: str) -> list[int]:
    """Each block's MACs (``"macs"``), parameters (``"params"``) or output elements of its
    layers (``"activations"``, what its backward keeps) at ``input_shape``."""
    if balance not in BALANCE[:3]:
        raise SettingError("balance", f"expected one of {BALANCE[:3]}, got {balance!r}")
    from jaxcnn.summary import summary  # the whole model, abstractly (no memory)
    rows = summary(model, input_shape).rows
    cost = {"macs": lambda r: r.macs, "params": lambda r: r.params,
            "activations": lambda r: math.prod(r.output_shape)}[balance]
    costs = []
    for b in blocks:
        prefix = b.name
        costs.append(sum(cost(r) for r in rows if r.name == prefix or r.name.startswith(prefix + ".")))
    return costs


def balanced_split(costs, stages: int) -> list[int]:
    """Blocks per stage: contiguous, non-empty, minimising the largest stage's cost
    (ties: the earliest stage boundaries).  Every block counts at least 1, so
    free blocks (pooling, activations) spread too."""
    n = len(costs)
    costs = [max(int(c), 1) for c in costs]
    prefix = np.concatenate([[0], np.cumsum(costs)])
    inf = float("inf")
    # best[k][i]: the smallest max-cost of splitting the first i blocks into k stages
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                v = max(best[k - 1][j], prefix[i] - prefix[j])
                if v < best[k][i]:
                    best[k][i], cut[k][i] = v, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def remat_stage_acts(acts, inputs, single) -> np.ndarray:
    """``A[j, i]``: the activation elements (per example) that a stage of blocks ``j..i-1``
    holds at the peak of its backward under ``remat``: the input of each of its units
    (stored from the recomputed forward to the unit's backward) plus the largest unit's
    internals (its layers' outputs, recomputed in the unit's own backward); ``inf`` for
    ``j >= i``.  Units as :meth:`Pipeline.remat_units` forms them: a run of consecutive
    single-layer blocks (``single``) is one unit, cut at the stage's edges.

    Arguments:
        acts: each block's layers' output elements per example (its internals).
        inputs: each block's input elements per example.
        single: whether each block is a single layer."""
    n = len(acts)
    A = np.full((n + 1, n + 1), np.inf)
    for j in range(n):
        stored = inner = unit = 0.0
        for k in range(j, n):  # the stage j..k
            if k > j and single[k] and single[k - 1]:
                unit += acts[k]  # joins the run of single layers before it
            else:
                stored, unit = stored + inputs[k], float(acts[k])
            inner = max(inner, unit)
            A[j, k + 1] = stored + inner
    return A


# The per-device memory model of balance="memory", in float32 elements, as the compiled
# step holds them at its peak (a stage's backward; measured on ResNet-50 at 224x224 with
# XLA's buffer assignment, docs/BENCHMARKS.md): the stage's activations of one micro-batch
# (its layers' outputs, kept for the backward) and its weights reassembled from the packed
# buffer inside its branch (MEMORY_OWN_PARAM_BUFFERS); the buffers that SPMD sizes by the
# largest stage's parameters on every device (MEMORY_PARAM_BUFFERS: its gathered
# parameters, the gradient accumulator and the switch's gradient output, which XLA keeps
# live through the whole branch); and the micro-batch buffers at the widest stage boundary
# besides the stash (MEMORY_WIRE_BUFFERS: the cotangent into the switch and the one out).
# Counting a stage's weights once picked ResNet-50's best measured 2-stage split; twice
# picked a worse 4-stage split (docs/BENCHMARKS.md).
MEMORY_OWN_PARAM_BUFFERS = 1
MEMORY_PARAM_BUFFERS = 3
MEMORY_WIRE_BUFFERS = 2


def boundary_widths(input_shape, blocks) -> list[int]:
    """Each block's output elements per example at ``input_shape`` (abstractly)."""
    widths = []

    def init(key):
        shape = tuple(int(d) for d in input_shape)
        for b in blocks:
            _, _, shape = b.layer.init(key, shape)
            widths.append(math.prod(shape[1:]))
        return jnp.zeros(())

    jax.eval_shape(init, jax.random.PRNGKey(0))
    return widths


def memory_split(acts, params, widths, stages: int, microbatch: int, stash: int,
                 stage_acts=None) -> list[int]:
    """Blocks per stage minimising the estimated per-device elements of the pipelined step,
    ``max_s (mb A_s + MEMORY_OWN_PARAM_BUFFERS P_s) + MEMORY_PARAM_BUFFERS max_s P_s +
    (stash + MEMORY_WIRE_BUFFERS) mb w``: ``A_s`` a stage's activation elements per example
    (``acts`` per block), ``P_s`` its parameters (``params`` per block), ``w`` the widest
    boundary between stages (``widths``: each block's output elements per example) and
    ``mb`` the micro-batch.  The last two terms are the largest stage's and the widest
    boundary's on every device (SPMD pads every device's buffers to them), so the split is
    searched over each cap on the boundary width and on a stage's parameters: the min-max
    split of the per-stage term under both caps (a vectorised dynamic programme), plus the
    capped terms.  ``stage_acts`` (an ``(n + 1, n + 1)`` array, :func:`remat_stage_acts`
    under ``remat``) replaces ``A_s`` by the activation elements per example that a stage
    of blocks ``j..i-1`` holds; None: the sum of its blocks' ``acts``."""
    n, S = len(acts), stages
    pa = np.concatenate([[0], np.cumsum(np.asarray(acts, np.float64))])
    pp = np.concatenate([[0], np.cumsum(np.asarray(params, np.float64))])
    P = pp[None, :] - pp[:, None]  # P[j, i]: blocks j..i-1
    if stage_acts is None:
        stage_acts = pa[None, :] - pa[:, None]
        A_low = (microbatch * pa[-1] + MEMORY_OWN_PARAM_BUFFERS * pp[-1]) / S  # a bound on max_s below
    else:  # some stage holds each block's internals, and some stage a 1/S share of the parameters
        stage_acts = np.asarray(stage_acts, np.float64)
        A_low = max(microbatch * max(acts), MEMORY_OWN_PARAM_BUFFERS * pp[-1] / S)
    A = microbatch * stage_acts + MEMORY_OWN_PARAM_BUFFERS * P  # the per-stage term
    ij = np.arange(n + 1)
    proper = ij[:, None] < ij[None, :]
    cut_width = np.concatenate([[0], np.asarray(widths[:-1], np.float64), [0]])  # width at boundary j
    caps_p = np.unique(P[proper])
    best_cost, best_sizes = float("inf"), None
    for w in np.unique(cut_width[1:n]) if n > 1 else [0.0]:
        fixed_w = (stash + MEMORY_WIRE_BUFFERS) * microbatch * w
        ok_cut = (cut_width <= w) | (ij == 0) | (ij == n)
        for cap in caps_p:
            if A_low + MEMORY_PARAM_BUFFERS * cap + fixed_w >= best_cost:
                break  # the caps only grow from here
            allowed = proper & ok_cut[:, None] & (P <= cap)
            cost = np.where(allowed, A, np.inf)
            found, sizes = _min_max_split([cost] * S)
            if found is None:
                continue
            total = found + MEMORY_PARAM_BUFFERS * cap + fixed_w
            if total < best_cost:
                best_cost, best_sizes = total, sizes
    if best_sizes is None:
        raise SettingError("balance", f"no split of {n} blocks into {S} stages")
    return best_sizes


def mpmd_memory_split(acts, params, widths, stages: int, microbatch: int, slots,
                      stage_acts=None) -> list[int]:
    """Blocks per stage minimising the largest stage's estimated bytes under the MPMD engine,
    where each device holds its own stage's buffers only: ``max_s (mb A_s + (MEMORY_PARAM_BUFFERS
    + MEMORY_OWN_PARAM_BUFFERS) P_s + (slots_s + MEMORY_WIRE_BUFFERS / 2) mb w_s)``, ``w_s`` the
    width of stage ``s``'s input (0 for stage 0: its input is the batch, there anyway),
    ``slots_s`` its stash (``slots``: a list by stage), the rest as :func:`memory_split` (an
    exact min-max dynamic programme over the contiguous splits)."""
    n, S = len(acts), stages
    pa = np.concatenate([[0], np.cumsum(np.asarray(acts, np.float64))])
    pp = np.concatenate([[0], np.cumsum(np.asarray(params, np.float64))])
    A = (pa[None, :] - pa[:, None]) if stage_acts is None else np.asarray(stage_acts, np.float64)
    P = pp[None, :] - pp[:, None]
    width_in = np.concatenate([[0.0], np.asarray(widths[:-1], np.float64), [0.0]])  # input of block j
    ij = np.arange(n + 1)
    proper = ij[:, None] < ij[None, :]
    costs = []
    for s in range(S):
        wire = (slots[s] + MEMORY_WIRE_BUFFERS / 2) * microbatch * (width_in if s else np.zeros(n + 1))
        costs.append(np.where(proper, microbatch * A + (MEMORY_PARAM_BUFFERS + MEMORY_OWN_PARAM_BUFFERS) * P
                              + wire[:, None], np.inf))
    found, sizes = _min_max_split(costs)
    if found is None:
        raise SettingError("balance", f"no split of {n} blocks into {S} stages")
    return sizes


def _min_max_split(costs):
    """The contiguous split minimising the largest stage's cost (a dynamic programme over the
    stages): ``costs[s][j, i]`` stage ``s``'s cost as blocks ``j..i-1`` (``inf``: not allowed).
    Returns ``(that cost, blocks per stage)``, or ``(None, None)`` when no split is allowed;
    ties go to the earliest boundaries."""
    n = costs[0].shape[0] - 1
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    cuts = []
    for cost in costs:
        cand = np.maximum(best[:, None], cost)
        cuts.append(np.argmin(cand, axis=0))
        best = cand.min(axis=0)
    if not np.isfinite(best[n]):
        return None, None
    sizes, i = [], n
    for k in range(len(costs) - 1, -1, -1):
        j = int(cuts[k][i])
        sizes.append(i - j)
        i = j
    return float(best[n]), sizes[::-1]


def check_split(split, stages: int, n_blocks: int) -> list[int]:
    """An explicit ``split`` (blocks per stage) checked against the stages and blocks."""
    if not isinstance(split, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in split):
        raise SettingError("split", f"expected a list of block counts per stage, got {split!r}")
    if len(split) != stages:  # the stages are the mesh's pipe axis
        raise SettingError("split", f"{len(split)} stages listed, but mesh.pipe={stages}")
    if any(v < 1 for v in split):
        raise SettingError("split", f"every stage needs at least one block, got {list(split)}")
    if sum(split) != n_blocks:
        raise SettingError("split", f"{list(split)} adds up to {sum(split)} blocks, but the model has "
                           f"{n_blocks}")
    return list(split)


def _get(tree, path):
    for p in path:
        tree = tree.get(p, {}) if isinstance(tree, dict) else {}
    return tree


def _set(tree, path, value):
    """A copy of nested dict ``tree`` with ``value`` at ``path`` (dicts on the path copied)."""
    if not path:
        return value
    out = dict(tree)
    out[path[0]] = _set(tree.get(path[0], {}), path[1:], value)
    return out

IDLE, FORWARD, BACKWARD = 0, 1, 2


class Timetable(NamedTuple):
    """A 1F1B schedule of ``stages`` x ``microbatches``, tick by tick (numpy, built in Python).

    ``op[t, s]``: what stage ``s`` runs at tick ``t`` (``IDLE``, ``FORWARD`` or ``BACKWARD``),
    ``micro[t, s]`` on which micro-batch (0 when idle).  Stage ``s > 0`` keeps the input
    activation of each micro-batch in one of ``slots`` stash slots from the tick it arrives
    (the tick after stage ``s - 1``'s forward sent it) to its own backward: ``store[t, s]`` is
    the slot the activation arriving at tick ``t`` goes to (-1: none arrives), ``slot[t, s]``
    the slot that tick's forward or backward reads (0 when idle or on stage 0, which reads
    the images).  A cotangent is always used the tick it arrives, and never arrives at the
    tick an activation does (both checked), so one receive buffer serves both.
    """

    ticks: int
    op: np.ndarray
    micro: np.ndarray
    slot: np.ndarray
    store: np.ndarray
    slots: int


def one_f_one_b(stages: int, microbatches: int) -> Timetable:
    """The 1F1B (PipeDream-flush) timetable: stage ``s`` runs ``min(S - 1 - s, M)`` warm-up
    forwards, then alternates one forward and one backward, then the cool-down backwards;
    each op runs at the first tick its inputs are there (a forward the tick after the previous
    stage's forward of the micro-batch, a backward the tick after the next stage's backward
    and after its own forward).  Forwards (and backwards) of a stage run in micro-batch order.
    A stage holds at most ``S - s`` micro-batches between their forward and backward; the
    schedule takes ``2 (M + S - 1)`` ticks, as GPipe's forward and backward scans together.
    """
    S, M = stages, microbatches
    if S < 1 or M < 1:
        raise ValueError(f"one_f_one_b: expected stages and microbatches >= 1, got {S}, {M}")
    seqs = []
    for s in range(S):
        w = min(S - 1 - s, M)
        seq = [(FORWARD, m) for m in range(w)]
        for i in range(M - w):
            seq += [(FORWARD, w + i), (BACKWARD, i)]
        seqs.append(seq + [(BACKWARD, m) for m in range(M - w, M)])
    done, pos, rows = {}, [0] * S, []
    while any(p < len(q) for p, q in zip(pos, seqs)):
        t, row = len(rows), []
        for s in range(S):
            if pos[s] == len(seqs[s]):
                row.append((IDLE, 0))
                continue
            kind, m = seqs[s][pos[s]]
            if kind == FORWARD:
                ready = s == 0 or done.get((FORWARD, s - 1, m), t) < t
            else:
                ready = done.get((FORWARD, s, m), t) < t and (s == S - 1 or done.get((BACKWARD, s + 1, m), t) < t)
            row.append((kind, m) if ready else (IDLE, 0))
            pos[s] += ready
        for s, (kind, m) in enumerate(row):
            if kind != IDLE:
                done[(kind, s, m)] = t
        rows.append(row)
        if len(rows) > 4 * (M + S):
            raise AssertionError(f"one_f_one_b: no progress at S={S}, M={M}")
    T = len(rows)
    op = np.array([[k for k, _ in r] for r in rows], np.int32).reshape(T, S)
    micro = np.array([[m for _, m in r] for r in rows], np.int32).reshape(T, S)
    for s in range(S - 1):  # a cotangent is used on arrival: no cotangent buffers
        for m in range(M):
            _check(done[(BACKWARD, s, m)] == done[(BACKWARD, s + 1, m)] + 1,
                   f"stage {s} runs the backward of micro-batch {m} after its cotangent's tick")
    for t in range(1, T):  # and never at the tick an activation arrives: one receive buffer
        for s in range(1, S - 1):
            _check(not (op[t - 1, s - 1] == FORWARD and op[t - 1, s + 1] == BACKWARD),
                   f"stage {s} receives an activation and a cotangent at tick {t}")
    # stash slots: micro-batch m's input lives on stage s from its arrival to its backward
    slot, store = np.zeros((T, S), np.int32), np.full((T, S), -1, np.int32)
    slots = 0
    for s in range(1, S):
        free_at, where = [], {}  # free_at[k]: the first tick slot k may be written again
        for m in range(M):  # arrivals come in micro-batch order
            arrive = done[(FORWARD, s - 1, m)] + 1
            k = next((k for k, f in enumerate(free_at) if f <= arrive), len(free_at))
            if k == len(free_at):
                free_at.append(0)
            free_at[k] = done[(BACKWARD, s, m)] + 1
            where[m] = k
            store[arrive, s] = k
        for kind in (FORWARD, BACKWARD):
            for m in range(M):
                slot[done[(kind, s, m)], s] = where[m]
        slots = max(slots, len(free_at))
        held = [None] * len(free_at)  # replayed: every read finds its own micro-batch's input
        for t in range(T):
            if store[t, s] >= 0:
                held[store[t, s]] = next(m for m in range(M) if done[(FORWARD, s - 1, m)] + 1 == t)
            if op[t, s] != IDLE:
                _check(held[slot[t, s]] == micro[t, s], f"stage {s}'s stash slot {slot[t, s]} was "
                       f"overwritten before tick {t} read micro-batch {micro[t, s]}")
    return Timetable(T, op, micro, slot, store, slots)


def stash_per_stage(schedule: str, stages: int, microbatches: int) -> list[int]:
    """The stage inputs each stage holds at once for its backward when every stage keeps its
    own (the ``mpmd`` engine): none on stage 0 (its input is the batch), ``M`` on the others
    under GPipe, and under 1F1B as many as the timetable's stash slots on that stage
    (``min(S - s + 1, M)``: the next input arrives as the stage still holds ``S - s``)."""
    if schedule == "gpipe":
        return [0] + [microbatches] * (stages - 1)
    table = one_f_one_b(stages, microbatches)
    return [0] + [int(table.store[:, s].max()) + 1 for s in range(1, stages)]


def _check(ok: bool, what: str) -> None:
    """An invariant of the timetable (kept under ``python -O``)."""
    if not ok:
        raise AssertionError(f"one_f_one_b: {what}")


class Pipeline:
    """The stage assignment and pipeline schedule (GPipe or 1F1B) of one model.

    Arguments:
        model: a ``serial`` Layer.
        input_shape: the model's global input shape ``(B, H, W, C)`` (for the
            MAC balance; any batch size will do).
        stages: pipeline stages (the size of the mesh's ``pipe`` axis).
        microbatches: micro-batches per device step (``M``; at least 1).
        balance: what a balanced split evens out: ``"macs"`` (default: compute time, what
            keeps every stage busy), ``"params"``, ``"activations"`` (the layers' output
            elements: the activation memory of each stage) or ``"memory"`` (the estimated
            per-device bytes of the step, :func:`memory_split`: activations of one
            micro-batch of ``input_shape[0] / microbatches`` examples, the parameter-sized
            buffers and the stash and wire buffers at the widest boundary, which SPMD gives
            every device; :class:`~jaxcnn.parallel.ParallelPlan` passes the batch of one
            data shard).  Under ``remat`` the ``memory`` estimate counts what a stage holds
            at its backward's peak instead of all its activations: its units' inputs plus
            its largest unit's internals (:func:`remat_stage_acts`).  (``activations`` stays
            the sum: measured on ResNet-50, its remat-aware split ignored the parameters and
            held more in all.)
        split: blocks per stage (a list of ``stages`` positive ints adding up to
            the number of blocks), or None for the balanced split.
        schedule: ``"gpipe"`` (default: every forward, then every backward) or ``"1f1b"``
            (one forward, one backward: :func:`one_f_one_b`); the same numbers, ``1f1b``
            stashes ``min(S, M)`` stage inputs per device instead of ``M``.
        remat: the backward's recomputation of a stage keeps only each unit's input
            (:func:`_recomputed`, ``jax.checkpoint``'s contract, around every unit of
            :meth:`remat_units`: a block with inner layers, or a run of consecutive
            single-layer blocks) and recomputes the
            unit's intermediate activations once more as its gradient is taken: one more
            forward of the stage, and a stage's activation memory is its units' inputs plus
            one unit's internals (``parallel.pipeline.remat``; default False: the whole
            stage's activations of one micro-batch).
        axis_name: the pipeline mesh axis.
        engine: ``"spmd"`` (default: the schedule as one program every device runs, this
            module) or ``"mpmd"`` (one program per stage, :mod:`jaxcnn.parallel.mpmd`: the
            same numbers, each device holding its own stage's buffers only; one process).
        mesh, split_dims: where the parameters live at rest (see :meth:`placed`; a
            :class:`~jaxcnn.parallel.ParallelPlan`'s pipeline has them), or None: a pipeline
            that splits and balances but cannot run a train step yet.

    Raises:
        SettingError: naming the argument (``model``, ``stages``, ``split``, ``microbatches``,
            ``balance``, ``schedule``, ``remat``, ``engine``) when the model cannot be split as
            asked: not a serial stack, more stages than blocks, a bad split, ``microbatches``
            below 1, an unknown schedule.
    """

    def __init__(self, model: Layer, input_shape, stages: int, microbatches: int, *,
                 balance: str = "macs", split=None, schedule: str = "gpipe", remat: bool = False,
                 axis_name: str = PIPE, engine: str = "spmd", mesh=None, split_dims=None):
        if engine not in ENGINES:
            raise SettingError("engine", f"expected one of {ENGINES}, got {engine!r}")
        self.engine = engine
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise SettingError("microbatches", f"expected an int >= 1, got {microbatches!r}")
        if balance not in BALANCE:
            raise SettingError("balance", f"expected one of {BALANCE}, got {balance!r}")
        if schedule not in SCHEDULES:
            raise SettingError("schedule", f"expected one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(remat, bool):
            raise SettingError("remat", f"expected true or false, got {remat!r}")
        self.remat = remat
        self.model, self.stages, self.microbatches, self.axis_name = model, stages, microbatches, axis_name
        self.mesh, self.split_dims = mesh, split_dims  # where the parameters live at rest
        self.blocks = pipeline_blocks(model)
        if stages > len(self.blocks):
            raise SettingError("stages", f"{stages} stages but the model has only {len(self.blocks)} "
                               f"blocks ({', '.join(b.name for b in self.blocks)})")
        if split is None and balance == "memory":
            self.costs = block_costs(model, input_shape, self.blocks, "activations")
            per_example = [c / input_shape[0] for c in self.costs]
            widths = boundary_widths(input_shape, self.blocks)
            # under remat a stage holds its units' inputs and one unit's internals
            stage_acts = None if not remat else remat_stage_acts(
                per_example, [math.prod(input_shape[1:])] + widths[:-1], [not b.layer.children for b in self.blocks])
            params, mb = block_costs(model, input_shape, self.blocks, "params"), max(input_shape[0] // microbatches, 1)
            if engine == "mpmd":  # each device holds its own stage's buffers: no padding to the largest
                sizes = mpmd_memory_split(per_example, params, widths, stages, mb,
                                          stash_per_stage(schedule, stages, microbatches), stage_acts=stage_acts)
            else:
                slots = microbatches if schedule == "gpipe" else max(one_f_one_b(stages, microbatches).slots, 1)
                sizes = memory_split(per_example, params, widths, stages, mb, slots, stage_acts=stage_acts)
        elif split is None:
            self.costs = block_costs(model, input_shape, self.blocks, balance)
            sizes = balanced_split(self.costs, stages)
        else:
            sizes = check_split(split, stages, len(self.blocks))
            self.costs = None
        bounds = np.concatenate([[0], np.cumsum(sizes)]).tolist()
        self.stage_blocks = [self.blocks[bounds[s]:bounds[s + 1]] for s in range(stages)]
        self.schedule = schedule

    @property
    def stash_slots(self) -> int:
        """Stage inputs each device keeps for the backward: ``M`` (GPipe) or ``min(S, M)`` (1F1B)."""
        if self.schedule == "gpipe":
            return self.microbatches
        return max(one_f_one_b(self.stages, self.microbatches).slots, 1)

    @property
    def split(self) -> list[int]:
        """Blocks per stage."""
        return [len(b) for b in self.stage_blocks]

    @property
    def bubble_fraction(self) -> float:
        """The share of ticks a device is idle: ``(S - 1) / (M + S - 1)`` (either schedule)."""
        s, m = self.stages, self.microbatches
        return (s - 1) / (m + s - 1)

    def describe(self) -> str:
        """One line per stage: its blocks."""
        lines = []
        for s, blocks in enumerate(self.stage_blocks):
            names = ", ".join(b.name for b in blocks)
            lines.append(f"stage {s}: {names}")
        return "\n".join(lines)

    def check_batch(self, per_device_batch: int) -> None:
        """Check that the batch of each data shard splits into the micro-batches (a
        :class:`SettingError` naming ``microbatches``)."""
        if per_device_batch % self.microbatches:
            raise SettingError("microbatches", f"{self.microbatches} micro-batches do not divide the "
                               f"batch of {per_device_batch} examples of each data shard")

    # ----- the schedule -----------------------------------------------------------------

    def remat_units(self, s) -> list[list[Block]]:
        """Stage ``s``'s blocks as ``remat`` runs them, one recomputed unit each: a
        block with inner layers alone, a maximal run of consecutive single-layer blocks
        together (ResNet's ``conv1``, ``bn1``, ``relu``, ``maxpool``: checkpointed one by one
        they would keep every input, each of them an activation anyway; together they
        keep the run's input only, and recompute the rest in the run's own backward)."""
        units = []
        for b in self.stage_blocks[s]:
            if not b.layer.children and units and not units[-1][-1].layer.children:
                units[-1].append(b)
            else:
                units.append([b])
        return units

    def _run_stage(self, s, params, state, x, rng, *, policy, choices):
        """Stage ``s`` on ``x``: ``(y, {block path: new state})``."""
        new_states = {}
        units = self.remat_units(s) if self.remat else [[b] for b in self.stage_blocks[s]]
        for unit in units:
            keys = [None if rng is None else _path_key(rng, b.rng_path) for b in unit]

            def apply(ps, sts, x, keys, unit=unit):
                out = []
                for b, p, st, r in zip(unit, ps, sts, keys):
                    x, ns = b.layer.apply(p, st, x, train=True, rng=r, policy=policy, choices=choices)
                    out.append(ns)
                return x, out

            if self.remat:
                apply = _recomputed(apply)
            x, ns = apply([_get(params, b.path) for b in unit], [_get(state, b.path) for b in unit], x, keys)
            for b, n in zip(unit, ns):
                if n:
                    new_states[b.path] = n
        return x, new_states

    def owners(self, tree) -> dict:
        """``{block path: stage}`` of the blocks that hold leaves in ``tree``."""
        return {b.path: s for s, blocks in enumerate(self.stage_blocks) for b in blocks if _get(tree, b.path)}

    def gradients(self, head: Callable, *, prepare: Callable = lambda x: x, policy=None, choices=None,
                  split_dims=None):
        """``gradients(blocks, model_state, batch, rng, loss_scale) -> (grads, loss, top1, new model
        state)`` of this device's share of the batch, to run inside ``shard_map`` over ``pipe``.

        ``blocks``: the parameters as this device holds them at rest (a leaf with a split
        dimension as its block along it, every other leaf whole).

        Arguments:
            head: ``head(logits, labels, loss_scale) -> (scaled loss, (loss, top1))`` of one
                micro-batch, run on the last stage.
            prepare: the first stage's input from a micro-batch's images (normalisation).
            policy, choices: passed to every block's ``apply``.
            split_dims: a tree shaped like the params of ints or None: the dimension of each
                leaf that is split over ``pipe`` at rest (:attr:`split_dims` of a placed
                pipeline, :meth:`placed`); None for every leaf whole.

        Returns the gradients of the scaled loss averaged over micro-batches (in the
        parameters' dtypes; a leaf with a split dimension as this device's block of it
        along that dimension; every other leaf whole), the mean loss and accuracy, and the
        model state after every micro-batch
        (loss, accuracy and model state replicated over ``pipe``).
        """
        def gradients(blocks, model_state, batch, rng, loss_scale):
            return self._schedule_gradients(head, prepare, policy, choices, split_dims, blocks, model_state,
                                            batch, rng, loss_scale)

        return gradients

    def _schedule_gradients(self, head, prepare, policy, choices, split_dims, blocks, model_state, batch,
                            rng, loss_scale):
        """:meth:`gradients`' function: the stages' buffers and branches, the schedule, and
        every stage's part to the devices that keep it."""
        S, M, axis = self.stages, self.microbatches, self.axis_name
        images = batch["image"]
        self.check_batch(images.shape[0])
        mb = images.shape[0] // M
        feed = _MicroBatches.of(batch, M, rng)
        # ----- this stage's parameters, one all_to_all per dtype ----------------------------
        packing = _Packing(self, blocks, split_dims)
        mine_of = packing.gather(blocks)  # mine_of(s): stage s's {block path: params}
        wire = self._wire(prepare, packing, model_state, (mb,) + images.shape[1:], images.dtype, feed, policy)
        fwd, bwd = self._branches(head, prepare, policy, choices, feed, wire, mine_of, packing,
                                  model_state, loss_scale, mb)
        stage = jax.lax.axis_index(axis)
        ticks = _Ticks(stage, fwd, bwd, S, M, axis, jnp.zeros((mb, wire.width), wire.dtype),
                       packing.zero_grads(), jnp.zeros((), jnp.float32))
        schedule = _gpipe if self.schedule == "gpipe" else _one_f_one_b_scan
        new_state, total, loss_sum, top1_sum = schedule(ticks, model_state)
        # ----- every stage's part to the devices that keep it ---------------------------
        grads = packing.scatter_grads(total)
        new_state = self._gather_state(new_state, model_state, stage)
        loss = jax.lax.psum(loss_sum, axis) / M
        top1 = jax.lax.psum(top1_sum, axis) / M
        return grads, loss, top1, new_state

    def _wire(self, prepare, packing, model_state, micro_shape, dtype, feed, policy) -> "_Wire":
        """The stage boundaries' shapes (abstractly, per micro-batch) and the buffers they
        travel in: the stash, wire and cotangent buffers are ``(micro-batch, width)`` at the
        widest boundary, in the boundaries' own dtype when they share one (bfloat16 under a
        bfloat16 compute policy: half of float32's bytes), else one that holds each exactly."""
        S = self.stages
        structs = []
        x = jax.eval_shape(prepare, jax.ShapeDtypeStruct(micro_shape, dtype))
        abstract = lambda t: jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
        for s in range(S):
            structs.append(x)
            x = jax.eval_shape(lambda p, st, v, s=s: self._run_stage(s, p, st, v, feed.key_of(0), policy=policy,
                                                                      choices=None)[0],
                               packing.whole_shapes, abstract(model_state), x)
        width = max([math.prod(st.shape[1:]) for st in structs[1:]] + [1])
        wire = jnp.result_type(*[st.dtype for st in structs[1:]]) if S > 1 else jnp.dtype(jnp.float32)
        return _Wire(structs, width, wire)

    def _branches(self, head, prepare, policy, choices, feed, wire, mine_of, packing, model_state,
                  loss_scale, mb):
        """Each stage's forward and backward branch (both schedules).

        Stage s reads its parameters from the buffers the all_to_all gave this device (each
        branch unpacks them in its own stage's layout), and its gradients leave the branch
        packed in that layout too: a (stages, length) buffer of the largest stage's split
        parameters, row k the blocks device k keeps, plus one short vector of every whole leaf
        (zero where another stage owns it)."""
        S = self.stages
        run = lambda s, p, st, x, r: self._run_stage(s, p, st, x, r, policy=policy, choices=choices)

        def with_own(s, tree, parts):
            for path, v in parts.items():
                if v:
                    tree = _set(tree, path, v)
            return tree

        run_own = lambda s, mine, st, x, r: run(s, with_own(s, {}, mine), st, x, r)

        def fwd_branch(s):
            def f(stash, k, m, model_state):  # the input from stash slot k (see bwd_branch)
                x = prepare(feed.image_of(m)) if s == 0 else wire.unpack(stash[k], s)
                y, new = run_own(s, mine_of(s), model_state, x, feed.key_of(m))
                model_state = with_own(s, model_state, new)
                if s == S - 1:
                    _, (loss, top1) = head(y, feed.label_of(m), loss_scale)
                    return jnp.zeros((mb, wire.width), wire.dtype), model_state, \
                        loss.astype(jnp.float32), top1.astype(jnp.float32)
                return wire.pack(y), model_state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)
            return f

        def bwd_branch(s):
            # The branch takes the whole stash and reads its slot itself: a slot sliced
            # outside would be one more micro-batch buffer at the widest boundary, copied
            # for the conditional.  Stage 0 reads the images and has no input cotangent.
            def f(stash, k, ct, m):
                def g(mine, x):
                    y, _ = run_own(s, mine, model_state, x, feed.key_of(m))
                    if s == S - 1:
                        return head(y, feed.label_of(m), loss_scale)[0]
                    return wire.pack(y)

                seed = (lambda out: jnp.ones_like(out)) if s == S - 1 else (lambda out: ct)
                if s == 0:
                    out, vjp = jax.vjp(lambda mine: g(mine, prepare(feed.image_of(m))), mine_of(s))
                    (d_mine,) = vjp(seed(out))
                    return packing.pack_grads(s, d_mine), jnp.zeros((mb, wire.width), wire.dtype)
                out, vjp = jax.vjp(g, mine_of(s), wire.unpack(stash[k], s))
                d_mine, d_x = vjp(seed(out))
                return packing.pack_grads(s, d_mine), wire.pack(d_x)
            return f

        return [fwd_branch(s) for s in range(S)], [bwd_branch(s) for s in range(S)]

    def placed(self, mesh, split_dims) -> "Pipeline":
        """The same pipeline with where its parameters live at rest: ``mesh`` (with this
        pipeline's axis) and, per leaf, the dimension split over ``pipe`` or None (a tree
        shaped like the params). A new object: this one is left as it is.
        :class:`~jaxcnn.parallel.ParallelPlan` holds the placed one; the train step then gets its
        gradients already split that way (:meth:`gradients`' ``split_dims``)."""
        out = copy.copy(self)
        out.mesh, out.split_dims = mesh, split_dims
        return out

    def _gather_state(self, new_state, old_state, stage):
        """Each leaf of the model state from the stage that owns its block."""
        owner = self.owners(old_state)
        for path, s in owner.items():
            part = jax.tree_util.tree_map(
                lambda x, s=s: jnp.where(stage == s, x, jnp.zeros_like(x)), _get(new_state, path))
            new_state = _set(new_state, path, _psum_f32(part, self.axis_name))
        return new_state


class _MicroBatches(NamedTuple):
    """Micro-batch ``m`` of a batch (examples ``m, m + M, ...``) and its key, as
    ``make_train_step(accumulate=M)`` draws them."""

    images: jax.Array  # (mb, M, ...) views of the batch: read in place, never a transposed copy
    labels: jax.Array
    rng: jax.Array | None

    @staticmethod
    def of(batch, microbatches: int, rng) -> "_MicroBatches":
        images, labels = batch["image"], batch["label"]
        mb = images.shape[0] // microbatches
        return _MicroBatches(*(x.reshape((mb, microbatches) + x.shape[1:]) for x in (images, labels)), rng)

    def image_of(self, m):
        return jax.lax.dynamic_index_in_dim(self.images, m, 1, keepdims=False)

    def label_of(self, m):
        return jax.lax.dynamic_index_in_dim(self.labels, m, 1, keepdims=False)

    def key_of(self, m):
        return None if self.rng is None else jax.random.fold_in(self.rng, m)


class _Wire(NamedTuple):
    """The stage boundaries (``structs[s]``: stage ``s``'s input per micro-batch) and the
    ``(micro-batch, width)`` buffers of ``dtype`` that carry them."""

    structs: list
    width: int
    dtype: jnp.dtype

    def pack(self, y):
        f = y.astype(self.dtype).reshape(y.shape[0], -1)
        return jnp.pad(f, ((0, 0), (0, self.width - f.shape[1])))

    def unpack(self, buf, s: int):
        st = self.structs[s]
        k = math.prod(st.shape[1:])
        return buf[:, :k].reshape(st.shape).astype(st.dtype)


class _Ticks(NamedTuple):
    """What both schedules run: this device's stage index, every stage's forward and backward
    branch, and the zeros they start from."""

    stage: jax.Array
    fwd: list
    bwd: list
    stages: int
    microbatches: int
    axis: str
    zero_buf: jax.Array
    zero_grads: object
    zero: jax.Array

    def send(self, x):
        S = self.stages
        return jax.lax.ppermute(x, self.axis, [(i, i + 1) for i in range(S - 1)]) if S > 1 else x

    def send_back(self, x):
        S = self.stages
        return jax.lax.ppermute(x, self.axis, [(i + 1, i) for i in range(S - 1)]) if S > 1 else x


def _gpipe(t: _Ticks, model_state):
    """Every forward (a scan of M + S - 1 ticks, stage s on micro-batch t - s, its input
    stashed in slot m), then every backward (the same, in reverse)."""
    S, M, stage, wire_buf = t.stages, t.microbatches, t.stage, t.zero_buf

    def fwd_tick(carry, tick):
        recv, st, stash, loss_sum, top1_sum = carry
        m = tick - stage
        valid = (m >= 0) & (m < M)
        mc = jnp.clip(m, 0, M - 1)
        stash = stash.at[mc].set(jnp.where(valid, recv, stash[mc]))
        out, new_st, loss, top1 = jax.lax.switch(stage, t.fwd, stash, mc, mc, st)
        st = jax.tree_util.tree_map(lambda a, b: jnp.where(valid, a, b), new_st, st)
        loss_sum = loss_sum + jnp.where(valid, loss, 0.0)
        top1_sum = top1_sum + jnp.where(valid, top1, 0.0)
        return (t.send(out), st, stash, loss_sum, top1_sum), None

    carry = (wire_buf, model_state, jnp.zeros((M,) + wire_buf.shape, wire_buf.dtype), t.zero, t.zero)
    (_, new_state, stash, loss_sum, top1_sum), _ = jax.lax.scan(fwd_tick, carry, jnp.arange(M + S - 1))

    def bwd_tick(carry, tick):
        ct, total = carry
        m = tick - (S - 1 - stage)
        valid = (m >= 0) & (m < M)
        mc = jnp.clip(m, 0, M - 1)
        grads, d_buf = jax.lax.switch(stage, t.bwd, stash, mc, ct, mc)
        total = jax.tree_util.tree_map(lambda a, g: a + jnp.where(valid, g, 0), total, grads)
        return (t.send_back(d_buf), total), None

    (_, total), _ = jax.lax.scan(bwd_tick, (wire_buf, t.zero_grads), jnp.arange(M + S - 1))
    return new_state, total, loss_sum, top1_sum


def _one_f_one_b_branches(t: _Ticks) -> list:
    """The 2S + 1 branches of a 1F1B tick: idle, each stage's forward, each stage's backward.

    Every branch returns one buffer (the outbox: a forward's activation or a backward's
    cotangent; one conditional output, not two live through the branch) and zeros made
    inside it (captured from outside, they would be loop operands live through the scan)."""
    shape, dtype = t.zero_buf.shape, t.zero_buf.dtype

    def idle(stash, k, ct, m, st, total):
        z = jnp.zeros((), jnp.float32)
        return jnp.zeros(shape, dtype), total, st, z, z

    def forward(s):
        def f(stash, k, ct, m, st, total):
            out, st, loss, top1 = t.fwd[s](stash, k, m, st)
            return out, total, st, loss, top1
        return f

    def backward(s):
        def f(stash, k, ct, m, st, total):
            grads, d_buf = t.bwd[s](stash, k, ct, m)
            z = jnp.zeros((), jnp.float32)
            return d_buf, jax.tree_util.tree_map(jnp.add, total, grads), st, z, z
        return f

    return [idle] + [forward(s) for s in range(t.stages)] + [backward(s) for s in range(t.stages)]


def _one_f_one_b_scan(t: _Ticks, model_state):
    """One scan over the 1F1B timetable: each tick a device stores the activation that arrived
    into its stash slot, runs its forward, backward or nothing (lax.switch over 2S + 1
    branches), and sends both ways."""
    S, M = t.stages, t.microbatches
    table = one_f_one_b(S, M)
    branch = np.where(table.op == FORWARD, 1 + np.arange(S), 0)
    branch = np.where(table.op == BACKWARD, 1 + S + np.arange(S), branch)
    # An activation (from s - 1) and a cotangent (from s + 1) never reach a stage at the
    # same tick, so one receive buffer (the inbox) carries whichever comes: the
    # activation where the next tick stores one in the stash, else the cotangent.
    arrives = table.store >= 0
    act_next = np.concatenate([arrives[1:], np.zeros((1, S), bool)]).astype(np.int32)
    rows = jnp.asarray(np.stack([branch, table.micro, table.slot, table.store, act_next], -1))
    slots = max(table.slots, 1)
    branches = _one_f_one_b_branches(t)

    def tick(carry, row):
        inbox, stash, st, total, loss_sum, top1_sum = carry
        b, m, k, store, act_next = [row[t.stage, i] for i in range(5)]
        kc = jnp.maximum(store, 0)
        stash = stash.at[kc].set(jnp.where(store >= 0, inbox, stash[kc]))
        outbox, total, st, loss, top1 = jax.lax.switch(b, branches, stash, k, inbox, m, st, total)
        # the same sums in the same order as gpipe's (zeros where a tick adds nothing)
        loss_sum = loss_sum + loss
        top1_sum = top1_sum + top1
        # the outbox goes both ways; the receiver keeps the one the table says comes
        inbox = jnp.where(act_next > 0, t.send(outbox), t.send_back(outbox))
        return (inbox, stash, st, total, loss_sum, top1_sum), None

    carry = (t.zero_buf, jnp.zeros((slots,) + t.zero_buf.shape, t.zero_buf.dtype), model_state,
             t.zero_grads, t.zero, t.zero)
    (_, _, new_state, total, loss_sum, top1_sum), _ = jax.lax.scan(tick, carry, rows)
    return new_state, total, loss_sum, top1_sum


class _Packing:
    """Where the parameters and gradients of each stage sit in the packed buffers that cross
    ``pipe`` (inside the ``shard_map``; ``blocks``: this device's view of the parameters, a
    split leaf as its block along its split dimension, a whole leaf whole).

    Parameters: per dtype, a ``(S, L)`` buffer whose row ``s`` holds this device's blocks of
    stage ``s``'s split leaves (each block flattened with its split dimension first, the
    leaves in order, zero-padded to ``L``, the largest stage's share); one ``all_to_all`` over
    ``pipe`` gives device ``s`` the rows of every device for stage ``s``, which are its
    leaves whole.  Gradients go the other way in the accumulator's dtype: stage ``s`` packs
    its leaves' gradients as ``(S, G)``, row ``k`` the blocks device ``k`` keeps, and one
    ``all_to_all`` gives each device its blocks of every stage's leaves, so no device ever
    holds all of the parameters or all of the gradients.  Whole leaves (too small to split)
    are on every device already; their gradients are one short vector over every stage's
    whole leaves, zero where another stage owns the leaf, summed over ``pipe`` (one non-zero
    term each: exact).
    """

    def __init__(self, pipeline, blocks, split_dims):
        S = self.S = pipeline.stages
        self.axis, self.M = pipeline.axis_name, pipeline.microbatches
        leaves, self.treedef = jax.tree_util.tree_flatten(blocks)
        self.dims = _leaf_dims(split_dims, len(leaves))
        self.shapes = [tuple(x.shape) for x in leaves]
        self.dtypes = [jnp.dtype(x.dtype) for x in leaves]
        self.whole_shape = [tuple(v * S if i == d else v for i, v in enumerate(x.shape)) for x, d in
                            zip(leaves, self.dims)]
        self.whole_shapes = jax.tree_util.tree_unflatten(
            self.treedef, [jax.ShapeDtypeStruct(sh, dt) for sh, dt in zip(self.whole_shape, self.dtypes)])
        self.acc = jnp.result_type(jnp.float32, *self.dtypes) if leaves else jnp.dtype(jnp.float32)
        index = jax.tree_util.tree_unflatten(self.treedef, list(range(len(leaves))))
        # the leaves of each stage, in the order of its {block path: params} tree's leaves
        self.stage_leaves = [jax.tree_util.tree_leaves({b.path: _get(index, b.path) for b in stage})
                             for stage in pipeline.stage_blocks]
        self.stage_def = [jax.tree_util.tree_structure({b.path: _get(index, b.path) for b in stage})
                          for stage in pipeline.stage_blocks]
        owned = sorted(i for ls in self.stage_leaves for i in ls)
        assert owned == list(range(len(leaves))), "every parameter belongs to exactly one stage"
        size = lambda i: math.prod(self.shapes[i])  # noqa: E731  (a block's elements)
        split = lambda s: [i for i in self.stage_leaves[s] if self.dims[i] is not None]  # noqa: E731
        # parameters: per dtype, each split leaf's offset in its stage's row
        self.p_off, self.p_len = {}, {}
        for dt in sorted({self.dtypes[i] for i in range(len(leaves)) if self.dims[i] is not None}, key=str):
            lengths = []
            for s in range(S):
                start = 0
                for i in split(s):
                    if self.dtypes[i] == dt:
                        self.p_off[i] = start
                        start += size(i)
                lengths.append(start)
            self.p_len[dt] = max(lengths)
        # gradients: each split leaf's offset in its stage's row; whole leaves in one vector
        self.g_off, lengths = {}, [0]
        for s in range(S):
            start = 0
            for i in split(s):
                self.g_off[i] = start
                start += size(i)
            lengths.append(start)
        self.g_len = max(lengths)
        self.w_off, start = {}, 0
        for i in range(len(leaves)):
            if self.dims[i] is None:
                self.w_off[i] = start
                start += size(i)
        self.w_len = start

    def gather(self, blocks):
        """``mine_of(s)``: stage ``s``'s ``{block path: parameters}``, whole, valid on the
        device running stage ``s`` (after one ``all_to_all`` per dtype)."""
        S, leaves = self.S, jax.tree_util.tree_leaves(blocks)
        recv = {}
        for dt, length in self.p_len.items():
            rows = []
            for s in range(S):
                parts = [_blocks(leaves[i], self.dims[i], 1)[0] for i in self.stage_leaves[s]
                         if self.dims[i] is not None and self.dtypes[i] == dt]
                flat = jnp.concatenate(parts + [jnp.zeros((0,), dt)])
                rows.append(jnp.pad(flat, (0, length - flat.shape[0])))
            send = jnp.stack(rows)
            recv[dt] = jax.lax.all_to_all(send, self.axis, 0, 0, tiled=True) if S > 1 else send

        def mine_of(s):
            out = []
            for i in self.stage_leaves[s]:
                d = self.dims[i]
                if d is None:
                    out.append(leaves[i])
                    continue
                n = math.prod(self.shapes[i])
                every = recv[self.dtypes[i]][:, self.p_off[i]:self.p_off[i] + n]  # row k: device k's block
                out.append(_unblock(every, d, self.whole_shape[i]))
            return jax.tree_util.tree_unflatten(self.stage_def[s], out)

        return mine_of

    def zero_grads(self):
        return (jnp.zeros((self.S, max(self.g_len, 1)), self.acc), jnp.zeros((max(self.w_len, 1),), self.acc))

    def pack_grads(self, s, d_mine):
        """Stage ``s``'s gradients (``{block path: tree}``) -> ``((S, G), (W,))`` in the
        accumulator's dtype: row ``k`` the blocks device ``k`` keeps of its split leaves, and
        its whole leaves at their places in the vector of every whole leaf."""
        S, g = self.S, jax.tree_util.tree_leaves(d_mine)
        rows, whole = [], []
        for i, x in zip(self.stage_leaves[s], g):
            x = x.astype(self.acc)
            if self.dims[i] is None:
                whole.append((self.w_off[i], x.reshape(-1)))
            else:
                rows.append(_blocks(x, self.dims[i], S))
        packed = jnp.concatenate(rows + [jnp.zeros((S, 0), self.acc)], axis=1)
        packed = jnp.pad(packed, ((0, 0), (0, max(self.g_len, 1) - packed.shape[1])))
        vec, at = [], 0
        for off, x in sorted(whole, key=lambda t: t[0]):
            vec += [jnp.zeros((off - at,), self.acc), x]
            at = off + x.shape[0]
        vec.append(jnp.zeros((max(self.w_len, 1) - at,), self.acc))
        return packed, jnp.concatenate(vec)

    def scatter_grads(self, total):
        """The summed ``pack_grads`` of this device's stage -> the gradient tree, a split leaf
        as this device's block, a whole leaf whole, divided by the micro-batches, in the
        parameters' dtypes (one ``all_to_all`` and one ``psum`` over ``pipe``)."""
        S, (packed, whole) = self.S, total
        if S > 1:
            packed = jax.lax.all_to_all(packed, self.axis, 0, 0, tiled=True)  # row s: stage s's
            whole = jax.lax.psum(whole, self.axis)
        owner = {i: s for s, ls in enumerate(self.stage_leaves) for i in ls}
        out = []
        for i, (shape, dt) in enumerate(zip(self.shapes, self.dtypes)):
            n = math.prod(shape)
            if self.dims[i] is None:
                x = whole[self.w_off[i]:self.w_off[i] + n].reshape(shape)
            else:
                x = _unblock(packed[owner[i], self.g_off[i]:self.g_off[i] + n], self.dims[i], shape)
            out.append((x / self.M).astype(dt))
        return jax.tree_util.tree_unflatten(self.treedef, out)


def _leaf_dims(split_dims, n):
    """The split dimension (or None) of each of the ``n`` leaves, in ``tree_leaves`` order."""
    if split_dims is None:
        return [None] * n
    dims = jax.tree_util.tree_leaves(split_dims, is_leaf=lambda x: x is None)
    assert len(dims) == n, (len(dims), n)
    return dims


def _blocks(x, dim, n):
    """``(n, x.size // n)``: row ``k`` is the ``k``-th of ``n`` blocks of ``x`` along ``dim``,
    flattened with ``dim`` moved first."""
    return jnp.moveaxis(x, dim, 0).reshape(n, -1)


def _unblock(flat, dim, shape):
    """A row of :func:`_blocks` back to its block of shape ``shape``."""
    moved = (shape[dim],) + tuple(v for i, v in enumerate(shape) if i != dim)
    return jnp.moveaxis(flat.reshape(moved), 0, dim)


def _recomputed(apply):
    """``apply(params, states, x, keys) -> (y, new states)`` whose gradient keeps only its
    inputs and recomputes the rest in the backward (``jax.checkpoint``'s contract), the
    recomputation reading a stored copy of ``x``.

    ``jax.checkpoint`` keeps XLA from merging the recomputation with the forward (common
    subexpression elimination) by an ``optimization_barrier``, which jax 0.10.2's XLA:CPU
    drops (0.11.2's keeps it; this is at least as small there): the
    forward's values of the recomputed layers then stay live until the backward reads
    them (on ResNet-50's first stage, three of ``layer1``'s convolution outputs and the
    stem's at its peak).  Here the recomputation starts from
    a conditional's output (:func:`jaxcnn._fence.stored`), which XLA cannot merge with the forward's
    input; the cotangents of ``states`` and ``keys`` are zero (the stage's vjp seeds only
    ``y``)."""
    @jax.custom_vjp
    def run(params, states, x, keys):
        return apply(params, states, x, keys)

    def fwd(params, states, x, keys):
        return apply(params, states, x, keys), (params, states, x, keys)

    def bwd(res, ct):
        params, states, x, keys = res
        _, vjp = jax.vjp(lambda p, v: apply(p, states, v, keys)[0], params, stored(x, after=ct[0]))
        d_params, d_x = vjp(ct[0])
        zeros = jax.tree_util.tree_map(jnp.zeros_like, states)
        return d_params, zeros, d_x, jax.tree_util.tree_map(lambda _: None, keys)

    run.defvjp(fwd, bwd)
    return run


def _psum_f32(tree, axis):
    """``lax.psum`` with 16-bit floats summed as float32 (XLA:CPU has no 16-bit all-reduce;
    every sum here has one non-zero term, so the result is exact)."""
    def one(x):
        if jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32:
            return jax.lax.psum(x.astype(jnp.float32), axis).astype(x.dtype)
        return jax.lax.psum(x, axis)
    return jax.tree_util.tree_map(one, tree)


def _path_key(rng, rng_path):
    """The key ``serial.apply`` hands a block: ``split_rng(key, n)[i]`` at every level
    (``rng_path`` holds the positions of the opened serials, then the block's own
    position and its serial's length)."""
    *outer, i, n = rng_path
    key = rng
    for j in outer:
        key = jax.random.fold_in(key, j)
    return split_rng(key, n)[i]
