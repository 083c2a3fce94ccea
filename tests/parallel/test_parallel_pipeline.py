"""Pipeline parallelism over the ``pipe`` axis: stage assignment, its errors, and a GPipe
step that trains like one device running the same micro-batches in turn
(``make_train_step(accumulate=M)``, BatchNorm per micro-batch)."""
import itertools
import re

import jax
import numpy as np
import optax
import pytest

import xla_cache
from jaxcnn import layers as L
from jaxcnn.models import get as get_model
from jaxcnn.models.resnet import basic_block
from jaxcnn.models.vgg import vgg
from jaxcnn.parallel import ParallelPlan, Pipeline, make_mesh, pipeline_blocks
from jaxcnn.parallel.pipeline import balanced_split
from jaxcnn.train.step import make_train_step

from _helpers import MOMENTUM, batches, bn_net, init, max_diff

# float32: the pipeline sums a stage's gradients over micro-batches in another order and XLA
# fuses each stage apart, so gradients agree to a few float32 roundings relative to their size.
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4  # of the largest |gradient| of each leaf (BatchNorm backward amplifies rounding)
STATE_TOL = 2e-5

SHAPE = (16, 32, 32, 3)  # micro-batches of 8 at M = 2: BatchNorm on 1x1 maps of 4 is ill-conditioned
# VGG-11 has no BatchNorm, so its runs take 4 images (micro-batches of 1 or 2): a step of its
# full-width convolutions on 16 images was most of these tests' time (the programs, and so the
# compilation, are the same whatever the batch).
VGG_SHAPE = (4, 32, 32, 3)


def shape_of(name):
    """The batch shape the model ``name`` runs on in these tests."""
    return VGG_SHAPE if name.startswith(("vgg11", "small_vgg")) else SHAPE
_MODELS = {}


def small_resnet(num_classes=10):
    """ResNet-18's pieces at a fraction of its compilation (a third of its pipelined step's and
    one-device reference's), for the tests of the pipeline's mechanism rather than of the zoo
    model: the zoo's stem (7x7/2 convolution, BatchNorm, ReLU, max-pool), ``layer1`` of one
    identity basic block and ``layer2`` of one strided block with a projection shortcut (nested
    serials, BatchNorm inside blocks and on the shortcut), pooling and ``fc``: 8 blocks, the
    zoo's names.  ResNet-18 itself runs the same checks with the slow tests."""
    return L.serial(("conv1", L.Conv2D(16, 7, stride=2, padding=3, use_bias=False)), ("bn1", L.BatchNorm()),
                    ("relu", L.Relu()), ("maxpool", L.MaxPool2D(3, stride=2, padding=1)),
                    ("layer1", L.serial(basic_block(16, 16))), ("layer2", L.serial(basic_block(16, 32, stride=2))),
                    ("avgpool", L.GlobalAvgPool2D()), ("fc", L.Linear(num_classes)))


def _model(name):
    if name not in _MODELS:
        _MODELS[name] = {"resnet18": lambda: get_model("resnet18", num_classes=10),
                         "small_resnet": small_resnet,
                         "vgg11": lambda: get_model("vgg11", num_classes=10, classifier_width=16),
                         # VGG-11's pieces at half its compilation (the zoo's builder: 3x3 convolutions,
                         # 2x2 pools, the adaptive pool, flatten, the classifier with dropout p=0.5 twice),
                         # 3 convolutions instead of 8: the default suite's VGG for the pipeline's mechanism
                         "small_vgg": lambda: vgg((16, "M", 32, "M", 64, "M"), batch_norm=False, num_classes=10,
                                                  classifier_width=16),
                         "vgg11_nodrop": lambda: get_model("vgg11", num_classes=10, classifier_width=16,
                                                           dropout=0.0),
                         "bn_net": bn_net}[name]()
    return _MODELS[name]


def _abstract(state):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)


def _plan(model, tx, shape, data, pipe, **pipeline):
    return ParallelPlan(make_mesh(data, 1, pipe=pipe), model, shape, _abstract(init(model, tx, shape)),
                        pipeline=pipeline)


def _pipelined(plan, model, tx, shape, data):
    step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name,
                                          pipeline=plan.pipeline), donate=False)
    state = plan.shard_state(init(model, tx, shape))
    metrics = []
    for b in data:
        state, m = step(state, plan.put_batch(b))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state)


_REFERENCES = {}


def _reference(model, tx, shape, data, accumulate):
    """One device, the same micro-batches in turn; the rng as data shard 0 folds it.  Cached per
    model, optimiser, batches and accumulation (host arrays): the GPipe, 1F1B, remat and mpmd
    tests compare against the same runs."""
    key = (id(model), id(tx), tuple(shape), accumulate,
           tuple((b["image"].tobytes(), b["label"].tobytes()) for b in data))
    if key not in _REFERENCES:  # holding model and tx keeps their ids unique
        _REFERENCES[key] = (model, tx, _run_reference(model, tx, shape, data, accumulate))
    return _REFERENCES[key][2]


def _run_reference(model, tx, shape, data, accumulate):
    step = jax.jit(make_train_step(model, tx, accumulate=accumulate).step)
    state = init(model, tx, shape)
    shared = state.rng
    folded = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(shared), 0))
    metrics = []
    for b in data:
        state, m = step(state._replace(rng=folded), b)
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state._replace(rng=shared))


_BN_RUNS = {}


def run_bn_net(policy, loss_scale="none", steps=2, **pipeline):
    """A small BatchNorm net on data 2 x pipe 4 under a precision policy: ``(metrics of each
    step, final state)`` (host arrays) of ``steps`` steps from the same initial state and
    batches.  Cached per arguments: the bfloat16 GPipe run is both
    test_mixed_precision_pipelined_matches_one_device's and test_bf16_1f1b_matches_gpipe's."""
    pipeline.setdefault("schedule", "gpipe")
    pipeline.setdefault("engine", "spmd")
    key = (policy, loss_scale, steps, tuple(sorted(pipeline.items())))
    if key not in _BN_RUNS:
        _BN_RUNS[key] = _run_bn_net(policy, loss_scale, steps, **pipeline)
    return _BN_RUNS[key]


def _run_bn_net(policy, loss_scale, steps, **pipeline):
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    model, tx, shape = _model("bn_net"), MOMENTUM, (16, 8, 8, 3)
    pol = P.get_policy(policy)
    state = jax.device_get(create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=pol,
                                              loss_scale=P.make_loss_scale(loss_scale)))
    plan = ParallelPlan(make_mesh(2, 1, pipe=4), model, shape, _abstract(state), pipeline=pipeline)
    step = plan.wrap_step(make_train_step(model, tx, policy=pol, axis_name="data", pipeline=plan.pipeline),
                          donate=False)
    got, metrics = plan.shard_state(state), []
    for b in batches(shape, steps, seed=6):
        got, m = step(got, plan.put_batch(b))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(got)


def random_blocks(seed):
    """A random split problem: ``(rng, n blocks, activations, parameters, boundary widths)``."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(4, 10))
    acts, params = rng.integers(1, 1000, n).tolist(), rng.integers(0, 3000, n).tolist()
    widths = rng.choice([50, 100, 200, 400], n).tolist()
    return rng, n, acts, params, widths


def _assert_grads_close(got, ref):
    """Momentum traces after one step from zero are the gradients."""
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        g, r = np.asarray(g, np.float64), np.asarray(r, np.float64)
        scale = max(np.max(np.abs(r)), 1e-12)
        assert np.max(np.abs(g - r)) <= GRAD_RTOL * scale, (np.max(np.abs(g - r)), scale)


_RUNS = {}


def pipelined_run(name, data_axis, pipe, microbatches, steps=1, **pipeline):
    """``(plan, (metrics, final state))`` of ``steps`` momentum steps of ``name`` on data x pipe
    from the same batches as :func:`_compare`'s reference, ``schedule`` gpipe when not given.
    GPipe's runs are cached (host arrays) per configuration: the GPipe leg of the 1F1B test is
    the GPipe test's run."""
    pipeline.setdefault("schedule", "gpipe")
    key = (name, data_axis, pipe, microbatches, steps, tuple(sorted(pipeline.items())))
    if key in _RUNS:
        return _RUNS[key]
    model, tx, shape = _model(name), MOMENTUM, shape_of(name)
    plan = _plan(model, tx, shape, data_axis, pipe, microbatches=microbatches, **pipeline)
    run = plan, _pipelined(plan, model, tx, shape, batches(shape, steps, seed=1))
    if pipeline["schedule"] == "gpipe":
        _RUNS[key] = run
    return run


