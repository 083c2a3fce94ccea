"""The MPMD pipeline engine (``parallel.pipeline.engine: mpmd``, :mod:`jaxcnn.parallel.mpmd`):
one program per stage on its own devices gives the SPMD engine's numbers, which are one
device's with ``accumulate=M`` (BatchNorm per micro-batch in order)."""
import jax
import numpy as np
import optax
import pytest

from jaxcnn.data.dataset import normalize
from jaxcnn.parallel import ParallelPlan, make_mesh
from jaxcnn.train.step import make_eval_step, make_train_step

from _helpers import MOMENTUM, batches, init
from test_parallel_pipeline import (SHAPE, _abstract, _assert_run_matches, _model, _pipelined, _plan,
                                    _reference, random_blocks, run_bn_net, shape_of)


# One ResNet case in the normal suite: 2 data shards (BatchNorm synced over data in the stage
# programs, which the schedule does not change: it is the driver's order) under 1F1B's order, on
# small_resnet (test_parallel_pipeline.py: the zoo's stem, an identity and a projection block, 8
# blocks; ResNet-18's 14 through the same code at three times the compilation run with the slow
# tests).  One data shard under 1F1B is the VGG's case (small_vgg; VGG-11 slow); the GPipe order is checked against one device on bn_net
# (2 steps: test_mpmd_splits_an_optimiser_state_that_holds_the_parameters_tree_under_its_own_keys)
# and against the SPMD engine on data 2 (test_mpmd_mixed_precision_and_loss_scaling_give_the_spmd_engines_numbers).
@pytest.mark.parametrize("name,data_axis,schedule", [
    ("small_resnet", 2, "1f1b"), pytest.param("resnet18", 2, "1f1b", marks=pytest.mark.slow),
    pytest.param("resnet18", 1, "1f1b", marks=pytest.mark.slow),
    pytest.param("resnet18", 2, "gpipe", marks=pytest.mark.slow), ("small_vgg", 1, "1f1b"),
    pytest.param("vgg11", 1, "1f1b", marks=pytest.mark.slow)])
def test_mpmd_matches_one_device_on_the_same_micro_batches(name, data_axis, schedule):
    """A ResNet and a VGG (dropout) on 4 stages, one program per stage (x 2 data shards): loss,
    accuracy, gradients, BatchNorm statistics and parameters of one step as one device with
    accumulate=2; each leaf of the state stays on its stage's devices."""
    model, tx, shape = _model(name), MOMENTUM, shape_of(name)
    data = batches(shape, 1, seed=1)
    ref_m, ref = _reference(model, tx, shape, data, 2)
    plan = _plan(model, tx, shape, data_axis, 4, microbatches=2, schedule=schedule, engine="mpmd")
    got_m, got = _pipelined(plan, model, tx, shape, data)
    _assert_run_matches(got_m, got, ref_m, ref, 1)


def test_mpmd_gives_the_spmd_engines_numbers_with_dropout_on_data_shards():
    """A VGG with dropout (small_vgg: VGG-11's layers at half the compilation) on 2 data shards x
    4 stages, 2 steps: each data shard draws its own masks (the one-device run cannot); both
    engines draw the same ones."""
    model, tx, shape = _model("small_vgg"), MOMENTUM, shape_of("small_vgg")
    data = batches(shape, 2, seed=2)
    runs = {engine: _pipelined(_plan(model, tx, shape, 2, 4, microbatches=2, schedule="1f1b", engine=engine),
                               model, tx, shape, data) for engine in ("spmd", "mpmd")}
    _assert_run_matches(*runs["mpmd"], *runs["spmd"], 2)


