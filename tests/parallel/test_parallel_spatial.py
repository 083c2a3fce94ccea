"""Spatial partitioning: images split along height over the mesh's ``spatial`` axis
(8 emulated CPU devices) give one device's losses, gradients and BatchNorm statistics,
and a model that cannot be split as asked is refused before any compute."""
import re

import jax
import numpy as np
import optax
import pytest

from jaxcnn import layers as L
from jaxcnn.models import get as get_model
from jaxcnn.parallel import ParallelPlan, make_mesh, spatial_layout
from jaxcnn.layers._tree import get_path
from jaxcnn.parallel.spatial import window_halo
from jaxcnn.train.step import make_train_step

from numeric import jaxpr_eqns
from _helpers import batches, init, max_diff, run_single

LR1 = optax.sgd(1.0)  # new params = params - grads: one step exposes the gradients

_MODELS = {}


def small_resnet():
    """ResNet-18's geometry up to layer3 at a fraction of its compilation: the zoo's stem (7x7/2
    convolution, BatchNorm, ReLU, 3x3/2 max-pool) and one basic block per stage, layer1 identity
    and layer2-3 strided with projection shortcuts, 16-32-64 channels; at 32x32 its layer3 runs on
    2-row maps as ResNet-18's does.  ResNet-18's layer4 (1x1 maps, never split at 32x32: every
    split here ends by layer3.0) is left out: it was half of each step's compilation, unsplit;
    ResNet-18 itself runs with the slow tests."""
    from jaxcnn.models.resnet import basic_block
    layers, width = [], 16
    for i, planes in enumerate((16, 32, 64)):
        layers.append((f"layer{i + 1}", L.serial(basic_block(width, planes, 1 if i == 0 else 2))))
        width = planes
    return L.serial(("conv1", L.Conv2D(16, 7, stride=2, padding=3, use_bias=False)), ("bn1", L.BatchNorm()),
                    ("relu", L.Relu()), ("maxpool", L.MaxPool2D(3, stride=2, padding=1)), *layers,
                    ("avgpool", L.GlobalAvgPool2D()), ("fc", L.Linear(10)))


def _model(name):
    """resnet18 on 32x32 (7x7/2 stem, 3x3/2 max-pool, strided blocks), small_resnet (its geometry
    to layer3, one block per stage, narrow: the default suite's ResNet) and vgg11 on 32x32 (3x3
    convolutions, 2x2 pools, a small classifier with dropout; small_vgg: its layers with 3
    convolutions, the default suite's VGG), 10 classes."""
    if name not in _MODELS:
        kw = dict(classifier_width=32) if name == "vgg11" else {}
        if name == "small_resnet":
            model = small_resnet()
        elif name == "small_vgg":  # VGG-11's layers (3x3 convolutions, 2x2 pools, the dropout classifier), 3 convolutions
            from jaxcnn.models.vgg import vgg
            model = vgg((16, "M", 32, "M", 64, "M"), batch_norm=False, num_classes=10, classifier_width=32)
        else:
            model = get_model(name, num_classes=10, **kw)
        _MODELS[name] = (model, (4, 32, 32, 3))
    return _MODELS[name]


def _abstract_state(model, tx, shape):
    """The TrainState as ShapeDtypeStructs, traced only: a plan needs no initialised weights
    (ResNet-18's eager initialisation was seconds of per-shape compilation, paid by tests that
    only trace or read shardings)."""
    from jaxcnn import precision as P
    from jaxcnn.train.state import create_train_state
    return jax.eval_shape(lambda: create_train_state(model, tx, jax.random.PRNGKey(0), shape,
                                                     loss_scale=P.make_loss_scale("none")))


def _plan(model, tx, shape, data, spatial, until="auto", devices=None):
    mesh = make_mesh(data, 1, spatial=spatial, devices=devices)
    return ParallelPlan(mesh, model, shape, _abstract_state(model, tx, shape), strategy="jit",
                        spatial_until=until)


def _run(plan, tx, shape, data, model):
    step = plan.wrap_step(make_train_step(plan.step_model, tx, axis_name=plan.step_axis_name),
                          donate=False)
    state = plan.shard_state(init(model, tx, shape))
    losses = []
    for b in data:
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state), step


def _rel(a, b):
    """max |a - b| over max |b|, over all leaves together."""
    scale = max(float(np.max(np.abs(np.asarray(x)))) for x in jax.tree_util.tree_leaves(b))
    return max_diff(a, b) / scale


# The data 2 x spatial 4 cases run with the slow tests: the data x spatial layout is checked on
# small_resnet (ResNet-18's strided blocks, BatchNorm statistics over both axes) and small_vgg (2x2
# pools, the dropout classifier) by test_remat_matches_one_device, the same layout and assertions with each
# unit recomputed; the two other cases check both models on spatial 4 without recomputation.
# ResNet-18 and VGG-11 themselves (several times small_resnet's and twice small_vgg's compilation, the same kinds
# of layers) run with the slow tests.
@pytest.mark.parametrize("name,data,spatial", [
    ("small_resnet", 1, 4), pytest.param("resnet18", 1, 4, marks=pytest.mark.slow),
    pytest.param("resnet18", 2, 4, marks=pytest.mark.slow), ("small_vgg", 1, 4),
    pytest.param("vgg11", 1, 4, marks=pytest.mark.slow), pytest.param("vgg11", 2, 4, marks=pytest.mark.slow)],
    ids=["small_resnet-spatial4", "resnet18-spatial4", "resnet18-data2_spatial4", "small_vgg-spatial4",
         "vgg11-spatial4", "vgg11-data2_spatial4"])
def test_same_loss_gradients_and_statistics_as_one_device(name, data, spatial):
    model, shape = _model(name)
    (batch,) = batches(shape, 1, seed=3)
    devices = jax.devices()[:data * spatial]
    plan = _plan(model, LR1, shape, data, spatial, devices=devices)
    assert plan.spatial.split and plan.spatial.shards == spatial
    _same_as_one_device(plan, model, shape, batch)