def _compare(name, data_axis, pipe, microbatches, steps=1, **pipeline):
    model, tx, shape = _model(name), MOMENTUM, shape_of(name)
    plan, (got_m, got) = pipelined_run(name, data_axis, pipe, microbatches, steps, **pipeline)
    ref_m, ref = _reference(model, tx, shape, batches(shape, steps, seed=1), microbatches)
    _assert_run_matches(got_m, got, ref_m, ref, steps)
    return plan, got, ref


def _assert_run_matches(got_m, got, ref_m, ref, steps):
    """A pipelined run's metrics and final state against the one-device run's."""
    for g, r in zip(got_m, ref_m):
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=LOSS_RTOL)
        assert g["top1"] == r["top1"]
        np.testing.assert_allclose(g["grad_norm"], r["grad_norm"], rtol=GRAD_RTOL)
    if steps == 1:  # the momentum after one step is the (scaled) gradient
        _assert_grads_close(got.opt_state, ref.opt_state)
    assert max_diff(got.state, ref.state) < STATE_TOL
    assert max_diff(got.params, ref.params) < STATE_TOL
    assert int(got.step) == steps and np.array_equal(got.rng, ref.rng)


# small_resnet on data 2 is also the GPipe leg of
# test_parallel_pipeline_1f1b.py::test_resnet_1f1b_matches_gpipe_and_one_device (pipelined_run: the
# same run, cached).  ResNet-18 itself runs with the slow tests: the zoo model's 14 blocks through
# the same pipeline code as small_resnet's 8 (stem, identity and projection blocks, pooling, fc),
# at three times the compilation; on one data shard it is also the remat test's layout (GPipe with
# each unit recomputed, against the same one-device run with the same assertions).
@pytest.mark.parametrize("name,data_axis", [("small_resnet", 2), pytest.param("resnet18", 2, marks=pytest.mark.slow),
                                            pytest.param("resnet18", 1, marks=pytest.mark.slow)])
def test_resnet_pipelined_matches_one_device_on_the_same_micro_batches(name, data_axis):
    """A ResNet on 4 stages (x 2 data shards): loss, accuracy, gradients, BatchNorm
    statistics and parameters of one step as one device with accumulate=2."""
    plan, _, _ = _compare(name, data_axis, 4, 2)
    assert plan.pipeline.stages == 4 and sum(plan.pipeline.split) == len(pipeline_blocks(_model(name)))
    assert sum(plan.pipeline.split) == {"small_resnet": 8, "resnet18": 14}[name]


# VGG-11 itself runs with the slow tests (small_vgg: its layers with dropout through the same code, at
# half the compilation).  Without dropout on 2 data shards too: 2 data shards x 4 stages against
# one device is the ResNet case above; a VGG with dropout on 2 data shards x 4 stages is
# test_parallel_pipeline_mpmd.py::test_mpmd_gives_the_spmd_engines_numbers_with_dropout_on_data_shards.
@pytest.mark.parametrize("name,data_axis", [("small_vgg", 1), pytest.param("vgg11", 1, marks=pytest.mark.slow),
                                            pytest.param("vgg11_nodrop", 2, marks=pytest.mark.slow)])
def test_vgg_pipelined_matches_one_device_on_the_same_micro_batches(name, data_axis):
    """A VGG on 4 stages; with dropout (p=0.5) on one data shard, whose masks are the
    reference's: each block draws the key ``serial`` would give it for its micro-batch."""
    _compare(name, data_axis, 4, 2)


def test_batch_norm_per_micro_batch_over_steps():
    """A small BatchNorm net, 2 steps of momentum SGD on 4 stages x 2 data shards with 8
    micro-batches (M > S): as accumulate=8 on one device, and measurably not as accumulate=1
    (running statistics and losses of micro-batches differ from the whole batch's).  The GPipe
    run and the accumulate=8 reference are those of
    test_parallel_pipeline_1f1b.py::test_batch_norm_net_1f1b_on_data_and_pipe_over_steps
    (pipelined_run and _reference hold them in a process, the compilation cache across the
    workers); 4 micro-batches on the same net and layout over 2 steps:
    test_global_optimisers_on_parameters_split_over_pipe."""
    model, tx = _model("bn_net"), MOMENTUM
    data = batches(SHAPE, 2, seed=1)
    _, (got_m, got) = pipelined_run("bn_net", 2, 4, 8, steps=2)
    ref_m, ref = _reference(model, tx, SHAPE, data, 8)
    whole_m, whole = _reference(model, tx, SHAPE, data, 1)
    np.testing.assert_allclose([m["loss"] for m in got_m], [m["loss"] for m in ref_m], rtol=LOSS_RTOL)
    assert max_diff(got.params, ref.params) < STATE_TOL
    assert max_diff(got.state, ref.state) < STATE_TOL
    assert max_diff(got.opt_state, ref.opt_state) < 1e-4
    assert max_diff(whole.state, ref.state) > 100 * STATE_TOL


def test_blocks_open_nested_serials():
    names = [b.name for b in pipeline_blocks(_model("resnet18"))]
    assert names == ["conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1", "layer2.0", "layer2.1",
                     "layer3.0", "layer3.1", "layer4.0", "layer4.1", "avgpool", "fc"]


@pytest.mark.parametrize("seed", range(5))
def test_balanced_split_is_the_best_contiguous_split(seed):
    """Against every contiguous split into non-empty stages (brute force)."""
    rng = np.random.default_rng(seed)
    costs = rng.integers(1, 100, size=rng.integers(4, 9)).tolist()
    for stages in range(1, min(len(costs), 4) + 1):
        sizes = balanced_split(costs, stages)
        assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == len(costs)

        def worst(cuts):
            edges = [0, *cuts, len(costs)]
            return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))

        best = min(worst(c) for c in itertools.combinations(range(1, len(costs)), stages - 1))
        assert worst(np.cumsum(sizes)[:-1].tolist()) == best


@pytest.mark.parametrize("seed", range(6))
def test_memory_split_is_the_best_contiguous_split_of_its_estimate(seed):
    """balance="memory": against every contiguous split (brute force), the estimate written out
    directly: the largest of mb x a stage's activations + MEMORY_OWN_PARAM_BUFFERS x its
    parameters, + MEMORY_PARAM_BUFFERS x the largest stage's parameters + (stash +
    MEMORY_WIRE_BUFFERS) x mb x the widest boundary between stages."""
    from jaxcnn.parallel.pipeline import (MEMORY_OWN_PARAM_BUFFERS, MEMORY_PARAM_BUFFERS, MEMORY_WIRE_BUFFERS,
                                          memory_split)
    rng, n, acts, params, widths = random_blocks(seed)
    for stages in range(1, min(n, 4) + 1):
        mb, stash = int(rng.integers(1, 9)), int(rng.integers(1, 5))

        def estimate(cuts):
            edges = [0, *cuts, n]
            own = max(mb * sum(acts[i:j]) + MEMORY_OWN_PARAM_BUFFERS * sum(params[i:j])
                      for i, j in zip(edges, edges[1:]))
            p = max(sum(params[i:j]) for i, j in zip(edges, edges[1:]))
            w = max([widths[c - 1] for c in cuts] + [0])
            return own + MEMORY_PARAM_BUFFERS * p + (stash + MEMORY_WIRE_BUFFERS) * mb * w

        sizes = memory_split(acts, params, widths, stages, mb, stash)
        assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == n
        best = min(estimate(c) for c in itertools.combinations(range(1, n), stages - 1))
        assert estimate(np.cumsum(sizes)[:-1].tolist()) == best