def test_mpmd_state_lives_on_its_stages_devices_and_evaluates_stage_by_stage():
    """Every parameter, optimiser moment and BatchNorm statistic on its own stage's devices (the
    step and key on every device); the evaluation sums are one device's, of ``uint8`` images
    normalised on the first stage's devices as one device normalises them."""
    model, tx = _model("small_resnet"), MOMENTUM
    plan = _plan(model, tx, SHAPE, 2, 4, microbatches=2, engine="mpmd")
    state = plan.shard_state(init(model, tx, SHAPE))
    stage_devices = [set(m.devices.flat) for m in plan.mpmd.meshes]
    owner = {b.path: s for s, blocks in enumerate(plan.pipeline.stage_blocks) for b in blocks}
    for field in ("params", "state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, field)):
            keys = tuple(k.key for k in path)
            s = next(owner[keys[:n]] for n in range(len(keys), 0, -1) if keys[:n] in owner)
            assert leaf.sharding.device_set == stage_devices[s], (field, keys)
    traces = jax.tree_util.tree_leaves(state.opt_state)  # SGD's momentum: one per parameter
    assert [t.sharding.device_set for t in traces] == [p.sharding.device_set
                                                      for p in jax.tree_util.tree_leaves(state.params)]
    assert state.step.sharding.device_set == set(plan.mesh.devices.flat)
    data = batches(SHAPE, 1, seed=3)[0]
    pixels = np.random.default_rng(3).integers(0, 256, SHAPE, np.uint8)
    data = dict(data, image=pixels, mask=np.arange(SHAPE[0]) < 13)
    norm = ((0.5, 0.4, 0.3), (0.2, 0.25, 0.3))
    got = plan.wrap_eval(make_eval_step(model, image_norm=norm))(state.params, state.state,
                                                                 plan.put_eval_batch(data))
    host = jax.device_get(init(model, tx, SHAPE))
    normalized = dict(data, image=normalize(pixels, *norm))
    want = jax.jit(make_eval_step(model).step)(host.params, host.state, normalized)
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the trainer test clips too (optim.grad_clip_norm), against one device
def test_mpmd_clips_by_the_whole_models_norm():
    """``clip_norm`` clips every stage by the norm of all the gradients: the same step as one device
    with ``optax.clip_by_global_norm`` first in the chain (a clip small enough to act)."""
    model = _model("resnet18")
    data = batches(SHAPE, 1, seed=4)
    chained = optax.chain(optax.clip_by_global_norm(0.05), MOMENTUM)
    ref_m, ref = _reference(model, chained, SHAPE, data, 2)
    plan = _plan(model, MOMENTUM, SHAPE, 1, 4, microbatches=2, engine="mpmd")
    step = plan.wrap_step(make_train_step(model, MOMENTUM, axis_name=plan.step_axis_name,
                                          pipeline=plan.pipeline, clip_norm=0.05), donate=False)
    state, m = step(plan.shard_state(init(model, MOMENTUM, SHAPE)), plan.put_batch(data[0]))
    assert ref_m[0]["grad_norm"] > 0.05
    _assert_run_matches([jax.device_get(m)], jax.device_get(state), ref_m, ref, 1)


def test_trainer_runs_the_mpmd_engine_and_resumes_across_engines(tmp_path):
    """jaxcnn-train with mesh.data=2 mesh.pipe=4 parallel.pipeline.engine=mpmd (and global-norm
    clipping that acts) trains and evaluates as one device with the same 4 micro-batches; its
    step-2 checkpoint resumes on one device without stages, and the one-device run's on the mpmd
    engine, each ending where the one-device run does.  Each resumed run takes the other run's
    layout and config, so its programs are the ones that run compiled (the persistent cache):
    the engine changes under the checkpoint, not the programs under test.  No default test
    resumes an mpmd checkpoint onto another stage count; the SPMD engine's checkpoints do
    (test_parallel_pipeline.py::test_trainer_runs_pipelined_and_resumes_onto_other_layouts)."""
    import shutil

    from test_parallel_pipeline import LOSS_RTOL, _final, _train
    from _helpers import max_diff

    # the reference run is test_parallel_pipeline.py's one_device_trainer_run's programs (_train clips
    # by global norm 0.05 too), which the compilation cache holds for whichever runs second
    common = ["parallel.pipeline.microbatches=4", "optim.grad_clip_norm=0.05", "train.eval_every=2"]
    code, out, err = _train(["mesh.data=1"] + common, tmp_path / "ref")
    assert code == 0, err
    ref_params, ref_losses = _final(tmp_path / "ref")
    code, out, err = _train(["mesh.data=2", "mesh.pipe=4", "parallel.pipeline.engine=mpmd"] + common, tmp_path / "mpmd")
    assert code == 0, err
    assert "one program per stage (mpmd)" in out
    params, losses = _final(tmp_path / "mpmd")
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert max_diff(params, ref_params) < 1e-5
    for source, layout in (("mpmd", ["mesh.data=1"]),
                           ("ref", ["mesh.data=2", "mesh.pipe=4", "parallel.pipeline.engine=mpmd"])):
        work = tmp_path / ("moved_" + source)
        shutil.copytree(tmp_path / source, work)
        shutil.rmtree(work / "checkpoints" / "4")
        (work / "params.npz").unlink()
        code, out, err = _train(layout + common + ["checkpoint.resume=must"], work)
        assert code == 0, err
        assert "resumed from step 2" in out
        assert ("one program per stage (mpmd)" in out) == (source == "ref"), out
        params, losses = _final(work)
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert max_diff(params, ref_params) < 1e-5


@pytest.mark.parametrize("seed", range(4))
def test_mpmd_memory_split_is_the_best_contiguous_split_of_its_estimate(seed):
    """balance="memory" under the mpmd engine: against every contiguous split (brute force), the
    largest stage's own estimate, mb x its activations + (MEMORY_PARAM_BUFFERS +
    MEMORY_OWN_PARAM_BUFFERS) x its parameters + (its stash + MEMORY_WIRE_BUFFERS / 2) x mb x the
    width of its input (none for stage 0): nothing padded to another stage's size."""
    import itertools

    from jaxcnn.parallel.pipeline import (MEMORY_OWN_PARAM_BUFFERS, MEMORY_PARAM_BUFFERS, MEMORY_WIRE_BUFFERS,
                                          mpmd_memory_split, stash_per_stage)
    rng, n, acts, params, widths = random_blocks(seed)
    for stages in range(1, min(n, 4) + 1):
        mb = int(rng.integers(1, 9))
        slots = stash_per_stage("1f1b", stages, 4)

        def estimate(cuts):
            edges = [0, *cuts, n]
            return max(mb * sum(acts[i:j]) + (MEMORY_PARAM_BUFFERS + MEMORY_OWN_PARAM_BUFFERS) * sum(params[i:j])
                       + (0 if s == 0 else (slots[s] + MEMORY_WIRE_BUFFERS / 2) * mb * widths[i - 1])
                       for s, (i, j) in enumerate(zip(edges, edges[1:])))

        sizes = mpmd_memory_split(acts, params, widths, stages, mb, slots)
        assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == n
        best = min(estimate(c) for c in itertools.combinations(range(1, n), stages - 1))
        assert estimate(np.cumsum(sizes)[:-1].tolist()) == best


@pytest.mark.parametrize("policy,loss_scale", [pytest.param("bf16", "none", marks=pytest.mark.slow),
                                                ("f16", "dynamic")])
def test_mpmd_mixed_precision_and_loss_scaling_give_the_spmd_engines_numbers(policy, loss_scale):
    """A bfloat16 policy, and float16 with dynamic loss scaling (its finiteness check and scale
    update over every stage's gradients): 2 steps of the mpmd engine as the SPMD engine's, to the
    16-bit dtype's rounding."""
    from _helpers import max_diff
    out = {engine: run_bn_net(policy, loss_scale, microbatches=4, engine=engine) for engine in ("spmd", "mpmd")}
    (ms, got), (rs, ref) = out["mpmd"], out["spmd"]
    for m, r in zip(ms, rs):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-3)
        assert m["loss_scale"] == r["loss_scale"] and m["finite"] == r["finite"] == 1.0
    for g, r in zip(jax.tree_util.tree_leaves(got.loss_scale), jax.tree_util.tree_leaves(ref.loss_scale)):
        assert np.array_equal(g, r)
    assert max_diff(got.params, ref.params) < 4e-3
    assert max_diff(got.state, ref.state) < 2e-3