def _same_as_one_device(plan, model, shape, batch):
    """One sgd(1.0) step of ``plan`` against one device.

    Float32 rounding: the loss to 1e-5 relative; the gradients (params0 - params1 under
    sgd(1.0)) to 3e-4 of their largest entry (BatchNorm over a batch of 4 on 1x1 maps
    amplifies rounding: data-parallel jit alone differs from one device by 6e-5..8e-5 of it on
    resnet18; a wrong halo differs by O(1)); BatchNorm running statistics (over data and
    spatial) to 1e-5 of their largest entry.  The compiled step exchanges halo rows between
    spatial neighbours (collective-permute)."""
    state0 = init(model, LR1, shape)
    ref_losses, ref = run_single(model, LR1, shape, [batch])
    losses, got, step = _run(plan, LR1, shape, [batch], model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    grads = jax.tree_util.tree_map(np.subtract, state0.params, got.params)
    ref_grads = jax.tree_util.tree_map(np.subtract, state0.params, ref.params)
    assert _rel(grads, ref_grads) < 3e-4
    if ref.state:
        assert _rel(got.state, ref.state) < 1e-5
    hlo = step.lower(plan.abstract_state, plan.put_batch(batch)).compile().as_text()
    assert re.search(r"collective-permute(-start)?\(", hlo)


# -- explicit halos: shard_map + ppermute ------------------------------------------------------------

def _halo_cases():
    """Window ops with random geometry (kernel, stride, padding, dilation, ceil_mode) on images
    that split into 2 or 4 blocks whose output splits too: ``(name, op(x, **kw), x shape, kw)``."""
    from jaxcnn import functional as F
    rng = np.random.default_rng(7)
    cases = []
    while len(cases) < 12:
        kind = ["conv", "conv", "conv", "max", "avg", "group"][len(cases) % 6]
        shards = int(rng.choice([2, 4]))
        k, s = int(rng.integers(1, 6)), int(rng.integers(1, 3))
        d = int(rng.integers(1, 3)) if kind in ("conv", "max") else 1
        pad = int(rng.integers(0, k // 2 + 1))
        ceil = bool(rng.integers(0, 2)) if kind in ("max", "avg") else False
        height = shards * int(rng.integers(1, 5)) * s
        shape = (2, height, 5, 4)
        kw = dict(stride=s, padding=pad, dilation=d)
        if kind == "conv":
            groups = int(rng.choice([1, 2, 4]))
            w = rng.standard_normal((k, k, 4 // groups, 4)).astype(np.float32)
            if len(cases) % 2:
                kw["padding"] = "SAME"
            op = lambda x, w=w, g=groups, **kw: F.conv2d(x, w, np.ones(4, np.float32), groups=g, **kw)
        elif kind == "max":
            kw["ceil_mode"] = ceil
            op = lambda x, k=k, **kw: F.max_pool2d(x, k, **kw)
        elif kind == "avg":
            kw = dict(stride=s, padding=pad, ceil_mode=ceil, count_include_pad=bool(len(cases) % 2))
            op = lambda x, k=k, **kw: F.avg_pool2d(x, k, **kw)
        else:
            kw = {}
            op = lambda x, **kw: F.group_norm(x, 2, **kw)
        try:
            out = jax.eval_shape(lambda x: op(x, **kw), jax.ShapeDtypeStruct(shape, np.float32))
        except ValueError:
            continue
        if out.shape[1] == 0 or out.shape[1] % shards:
            continue
        cases.append((kind, shards, op, shape, kw))
    return cases


def test_explicit_halo_ops_give_their_block_of_the_whole_images_output():
    """conv2d / max_pool2d / avg_pool2d / group_norm with ``height_axis`` inside shard_map (the
    image's rows in 2 or 4 blocks) against the same op on the whole image: forward and input
    gradient (and the weight gradient of conv2d, summed over the blocks) to float32 rounding
    (1e-5 of the largest entry); random geometry including "SAME", dilation, ceil_mode, groups,
    windows taller than a block and the padding of the first and last blocks."""
    from jax.sharding import Mesh, PartitionSpec as P
    rng = np.random.default_rng(0)
    for kind, shards, op, shape, kw in _halo_cases():
        mesh = Mesh(np.array(jax.devices()[:shards]), ("rows",))
        blocks = jax.shard_map(lambda x: op(x, height_axis="rows", **kw), mesh=mesh, in_specs=P(None, "rows"),
                               out_specs=P(None, "rows"), check_vma=True)
        x = rng.standard_normal(shape).astype(np.float32)
        want = jax.jit(lambda x: op(x, **kw))(x)  # jitted: one compilation, not one per eager op
        ct = rng.standard_normal(want.shape).astype(np.float32)
        got = jax.jit(blocks)(x)
        grad = jax.jit(jax.grad(lambda x: (blocks(x) * ct).sum()))(x)
        want_grad = jax.jit(jax.grad(lambda x: (op(x, **kw) * ct).sum()))(x)
        where = (kind, shards, shape, kw)
        np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), err_msg=str(where))
        np.testing.assert_allclose(grad, want_grad, atol=1e-5 * np.abs(want_grad).max(), err_msg=str(where))


def test_explicit_halo_weight_gradient_sums_over_the_blocks():
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxcnn import functional as F
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 16, 6, 3)).astype(np.float32)
    w = rng.standard_normal((7, 7, 3, 5)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("rows",))
    conv = lambda x, w, **kw: F.conv2d(x, w, stride=2, padding=3, **kw)
    blocks = jax.shard_map(lambda x, w: conv(x, w, height_axis="rows"), mesh=mesh,
                           in_specs=(P(None, "rows"), P()), out_specs=P(None, "rows"), check_vma=True)
    ct = rng.standard_normal(conv(x, w).shape).astype(np.float32)
    got = jax.jit(jax.grad(lambda w: (blocks(x, w) * ct).sum()))(w)
    want = jax.grad(lambda w: (conv(x, w) * ct).sum())(w)
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_explicit_halo_refuses_windows_past_the_neighbouring_blocks():
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxcnn import functional as F
    mesh = Mesh(np.array(jax.devices()[:4]), ("rows",))
    w = np.ones((7, 7, 1, 1), np.float32)
    blocks = jax.shard_map(lambda x: F.conv2d(x, w, padding=3, height_axis="rows"), mesh=mesh,
                           in_specs=P(None, "rows"), out_specs=P(None, "rows"))
    with pytest.raises(ValueError, match=r"block 0 of 4 reads rows 0..4 of the 8-row image, beyond its "
                                         r"neighbours' 2-row blocks"):
        blocks(np.ones((1, 8, 3, 1), np.float32))


@pytest.mark.parametrize("layer,why", [
    (L.GlobalAvgPool2D(), "GlobalAvgPool2D: computes on whole images"),
    (L.AdaptiveAvgPool2D(2), "AdaptiveAvgPool2D: computes on whole images"),
    (L.Flatten(), "Flatten: computes on whole images"),
    (L.ConvTranspose2D(2, 3), "ConvTranspose2D: has no halo exchange of its own"),
    (L.LayerNorm(axes=(-3, -2, -1)), "LayerNorm: normalises over axes (-3, -2, -1), the rows among them"),
    (L.BatchNorm(), "BatchNorm: takes its statistics over axis_name=None only"),
])
def test_layers_that_cannot_compute_a_block_of_rows_refuse_height_axis(layer, why):
    """Choices.height_axis says x is one block of each image's rows: a layer that would return a
    wrong result from a block alone (per-block means, a transposed convolution without halos,
    BatchNorm statistics not reduced over the blocks) raises instead of computing it."""
    from jaxcnn.layers import Choices
    x = np.ones((2, 4, 4, 3), np.float32)
    params, state, _ = layer.init(jax.random.PRNGKey(0), x.shape)
    with pytest.raises(ValueError, match=re.escape(why) + r", but Choices.height_axis='rows' makes x one "
                                         r"block of each image's rows"):
        layer.apply(params, state, x, train=True, choices=Choices(height_axis="rows"))
    layer.apply(params, state, x, train=True, choices=Choices())  # and without it, computes


def test_explicit_halo_ops_accept_every_window_the_plan_accepts():
    """The ops refuse a window exactly when the plan does (its halo, over the rows the taps
    read, is more than a block holds): a dilated window whose span passes a block but whose
    taps skip it was accepted by the plan and refused by the op.  And that window, computed."""
    from jax.sharding import Mesh, PartitionSpec as P
    from jaxcnn import functional as F
    from jaxcnn.functional._halo import halo_sizes
    checked = 0
    for shards in (2, 3, 4):
        for h in (1, 2, 3):
            for k in range(1, 6):
                for d in (1, 2, 3):
                    for s in (1, 2):
                        for lo in range(0, (k - 1) * d + 1):
                            for hi in range(0, (k - 1) * d + 1):
                                height = shards * h
                                out = (height + lo + hi - (k - 1) * d - 1) // s + 1
                                if out < shards or out % shards:
                                    continue
                                plan = window_halo(height, out, shards, k, s, (lo, hi), d) <= h
                                try:
                                    halo_sizes(height, shards, k, d, s, lo, out)
                                    op = True
                                except ValueError:
                                    op = False
                                assert plan == op, (shards, h, k, d, s, lo, hi)
                                checked += 1
    assert checked > 1000
    mesh = Mesh(np.array(jax.devices()[:3]), ("rows",))
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 2)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((3, 3, 2, 4)).astype(np.float32)
    blocks = jax.shard_map(lambda x: F.conv2d(x, w, padding=3, dilation=3, height_axis="rows"), mesh=mesh,
                           in_specs=P(None, "rows"), out_specs=P(None, "rows"))
    want = F.conv2d(x, w, padding=3, dilation=3)
    np.testing.assert_allclose(jax.jit(blocks)(x), want, atol=1e-5 * np.abs(want).max())