@pytest.mark.parametrize("seed", range(6))
def test_remat_memory_split_is_the_best_split_of_its_remat_estimate(seed):
    """balance="memory" under remat: against every contiguous split (brute force), the estimate
    written out with each stage's units formed directly (a run of single-layer blocks is one
    unit, cut at the stage's edges): a stage holds its units' inputs and its largest unit's
    internals, not the sum of its activations."""
    from jaxcnn.parallel.pipeline import (MEMORY_OWN_PARAM_BUFFERS, MEMORY_PARAM_BUFFERS, MEMORY_WIRE_BUFFERS,
                                          memory_split, remat_stage_acts)
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(4, 10))
    acts, params = rng.integers(1, 1000, n).tolist(), rng.integers(0, 3000, n).tolist()
    inputs = rng.integers(1, 300, n).tolist()
    single = (rng.random(n) < 0.5).tolist()
    widths = rng.choice([50, 100, 200, 400], n).tolist()

    def held(a, b):  # the stage of blocks a..b-1 under remat
        units = []
        for k in range(a, b):
            if k > a and single[k] and single[k - 1]:
                units[-1].append(k)
            else:
                units.append([k])
        return sum(inputs[u[0]] for u in units) + max(sum(acts[k] for k in u) for u in units)

    for stages in range(1, min(n, 4) + 1):
        mb, stash = int(rng.integers(1, 9)), int(rng.integers(1, 5))

        def estimate(cuts, stage):
            edges = [0, *cuts, n]
            own = max(mb * stage(i, j) + MEMORY_OWN_PARAM_BUFFERS * sum(params[i:j]) for i, j in zip(edges, edges[1:]))
            p = max(sum(params[i:j]) for i, j in zip(edges, edges[1:]))
            w = max([widths[c - 1] for c in cuts] + [0])
            return own + MEMORY_PARAM_BUFFERS * p + (stash + MEMORY_WIRE_BUFFERS) * mb * w

        sizes = memory_split(acts, params, widths, stages, mb, stash,
                             stage_acts=remat_stage_acts(acts, inputs, single))
        assert len(sizes) == stages and min(sizes) >= 1 and sum(sizes) == n
        splits = list(itertools.combinations(range(1, n), stages - 1))
        best = min(estimate(c, held) for c in splits)
        assert estimate(np.cumsum(sizes)[:-1].tolist(), held) == best


def test_remat_memory_balance_of_a_model():
    """Pipeline(balance="memory", remat=True) splits by the remat estimate of the model's own
    blocks (ResNet's stem a single unit) and picks another split than without remat (ResNet-18
    at 64x64, micro-batches of 16)."""
    from jaxcnn.parallel.pipeline import block_costs, boundary_widths, memory_split, remat_stage_acts
    model, shape = _model("resnet18"), (64, 64, 64, 3)
    blocks = pipeline_blocks(model)
    acts = [c / shape[0] for c in block_costs(model, shape, blocks, "activations")]
    widths = boundary_widths(shape, blocks)
    stage_acts = remat_stage_acts(acts, [64 * 64 * 3] + widths[:-1], [not b.layer.children for b in blocks])
    assert stage_acts[0, 4] == 64 * 64 * 3 + sum(acts[:4])  # the stem: its input and all its layers
    assert stage_acts[4, 6] == widths[3] + widths[4] + max(acts[4:6])  # layer1.0, layer1.1
    want = memory_split(acts, block_costs(model, shape, blocks, "params"), widths, 4, 16, 4, stage_acts=stage_acts)
    split = Pipeline(model, shape, 4, 4, balance="memory", remat=True).split
    assert split == want != Pipeline(model, shape, 4, 4, balance="memory").split


def test_memory_balance_weighs_parameters_at_small_batches():
    """ResNet-18 at 64x64 on 4 stages: with micro-batches of 1 the memory split's largest stage
    holds fewer parameters than the activation split's (which puts layer4's 8.4 M on one stage);
    with micro-batches of 64 it cuts no boundary at the stem's full resolution (the activation
    split's first cut is there), as every device's stash and wire buffers take the widest cut; a
    plan weighs the batch of one data shard."""
    from jaxcnn.parallel.pipeline import block_costs, boundary_widths
    model = _model("resnet18")
    blocks = pipeline_blocks(model)
    params = block_costs(model, (1, 64, 64, 3), blocks, "params")

    def worst(costs, sizes):
        edges = np.cumsum([0, *sizes])
        return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))

    small, by_acts = (Pipeline(model, (4, 64, 64, 3), 4, 4, balance=b).split for b in ("memory", "activations"))
    assert worst(params, small) < worst(params, by_acts)
    large = Pipeline(model, (256, 64, 64, 3), 4, 4, balance="memory").split
    widths = boundary_widths((1, 64, 64, 3), blocks)
    widest = lambda sizes: max(widths[c - 1] for c in np.cumsum(sizes)[:-1])  # noqa: E731
    assert widest(by_acts) == 32 * 32 * 64 and widest(large) < widest(by_acts)
    # a plan weighs the batch of one data shard: 512 over data 2 is large's 256
    plan = ParallelPlan(make_mesh(2, 1, pipe=4), model, (512, 64, 64, 3),
                        _abstract_state(model, MOMENTUM, (512, 64, 64, 3)),
                        pipeline={"microbatches": 4, "balance": "memory"})
    assert plan.pipeline.split == large != small


def test_memory_balance_config_key_and_its_error():
    """parallel.pipeline.balance: memory goes from the config to the plan; a bad value is one line
    naming the key."""
    import os

    from jaxcnn.train._plan import pipeline_spec
    from jaxcnn.train.config import load_config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = os.path.join(root, "configs", "mnist_cnn.yaml")
    cfg = load_config(config, ["mesh.pipe=4", "parallel.pipeline.microbatches=4", "parallel.pipeline.balance=memory"])
    assert pipeline_spec(cfg)["balance"] == "memory"
    with pytest.raises(ValueError, match="parallel.pipeline.balance") as err:
        load_config(config, ["parallel.pipeline.balance=bytes"])
    assert "\n" not in str(err.value) and "memory" in str(err.value)


def test_block_costs_against_the_model():
    """bn_net at (16, 8, 8, 3): parameters from its initialised tree, conv1's MACs and every
    block's output elements by hand."""
    from jaxcnn.parallel.pipeline import block_costs
    model, shape = _model("bn_net"), (16, 8, 8, 3)
    blocks = pipeline_blocks(model)
    assert [b.name for b in blocks] == ["conv1", "bn1", "relu", "block", "pool", "fc"]
    params, _, _ = model.init(jax.random.PRNGKey(0), shape)
    sizes = [sum(np.size(x) for x in jax.tree_util.tree_leaves(params.get(b.name, {}))) for b in blocks]
    assert block_costs(model, shape, blocks, "params") == sizes
    assert block_costs(model, shape, blocks, "macs")[0] == 16 * 8 * 8 * 8 * (3 * 3 * 3)
    acts = block_costs(model, shape, blocks, "activations")
    assert acts[:3] == [16 * 8 * 8 * 8] * 3 and acts[4:] == [16 * 16, 16 * 10]
    assert acts[3] > 16 * 4 * 4 * 16  # the block's convolutions, norms and shortcut