def test_mpmd_errors_name_the_key():
    """An unknown engine is one line naming pipeline.engine, and an mpmd plan given a one-program
    step one naming train_step. An mpmd TrainStep has no one-program step: its stages are the
    programs."""
    model = _model("small_resnet")
    with pytest.raises(ValueError, match="^pipeline.engine: expected one of"):
        _plan(model, MOMENTUM, SHAPE, 1, 2, microbatches=2, engine="mimd")
    plan = _plan(model, MOMENTUM, SHAPE, 1, 2, microbatches=2, engine="mpmd")
    parts = make_train_step(model, MOMENTUM, axis_name=plan.step_axis_name, pipeline=plan.pipeline)
    assert parts.step is None and parts.stages is not None and parts.pipeline is plan.pipeline
    with pytest.raises(ValueError, match="^train_step: the plan's pipeline engine is mpmd, which runs a step's stages"):
        plan.wrap_step(lambda state, batch: (state, {}))


def test_engine_auto_is_mpmd_in_one_process_and_spmd_across_processes(monkeypatch):
    """``engine="auto"`` (the config's default) picks mpmd in one process; across processes,
    where mpmd cannot run, spmd (the two-process trainer runs of test_parallel_distributed.py
    run it so)."""
    from jaxcnn.parallel import plan as plan_module
    model = _model("small_resnet")
    assert _plan(model, MOMENTUM, SHAPE, 1, 2, microbatches=2, engine="auto").mpmd is not None
    monkeypatch.setattr(plan_module.jax, "process_count", lambda: 2)
    assert plan_module._engine("auto") == "spmd" and plan_module._engine("mpmd") == "mpmd"


