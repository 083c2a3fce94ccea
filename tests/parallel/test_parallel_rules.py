"""Logical axis names of parameters and the rule table that maps them to mesh axes."""
import optax
import pytest
from jax.sharding import PartitionSpec as P

from jaxcnn import layers as L
from jaxcnn import models, parallel
from jaxcnn.parallel import rules as R

from _helpers import BN_SHAPE, MNIST_SHAPE, bn_net, init, plan_for


def test_logical_axes_follow_layer_kinds():
    params_axes, state_axes = R.logical_axes(bn_net(), BN_SHAPE)
    assert params_axes["conv1"] == {"w": ("kh", "kw", "in", "out")}
    assert params_axes["bn1"] == {"scale": ("out",), "bias": ("out",)}
    assert params_axes["block"]["downsample"]["0"] == {"w": ("kh", "kw", "in", "out")}
    assert params_axes["fc"] == {"w": ("in", "out"), "b": ("out",)}
    assert state_axes["bn1"] == {"mean": ("out",), "var": ("out",), "count": ()}
    assert state_axes["block"]["downsample"]["1"]["count"] == ()


def test_multi_axis_layer_norm_and_unknown_leaves_are_replicated():
    net = L.serial(("conv", L.Conv2D(4, 3)), ("ln", L.LayerNorm(axes=(-3, -2, -1))),
                   ("gn", L.GroupNorm(2)), ("flat", L.Flatten()), ("fc", L.Linear(3, use_bias=False)))
    params_axes, _ = R.logical_axes(net, (2, 6, 6, 1))
    assert params_axes["ln"] == {"scale": (None, None, None), "bias": (None, None, None)}
    assert params_axes["gn"] == {"scale": ("out",), "bias": ("out",)}
    assert params_axes["fc"] == {"w": ("in", "out")}


def test_partition_spec_rules():
    mesh = parallel.make_mesh(2, 4)
    rules = R.merge_rules()
    conv = ("kh", "kw", "in", "out")
    assert R.partition_spec(conv, (3, 3, 8, 16), mesh, rules) == P(None, None, None, "model")
    # 10 classes do not split over 4 devices: the dimension stays whole.
    assert R.partition_spec(("in", "out"), (128, 10), mesh, rules) == P(None, None)
    row = R.merge_rules({"in": "model", "out": None})
    assert R.partition_spec(conv, (3, 3, 8, 16), mesh, row) == P(None, None, "model", None)
    # One mesh axis can split only one dimension: "out" loses to the earlier "in".
    both = R.merge_rules({"in": "model"})
    assert R.partition_spec(conv, (3, 3, 8, 16), mesh, both) == P(None, None, "model", None)
    # A size-1 mesh axis shards nothing.
    assert R.partition_spec(conv, (3, 3, 8, 16), parallel.make_mesh(8, 1), rules) == P(None, None, None, None)


def test_unknown_rule_names_are_value_errors_naming_the_key():
    with pytest.raises(ValueError, match=r"^rules.channels: unknown logical axis 'channels'"):
        R.merge_rules({"channels": "model"})
    with pytest.raises(ValueError, match="^rules.out: expected 'data', 'model' or null"):
        R.merge_rules({"out": "pipeline"})


def test_fsdp_splits_large_arrays_over_data_on_their_largest_free_dimension():
    mesh = parallel.make_mesh(2, 4)
    rules = R.merge_rules()
    big = (3, 3, 64, 128)
    assert R.partition_spec(("kh", "kw", "in", "out"), big, mesh, rules, fsdp=True) == \
        P(None, None, "data", "model")
    assert R.partition_spec(("in", "out"), (9216, 128), parallel.make_mesh(8, 1), rules, fsdp=True) == \
        P("data", None)
    small = (3, 3, 8, 16)  # below FSDP_MIN_SIZE
    assert R.partition_spec(("kh", "kw", "in", "out"), small, mesh, rules, fsdp=True) == \
        P(None, None, None, "model")


def test_optimizer_moments_follow_their_params():
    model, tx = models.get("mnist_cnn"), optax.adam(1e-3)
    plan = plan_for(model, tx, MNIST_SHAPE, strategy="jit", data=2, model_axis=4, fsdp=True)
    sh = plan.state_shardings
    assert sh.params["fc1"]["w"].spec == P("data", "model")
    assert sh.params["conv2"]["w"].spec == P(None, None, "data", "model")
    adam = sh.opt_state[0]
    assert adam.mu["fc1"]["w"].spec == P("data", "model") == adam.nu["fc1"]["w"].spec
    assert adam.mu["fc2"]["b"].spec == P(None)
    assert adam.count.spec == P()
    assert sh.step.spec == P() and sh.rng.spec == P()
    state = plan.shard_state(init(model, tx, MNIST_SHAPE))
    w = state.opt_state[0].mu["fc1"]["w"]
    assert w.shape == (9216, 128)
    assert {s.data.shape for s in w.addressable_shards} == {(9216 // 2, 128 // 4)}


def test_pmap_and_jit_refuse_what_they_cannot_run():
    model, tx = bn_net(), optax.sgd(0.1)
    with pytest.raises(ValueError, match="^strategy: pmap runs single-process data"):
        plan_for(model, tx, BN_SHAPE, strategy="pmap", model_axis=2)
    with pytest.raises(ValueError, match="^sync_batch_norm: false needs strategy"):
        plan_for(model, tx, BN_SHAPE, strategy="jit", sync_batch_norm=False)
    with pytest.raises(ValueError, match="global batch 12 does not divide over the 8"):
        plan_for(model, tx, (12,) + BN_SHAPE[1:])