def test_split_by_params_macs_or_explicitly():
    model = _model("resnet18")
    by_params = Pipeline(model, SHAPE, 4, 2, balance="params").split
    by_macs = Pipeline(model, SHAPE, 4, 2).split  # the default: compute time
    assert by_params != by_macs and sum(by_params) == sum(by_macs) == 14
    assert Pipeline(model, SHAPE, 2, 2, split=[10, 4]).split == [10, 4]
    assert Pipeline(model, SHAPE, 4, 4).bubble_fraction == pytest.approx(3 / 7)


def _tiny():
    return L.serial(("conv", L.Conv2D(4, 3)), ("relu", L.Relu()), ("fc", L.serial(L.Flatten(), L.Linear(3))))


@pytest.mark.parametrize("kw,key,words", [
    (dict(model="tiny", pipe=8), "mesh.pipe", "8 stages but the model has only 4 blocks"),
    (dict(split=[2, 2]), "pipeline.split", "2 stages listed, but mesh.pipe=4"),
    (dict(split=[3, 3, 3, 4]), "pipeline.split", "adds up to 13 blocks, but the model has 14"),
    (dict(split=[0, 4, 4, 6]), "pipeline.split", "at least one block"),
    (dict(microbatches=3), "pipeline.microbatches", "3 micro-batches do not divide the batch of 8"),
    (dict(microbatches=0), "pipeline.microbatches", "expected an int >= 1"),
    (dict(balance="flops"), "pipeline.balance", "expected one of"),
    (dict(remat="yes"), "pipeline.remat", "expected true or false"),
    (dict(bogus=1), "pipeline", "unknown key(s) ['bogus']"),
    (dict(strategy="jit"), "strategy", "runs under shard_map"),
    (dict(model_axis=2), "mesh.model", "combine with the data axis only"),
    (dict(fsdp=True), "fsdp", "not with pipeline parallelism"),
    (dict(model="conv"), "pipeline", "must be a serial stack"),
])
def test_a_model_that_cannot_be_split_as_asked_is_one_line_before_any_compute(kw, key, words):
    kw = dict(kw)
    name = kw.pop("model", "resnet18")
    model = {"resnet18": _model("resnet18"), "tiny": _tiny(), "conv": L.Conv2D(4, 3)}[name]
    pipe, model_axis = kw.pop("pipe", 4), kw.pop("model_axis", 1)
    plan_kw = {k: kw.pop(k) for k in ("strategy", "fsdp") if k in kw}
    shape = (16, 8, 8, 3)
    abstract = _abstract(jax.eval_shape(lambda: init_abstract(model, shape)))
    with pytest.raises(ValueError, match=f"^{key}: ") as err:
        ParallelPlan(make_mesh(-1, model_axis, pipe=pipe), model, shape, abstract, pipeline=kw, **plan_kw)
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def init_abstract(model, shape):
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    return create_train_state(model, optax.sgd(0.1), jax.random.PRNGKey(0), shape,
                              loss_scale=P.make_loss_scale("none"))


def test_a_step_built_without_the_plans_pipeline_is_refused():
    model, tx = _model("bn_net"), MOMENTUM
    plan = _plan(model, tx, SHAPE, 2, 4)
    assert plan.pipeline.microbatches == 8  # twice the stages by default
    with pytest.raises(ValueError, match="^train_step: not built with this plan's pipeline"):
        plan.wrap_step(make_train_step(model, tx, axis_name="data"))


# ----- the trainer: config keys, checkpoints, resume onto another layout --------------------

def _train(args, workdir):
    """jaxcnn-train in this process on lenet5 (4 steps of 32 images, checkpoints at 2 and 4), with
    global-norm clipping that acts: the one-device run with 4 micro-batches is then the same
    programs as test_parallel_pipeline_mpmd.py::test_trainer_runs_the_mpmd_engine_and_resumes_across_engines's
    reference run, which the compilation cache compiles once for both modules
    (``train.eval_every`` changes no program).  ``(exit code, stdout, stderr)``."""
    import contextlib
    import io
    import os

    from jaxcnn.train.cli import train_main
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    common = [os.path.join(root, "configs", "mnist_cnn.yaml"), "model.name=lenet5", "data.batch_size=32",
              "data.eval_batch_size=500", "data.prefetch=1", "logging.log_every=1",
              "logging.progress=lines", "optim.name=adam", "optim.lr=0.002", "optim.schedule.name=constant",
              "optim.grad_clip_norm=0.05", "train.eval_every=null", "train.steps=4", "checkpoint.every=2",
              "checkpoint.keep=3"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train_main(common + list(args) + ["--workdir", str(workdir)])
    return code, out.getvalue(), err.getvalue()


def _final(workdir):
    from jaxcnn.interop import load_npz
    from jaxcnn.train.metrics import read_metrics
    params, _ = load_npz(workdir / "params.npz")
    losses = {r["step"]: r["loss"] for r in read_metrics(workdir) if r["kind"] == "train"}
    return params, [losses[s] for s in sorted(losses)]


@pytest.fixture(scope="module")
def one_device_trainer_run(tmp_path_factory):
    """jaxcnn-train on one device with 4 micro-batches as accumulation (lenet5, 4 steps,
    checkpoints at steps 2 and 4): ``(workdir, final params, train losses)``.  Run once for the
    trainer tests below, which compare with it and copy its directory before resuming from it."""
    work = tmp_path_factory.mktemp("one_device") / "ref"
    code, out, err = _train(["mesh.data=1", "parallel.pipeline.microbatches=4"], work)
    assert code == 0, err
    return (work, *_final(work))


def test_trainer_runs_pipelined_and_resumes_onto_other_layouts(tmp_path, one_device_trainer_run):
    """jaxcnn-train with mesh.data=2 mesh.pipe=4 (the SPMD engine; one process's default is
    mpmd: test_parallel_pipeline_mpmd.py) trains as one device with the same 4 micro-batches; its
    step-2 checkpoint resumes on data 1 x pipe 2 and on one device without stages (micro-batches as
    accumulation), each ending where the one-device run does.  The run on one device takes
    one_device_trainer_run's layout and config, so its programs are the ones that run compiled (the
    persistent cache): a checkpoint holds host arrays whatever the layout that wrote it, so 8
    data-parallel devices (replicated parameters, the programs of another data-parallel run)
    would resume the same files onto another target sharding only."""
    import shutil

    micro = "parallel.pipeline.microbatches=4 parallel.pipeline.engine=spmd".split()
    _, ref_params, ref_losses = one_device_trainer_run
    code, out, err = _train(["mesh.data=2", "mesh.pipe=4", *micro], tmp_path / "pipe")
    assert code == 0, err
    assert "pipeline over 4 stages (4 micro-batches, bubble 43%" in out
    params, losses = _final(tmp_path / "pipe")
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert max_diff(params, ref_params) < 1e-5
    for layout in (["mesh.data=1", "mesh.pipe=2"], ["mesh.data=1"]):
        work = tmp_path / ("moved" + "_".join(layout))
        shutil.copytree(tmp_path / "pipe", work)
        shutil.rmtree(work / "checkpoints" / "4")
        (work / "params.npz").unlink()
        code, out, err = _train(layout + [*micro, "checkpoint.resume=must"], work)
        assert code == 0, err
        assert "resumed from step 2" in out
        params, losses = _final(work)
        np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
        assert max_diff(params, ref_params) < 1e-5


@pytest.mark.parametrize("args,needle", [
    (["mesh.pipe=4"], "parallel.pipeline.microbatches: required with mesh.pipe=4"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=3"],
     "parallel.pipeline.microbatches: 3 micro-batches do not divide the batch of 16"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=4", "train.accumulate_steps=2"],
     "train.accumulate_steps: 2, but parallel.pipeline.microbatches=4"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=4", "parallel.pipeline.split=[1,1,1]"],
     "parallel.pipeline.split: 3 stages listed, but mesh.pipe=4"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=4", "parallel.pipeline.split=[9,1,1,2]"],
     "parallel.pipeline.split: [9, 1, 1, 2] adds up to 13 blocks, but the model has 12"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=4", "parallel.strategy=pmap"],
     "parallel.strategy: pipeline parallelism (mesh.pipe=4) runs under shard_map"),
    (["mesh.pipe=4", "parallel.pipeline.microbatches=4", "data.augment.mixup.alpha=0.2"],
     "data.augment.mixup.prob: mixup/CutMix is not supported with mesh.pipe > 1"),
])
def test_trainer_refuses_a_split_it_cannot_run_in_one_line(tmp_path, args, needle):
    code, out, err = _train(["checkpoint.enabled=false"] + args, tmp_path / "w")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], (code, err)


