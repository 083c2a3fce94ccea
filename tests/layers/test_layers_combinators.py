"""serial / residual / parallel: naming, omission of empty trees, record_layers
paths, rng splitting, shape checks, jit, gradients (finite differences in
float64) and policy casting."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jaxcnn import layers as L
from jaxcnn.layers.base import record_layers, split_rng
from jaxcnn.precision import Policy

KEY = jax.random.key(0)


def shapes(tree):
    return jax.tree_util.tree_map(lambda a: tuple(a.shape), tree)


def abstract_init(layer, input_shape):
    box = {}

    def f(k):
        p, s, box["out"] = layer.init(k, input_shape)
        return p, s
    p, s = jax.eval_shape(f, KEY)
    return shapes(p), shapes(s), box["out"]


def rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def materialize(layer, input_shape, seed=0):
    """(params, state, output_shape) with numpy-random params of init's shapes.

    Compiling the PRNG for every test is slow on a busy 2-core machine; the
    real init is covered by test_rng_* here and test_layers_initializers.py.
    The state comes from init itself (its PRNG work is dead code under jit)."""
    rng = np.random.default_rng(seed)
    p = jax.eval_shape(lambda k: layer.init(k, input_shape)[0], KEY)
    p = jax.tree_util.tree_map(lambda a: (0.5 * rng.standard_normal(a.shape)).astype(a.dtype), p)
    state = jax.jit(lambda k: layer.init(k, input_shape)[1])(KEY)
    return p, state, abstract_init(layer, input_shape)[2]


def basic_block(stride=1, cin=4, cout=4):
    downsample = None
    if stride != 1 or cin != cout:
        downsample = L.serial(L.Conv2D(cout, 1, stride=stride, use_bias=False), L.BatchNorm())
    return L.residual(("conv1", L.Conv2D(cout, 3, stride=stride, padding=1, use_bias=False)),
                      ("bn1", L.BatchNorm()), ("relu", L.Relu()),
                      ("conv2", L.Conv2D(cout, 3, padding=1, use_bias=False)),
                      ("bn2", L.BatchNorm()),
                      shortcut=downsample, shortcut_name="downsample", activation=L.Relu())


# ---------------------------------------------------------------- naming

def test_serial_names_and_empty_trees_omitted():
    net = L.serial(L.Conv2D(3, 3), L.Relu(), L.BatchNorm(), L.Flatten(), ("fc", L.Linear(2)))
    p, s, out = abstract_init(net, (2, 5, 5, 1))
    assert p == {"0": {"w": (3, 3, 1, 3), "b": (3,)}, "2": {"scale": (3,), "bias": (3,)},
                 "fc": {"w": (27, 2), "b": (2,)}}
    assert s == {"2": {"mean": (3,), "var": (3,), "count": ()}}
    assert out == (2, 2)
    assert [n for n, _ in net.children] == ["0", "1", "2", "3", "fc"]
    assert net.kind == "serial"
    assert abstract_init(L.serial(L.Relu(), L.Flatten()), (2, 3, 3, 1)) == ({}, {}, (2, 9))
    assert abstract_init(L.serial(), (2, 3)) == ({}, {}, (2, 3))


def test_residual_basic_block_names_and_paths():
    model = L.serial(("stem", L.Conv2D(4, 3, padding=1)),
                     ("layer1", L.serial(basic_block(2, 4, 8), basic_block(1, 8, 8))))
    with record_layers() as records:
        p, s, out = abstract_init(model, (2, 8, 8, 3))
    assert out == (2, 4, 4, 8)
    assert set(p["layer1"]["0"]) == {"conv1", "bn1", "conv2", "bn2", "downsample"}
    assert set(p["layer1"]["0"]["downsample"]) == {"0", "1"}
    assert set(p["layer1"]["1"]) == {"conv1", "bn1", "conv2", "bn2"}
    assert p["layer1"]["0"]["downsample"]["0"] == {"w": (1, 1, 4, 8)}
    assert set(s["layer1"]["0"]) == {"bn1", "bn2", "downsample"}
    paths = [(r.path, r.kind) for r in records]
    assert paths == [
        ("stem", "conv2d"),
        ("layer1.0.conv1", "conv2d"), ("layer1.0.bn1", "batch_norm"), ("layer1.0.relu", "relu"),
        ("layer1.0.conv2", "conv2d"), ("layer1.0.bn2", "batch_norm"),
        ("layer1.0.downsample.0", "conv2d"), ("layer1.0.downsample.1", "batch_norm"),
        ("layer1.0.activation", "relu"),
        ("layer1.1.conv1", "conv2d"), ("layer1.1.bn1", "batch_norm"), ("layer1.1.relu", "relu"),
        ("layer1.1.conv2", "conv2d"), ("layer1.1.bn2", "batch_norm"),
        ("layer1.1.activation", "relu"),
    ]
    rec = records[6]
    assert rec.input_shape == (2, 8, 8, 4) and rec.output_shape == (2, 4, 4, 8)
    block = model.children[1][1].children[0][1]
    assert block.kind == "residual" and block.config == {"shortcut_name": "downsample"}
    assert [n for n, _ in block.children] == ["conv1", "bn1", "relu", "conv2", "bn2",
                                              "downsample", "activation"]


def test_bad_names_and_items():
    with pytest.raises(ValueError, match="serial: duplicate child name 'a'"):
        L.serial(("a", L.Relu()), ("a", L.Tanh()))
    with pytest.raises(ValueError, match="serial: duplicate child name '1'"):
        L.serial(L.Relu(), L.Relu(), ("1", L.Tanh()))
    with pytest.raises(ValueError, match="residual: duplicate child name 'shortcut'"):
        L.residual(("shortcut", L.Relu()), shortcut=L.Identity())
    with pytest.raises(ValueError, match="parallel: duplicate"):
        L.parallel(("x", L.Relu()), ("x", L.Relu()))
    with pytest.raises(ValueError, match="without '.'"):
        L.serial(("a.b", L.Relu()))
    with pytest.raises(TypeError, match="serial: item 1 must be a Layer"):
        L.serial(L.Relu(), lambda x: x)
    with pytest.raises(ValueError, match="parallel: combine"):
        L.parallel(L.Relu(), combine="mul")
    with pytest.raises(ValueError, match="residual: needs at least one"):
        L.residual()


def test_child_init_error_names_its_path():
    model = L.serial(("body", L.serial(L.Conv2D(4, 3), ("bad", L.Conv2D(4, 3, groups=3)))))
    with pytest.raises(ValueError, match="Conv2D: groups=3") as info:
        abstract_init(model, (1, 8, 8, 3))
    notes = [n for n in info.value.__notes__ if n.startswith("while initialising")]
    assert notes == ["while initialising layer 'body.bad' with input shape (1, 6, 6, 4)"]


# ---------------------------------------------------------------- values

def test_residual_and_parallel_values():
    conv, bn = L.Conv2D(4, 3, padding=1), L.BatchNorm()
    sc = L.Conv2D(4, 1)
    block = L.residual(conv, bn, shortcut=sc, activation=L.Tanh())
    x = rand((2, 5, 5, 3))
    params, state, out = materialize(block, x.shape)
    assert set(params) == {"0", "1", "shortcut"} and set(state) == {"1"} and out == x.shape[:3] + (4,)
    y, new_state = block.apply(params, state, x, train=True)
    h, bn_state = bn.apply(params["1"], state["1"], conv.apply(params["0"], {}, x)[0], train=True)
    ref = np.tanh(h + sc.apply(params["shortcut"], {}, x)[0])
    np.testing.assert_allclose(y, ref, rtol=1e-6, atol=1e-6)
    jax.tree_util.tree_map(np.testing.assert_array_equal, new_state, {"1": bn_state})

    ident = L.residual(L.Tanh())
    y, st = ident.apply({}, {}, x)
    np.testing.assert_allclose(y, np.tanh(x) + x, rtol=1e-6)
    assert st == {} and ident.init(KEY, x.shape) == ({}, {}, x.shape)

    par = L.parallel(L.Conv2D(2, 1), ("pool", L.MaxPool2D(3, 1, 1)), L.Relu())
    params, state, out = materialize(par, x.shape)
    assert set(params) == {"0"} and state == {} and out == (2, 5, 5, 8)
    y, _ = par.apply(params, state, x)
    parts = [L.Conv2D(2, 1).apply(params["0"], {}, x)[0], L.MaxPool2D(3, 1, 1).apply({}, {}, x)[0],
             np.maximum(x, 0)]
    np.testing.assert_allclose(y, np.concatenate(parts, -1), rtol=1e-6, atol=1e-6)

    add = L.parallel(L.Tanh(), L.Identity(), L.Sigmoid(), combine="add")
    y, _ = add.apply({}, {}, x)
    assert add.init(KEY, x.shape)[2] == x.shape
    np.testing.assert_allclose(y, np.tanh(x) + x + 1 / (1 + np.exp(-x)), rtol=1e-6, atol=1e-6)


def test_shape_mismatch_errors():
    with pytest.raises(ValueError, match=r"main branch output \(1, 4, 4, 5\) does not match "
                                         r"shortcut output \(1, 4, 4, 3\)"):
        abstract_init(L.residual(L.Conv2D(5, 1)), (1, 4, 4, 3))
    with pytest.raises(ValueError, match="parallel at '': cannot concat"):
        abstract_init(L.parallel(L.Conv2D(5, 3), L.Identity()), (1, 4, 4, 3))
    with pytest.raises(ValueError, match="cannot add"):
        abstract_init(L.parallel(L.Conv2D(5, 1), L.Identity(), combine="add"), (1, 4, 4, 3))


# ---------------------------------------------------------------- rng

def test_rng_splitting_is_deterministic_and_per_child():
    net = L.serial(L.Dropout(0.5), L.Relu(), L.Dropout(0.5))
    x = np.ones((1, 256), np.float32)
    rng = jax.random.key(3)
    y1, _ = net.apply({}, {}, x, train=True, rng=rng)
    y2, _ = net.apply({}, {}, x, train=True, rng=rng)
    np.testing.assert_array_equal(y1, y2)
    # child i gets split_rng(rng, n)[i]
    k0, _, k2 = split_rng(rng, 3)
    d = L.Dropout(0.5)
    ref = d.apply({}, {}, d.apply({}, {}, x, train=True, rng=k0)[0], train=True, rng=k2)[0]
    np.testing.assert_array_equal(y1, ref)
    assert not np.array_equal(d.apply({}, {}, x, train=True, rng=k0)[0],
                              d.apply({}, {}, x, train=True, rng=k2)[0])

    # init: same key -> same params; two identical children get different weights
    twins = L.serial(L.Linear(8), L.Linear(8))
    p1, _, _ = twins.init(KEY, (1, 8))
    p2, _, _ = twins.init(KEY, (1, 8))
    jax.tree_util.tree_map(np.testing.assert_array_equal, p1, p2)
    assert not np.array_equal(p1["0"]["w"], p1["1"]["w"])
    np.testing.assert_array_equal(p1["1"]["w"], L.Linear(8).init(split_rng(KEY, 2)[1], (1, 8))[0]["w"])


# ---------------------------------------------------------------- jit, grads, policy

def small_net():
    return L.serial(L.Conv2D(3, 3, padding=1), L.BatchNorm(), L.Tanh(),
                    L.residual(L.Conv2D(3, 3, padding=1), L.GroupNorm(3), activation=L.Silu()),
                    L.AvgPool2D(2), L.Flatten(), L.Linear(2))


def test_jit_matches_eager_and_state_updates():
    net = small_net()
    x = rand((2, 4, 4, 2))
    params, state, out = materialize(net, x.shape)
    y, st = net.apply(params, state, x, train=True)
    yj, stj = jax.jit(lambda p, s, x: net.apply(p, s, x, train=True))(params, state, x)
    assert y.shape == out == (2, 2)
    np.testing.assert_allclose(yj, y, rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), stj, st)
    assert int(st["1"]["count"]) == 1
    assert jax.tree_util.tree_structure(st) == jax.tree_util.tree_structure(state)
    _, st_eval = net.apply(params, state, x)
    jax.tree_util.tree_map(np.testing.assert_array_equal, st_eval, state)


def test_gradients_match_finite_differences():
    net = small_net()
    x = rand((2, 4, 4, 2))
    params, state, _ = materialize(net, x.shape)
    with jax.enable_x64(True):
        params = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64), params)
        x64 = x.astype(np.float64)

        @jax.jit
        def loss(p, x):
            y, _ = net.apply(p, state, x, train=True)
            return jnp.sum(jnp.sin(y))
        check_grads(loss, (params, x64), order=1, modes=["rev"], eps=1e-6, atol=1e-6, rtol=1e-5)
        g = jax.grad(loss)(params, x64)
        assert all(float(jnp.abs(v).sum()) > 0 for v in jax.tree_util.tree_leaves(g))


def test_policy_through_combinators():
    """Output and state dtypes under a bfloat16 policy: traced only (jax.eval_shape gives the
    dtypes the applies return, without compiling each of their eager ops)."""
    policy = Policy(compute_dtype=jnp.bfloat16)
    x = rand((2, 4, 4, 4))
    block = basic_block()
    params, state, _ = materialize(block, x.shape)
    y, st = jax.eval_shape(lambda: block.apply(params, state, x, train=True, policy=policy))
    assert y.dtype == jnp.bfloat16  # identity shortcut (float32 x) cast before the sum
    assert st["bn1"]["mean"].dtype == jnp.float32
    par = L.parallel(L.BatchNorm(), L.Conv2D(2, 1))
    params, state, _ = materialize(par, x.shape)
    y, _ = jax.eval_shape(lambda: par.apply(params, state, x, policy=policy))
    assert y.dtype == jnp.bfloat16
    y, _ = jax.eval_shape(lambda: par.apply(params, state, x))
    assert y.dtype == jnp.float32


def test_public_names():
    for name in ["Layer", "record_layers", "Conv2D", "ConvTranspose2D", "Linear", "BatchNorm",
                 "LayerNorm", "GroupNorm", "MaxPool2D", "AvgPool2D", "AdaptiveAvgPool2D",
                 "GlobalAvgPool2D", "Flatten", "Identity", "Dropout", "Relu", "Relu6", "LeakyRelu",
                 "Elu", "Gelu", "Silu", "Hardswish", "Sigmoid", "Tanh", "Softmax", "LogSoftmax",
                 "serial", "residual", "parallel", "initializers"]:
        assert name in L.__all__ and hasattr(L, name)