# data2_spatial2 alone runs with the slow tests: its halo exchange is the other two cases' (the same
# layout with a model axis besides, and with each unit recomputed), with the same assertions; so do
# ResNet-18's cases (small_resnet has its geometry to layer3, on 2-row maps there, at a fraction of the compilation).
@pytest.mark.parametrize("name,data,spatial,model_axis,remat", [
    pytest.param("small_resnet", 2, 2, 1, False, marks=pytest.mark.slow), ("small_resnet", 2, 2, 2, False),
    ("small_resnet", 2, 2, 1, True), pytest.param("resnet18", 2, 2, 2, False, marks=pytest.mark.slow),
    pytest.param("resnet18", 2, 2, 1, True, marks=pytest.mark.slow)],
    ids=["data2_spatial2", "data2_spatial2_model2", "data2_spatial2_remat", "resnet18-data2_spatial2_model2",
         "resnet18-data2_spatial2_remat"])
def test_explicit_halos_match_one_device_where_the_partitioner_is_wrong(name, data, spatial, model_axis, remat):
    """A ResNet with ``parallel.spatial.halo: explicit`` in the two layouts XLA's partitioner gets
    wrong: a 3x3 window on 2-row images (layer3, split here; the partitioner stops before it) with
    data 2, and spatial x model; and with ``parallel.spatial.remat``.  Loss, gradients and
    BatchNorm statistics as on one device (tolerances as in
    test_same_loss_gradients_and_statistics_as_one_device)."""
    model, shape = _model(name)
    (batch,) = batches(shape, 1, seed=3)
    mesh = make_mesh(data, model_axis, spatial=spatial, devices=jax.devices()[:data * spatial * model_axis])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      init(model, LR1, shape))
    plan = ParallelPlan(mesh, model, shape, abstract, strategy="jit", spatial_halo="explicit",
                        spatial_remat=remat)
    assert plan.spatial.gather_after == {"resnet18": "layer3.1", "small_resnet": "layer3.0"}[name]
    assert plan.spatial.gather_after not in spatial_layout(model, shape, spatial).split
    _same_as_one_device(plan, model, shape, batch)