# The default suite covers the pipe axis across two processes through the trainer:
# test_parallel_distributed.py::test_trainer_with_the_pipe_axis_across_two_processes_matches_one_and_resumes
# (lenet5's fc1 split over the stages, so over the processes; losses, evaluations and parameters
# as one process); BatchNorm per micro-batch on data x pipe: test_batch_norm_per_micro_batch_over_steps.
@pytest.mark.slow
def test_two_processes_with_the_pipe_axis_across_them(tmp_path):
    """data 2 x pipe 4 over two processes of 4 CPU devices, stages 0-1 on one and 2-3 on the
    other: 2 steps as one device with the same 4 micro-batches."""
    import json
    import os
    import socket
    import subprocess
    import sys

    from jaxcnn.interop import load_npz
    here = os.path.dirname(os.path.abspath(__file__))
    env = xla_cache.subprocess_env()  # the worker keeps the suite's flags with 4 devices
    env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(os.path.dirname(here)), here,
                                         os.path.dirname(here), env.get("PYTHONPATH", "")])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "_mp_pipe_worker.py"), str(port), str(pid),
                               "2", str(tmp_path), "60"], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for pid in (0, 1)]
    for p in procs:
        try:
            _, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
    losses = json.loads((tmp_path / "losses.json").read_text())
    params, _ = load_npz(tmp_path / "params.npz")
    shape = (16, 8, 8, 3)
    ref_m, ref = _reference(_model("bn_net"), MOMENTUM, shape, batches(shape, 2, seed=4), 4)
    np.testing.assert_allclose(losses, [m["loss"] for m in ref_m], rtol=LOSS_RTOL)
    assert max_diff(params, ref.params) < STATE_TOL


@pytest.mark.parametrize("policy", ["bf16", pytest.param("bf16_params", marks=pytest.mark.slow)])
def test_mixed_precision_pipelined_matches_one_device(policy):
    """bfloat16 compute (activations cross stages as float32 buffers, exactly) and bfloat16
    parameters with a float32 master copy: 2 steps as one device with accumulate=4, to
    bfloat16 rounding (XLA rounds at other fusion boundaries in each stage's program)."""
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    model, tx, shape = _model("bn_net"), MOMENTUM, (16, 8, 8, 3)
    pol = P.get_policy(policy)
    state = jax.device_get(create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=pol,
                                              loss_scale=P.make_loss_scale("none")))
    # the pipelined run: data 2 x pipe 4, GPipe, 4 micro-batches, from this state on these batches
    metrics, got = run_bn_net(policy, microbatches=4)
    ref_step = jax.jit(make_train_step(model, tx, policy=pol, accumulate=4).step)
    folded = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0))
    ref = state
    for m, b in zip(metrics, batches(shape, 2, seed=6), strict=True):
        ref, r = ref_step(ref._replace(rng=folded), b)
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-3)
    assert jax.tree_util.tree_leaves(got.params)[0].dtype == jax.tree_util.tree_leaves(state.params)[0].dtype
    assert max_diff(got.params, ref.params) < 4e-3  # a few bfloat16 ulps of weights ~0.5
    assert max_diff(got.state, ref.state) < 2e-3


def test_recomputed_units_keep_only_their_inputs_for_the_backward():
    """pipeline._recomputed (remat's unit): the gradient of three recomputed units of two
    3x3 convolutions equals jax.checkpoint's, and its compiled temporaries stay near a
    unit's own activations (6x the input) where the plain gradient holds every unit's (13x),
    and never above jax.checkpoint's (13x with jax 0.10.2, whose XLA:CPU drops
    jax.checkpoint's optimization barrier and schedules a recomputation as early as its
    inputs allow; 7x with jax 0.11.2)."""
    from jaxcnn import functional as F
    from jaxcnn.parallel.pipeline import _recomputed
    shape = (8, 32, 32, 64)

    def unit(ps, sts, x, keys):
        for w in ps:
            x = jax.nn.relu(F.conv2d(x, w, padding=1))
        return x, [{} for _ in ps]

    def loss(wrap):
        def f(ws, x):
            for w in ws:
                x, _ = wrap(unit)([w, w], [{}, {}], x, [None, None])
            return jax.numpy.sum(x ** 2)
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    rng = np.random.default_rng(3)
    ws = [jax.numpy.asarray(rng.standard_normal((3, 3, 64, 64)) * 0.05, np.float32) for _ in range(3)]
    x = jax.numpy.asarray(rng.standard_normal(shape), np.float32)
    temp = {}
    for name, wrap in (("plain", lambda f: f), ("checkpoint", jax.checkpoint), ("recomputed", _recomputed)):
        mem = loss(wrap).lower(ws, x).compile().memory_analysis()
        temp[name] = mem.temp_size_in_bytes / x.nbytes
    assert temp["recomputed"] < 0.75 * temp["plain"] and temp["recomputed"] <= temp["checkpoint"], temp
    got, ref = loss(_recomputed)(ws, x), loss(jax.checkpoint)(ws, x)
    scale = max(float(np.max(np.abs(np.asarray(r)))) for r in jax.tree_util.tree_leaves(ref))
    assert max_diff(got, ref) <= 1e-6 * scale  # float32: the same operations, fused apart


def test_16_bit_policies_send_and_stash_activations_in_their_compute_dtype():
    """The wire, stash and cotangent buffers take the stage boundaries' dtype: every ppermute
    of the step's jaxpr (activations forward, cotangents back) is float32 under float32,
    bfloat16 under bf16 and bf16_params, float16 under f16 (half the bytes of the float32
    buffers the step used to send); float16 steps with dynamic loss scaling on data 2 x pipe 4
    still match one device with accumulate=4 to float16 rounding (bfloat16:
    test_mixed_precision_pipelined_matches_one_device).  The float16 run is run_bn_net's, the SPMD
    leg of test_parallel_pipeline_mpmd.py::test_mpmd_mixed_precision_and_loss_scaling_give_the_spmd_engines_numbers
    (one program, compiled once for both; a float16 step of its own on pipe 4 was another)."""
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    model, tx, shape = _model("bn_net"), MOMENTUM, (16, 8, 8, 3)
    batch = batches(shape, 1, seed=6)[0]
    for policy, dtype in (("f32", "f32"), ("bf16", "bf16"), ("bf16_params", "bf16"), ("f16", "f16")):
        pol = P.get_policy(policy)
        state = jax.device_get(create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=pol,
                                                  loss_scale=P.make_loss_scale("none")))
        plan = ParallelPlan(make_mesh(1, 1, pipe=4), model, shape, _abstract(state), pipeline={"microbatches": 4})
        step = plan.wrap_step(make_train_step(model, tx, policy=pol, axis_name=plan.step_axis_name,
                                              pipeline=plan.pipeline), donate=False)
        jaxpr = str(jax.make_jaxpr(step)(plan.abstract_state, plan.put_batch(batch)))
        sent = set(re.findall(r"(\w+)\[[\d,]+\] = ppermute", jaxpr))
        assert sent == {dtype}, (policy, sent)
    # f16 numbers: run_bn_net's 2 steps from this state on these batches, against one device
    pol = P.get_policy("f16")
    state = jax.device_get(create_train_state(model, tx, jax.random.PRNGKey(0), shape, policy=pol,
                                              loss_scale=P.make_loss_scale("dynamic")))
    metrics, got = run_bn_net("f16", "dynamic", microbatches=4)
    ref_step = jax.jit(make_train_step(model, tx, policy=pol, accumulate=4).step)
    folded = jax.random.key_data(jax.random.fold_in(jax.random.wrap_key_data(state.rng), 0))
    ref = state
    for m, b in zip(metrics, batches(shape, 2, seed=6), strict=True):
        ref, r = ref_step(ref._replace(rng=folded), b)
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-3)
        assert m["loss_scale"] == r["loss_scale"] and m["finite"] == r["finite"] == 1.0
    assert max_diff(got.params, ref.params) < 1e-3 and max_diff(got.state, ref.state) < 1e-3


