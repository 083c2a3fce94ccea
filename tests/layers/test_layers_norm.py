"""BatchNorm, LayerNorm, GroupNorm against float64 numpy references and PyTorch.

Tolerances (float32 layer vs float64 reference on O(1) data): rtol/atol 1e-5
for outputs, 1e-6 relative for running statistics."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn.precision import Policy

KEY = jax.random.key(0)
TOL = dict(rtol=1e-5, atol=1e-5)


def rand(shape, seed=0, loc=0.0, scale=1.0):
    return (loc + scale * np.random.default_rng(seed).standard_normal(shape)).astype(np.float32)


def affine(c, seed=7):
    return {"scale": rand((c,), seed, 1.0, 0.3), "bias": rand((c,), seed + 1, 0.0, 0.3)}


def np_bn_steps(xs, params, momentum, eps=1e-5):
    """PyTorch's BatchNorm2d training recursion, in float64 numpy."""
    c = xs[0].shape[-1]
    mean, var, count, ys = np.zeros(c), np.ones(c), 0, []
    for x in xs:
        x = x.astype(np.float64).reshape(-1, c)
        n = x.shape[0]
        count += 1
        m = momentum if momentum is not None else 1.0 / count
        bm, bv = x.mean(0), x.var(0)
        ys.append((x - bm) / np.sqrt(bv + eps) * params["scale"] + params["bias"])
        mean = (1 - m) * mean + m * bm
        var = (1 - m) * var + m * bv * n / (n - 1)
    return ys, mean, var, count


# ---------------------------------------------------------------- BatchNorm

def test_batch_norm_init():
    layer = L.BatchNorm()
    params, state, out = layer.init(KEY, (2, 4, 4, 3))
    assert out == (2, 4, 4, 3) and layer.kind == "batch_norm"
    np.testing.assert_array_equal(params["scale"], np.ones(3))
    np.testing.assert_array_equal(params["bias"], np.zeros(3))
    np.testing.assert_array_equal(state["mean"], np.zeros(3))
    np.testing.assert_array_equal(state["var"], np.ones(3))
    assert state["count"].shape == () and state["count"].dtype == jnp.int32 and state["count"] == 0
    assert all(v.dtype == jnp.float32 for v in (*params.values(), state["mean"], state["var"]))
    assert layer.config == dict(momentum=0.1, eps=1e-5, axis_name=None)
    with pytest.raises(ValueError, match=r"BatchNorm: expected an input of rank >= 2, got shape \(3,\)"):
        layer.init(KEY, (3,))


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
def test_batch_norm_train_matches_numpy(momentum):
    layer = L.BatchNorm(momentum=momentum)
    xs = [rand((4, 3, 2, 5), seed=i, loc=i, scale=1 + i) for i in range(3)]
    params = affine(5)
    _, state, _ = layer.init(KEY, xs[0].shape)
    step = jax.jit(lambda p, s, x: layer.apply(p, s, x, train=True))
    for x, y_ref in zip(xs, np_bn_steps(xs, params, momentum)[0]):
        y, state = step(params, state, x)
        np.testing.assert_allclose(np.asarray(y).reshape(-1, 5), y_ref, **TOL)
    _, mean, var, count = np_bn_steps(xs, params, momentum)
    np.testing.assert_allclose(state["mean"], mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(state["var"], var, rtol=1e-6, atol=1e-6)
    assert int(state["count"]) == count and state["count"].dtype == jnp.int32
    assert state["mean"].dtype == state["var"].dtype == jnp.float32

    x = rand((2, 3, 2, 5), seed=9)
    y, new_state = layer.apply(params, state, x, train=False)
    assert new_state is state
    ref = (x - mean) / np.sqrt(var + 1e-5) * params["scale"] + params["bias"]
    np.testing.assert_allclose(y, ref, **TOL)


def test_batch_norm_rank2_and_single_value_error():
    layer = L.BatchNorm()
    _, state, _ = layer.init(KEY, (6, 3))
    x = rand((6, 3))
    y, st = layer.apply(affine(3), state, x, train=True)
    ys, mean, var, _ = np_bn_steps([x], affine(3), 0.1)
    np.testing.assert_allclose(y, ys[0], **TOL)
    np.testing.assert_allclose(st["var"], var, rtol=1e-6)
    with pytest.raises(ValueError, match=r"BatchNorm: expected more than 1 value per channel .*\(1, 3\)"):
        layer.apply(affine(3), state, x[:1], train=True)
    with pytest.raises(ValueError, match="momentum"):
        L.BatchNorm(momentum=1.5)


def test_batch_norm_axis_name_uses_global_batch():
    """Synced over 4 devices, the statistics (and n in n/(n-1)) are the global batch's."""
    n_dev = 4
    assert jax.local_device_count() >= n_dev
    x = rand((n_dev * 2, 3, 2, 4), seed=3, loc=2.0)
    params = affine(4)
    synced = L.BatchNorm(axis_name="batch")
    _, state, _ = synced.init(KEY, x.shape)
    y, new_state = jax.pmap(lambda x: synced.apply(params, state, x, train=True),
                            axis_name="batch")(x.reshape(n_dev, 2, 3, 2, 4))
    ys, mean, var, count = np_bn_steps([x], params, 0.1)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 4), ys[0], **TOL)
    for d in range(n_dev):
        np.testing.assert_allclose(new_state["mean"][d], mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new_state["var"][d], var, rtol=1e-6, atol=1e-6)
        assert int(new_state["count"][d]) == count