@pytest.mark.parametrize("halo,drop", [("partitioner", 0.3), ("explicit", 0.0)])
def test_convnext_blocks_split_their_layer_norms_and_linear_layers(halo, drop):
    """ConvNeXt's blocks (7x7 depthwise conv, LayerNorm over channels, linear layers over
    channels, layer scale, stochastic depth) are computed row by row: a small ConvNeXt is split
    through its last block on data 2 x spatial 2 (the split used to end at the stem's LayerNorm)
    and gives one device's loss and gradients (as in
    test_same_loss_gradients_and_statistics_as_one_device).  Stochastic depth at 0.3 under the
    partitioner (one global program draws as one device does); explicit halos split it at rate 0."""
    from jaxcnn.models.convnext import cn_block
    model = L.serial(("stem", L.serial(L.Conv2D(8, 2, stride=2), L.LayerNorm(axes=-1, eps=1e-6))),
                     ("blocks", L.serial(cn_block(8, 0.5, drop), cn_block(8, 0.5, drop))),
                     ("pool", L.GlobalAvgPool2D()), ("head", L.Linear(10)))
    shape = (4, 16, 16, 3)
    (batch,) = batches(shape, 1, seed=5)
    mesh = make_mesh(2, 1, spatial=2, devices=jax.devices()[:4])
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      init(model, LR1, shape))
    plan = ParallelPlan(mesh, model, shape, abstract, strategy="jit", spatial_halo=halo)
    assert plan.spatial.gather_after == "blocks.1", plan.spatial.stop
    _same_as_one_device(plan, model, shape, batch)


def test_squeeze_excitation_gates_are_split_through():
    """A squeeze-and-excitation gate (global average pooling to (N, 1, 1, C), 1x1 convolutions,
    the product broadcast back) inside the split: the partitioner reduces the pooling over the
    split rows, so the split goes on past it (it ended at the gate's pooling: EfficientNet and
    MobileNetV3 split only their first block), and the step is one device's."""
    model = L.serial(("stem", L.Conv2D(8, 3, padding=1)), ("bn", L.BatchNorm()), ("act", L.Silu()),
                     ("se", L.SqueezeExcitation(8, 2, activation=L.Silu)),
                     ("down", L.Conv2D(8, 3, stride=2, padding=1)), ("pool", L.GlobalAvgPool2D()),
                     ("head", L.Linear(10)))
    shape = (4, 16, 16, 3)
    (batch,) = batches(shape, 1, seed=6)
    plan = _plan(model, LR1, shape, 2, 2, devices=jax.devices()[:4])
    assert plan.spatial.gather_after == "down", plan.spatial.stop
    _same_as_one_device(plan, model, shape, batch)
    # the zoo's gated models split until a height stops dividing (224x224 on 2 shards: 7 rows)
    for name in ("efficientnet_b0", "mobilenet_v3_small"):
        layout = spatial_layout(get_model(name, num_classes=10), (2, 224, 224, 3), 2)
        assert "output height 7 does not divide" in layout.stop, (name, layout.stop)
    # explicit halos do not split a gate's global pooling
    assert spatial_layout(model, shape, 2, halo="explicit").gather_after == "act"


def test_explicit_halos_end_the_split_at_random_layers():
    """Dropout draws per position: one block's draw is not the whole image's, so explicit
    halos stop before it (the partitioner's global program draws the whole image's)."""
    model = L.serial(L.Conv2D(4, 3, padding=1), L.Dropout(0.5), L.Conv2D(4, 3, padding=1),
                     L.GlobalAvgPool2D())
    shape = (2, 8, 8, 3)
    assert spatial_layout(model, shape, 2).gather_after == "2"
    layout = spatial_layout(model, shape, 2, halo="explicit")
    assert layout.split == ("0",) and "1 (dropout) draws random numbers per example or position" in layout.stop
    with pytest.raises(ValueError, match=r"^halo: expected one of \('partitioner', "
                                         r"'explicit'\), got 'ppermute'"):
        spatial_layout(model, shape, 2, halo="ppermute")


def test_activations_are_height_sharded_until_the_gather():
    model, shape = _model("resnet18")
    plan = _plan(model, LR1, shape, 2, 4)
    assert plan.spatial.split[:4] == ("conv1", "bn1", "relu", "maxpool")
    assert plan.spatial.gather_after == "layer2.1"  # layer3.0's 2-row output does not divide by 4
    assert "layer3.0" in plan.spatial.stop
    state0 = plan.abstract_state  # traced only: shapes are all the jaxpr needs
    x = plan.put_batch(batches(shape, 1)[0])["image"]
    # Which layers carry constraints: read them back from the jaxpr.
    jaxpr = jax.make_jaxpr(lambda p, s, x: plan.step_model.apply(p, s, x))(
        state0.params, state0.state, x)
    eqns = list(jaxpr_eqns(jaxpr))
    specs = [str(e.params["sharding"].spec) for e in eqns if e.primitive.name == "sharding_constraint"]
    # The input is pinned first; then each unit gathers its own parameters whole (P(); at rest
    # the large ones are split over spatial) as it runs, and every split unit's output is
    # pinned (4 stem units + 4 blocks of layer1/layer2), the last one gathering the images.
    split = set(plan.spatial.split)
    expected = ["P('data', 'spatial')"]
    for unit in plan.spatial.units:
        expected += ["P()"] * len(jax.tree_util.tree_leaves(get_path(state0.params, unit)))
        if unit in split:
            expected.append("P('data',)" if unit == plan.spatial.gather_after else "P('data', 'spatial')")
    assert specs == expected