def test_make_mesh_keeps_the_order_of_the_devices_it_is_given():
    """All 8 devices given in another order: the mesh is laid out in that order (it used to
    take jax.make_mesh's own order whenever every device was used, which put the 2-process
    test's stages in the wrong processes)."""
    devices = jax.devices()[::-1]
    mesh = make_mesh(2, 1, pipe=4, devices=devices)
    assert list(mesh.devices.reshape(-1)) == devices
    assert list(make_mesh(2, 1, pipe=4).devices.reshape(-1)) == jax.devices()


# ----- ZeRO over pipe: parameters and optimiser state split over the stages at rest ----------

def _pipe_dims(tree):
    """The dimension each leaf's sharding splits over ``pipe`` (None: whole on every stage)."""
    return [next((i for i, a in enumerate(x.sharding.spec) if a == "pipe"), None)
            for x in jax.tree_util.tree_leaves(tree)]


def _assert_split_over_pipe(state, pipe):
    """Every params leaf split over pipe is held in ``pipe`` blocks, one per stage device, and its
    optimiser moments are split the same way."""
    for x, dim in zip(jax.tree_util.tree_leaves(state.params), _pipe_dims(state.params)):
        if dim is not None:
            shard = x.addressable_shards[0].data.shape
            assert shard[dim] * pipe == x.shape[dim] and len(x.addressable_shards) == len(x.sharding.device_set)
    split = {tuple(x.shape) for x, d in zip(jax.tree_util.tree_leaves(state.params), _pipe_dims(state.params))
             if d is not None}
    moments = [x for x in jax.tree_util.tree_leaves(state.opt_state) if np.ndim(x) > 0]
    assert any(tuple(x.shape) in split for x in moments)
    for x in moments:  # momentum, EMA, LAMB's moments: split as their parameter is
        assert ("pipe" in x.sharding.spec) == (tuple(x.shape) in split), (x.shape, x.sharding.spec)


def test_resnet18_parameters_split_over_the_stages_at_rest():
    """The plan's shardings: every leaf of ResNet-18 of at least FSDP_MIN_SIZE elements (over 99%
    of its parameters) is split over pipe along a dimension 4 divides, and its momentum follows;
    BatchNorm statistics stay whole; a device's share of the parameters is then ~1/4."""
    from jaxcnn.parallel.rules import FSDP_MIN_SIZE
    model, tx = _model("resnet18"), MOMENTUM
    plan = ParallelPlan(make_mesh(2, 1, pipe=4), model, SHAPE, _abstract_state(model, tx, SHAPE),
                        pipeline={"microbatches": 2})
    params = plan.abstract_state.params
    leaves, dims = jax.tree_util.tree_leaves(params), _pipe_dims(params)
    total = sum(x.size for x in leaves)
    split = sum(x.size for x, d in zip(leaves, dims) if d is not None)
    assert split > 0.99 * total
    for x, d in zip(leaves, dims):
        assert (d is not None) == (x.size >= FSDP_MIN_SIZE), (x.shape, d)
    per_device = sum(x.size // 4 if d is not None else x.size for x, d in zip(leaves, dims))
    assert per_device < 0.26 * total
    assert all(d is None for d in _pipe_dims(plan.abstract_state.state))
    opt_dims = [d for d in _pipe_dims(plan.abstract_state.opt_state)]
    assert sorted(d for d in opt_dims if d is not None) == sorted(d for d in dims if d is not None)
    assert plan.pipeline.split_dims is not None


def _abstract_state(model, tx, shape):
    """The TrainState as ShapeDtypeStructs, traced only (no initialisation runs)."""
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    return _abstract(jax.eval_shape(lambda: create_train_state(
        model, tx, jax.random.PRNGKey(0), shape, loss_scale=P.make_loss_scale("none"))))


def _lowered_threshold(monkeypatch):
    """bn_net's leaves are all below FSDP_MIN_SIZE: split every leaf of 64 elements or more."""
    from jaxcnn.parallel import rules
    monkeypatch.setattr(rules, "FSDP_MIN_SIZE", 64)


def test_global_optimisers_on_parameters_split_over_pipe(monkeypatch):
    """bn_net on data 2 x pipe 4 with every leaf of 64+ elements split over pipe: one chain of
    LAMB (per-leaf trust ratios, weight decay masked off the 1-D leaves), a clip of LAMB's
    update by its global norm (that clips: the bound is a fifth of the update's norm) and an EMA
    of the parameters runs as one global program over the shards (moments and EMA split like
    their parameters); 2 steps equal one device with accumulate=4 (losses, gradient norms,
    params, optimiser state).  Each reduction moves the parameters directly: a norm taken per
    shard, by LAMB over a leaf or by the clip over the whole update, scales the step by another
    factor.  (Clipping the gradients with momentum and LAMB were two cases, each compiling a
    pipelined step and a one-device reference; a clip before LAMB would hardly show, since
    Adam's direction and the trust ratio undo a gradient's scale.)"""
    _lowered_threshold(monkeypatch)
    model, shape = _model("bn_net"), (16, 8, 8, 3)
    from jaxcnn.train.ema import ema
    lr = 0.01
    start = init(model, MOMENTUM, shape).params
    # LAMB's update of each leaf is lr times the leaf's norm (lr times Adam's direction for a
    # zero leaf), so the whole update's norm is at least lr * ||params||.
    bound = 0.2 * lr * float(optax.tree.norm(start))
    tx = optax.chain(optax.lamb(lr, weight_decay=0.1, mask=lambda p: jax.tree_util.tree_map(
                         lambda x: x.ndim > 1, p)),
                     optax.clip_by_global_norm(bound),
                     ema(0.9))
    data = batches(shape, 2, seed=7)
    plan = ParallelPlan(make_mesh(2, 1, pipe=4), model, shape, _abstract(init(model, tx, shape)),
                        pipeline={"microbatches": 4})
    step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name, pipeline=plan.pipeline),
                          donate=False)
    state = plan.shard_state(init(model, tx, shape))
    got_m = []
    for b in data:
        state, m = step(state, plan.put_batch(b))
        got_m.append(jax.device_get(m))
    assert sum(d is not None for d in _pipe_dims(state.params)) >= 5
    _assert_split_over_pipe(state, 4)
    ref_m, ref = _reference(model, tx, shape, data, 4)
    # Clipped every step: two steps of norm `bound` move the parameters at most 2 * bound (the
    # unclipped updates would move them about 5 times as far).
    moved = float(optax.tree.norm(optax.tree.sub(ref.params, start)))
    assert 0.5 * bound < moved <= 2 * bound * (1 + 1e-5), (moved, bound)
    for g, r in zip(got_m, ref_m):
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=LOSS_RTOL)
        np.testing.assert_allclose(g["grad_norm"], r["grad_norm"], rtol=GRAD_RTOL)
    got = jax.device_get(state)
    assert max_diff(got.params, ref.params) < STATE_TOL
    assert max_diff(got.opt_state, ref.opt_state) < 1e-4
    assert max_diff(got.state, ref.state) < STATE_TOL