def test_batch_norm_takes_its_axis_and_backward_from_apply_choices():
    """A BatchNorm built without axis_name syncs over ``choices.axis_name`` (its own
    axis_name wins) and differentiates with ``choices.batch_norm_grad``."""
    n_dev = 4
    assert jax.local_device_count() >= n_dev
    x = rand((n_dev * 2, 3, 2, 4), seed=3, loc=2.0)
    params = affine(4)
    layer = L.BatchNorm()
    _, state, _ = layer.init(KEY, x.shape)
    shards = x.reshape(n_dev, 2, 3, 2, 4)
    ys, mean, var, _ = np_bn_steps([x], params, 0.1)
    for choices in (L.Choices(axis_name="batch"),
                    L.Choices(axis_name="batch", batch_norm_grad="closed_form"),
                    L.Choices(axis_name="batch", batch_norm_grad="autodiff")):
        y, new_state = jax.pmap(lambda x: layer.apply(params, state, x, train=True,
                                                      choices=choices), axis_name="batch")(shards)
        np.testing.assert_allclose(np.asarray(y).reshape(-1, 4), ys[0], **TOL)
        np.testing.assert_allclose(new_state["mean"][0], mean, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(new_state["var"][0], var, rtol=1e-6, atol=1e-6)
    # Without the axis each device has its own statistics.
    y, _ = jax.pmap(lambda x: layer.apply(params, state, x, train=True),
                    axis_name="batch")(shards)
    assert not np.allclose(np.asarray(y).reshape(-1, 4), ys[0], **TOL)
    # The layer's own axis_name wins over the choices' (an unbound name would fail).
    own = L.BatchNorm(axis_name="batch")
    y, _ = jax.pmap(lambda x: own.apply(params, state, x, train=True,
                                        choices=L.Choices(axis_name="unbound")),
                    axis_name="batch")(shards)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 4), ys[0], **TOL)
    # The backward form reaches the op: the one-pass moments, and the explicit affine.
    grad_text = {g: str(jax.make_jaxpr(lambda x: layer.apply(
        params, state, x, train=True, choices=L.Choices(batch_norm_grad=g))[0])(x))
        for g in ("autodiff", "closed_form", "explicit")}
    assert "_moments" not in grad_text["autodiff"] and "_moments" in grad_text["closed_form"]
    assert "_affine_relu" in grad_text["explicit"] and "_affine_relu" not in grad_text[
        "closed_form"]


def test_batch_norm_policy_computes_in_float32():
    layer = L.BatchNorm()
    x = rand((4, 3, 3, 2), loc=3.0).astype(jnp.bfloat16)
    params = affine(2)
    _, state, _ = layer.init(KEY, x.shape)
    policy = Policy(compute_dtype=jnp.bfloat16)
    for train in (True, False):
        y, st = layer.apply(params, state, x, train=train, policy=policy)
        y32, st32 = layer.apply(params, state, x.astype(jnp.float32), train=train)
        assert y.dtype == jnp.bfloat16
        # Computed in float32, rounded once at the end: within half a bf16 ulp.
        np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=2 ** -8, atol=1e-6)
        for k in ("mean", "var"):
            assert st[k].dtype == jnp.float32
            np.testing.assert_allclose(st[k], st32[k], rtol=1e-6)
    # A float32 input under a bf16 policy stays float32.
    y, _ = layer.apply(params, state, x.astype(jnp.float32), train=True, policy=policy)
    assert y.dtype == jnp.float32


def _bn_relu_net():
    return L.serial(("conv", L.Conv2D(6, 3, padding=1)), ("bn", L.BatchNorm()),
                    ("relu", L.Relu()), ("conv2", L.Conv2D(4, 1)), ("bn2", L.BatchNorm()))