def test_parameters_and_moments_rest_split_over_spatial():
    """ZeRO over spatial: every parameter of at least FSDP_MIN_SIZE elements (and its optimiser
    moments) is split over the spatial axis at rest (the step model gathers them before use:
    test_activations_are_height_sharded_until_the_gather; the runs above match one device)."""
    from jaxcnn.parallel import rules as R
    model, shape = _model("resnet18")
    plan = _plan(model, optax.sgd(0.1, momentum=0.9), shape, 2, 4)
    params = plan.state_shardings.params
    big = [(x.shape, s.spec) for x, s in zip(jax.tree_util.tree_leaves(plan.abstract_state.params),
                                             jax.tree_util.tree_leaves(params))
           if x.size >= R.FSDP_MIN_SIZE]
    assert big and all("spatial" in spec for _, spec in big), big
    moments = [s.spec for s in jax.tree_util.tree_leaves(plan.state_shardings.opt_state)]
    assert sum("spatial" in spec for spec in moments) == len(big)


def test_halo_rows_against_the_convolution_jacobian():
    """window_halo against the rows lax.conv_general_dilated actually reads: the nonzero
    pattern of d(output rows of shard i) / d(input) for a positive input and kernel."""
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 40:
        shards = int(rng.choice([2, 4]))
        k, s, d = int(rng.integers(1, 8)), int(rng.integers(1, 4)), int(rng.integers(1, 3))
        lo, hi = int(rng.integers(0, k * d)), int(rng.integers(0, k * d))
        height = shards * int(rng.integers(1, 7))
        out = (height + lo + hi - (k - 1) * d - 1) // s + 1
        if out < shards or out % shards:
            continue
        checked += 1
        # The convolution is linear in x: its Jacobian's columns are its outputs for the unit
        # inputs, one per example of a batch (one convolution, not jax.jacobian's several ops).
        units = np.eye(height, dtype=np.float32).reshape(height, height, 1, 1)
        jac = np.asarray(jax.lax.conv_general_dilated(
            units, np.ones((k, 1, 1, 1), np.float32), (s, 1), ((lo, hi), (0, 0)), rhs_dilation=(d, 1),
            dimension_numbers=("NHWC", "HWIO", "NHWC")))[:, :, 0, 0].T
        h, ho = height // shards, out // shards
        need = 0
        for i in range(shards):
            rows = np.nonzero(jac[i * ho:(i + 1) * ho].any(axis=0))[0]
            if rows.size:
                need = max(need, i * h - rows.min(), rows.max() - ((i + 1) * h - 1))
        assert window_halo(height, out, shards, k, s, (lo, hi), d) == need, (height, shards, k, s, d, lo, hi)


def test_refused_before_compute():
    model, _ = _model("resnet18")
    # Height not divisible by the spatial shards.
    with pytest.raises(ValueError, match=r"^shards: the input height 30 .* does not divide into 4"):
        spatial_layout(model, (4, 30, 32, 3), 4)
    # A window whose halo is more than a shard holds: 7x7 stride-2 stem on 2-row shards.
    with pytest.raises(ValueError, match=r"^shards: .*conv1 \(conv2d 7x7, stride 2, padding "
                                         r"\(3, 3\)\) needs 3 halo rows .* holds 2"):
        spatial_layout(model, (4, 8, 32, 3), 4)
    # until= asks for more than the model allows (layer3.0's output height 2 over 4 shards).
    with pytest.raises(ValueError, match=r"^until: cannot split up to 'layer3' .*"
                                         r"layer3.0.conv1 .* output height 2 does not divide into 4"):
        spatial_layout(model, (4, 32, 32, 3), 4, until="layer3")
    with pytest.raises(ValueError, match=r"^until: 'layer9' names no layer"):
        spatial_layout(model, (4, 32, 32, 3), 4, until="layer9")
    with pytest.raises(ValueError, match=r"^until: .*avgpool \(global_avg_pool2d\) "
                                         r"is not computed row by row"):
        spatial_layout(model, (4, 128, 128, 3), 2, until="avgpool")
    # A window taller than its whole input (layer3.0.conv2: 3x3 on 2 rows) is never split: XLA's
    # partitioner gets its input gradient wrong (O(1) errors with data 2 x spatial 2).
    assert "layer3.0.conv2 (conv2d 3x3" in spatial_layout(model, (4, 32, 32, 3), 2).stop
    with pytest.raises(ValueError, match=r"^until: .*layer3.0.conv2 .* taller than"):
        spatial_layout(model, (4, 32, 32, 3), 2, until="layer3")
    # Only the jit strategy partitions a global program.
    shape = (4, 32, 32, 3)
    abstract = _abstract_state(model, LR1, shape)
    with pytest.raises(ValueError, match=r"^strategy: mesh.spatial=4 needs strategy jit"):
        ParallelPlan(make_mesh(2, 1, spatial=4), model, shape, abstract, strategy="shard_map")
    # Not with a model axis: XLA's partitioner got spatial x model wrong (0.02-0.2 off).
    with pytest.raises(ValueError, match=r"^mesh.model: 2 with mesh.spatial=2: spatial partitioning "
                                         r"composes with the data axis only .* or spatial_halo=explicit"):
        ParallelPlan(make_mesh(2, 2, spatial=2), model, shape, abstract, strategy="jit")


def test_until_stops_the_split_where_asked():
    model, shape = _model("resnet18")
    layout = spatial_layout(model, shape, 4, until="layer1")
    assert layout.split == ("conv1", "bn1", "relu", "maxpool", "layer1.0", "layer1.1")
    assert layout.stop == "until is 'layer1'"
    assert layout.halos["conv1"] == 3 and layout.halos["maxpool"] == 1
    auto = spatial_layout(model, shape, 4)
    assert auto.split[-1] == "layer2.1" and auto.split[:len(layout.split)] == layout.split


# -- through jaxcnn-train: config keys, dry run, checkpoint and resume onto another layout ---------

SPATIAL4 = ["mesh.data=2", "mesh.spatial=4", "parallel.strategy=jit"]
DATA_ONLY = ["mesh.data=-1", "mesh.spatial=1", "parallel.strategy=jit"]