def test_trainer_resumes_a_data_parallel_checkpoint_onto_split_stages(tmp_path, one_device_trainer_run):
    """The other way round from the test above: the one-device run's step-2 checkpoint (whole
    parameters, micro-batches as accumulation) resumed on data 2 x pipe 4, where lenet5's
    largest leaves (fc1 400 x 120, ...) live split over the stages, ends where the one-device
    run does."""
    import shutil

    lenet, shape = get_model("lenet5"), (32, 28, 28, 1)
    plan = ParallelPlan(make_mesh(2, 1, pipe=4), lenet, shape, _abstract_state(lenet, MOMENTUM, shape),
                        pipeline={"microbatches": 4})
    dims = _pipe_dims(plan.abstract_state.params)
    assert sum(d is not None for d in dims) == 1, dims  # fc1; the rest are below FSDP_MIN_SIZE
    micro = "parallel.pipeline.microbatches=4"
    ref_dir, ref_params, ref_losses = one_device_trainer_run
    work = tmp_path / "moved"
    shutil.copytree(ref_dir, work)
    shutil.rmtree(work / "checkpoints" / "4")
    (work / "params.npz").unlink()
    code, out, err = _train(["mesh.data=2", "mesh.pipe=4", micro, "parallel.pipeline.engine=spmd",
                             "checkpoint.resume=must"], work)
    assert code == 0, err
    assert "resumed from step 2" in out and "pipeline over 4 stages" in out
    params, losses = _final(work)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    assert max_diff(params, ref_params) < 1e-5


def test_per_shard_batch_norm_pipelined_matches_data_parallel(monkeypatch):
    """sync_batch_norm=False on data 2 x pipe 4 (leaves split over pipe): each data shard
    normalises with its own micro-batch statistics and the running statistics are averaged over
    data after the step, as 2-way data parallelism with accumulate=4 and the same setting does;
    2 steps, and measurably not the synced statistics.  The synced data-parallel run with
    accumulate=4 (gradients averaged over data inside the accumulation) equals one device with
    accumulate=4 on the same batches."""
    _lowered_threshold(monkeypatch)
    model, tx, shape = _model("bn_net"), MOMENTUM, (16, 8, 8, 3)
    data = batches(shape, 2, seed=8)
    abstract = _abstract(init(model, tx, shape))

    def run(mesh, sync, **kw):
        plan = ParallelPlan(mesh, model, shape, abstract, sync_batch_norm=sync, **kw)
        step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name, sync_batch_norm=sync,
                                              accumulate=4, pipeline=plan.pipeline), donate=False)
        state = plan.shard_state(init(model, tx, shape))
        losses = []
        for b in data:
            state, m = step(state, plan.put_batch(b))
            losses.append(float(m["loss"]))
        return losses, jax.device_get(state)

    got_l, got = run(make_mesh(2, 1, pipe=4), False, pipeline={"microbatches": 4})
    ref_l, ref = run(make_mesh(2, 1, devices=jax.devices()[:2]), False)
    synced_l, synced = run(make_mesh(2, 1, devices=jax.devices()[:2]), True)
    np.testing.assert_allclose(got_l, ref_l, rtol=LOSS_RTOL)
    assert max_diff(got.params, ref.params) < STATE_TOL
    assert max_diff(got.state, ref.state) < STATE_TOL
    assert max_diff(synced.state, ref.state) > 100 * STATE_TOL
    one_m, one = _reference(model, tx, shape, data, 4)
    np.testing.assert_allclose(synced_l, [float(m["loss"]) for m in one_m], rtol=LOSS_RTOL)
    assert max_diff(synced.params, one.params) < STATE_TOL
    assert max_diff(synced.state, one.state) < STATE_TOL