@pytest.mark.parametrize("grad", ["explicit", "autodiff"])
def test_batch_norm_then_relu_runs_as_one_in_training(grad):
    """In training a serial's BatchNorm -> ReLU pair is one op (the ReLU's mask recomputed in
    BatchNorm's backward): the same outputs, running statistics and gradients as the two
    layers one after the other; nothing changes in evaluation."""
    net = _bn_relu_net()
    x = jnp.asarray(rand((4, 5, 5, 3), seed=11, loc=0.5))
    params, state, _ = net.init(KEY, x.shape)
    choices = L.Choices(batch_norm_grad=grad)

    def loss(p, model, train=True):
        y, new_state = model.apply(p, state, x, train=train, choices=choices)
        return jnp.sum(jnp.sin(y)), new_state

    def stepwise(p, train=True):  # each child through its own apply
        new_state, h = {}, x
        for name, layer in net.children:
            h, s = layer.apply(p.get(name, {}), state.get(name, {}), h, train=train,
                               choices=choices)
            if s:
                new_state[name] = s
        return jnp.sum(jnp.sin(h)), new_state

    (value, st), grads = jax.value_and_grad(loss, has_aux=True)(params, net)
    (ref, st_ref), grads_ref = jax.value_and_grad(stepwise, has_aux=True)(params)
    np.testing.assert_allclose(value, ref, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((st, grads)), jax.tree.leaves((st_ref, grads_ref))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    folded = str(jax.make_jaxpr(lambda p: loss(p, net)[0])(params))
    assert "name=relu" not in folded  # no separate ReLU: it is inside BatchNorm's op
    assert "name=relu" in str(jax.make_jaxpr(lambda p: loss(p, net, train=False)[0])(params))
    np.testing.assert_allclose(loss(params, net, train=False)[0],
                               stepwise(params, train=False)[0], rtol=1e-6)


def test_batch_norm_keeps_a_16_bit_input_for_its_backward():
    """Under a policy computing BatchNorm in float32 a bfloat16 input goes in as it is: the
    backward keeps it (no float32 copy of the activation), and the result is the cast's."""
    import contextlib
    import io

    from jax.ad_checkpoint import print_saved_residuals
    layer = L.BatchNorm()
    x = jnp.asarray(rand((4, 6, 6, 8), seed=12, loc=1.0), jnp.bfloat16)
    params = affine(8)
    _, state, _ = layer.init(KEY, x.shape)
    policy = Policy(compute_dtype=jnp.bfloat16)
    choices = L.Choices(batch_norm_grad="explicit")

    def f(x):
        return layer.apply(params, state, x, train=True, policy=policy, choices=choices)[0]

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, x)
    saved = out.getvalue()
    assert "bf16[4,6,6,8]" in saved and "f32[4,6,6,8]" not in saved, saved
    y32 = layer.apply(params, state, x.astype(jnp.float32), train=True, choices=choices)[0]
    np.testing.assert_allclose(np.asarray(f(x), np.float32), y32, rtol=2 ** -8, atol=1e-6)


# ---------------------------------------------------------------- LayerNorm / GroupNorm