def _tiny16(path, n_train=64, n_test=32, classes=4):
    """tiny_npz's learnable grey images (brightness encodes the label), 16x16 so 4 shards split them."""
    rng = np.random.default_rng(0)
    labels = rng.integers(0, classes, n_train + n_test)
    x = (rng.random((n_train + n_test, 16, 16)) * 60 + labels[:, None, None] * 50).astype(np.uint8)
    np.savez(path, x_train=x[:n_train], y_train=labels[:n_train], x_test=x[n_train:], y_test=labels[n_train:])
    return str(path)


def _cli_args(data, workdir, *extra):
    from reliability.reliability_lib import tiny_args
    return [a for a in tiny_args(data, "model.name=lenet5", "train.steps=8", "checkpoint.every=2",
                                 "checkpoint.keep=10", *extra, "--workdir", str(workdir))
            if a != "model.name=mnist_cnn"]


def _keep_until(workdir, step):
    import os
    import shutil
    for name in os.listdir(workdir / "checkpoints"):
        if name.isdigit() and int(name) > step:
            shutil.rmtree(workdir / "checkpoints" / name)
    os.remove(workdir / "params.npz")


def test_train_cli_spatial_run_resumes_onto_data_only_and_back(tmp_path, capsys):
    """lenet5 on 16x16 images: spatial 4 (data 2) splits conv1 (5x5, 2 halo rows of 4), act1 and
    pool1 and gathers before conv2 (whose 5x5 window needs 3 rows of a 2-row shard).  A spatial run
    resumed at step 4 as data-parallel, and that run resumed at step 6 as spatial again, end where
    the spatial run ends (float32: 1e-5; the layout is not a config change).  A checkpoint holds
    host arrays whatever the layout that wrote it (checkpoint.save gathers them), so resuming onto
    pipeline stages is the pipeline trainer tests' (test_parallel_pipeline_mpmd.py::
    test_trainer_runs_the_mpmd_engine_and_resumes_across_engines: a one-device checkpoint on mpmd
    data 2 x pipe 4; test_parallel_pipeline.py::
    test_trainer_resumes_a_data_parallel_checkpoint_onto_split_stages: on SPMD stages), not
    repeated here.  The run back on spatial 4 takes the first run's config, so its programs are
    the ones that run compiled (the persistent cache): the layout changes under the checkpoint,
    not the program.  No default test trains
    with another ``parallel.spatial.until``: the key reaches the layout from the config
    (test_train_cli_refuses_an_impossible_split_before_compute) and the layout stops where it
    says (test_until_stops_the_split_where_asked)."""
    import shutil

    from jaxcnn.interop import load_npz
    from jaxcnn.train.cli import train_main
    data = _tiny16(tmp_path / "tiny16.npz")
    # the run's own start-up line names the split (a --dry-run first compiled the same steps
    # again; the dry run's spatial line: test_train_cli_takes_explicit_halos_with_a_model_axis)
    ref = tmp_path / "spatial"
    assert train_main(_cli_args(data, ref, *SPATIAL4)) == 0
    out = capsys.readouterr().out
    assert "data parallel over 2 (jit), images split along height over 4 (through pool1)" in out, out
    flat = tmp_path / "data_only"
    shutil.copytree(ref, flat)
    _keep_until(flat, 4)
    assert train_main(_cli_args(data, flat, *DATA_ONLY)) == 0
    assert "resumed from step 4" in capsys.readouterr().out
    back = tmp_path / "back"
    shutil.copytree(flat, back)
    _keep_until(back, 6)
    assert train_main(_cli_args(data, back, *SPATIAL4)) == 0
    out = capsys.readouterr().out
    assert "resumed from step 6" in out and "images split along height over 4 (through pool1)" in out, out
    want = load_npz(str(ref / "params.npz"))
    for run in (flat, back):
        got = load_npz(str(run / "params.npz"))
        assert max_diff(got, want) < 1e-5, run.name


def test_train_cli_refuses_an_impossible_split_before_compute(tmp_path, capsys):
    from jaxcnn.train.cli import train_main
    data = _tiny16(tmp_path / "tiny16.npz")
    assert train_main(_cli_args(data, tmp_path / "a", *SPATIAL4, "parallel.spatial.until=conv2",
                                "--dry-run")) == 2
    err = capsys.readouterr().err
    assert ("parallel.spatial.until: cannot split up to 'conv2' over 4 spatial shards: conv2 (conv2d 5x5, "
            "stride 1, padding (0, 0)) needs 3 halo rows from its neighbour but a shard of its 8-row "
            "input holds 2") in err
    assert "Traceback" not in err
    assert train_main(_cli_args(data, tmp_path / "b", "mesh.spatial=4", "--dry-run")) == 2
    assert "parallel.strategy: mesh.spatial=4 needs strategy jit" in capsys.readouterr().err


def test_train_cli_takes_explicit_halos_with_a_model_axis(tmp_path, capsys):
    """``parallel.spatial.halo: explicit`` from the config: the spatial x model mesh the partitioner
    layout refuses is accepted, and the start-up line says which halos."""
    from jaxcnn.train.cli import train_main
    data = _tiny16(tmp_path / "tiny16.npz")
    mesh = ["mesh.data=1", "mesh.spatial=4", "mesh.model=2", "parallel.strategy=jit"]
    assert train_main(_cli_args(data, tmp_path / "a", *mesh, "--dry-run")) == 2
    assert "use mesh.model=1 or parallel.spatial.halo=explicit" in capsys.readouterr().err
    assert train_main(_cli_args(data, tmp_path / "b", *mesh, "parallel.spatial.halo=explicit",
                                "--dry-run")) == 0
    assert "spatial 4 (images split along height through pool1, explicit halos)" in capsys.readouterr().out
    assert train_main(_cli_args(data, tmp_path / "c", *mesh, "parallel.spatial.halo=both", "--dry-run")) == 2
    assert "parallel.spatial.halo" in capsys.readouterr().err