def test_bench_scaling_pipe_reports_args_temporaries_and_total(capsys):
    """scripts/bench_scaling.py --pipe 1,2 --engine spmd,mpmd on lenet5 (compile only): a row per
    stage count and engine with XLA's argument, temporary and total bytes per device; the arguments (parameters, momentum,
    batch) fall with 2 stages, as fc1's 48,000 weights and their momentum are split over pipe.
    --split and --precision reach the plan and the step; bad ones exit 2 with one line.
    4 micro-batches (the script's default): the SPMD engine's 2-stage row is then the GPipe row of
    test_parallel_pipeline_1f1b.py::test_bench_scaling_pipe_rows_per_schedule, one program the
    compilation cache holds for whichever of the two runs second."""
    import importlib.util
    import json
    import os
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scaling.py"
    spec = importlib.util.spec_from_file_location("bench_scaling", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # JAX starts here if no test before this one started it: with the suite's 8 devices, not
    # the count the script writes into XLA_FLAGS (the tests after it in this process need 8)
    assert jax.device_count() == 8
    environ = dict(os.environ)  # the script sets XLA_FLAGS as a command-line tool does
    try:
        assert bench.main(["--model", "lenet5", "--pipe", "1,2", "--per-device-batch", "8",
                           "--microbatches", "4", "--steps", "0", "--json", "--engine", "spmd,mpmd"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    # each engine for each stage count above 1 (one stage has no pipeline: one row, no engine)
    assert [(r["pipe"], r["engine"]) for r in rows] == [(1, "-"), (2, "spmd"), (2, "mpmd")]
    assert rows[0]["split"] is None and rows[2]["split"] == rows[1]["split"]
    one, two = rows[:2]
    assert two["bubble"] == pytest.approx(1 / 5) and sum(two["split"]) == len(pipeline_blocks(get_model("lenet5")))
    for r in rows:
        total = r["args_mib"] + r["out_mib"] + r["temp_mib"] - r["alias_mib"]
        assert r["memory_mib"] == pytest.approx(total) and r["temp_mib"] > 0
    fc1 = 2 * 400 * 120 * 4 / 2**20  # weights and momentum, float32
    assert one["args_mib"] - two["args_mib"] == pytest.approx(fc1 / 2, rel=0.05)
    assert "args" in out and "temp" in out and "total" in out

    # --engine mpmd: the largest stage's peak (its state and batch, then the rest), one step run;
    # the same split as the SPMD engine's row above (its programs are the first call's mpmd row's)
    try:
        assert bench.main(["--model", "lenet5", "--pipe", "2", "--per-device-batch", "8", "--microbatches", "4",
                           "--steps", "1", "--warmup", "0", "--json", "--engine", "mpmd"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr().out
    (mpmd,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert (two["engine"], mpmd["engine"]) == ("spmd", "mpmd") and mpmd["split"] == two["split"]
    assert mpmd["memory_mib"] == pytest.approx(mpmd["args_mib"] + mpmd["temp_mib"])
    assert abs(mpmd["memory_mib"] - max(mpmd["stage_mib"])) <= 0.05
    assert mpmd["step_ms"] > 0 and len(mpmd["stage_mib"]) == 2

    # --split by hand and --precision: a bfloat16 step's row; bad values are one line, exit 2
    split = [len(pipeline_blocks(get_model("lenet5"))) - 1, 1]
    try:
        assert bench.main(["--model", "lenet5", "--pipe", "2", "--per-device-batch", "8", "--microbatches", "4",
                           "--steps", "0", "--json", "--split", ",".join(map(str, split)),
                           "--precision", "bf16"]) == 0
        out = capsys.readouterr().out
        (row,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert row["split"] == split and "precision bf16" in out
        for bad, words in ((["--split", "1,x"], "--split"), (["--split", "1,1,1"], "--split: 3 stages listed"),
                           (["--precision", "f12"], "--precision")):
            assert bench.main(["--model", "lenet5", "--pipe", "2", "--steps", "0"] + bad) == 2
            err = capsys.readouterr().err
            assert words in err and err.count("\n") == 1, err
    finally:
        os.environ.clear()
        os.environ.update(environ)


def test_packing_gives_each_stage_its_parameters_and_each_device_its_gradient_blocks():
    """pipeline._Packing inside a shard_map over pipe 4 (x data 2), bn_net's parameters as random
    arrays, leaves split along their first, middle or last dimension or whole, one in bfloat16:
    after the all_to_all each device holds its own stage's parameters exactly (and their shapes are
    the whole leaves'); random gradients of every stage, packed by their stage and scattered, come
    back on every device as its block of each split leaf and each whole leaf whole, divided by the
    micro-batches (exact: NumPy reference)."""
    from jax.sharding import NamedSharding, PartitionSpec as PS
    from jaxcnn.parallel.pipeline import _Packing
    model, S, M = _model("bn_net"), 4, 2
    pipe = Pipeline(model, (16, 8, 8, 3), S, M, split=[1, 1, 2, 2])
    shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), (16, 8, 8, 3))[0])
    rng = np.random.default_rng(3)
    leaves, treedef = jax.tree_util.tree_flatten(shapes)
    dims, whole = [], []
    for j, x in enumerate(leaves):
        d = next((i for i in ([x.ndim - 1, 0] if j % 2 else range(x.ndim)) if x.shape[i] % S == 0), None)
        dims.append(None if x.size < 16 or d is None else d)
        dtype = jax.numpy.bfloat16 if j == 0 else np.float32
        whole.append(rng.normal(size=x.shape).astype(dtype))
    assert sum(d is not None for d in dims) >= 4 and any(d is None for d in dims)
    params = jax.tree_util.tree_unflatten(treedef, whole)
    dim_tree = jax.tree_util.tree_unflatten(treedef, dims)
    mesh = make_mesh(2, 1, pipe=S)
    specs = jax.tree_util.tree_map(lambda d, x: PS(*["pipe" if i == d else None for i in range(x.ndim)]),
                                   dim_tree, params, is_leaf=lambda x: x is None)
    placed = jax.tree_util.tree_map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)
    grads = [rng.normal(size=np.shape(x)).astype(np.float32) for x in whole]

    def per_device(blocks):
        packing = _Packing(pipe, blocks, dim_tree)
        mine_of, stage = packing.gather(blocks), jax.lax.axis_index("pipe")
        flats = [jax.numpy.concatenate([x.astype(np.float32).reshape(-1) for x in
                                        jax.tree_util.tree_leaves(mine_of(s))]) for s in range(S)]
        width = max(f.shape[0] for f in flats)
        mine = jax.numpy.stack([jax.numpy.pad(f, (0, width - f.shape[0])) for f in flats])[stage]
        g_tree = jax.tree_util.tree_unflatten(treedef, [jax.numpy.asarray(g) for g in grads])
        packs = [packing.pack_grads(s, {b.path: _get(g_tree, b.path) for b in pipe.stage_blocks[s]})
                 for s in range(S)]
        total = jax.tree_util.tree_map(lambda *p: jax.numpy.stack(p)[stage], *packs)
        return mine[None], packing.scatter_grads(total)

    from jaxcnn.parallel.pipeline import _get
    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(specs,), out_specs=(PS("pipe"), specs),
                               axis_names={"data", "pipe"}, check_vma=False))
    mine, got = jax.device_get(fn(placed))
    index = jax.tree_util.tree_unflatten(treedef, list(range(len(leaves))))
    for s in range(S):
        own = jax.tree_util.tree_leaves({b.path: _get(index, b.path) for b in pipe.stage_blocks[s]})
        ref = np.concatenate([np.asarray(whole[i], np.float32).reshape(-1) for i in own] + [np.zeros(0)])
        assert own and np.array_equal(mine[s, :ref.size], ref), s
    for g, r, p in zip(jax.tree_util.tree_leaves(got), grads, whole):
        assert g.dtype == p.dtype and g.shape == r.shape
        np.testing.assert_array_equal(np.asarray(g, np.float32),
                                      np.asarray((r / M).astype(p.dtype), np.float32))


# small_resnet split by hand: the stem cut after bn1 (a run of single-layer blocks is cut at the
# stage's edges), a stage of a run (relu, maxpool) and a block (layer1.0), a stage of one block,
# and the tail run (avgpool, fc): 5 units on 4 stages, so counting per unit is not per stage.
REMAT_SPLIT = [2, 3, 1, 2]
REMAT_UNITS = [["conv1", "bn1"], ["relu", "maxpool"], ["layer1.0"], ["layer2.0"], ["avgpool", "fc"]]


def _remat_step_jaxpr_counts(model, tx, data, remat):
    """small_resnet's pipelined step (data 1 x pipe 4, 2 micro-batches, REMAT_SPLIT) traced on
    the first batch: ``((custom VJPs named run, conds) in its jaxpr, (plan, the
    jax.stages.Traced))``.  The recomputed units are the custom VJPs named ``run`` (BatchNorm has
    its own)."""
    plan = _plan(model, tx, SHAPE, 1, 4, microbatches=2, remat=remat, split=REMAT_SPLIT)
    step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name, pipeline=plan.pipeline),
                          donate=False)
    step = getattr(step, "step", step)  # the jitted step under CPU's bounded dispatch (strategies._Bounded)
    traced = step.trace(plan.abstract_state, plan.put_batch(data[0]))
    jaxpr = str(traced.jaxpr)
    return ((len(re.findall(r"custom_vjp_call\[\s*name=run\b", jaxpr)), len(re.findall(r"\bcond\[", jaxpr))),
            (plan, traced))


def test_remat_recomputes_each_block_and_matches_one_device():
    """parallel.pipeline.remat: every unit of a stage (a block with inner layers, or a run
    of consecutive single-layer blocks, cut at the stage's edges: ResNet's stem is one) is
    recomputed in the backward (the step's jaxpr has one custom_vjp call per unit in the forward
    branches and one more conditional per unit, the recomputation's stored input, none without
    remat), and a ResNet on 4 stages (small_resnet; ResNet-18 is the slow GPipe test's
    layout) still gives one device's loss, gradients, BatchNorm statistics and parameters; the
    config key reaches the plan, a bad value is one line."""
    model, tx = _model("small_resnet"), MOMENTUM
    data = batches(SHAPE, 1, seed=1)
    (calls, conds), _ = _remat_step_jaxpr_counts(model, tx, data, remat=False)
    (calls_remat, conds_remat), (plan, traced) = _remat_step_jaxpr_counts(model, tx, data, remat=True)
    # the step run is the one traced for the counts: one trace of the pipelined step
    state, m = traced.lower().compile()(plan.shard_state(init(model, tx, SHAPE)), plan.put_batch(data[0]))
    _assert_run_matches([jax.device_get(m)], jax.device_get(state), *_reference(model, tx, SHAPE, data, 2), 1)
    assert plan.pipeline.remat and plan.pipeline.split == REMAT_SPLIT
    units = [[b.name for b in u] for s in range(4) for u in plan.pipeline.remat_units(s)]
    assert units == REMAT_UNITS and sum(map(len, units)) == sum(plan.pipeline.split)
    assert calls == 0 and calls_remat == len(units) and conds_remat == conds + len(units)

    import os

    from jaxcnn.train._plan import pipeline_spec
    from jaxcnn.train.config import load_config
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = os.path.join(root, "configs", "mnist_cnn.yaml")
    cfg = load_config(config, ["mesh.pipe=4", "parallel.pipeline.microbatches=4", "parallel.pipeline.remat=true"])
    assert pipeline_spec(cfg)["remat"] is True
    with pytest.raises(ValueError, match="parallel.pipeline.remat") as err:
        load_config(config, ["parallel.pipeline.remat=sometimes"])
    assert "\n" not in str(err.value)