def test_clip_norm_is_clip_by_global_norm_first_in_the_chain():
    """``make_train_step(clip_norm=c)`` on one device: the step of ``optax.chain(clip_by_global_norm(c),
    tx)``, and the reported ``grad_norm`` is the norm before clipping."""
    from _helpers import max_diff
    model, shape = _model("bn_net"), (16, 8, 8, 3)
    data = batches(shape, 2, seed=7)
    runs = {}
    for name, tx, clip in (("chain", optax.chain(optax.clip_by_global_norm(0.01), MOMENTUM), None),
                           ("step", MOMENTUM, 0.01)):
        step = jax.jit(make_train_step(model, tx, clip_norm=clip).step)
        state, ms = init(model, tx, shape), []
        for b in data:
            state, m = step(state, b)
            ms.append(jax.device_get(m))
        runs[name] = ms, jax.device_get(state)
    (ms, got), (rs, ref) = runs["step"], runs["chain"]
    assert ms[0]["grad_norm"] > 0.01
    for m, r in zip(ms, rs):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-6)
        np.testing.assert_allclose(m["grad_norm"], r["grad_norm"], rtol=1e-6)
    assert max_diff(got.params, ref.params) < 1e-7


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_drivers_order_holds_what_the_memory_estimate_counts(schedule):
    """Replaying the driver's dispatch order: every op after its inputs, each stage's stash at
    most ``stash_per_stage`` inputs at once (and that many at some point), at most one cotangent
    waiting on any stage."""
    from types import SimpleNamespace

    from jaxcnn.parallel.mpmd import _Driver
    from jaxcnn.parallel.pipeline import BACKWARD, FORWARD, stash_per_stage
    for S, M in [(2, 1), (2, 4), (3, 6), (4, 2), (4, 8), (4, 16), (5, 3)]:
        order = _Driver.order(SimpleNamespace(p=SimpleNamespace(stages=S, microbatches=M, schedule=schedule)))
        assert sorted(order) == sorted((k, s, m) for k in (FORWARD, BACKWARD) for s in range(S) for m in range(M))
        stash, cts, done = [set() for _ in range(S)], [set() for _ in range(S)], set()
        most, most_ct = [0] * S, 0
        for kind, s, m in order:
            if kind == FORWARD:
                assert s == 0 or m in stash[s]
                if s < S - 1:
                    stash[s + 1].add(m)
            else:
                assert (FORWARD, s, m) in done and (s == S - 1 or m in cts[s])
                stash[s].discard(m)
                cts[s].discard(m)
                if s > 0:
                    cts[s - 1].add(m)
            done.add((kind, s, m))
            most = [max(a, len(b)) for a, b in zip(most, stash)]
            most_ct = max(most_ct, max(len(c) for c in cts))
        assert most == stash_per_stage(schedule, S, M), (S, M, most)
        assert most_ct <= 1


def test_mpmd_splits_an_optimiser_state_that_holds_the_parameters_tree_under_its_own_keys():
    """``optax.named_chain`` keeps its parts' states under their names, and a state that is the
    parameters' tree itself then sits under a dict key: each leaf still goes to its parameter's
    stage, and the step is one device's."""
    import jax.numpy as jnp

    def trace():  # a state that is the parameters' tree itself
        return optax.GradientTransformation(
            lambda p: jax.tree_util.tree_map(jnp.zeros_like, p),
            lambda u, st, params=None: (u, jax.tree_util.tree_map(lambda a, g: 0.9 * a + g, st, u)))

    model, shape = _model("bn_net"), (16, 8, 8, 3)
    tx = optax.named_chain(("momentum", MOMENTUM), ("trace", trace()))
    data = batches(shape, 2, seed=8)
    ref_m, ref = _reference(model, tx, shape, data, 2)
    plan = _plan(model, tx, shape, 1, 4, microbatches=2, engine="mpmd")
    got_m, got = _pipelined(plan, model, tx, shape, data)
    _assert_run_matches(got_m, got, ref_m, ref, 2)


def test_mpmd_refuses_a_step_whose_batch_norm_sync_is_not_the_plans():
    """A plan without BatchNorm sync and a step built with it: refused, as the SPMD engine does."""
    model = _model("small_resnet")
    plan = ParallelPlan(make_mesh(2, 1, pipe=2), model, SHAPE, _abstract(init(model, MOMENTUM, SHAPE)),
                        sync_batch_norm=False, pipeline={"microbatches": 2, "engine": "mpmd"})
    step = make_train_step(model, MOMENTUM, axis_name=plan.step_axis_name, pipeline=plan.pipeline)
    with pytest.raises(ValueError, match="BatchNorm"):
        plan.wrap_step(step)