def test_bench_scaling_reports_memory_and_halo_exchanges(capsys):
    import importlib.util
    import json
    import os
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scaling.py"
    spec = importlib.util.spec_from_file_location("bench_scaling", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # The script sets XLA_FLAGS (its device count) as a command-line tool does; the
    # subprocesses of later tests in this worker must not inherit that, and JAX must start
    # here with the suite's 8 devices, not with the script's count (later tests use 8).
    import jax
    assert jax.device_count() == 8
    environ = dict(os.environ)
    try:
        assert bench.main(["--model", "mnist_cnn", "--layout", "spatial", "--devices", "1,2",
                           "--per-device-batch", "4", "--compile-only", "--json",
                           "--halo", "partitioner,explicit"]) == 0
    finally:
        os.environ.clear()
        os.environ.update(environ)
    out = capsys.readouterr().out
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["data"], r["spatial"], r["global_batch"], r["halo"]) for r in rows] == [
        (1, 1, 4, "-"), (1, 2, 4, "partitioner"), (1, 2, 4, "explicit")]
    # explicit halos stop before dropout1 (it draws per position)
    assert [r["split_through"] for r in rows] == [None, "dropout1", "pool"]
    assert rows[0]["collective-permute"] == 0 and rows[1]["collective-permute"] > 0
    assert rows[2]["collective-permute"] > 0
    assert all(r["step_bytes"] > 0 for r in rows)
    assert "mem/device" in out


def test_cpu_fence_reads_one_element_of_a_height_split_activation():
    """The CPU lowering's fence (a stored copy of a convolution's input) reads the first element
    without flattening, so a height-split input is not all-gathered to read it."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxcnn.functional import _cpu_lowering as CL
    mesh = make_mesh(2, 1, spatial=4)
    x = jax.device_put(np.random.default_rng(0).normal(size=(4, 8, 8, 16)).astype(np.float32),
                       NamedSharding(mesh, P("data", "spatial")))
    fenced = jax.jit(CL._fence)
    assert np.asarray(fenced(x)).tobytes() == np.asarray(x).tobytes()
    assert "all-gather" not in fenced.lower(x).compile().as_text()


def test_split_units_run_xla_kernels_the_rest_keeps_the_callers_choices():
    from jaxcnn.layers import Choices
    seen = []

    def spy(kind):
        def apply(params, state, x, *, choices=None, **kw):
            seen.append((kind, choices.impl, choices.conv_bn))
            return x, state
        return L.Layer(lambda k, s: ({}, {}, s), apply, "identity")

    model = L.serial(("a", spy("a")), ("b", spy("b")), ("pool", L.GlobalAvgPool2D()), ("c", spy("c")))
    mesh = make_mesh(2, 1, spatial=4)
    from jaxcnn.parallel.spatial import SpatialLayout, constrain
    layout = SpatialLayout(4, ("a", "b", "pool", "c"), ("a", "b"), {}, "pool")
    x = np.zeros((2, 8, 8, 3), np.float32)
    jax.jit(lambda x: constrain(model, layout, mesh).apply(
        {}, {}, x, choices=Choices(impl="pallas", conv_bn="mosaic"))[0]).lower(x)
    assert seen == [("a", "xla", "off"), ("b", "xla", "off"), ("c", "pallas", "mosaic")]


def test_no_fused_chain_walks_past_the_split_units(monkeypatch):
    """With the Conv -> BatchNorm fusion chosen (conv_bn="mosaic", as on a GPU) a rebuilt
    serial must not walk its children through the fusion's chain (which calls the fused kernel
    on a child's parameters directly, past the child's pin and parameter gather: ResNet's stem
    conv1 -> bn1 would run unsplit on ungathered weights); the units' insides still may."""
    from jaxcnn.layers import Choices, fusion
    walked, names = [], []

    def walk(children, rngs, params, state, x, *, train, policy, choices, new_state, apply_child):
        walked.append([layer for _, layer in children])
        names.append([name for name, _ in children])
        for (name, layer), r in zip(children, rngs):
            x = apply_child(name, layer, r, params, state, x, train, policy, choices, new_state)
        return x

    monkeypatch.setattr(fusion, "apply_chain", walk)
    model, shape = _model("resnet18")
    plan = _plan(model, LR1, shape, 2, 4)
    state0 = plan.abstract_state  # traced only: shapes are all the jaxpr needs
    x = plan.put_batch(batches(shape, 1)[0])["image"]
    jax.make_jaxpr(lambda p, s, x: plan.step_model.apply(
        p, s, x, train=True, rng=jax.random.PRNGKey(0), choices=Choices(conv_bn="mosaic")))(
        state0.params, state0.state, x)
    top = dict(plan.step_model.children)
    rebuilt = [plan.step_model, top["layer1"], top["layer2"]]  # serials holding split units
    assert plan.spatial.gather_after == "layer2.1"

    def same(a, b):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b))
    assert not [w for w in walked for r in rebuilt if same(w, [c for _, c in r.children])]
    # layer3 and layer4 are not split: their four blocks keep the caller's fusion inside.
    assert names.count(["conv1", "bn1", "relu1", "conv2", "bn2"]) == 4