def np_layer_norm(x, scale, bias, naxes, eps=1e-5):
    x = x.astype(np.float64)
    axes = tuple(range(x.ndim - naxes, x.ndim))
    m, v = x.mean(axes, keepdims=True), x.var(axes, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * scale + bias


def np_group_norm(x, g, scale, bias, eps=1e-5):
    n, *sp, c = x.shape
    xg = x.astype(np.float64).reshape(n, -1, g, c // g)
    m, v = xg.mean((1, 3), keepdims=True), xg.var((1, 3), keepdims=True)
    return ((xg - m) / np.sqrt(v + eps)).reshape(x.shape) * scale + bias


@pytest.mark.parametrize("axes", [-1, (-2, -1), (-3, -2, -1), (3, 2)])
def test_layer_norm_matches_numpy(axes):
    layer = L.LayerNorm(axes=axes)
    x = rand((2, 3, 4, 5), loc=1.0, scale=2.0)
    params, state, out = layer.init(KEY, x.shape)
    naxes = 1 if isinstance(axes, int) else len(axes)
    assert out == x.shape and state == {}
    assert params["scale"].shape == params["bias"].shape == x.shape[4 - naxes:]
    params = {k: rand(v.shape, seed=i, loc=float(k == "scale"), scale=0.3)
              for i, (k, v) in enumerate(params.items())}
    y, _ = layer.apply(params, {}, x)
    np.testing.assert_allclose(y, np_layer_norm(x, params["scale"], params["bias"], naxes), **TOL)


def test_layer_norm_validation():
    with pytest.raises(ValueError, match=r"LayerNorm: axes \(1,\) must be the trailing axes .*\(2, 3, 4, 5\)"):
        L.LayerNorm(axes=(1,)).init(KEY, (2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"LayerNorm: expected an input of rank >= 4, got shape \(3, 4, 5\)"):
        L.LayerNorm(axes=(-3, -2, -1)).init(KEY, (3, 4, 5))
    with pytest.raises(ValueError, match="LayerNorm: axes"):
        L.LayerNorm(axes=())


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_group_norm_matches_numpy(groups):
    layer = L.GroupNorm(groups)
    x = rand((2, 3, 4, 6), loc=-1.0, scale=3.0)
    params, state, out = layer.init(KEY, x.shape)
    assert out == x.shape and state == {} and params["scale"].shape == (6,)
    params = affine(6)
    y, _ = layer.apply(params, {}, x)
    np.testing.assert_allclose(y, np_group_norm(x, groups, params["scale"], params["bias"]), **TOL)
    with pytest.raises(ValueError, match=r"GroupNorm: num_groups=4 must divide .*\(2, 3, 4, 6\)"):
        L.GroupNorm(4).init(KEY, x.shape)


@pytest.mark.parametrize("layer", [L.LayerNorm(), L.GroupNorm(2)])
def test_norm_policy_dtypes(layer):
    x = rand((2, 3, 3, 4), loc=2.0)
    params, _, _ = layer.init(KEY, x.shape)
    policy = Policy(compute_dtype=jnp.bfloat16)
    y, _ = layer.apply(params, {}, x.astype(jnp.bfloat16), policy=policy)
    y32, _ = layer.apply(params, {}, x.astype(jnp.bfloat16).astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y, np.float32), y32, rtol=2 ** -8, atol=1e-6)


# ---------------------------------------------------------------- PyTorch

@pytest.mark.torch
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_matches_torch(momentum):
    torch = pytest.importorskip("torch")
    layer = L.BatchNorm(momentum=momentum, eps=1e-3)
    params = affine(3)
    tbn = torch.nn.BatchNorm2d(3, eps=1e-3, momentum=momentum)
    with torch.no_grad():
        tbn.weight.copy_(torch.from_numpy(params["scale"]))
        tbn.bias.copy_(torch.from_numpy(params["bias"]))
    _, state, _ = layer.init(KEY, (4, 3, 5, 3))
    step = jax.jit(lambda s, x: layer.apply(params, s, x, train=True))
    for i in range(4):
        x = rand((4, 3, 5, 3), seed=10 + i, loc=i - 1.0, scale=0.5 + i)
        y, state = step(state, x)
        yt = tbn.train()(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
        np.testing.assert_allclose(y, yt.detach().numpy(), **TOL)
    np.testing.assert_allclose(state["mean"], tbn.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["var"], tbn.running_var.numpy(), rtol=1e-5, atol=1e-6)
    assert int(state["count"]) == int(tbn.num_batches_tracked) == 4
    x = rand((2, 3, 5, 3), seed=99)
    y, _ = layer.apply(params, state, x)
    yt = tbn.eval()(torch.from_numpy(x).permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    np.testing.assert_allclose(y, yt.detach().numpy(), **TOL)


@pytest.mark.torch
def test_layer_and_group_norm_match_torch():
    torch = pytest.importorskip("torch")
    x = rand((2, 3, 4, 6), loc=1.0, scale=2.0)
    xt = torch.from_numpy(x)
    # LayerNorm over channels (NHWC last axis) and over whole images.
    for axes, shape in [(-1, [6]), ((-3, -2, -1), [3, 4, 6])]:
        params, _, _ = L.LayerNorm(axes=axes, eps=1e-4).init(KEY, x.shape)
        params = {"scale": rand(params["scale"].shape, 1, 1.0, 0.3),
                  "bias": rand(params["bias"].shape, 2, 0.0, 0.3)}
        tln = torch.nn.LayerNorm(shape, eps=1e-4)
        with torch.no_grad():
            tln.weight.copy_(torch.from_numpy(params["scale"]))
            tln.bias.copy_(torch.from_numpy(params["bias"]))
        y, _ = L.LayerNorm(axes=axes, eps=1e-4).apply(params, {}, x)
        np.testing.assert_allclose(y, tln(xt).detach().numpy(), **TOL)
    params = affine(6)
    tgn = torch.nn.GroupNorm(3, 6)
    with torch.no_grad():
        tgn.weight.copy_(torch.from_numpy(params["scale"]))
        tgn.bias.copy_(torch.from_numpy(params["bias"]))
    y, _ = L.GroupNorm(3).apply(params, {}, x)
    yt = tgn(xt.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)
    np.testing.assert_allclose(y, yt.detach().numpy(), **TOL)