@pytest.mark.parametrize("policy", [None, "bf16"])
def test_one_units_whole_parameters_live_at_a_time(policy):
    """Each unit gathers its own parameters as it runs and again in the backward, and its
    gradient is reduce-scattered before the units below run theirs: the compiled step's
    temporaries hold about one unit's whole weights and gradient, not the whole model's
    (XLA:CPU left to itself gathers every weight at the start, keeps them for the backward and
    reduces every gradient in one all-reduce at the end: 2.0x the model's weights here).
    Under a bfloat16 policy too: the unit's 16-bit copies of its weights are not kept for
    the backward either (1.4x of the float32 weights before they were)."""
    from jaxcnn.train.state import create_train_state
    from jaxcnn import precision as Pr
    policy = Pr.get_policy(policy) if policy else None
    c, depth = 256, 6
    blocks = []
    for i in range(depth):
        blocks += [(f"conv{i}", L.Conv2D(c, 3, padding=1)), (f"relu{i}", L.Relu())]
    model = L.serial(*blocks, ("pool", L.GlobalAvgPool2D()), ("fc", L.Linear(10)))
    shape = (4, 8, 8, c)
    tx = optax.sgd(0.1)
    abstract = jax.eval_shape(lambda: create_train_state(model, tx, jax.random.PRNGKey(0), shape,
                                                         loss_scale=Pr.make_loss_scale("none")))
    plan = ParallelPlan(make_mesh(1, 1, spatial=4, devices=jax.devices()[:4]), model, shape, abstract,
                        strategy="jit")
    step = plan.wrap_step(make_train_step(plan.step_model, tx, axis_name=plan.step_axis_name,
                                          policy=policy))
    host = {"image": np.zeros(shape, np.float32), "label": np.zeros(4, np.int32)}
    temp = step.lower(plan.abstract_state, plan.put_batch(host)).compile().memory_analysis().temp_size_in_bytes
    weights = depth * 9 * c * c * 4
    assert temp < 0.6 * weights, (temp, weights)


def _twice_used():
    """A leaf layer that uses its weight cast to bfloat16 and as it is: ``x @ bf16(w) + x @ w``."""
    import jax.numpy as jnp

    def init(key, shape):
        return {"w": jax.random.normal(key, (shape[-1], 8))}, {}, shape[:-1] + (8,)

    def apply(params, state, x, **kwargs):
        w = params["w"]
        return x @ w.astype(jnp.bfloat16).astype(jnp.float32) + x @ w, state
    return L.Layer(init, apply, kind="twice_used")


@pytest.mark.parametrize("which", ["conv_bn_relu", "twice_used"])
def test_gathered_unit_under_a_16_bit_policy_has_the_plain_units_gradients(which):
    """The per-unit gather casts a weight to the 16-bit dtype before the unit when casting
    is all the unit does with it (so the residuals hold the cast weights it can drop), and
    never otherwise: gradients bit for bit those of the plain unit (a Conv -> BatchNorm ->
    ReLU block under bf16; a layer that also uses its weight in float32, where casting it
    first would round the second term)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxcnn import precision as Pr
    from jaxcnn.parallel.spatial import _entry_casts, _gathering
    policy = Pr.get_policy("bf16")
    if which == "conv_bn_relu":
        layer = L.serial(("conv", L.Conv2D(8, 3, padding=1)), ("bn", L.BatchNorm()), ("relu", L.Relu()))
    else:
        layer = _twice_used()
    shape = (2, 6, 6, 4)
    params, state, _ = layer.init(jax.random.PRNGKey(0), shape)
    x = jax.random.normal(jax.random.PRNGKey(1), shape)
    mesh = Mesh(np.array(jax.devices()[:1]), ("spatial",))
    gathered = _gathering(layer, jax.tree_util.tree_map(lambda _: NamedSharding(mesh, P()), params))

    def loss(layer):
        def f(p, x):
            y, _ = layer.apply(p, state, x, train=True, policy=policy)
            return (y.astype(np.float32) ** 2).sum()
        return jax.jit(jax.grad(f, argnums=(0, 1)))

    want, got = loss(layer)(params, x), loss(gathered)(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    casts = _entry_casts(lambda w, x: layer.apply(w, state, x, train=True, policy=policy), params, x)
    names = ["/".join(str(k) for k in path) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    cast = {n for n, c in zip(names, casts) if c is not None}
    if which == "twice_used":
        assert cast == set(), cast
    else:  # the convolution's weight and bias go to bfloat16 (BatchNorm's affine stays float32)
        assert any("conv" in n for n in cast), (names, casts)


# ResNet-18 and VGG-11 with the slow tests: small_resnet and small_vgg have their layers at half the
# compilation.
@pytest.mark.parametrize("name", ["small_resnet", pytest.param("resnet18", marks=pytest.mark.slow), "small_vgg",
                                  pytest.param("vgg11", marks=pytest.mark.slow)])
def test_remat_matches_one_device(name):
    """parallel.spatial.remat: every unit computed again in the backward from its input (the
    same dropout masks: vgg11's classifier) gives one device's step."""
    model, shape = _model(name)
    (batch,) = batches(shape, 1, seed=3)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      init(model, LR1, shape))
    plan = ParallelPlan(make_mesh(2, 1, spatial=4, devices=jax.devices()[:8]), model, shape, abstract,
                        strategy="jit", spatial_remat=True)
    _same_as_one_device(plan, model, shape, batch)


def test_remat_keeps_fewer_temporaries():
    """small_resnet at 32x32, batch 4, on 4 spatial shards (split through layer2.0): the compiled
    step's temporaries with parallel.spatial.remat are below 0.9x of those without (616 -> 425
    KiB when written; ResNet-18 at 64x64, whose compilations took 4x as long, 34 -> 29 MiB).  The
    step without remat is test_same_loss_gradients_and_statistics_as_one_device[small_resnet-spatial4]'s
    (the same model, shapes and plan, donate=False): the compilation cache compiles it once for
    both tests."""
    model, shape = _model("small_resnet")
    abstract = _abstract_state(model, LR1, shape)
    temps = {}
    for remat in (False, True):
        plan = ParallelPlan(make_mesh(1, 1, spatial=4, devices=jax.devices()[:4]), model, shape,
                            abstract, strategy="jit", spatial_remat=remat)
        assert plan.spatial.gather_after == "layer2.0"
        step = plan.wrap_step(make_train_step(plan.step_model, LR1, axis_name=plan.step_axis_name), donate=False)
        host = {"image": np.zeros(shape, np.float32), "label": np.zeros(shape[0], np.int32)}
        compiled = step.lower(plan.abstract_state, plan.put_batch(host)).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[True] < 0.9 * temps[False], temps
