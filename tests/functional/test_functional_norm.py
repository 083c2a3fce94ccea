"""Normalisation ops against numpy float64 references and PyTorch, incl. synced batch stats."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from hypothesis import given, settings, strategies as st
from jax.test_util import check_grads

from jaxcnn import functional as F
from numeric import assert_close

RTOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}   # relative to max(|expected|, 1)
GRAD_RTOL = 1e-5
NUMERIC_GRAD_TOL = 2e-2


def normalise_ref(x, axes, eps):
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=axes, keepdims=True)
    return (x - mean) / np.sqrt(var + eps), mean, var


def data(seed, shape, offset=3.0):
    # A non-zero mean makes variance bugs (E[x^2] cancellation, missing centring) visible.
    return (np.random.default_rng(seed).standard_normal(shape) * 2 + offset).astype(np.float32)


def test_batch_norm_inference_form():
    x, mean, var = data(0, (2, 3, 3, 4)), data(1, (4,)), np.abs(data(2, (4,)))
    scale, bias = data(3, (4,)), data(4, (4,))
    y = F.batch_norm(x, mean, var, scale, bias, eps=1e-3)
    expected = (x.astype(np.float64) - mean) / np.sqrt(var.astype(np.float64) + 1e-3) * scale + bias
    assert_close(y, expected, RTOL[jnp.float32])
    assert_close(F.batch_norm(x, mean, var), (x - mean.astype(np.float64)) / np.sqrt(var + 1e-5),
                 RTOL[jnp.float32])


GRADS = pytest.mark.parametrize("grad", F.BATCH_NORM_GRADS)


@GRADS
def test_batch_norm_train_statistics_and_output(grad):
    x, scale, bias = data(5, (4, 5, 3, 6)), data(6, (6,)), data(7, (6,))
    y, mean, var = F.batch_norm_train(x, scale, bias, eps=1e-5, grad=grad)
    z, m, v = normalise_ref(x, (0, 1, 2), 1e-5)
    assert mean.dtype == var.dtype == jnp.float32
    assert_close(mean, m.ravel(), RTOL[jnp.float32])
    assert_close(var, v.ravel(), RTOL[jnp.float32])           # biased variance
    assert_close(y, z * scale + bias, RTOL[jnp.float32])


@GRADS
def test_batch_norm_train_bf16_output_dtype_and_float32_stats(grad):
    x = data(8, (8, 4, 4, 3))
    y, mean, var = F.batch_norm_train(jnp.asarray(x, jnp.bfloat16), grad=grad)
    assert y.dtype == jnp.bfloat16 and mean.dtype == jnp.float32
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    z, m, _ = normalise_ref(xb, (0, 1, 2), 1e-5)
    assert_close(mean, m.ravel(), RTOL[jnp.float32])
    assert_close(y, z, RTOL[jnp.bfloat16])


@GRADS
def test_batch_norm_train_synced_under_vmap_equals_whole_batch(grad):
    x = data(9, (4, 3, 5, 5, 2))           # 4 "devices" x 3 images each
    # jitted: one program each instead of a compilation per eager op; vmap's axis is traced
    # the same way
    per_device = jax.jit(jax.vmap(lambda xi: F.batch_norm_train(xi, axis_name="batch", grad=grad),
                                  axis_name="batch"))
    y, mean, var = per_device(jnp.asarray(x))
    z, m, v = normalise_ref(x.reshape(12, 5, 5, 2), (0, 1, 2), 1e-5)
    for d in range(4):
        assert_close(mean[d], m.ravel(), RTOL[jnp.float32])
        assert_close(var[d], v.ravel(), RTOL[jnp.float32])
    assert_close(y.reshape(12, 5, 5, 2), z, RTOL[jnp.float32])
    # Without the axis name each device would normalise with its own statistics.
    _, local_mean, _ = jax.jit(jax.vmap(F.batch_norm_train))(jnp.asarray(x))
    assert np.max(np.abs(np.asarray(local_mean) - m.ravel())) > 1e-2


@GRADS
def test_batch_norm_train_synced_under_shard_map_with_gradients(grad):
    devices = jax.devices()[:4]
    assert len(devices) == 4, "conftest asks for 8 host devices"
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    x, scale = jnp.asarray(data(10, (8, 3, 3, 5))), jnp.asarray(data(11, (5,)))
    g = jnp.asarray(data(12, (8, 3, 3, 5), offset=0.0))

    def sharded(x, scale):
        return jax.shard_map(
            lambda x, s: F.batch_norm_train(x, s, axis_name="data", grad=grad), mesh=mesh,
            in_specs=(P("data"), P()), out_specs=(P("data"), P(), P()))(x, scale)

    def whole(x, scale):
        return F.batch_norm_train(x, scale, grad="autodiff")

    def outputs_and_grads(fn):  # one compiled program per function, run for each cotangent
        return jax.jit(lambda x, scale, cts: (lambda out, pull: (out, pull(cts)))(
            *jax.vjp(fn, x, scale)))

    sharded_run, whole_run = outputs_and_grads(sharded), outputs_and_grads(whole)
    # Cotangents for the statistics too: replicated outputs (check_vma on), so each
    # device's copy of the cotangent is the total, not a share to be summed.
    dmean, dvar = jnp.asarray(data(41, (5,), 0.0)), jnp.asarray(data(42, (5,), 0.0))
    for cts in ((g, jnp.zeros((5,)), jnp.zeros((5,))), (g, dmean, dvar),
                (jnp.zeros_like(g), dmean, jnp.zeros((5,)))):
        (out, grads), (out_ref, grads_ref) = sharded_run(x, scale, cts), whole_run(x, scale, cts)
        for a, b in zip(out, out_ref):
            assert_close(a, b, RTOL[jnp.float32])
        for a, b in zip(grads, grads_ref):
            assert_close(a, b, 1e-4)


def _bn_vjp(grad, x, scale, bias, cts, axis_name=None):
    (y, mean, var), vjp = jax.vjp(
        lambda x, s, b: F.batch_norm_train(x, s, b, eps=1e-3, axis_name=axis_name, grad=grad),
        x, scale, bias)
    return (y, mean, var), vjp(cts)


ONE_PASS = pytest.mark.parametrize("form", ["explicit", "closed_form"])


@jax.jit(static_argnames=("grad", "relu"))
def _bn_train_and_pullback(x, params, cts, *, grad, relu):
    """``F.batch_norm_train``'s outputs and its VJP of ``cts``: one compiled program per form,
    geometry and options (shared by the examples and, for "autodiff", by both forms) instead of
    a compile per eager op; the custom VJP is traced the same way."""
    out, pull = jax.vjp(lambda *a: F.batch_norm_train(*a, eps=1e-3, grad=grad, relu=relu),
                        x, *params)
    return out, pull(cts)


@ONE_PASS
@settings(max_examples=12, deadline=None)
@given(shape=st.sampled_from([(7, 3), (2, 3, 5, 4), (3, 1, 4, 9), (5, 2, 2, 1)]),
       offset=st.sampled_from([0.0, 3.0, -50.0]), affine=st.booleans(), relu=st.booleans(),
       seed=st.integers(0, 2**16))
def test_batch_norm_one_pass_forms_match_autodiff_with_statistics_cotangents(
        form, shape, offset, affine, relu, seed):
    """Every output's cotangent, the running-statistics ones included, against JAX's own
    derivative of the two-pass formula (float32, 1e-4 relative to the largest gradient),
    with and without the ReLU folded in."""
    c = shape[-1]
    x = jnp.asarray(data(seed, shape, offset))
    params = (jnp.asarray(data(seed + 1, (c,))), jnp.asarray(data(seed + 2, (c,)))) \
        if affine else ()
    cts = (jnp.asarray(data(seed + 3, shape, 0.0)), jnp.asarray(data(seed + 4, (c,), 0.0)),
           jnp.asarray(data(seed + 5, (c,), 0.0)))

    def run(grad):
        return _bn_train_and_pullback(x, params, cts, grad=grad, relu=relu)
    (out_c, grads_c), (out_a, grads_a) = run(form), run("autodiff")
    for a, b in zip(out_c, out_a):
        assert_close(a, b, RTOL[jnp.float32])
    for a, b in zip(grads_c, grads_a):
        assert_close(a, b, 1e-4)


@GRADS
def test_batch_norm_train_gradient_of_a_synced_vmap(grad):
    """``grad(vmap(f, axis_name))``: the backward runs outside the mapped axis, so no
    collective may hide in a custom VJP; the gradient equals the whole batch's."""
    x = jnp.asarray(data(43, (4, 3, 3, 3, 2)))
    w = jnp.asarray(data(44, x.shape, 0.0))

    def per_device(x):
        y, mean, var = jax.vmap(lambda xi: F.batch_norm_train(xi, axis_name="b", grad=grad),
                                axis_name="b")(x)
        return jnp.sum(jnp.sin(y) * w) + jnp.sum(mean[0] * var[0])

    def whole(x):
        y, mean, var = F.batch_norm_train(x.reshape(12, 3, 3, 2), grad="autodiff")
        return jnp.sum(jnp.sin(y).reshape(x.shape) * w) + jnp.sum(mean * var)

    # jitted: one program each instead of an eager op at a time; vmap's axis and the
    # custom VJP are traced the same way
    assert_close(jax.jit(jax.grad(per_device))(x), jax.jit(jax.grad(whole))(x), 1e-4)


@ONE_PASS
def test_batch_norm_one_pass_bf16_gradients_against_float32(form):
    x = data(31, (4, 6, 6, 8), 2.0)
    scale, bias, g = data(32, (8,)), data(33, (8,)), data(34, x.shape, 0.0)
    zeros = jnp.zeros((8,))
    _, (dx16, ds16, db16) = _bn_vjp(form, jnp.asarray(x, jnp.bfloat16), scale, bias,
                                    (jnp.asarray(g, jnp.bfloat16), zeros, zeros))
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32)
    gb = np.asarray(jnp.asarray(g, jnp.bfloat16), np.float32)
    _, (dx, ds, db) = _bn_vjp("autodiff", xb, scale, bias, (gb, zeros, zeros))
    assert dx16.dtype == jnp.bfloat16
    assert_close(dx16, dx, RTOL[jnp.bfloat16])
    assert_close(ds16, ds, 1e-4)         # the sums are taken in float32
    assert_close(db16, db, 1e-4)


@ONE_PASS
def test_batch_norm_one_pass_statistics_survive_a_large_mean(form):
    """One read of x gives both statistics by summing about a per-channel shift: without
    it, E[x**2] - E[x]**2 at mean 1e4 and variance ~1 loses every digit in float32.  The
    shift averages the first rows, so one outlying first row barely moves it."""
    x = data(35, (16, 8, 8, 3), 0.0) / 2 + 1e4
    _, mean, var = F.batch_norm_train(x, grad=form)
    _, m, v = normalise_ref(x, (0, 1, 2), 1e-5)
    np.testing.assert_allclose(np.asarray(mean), m.ravel(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(var), v.ravel(), rtol=1e-3)
    x = data(36, (4096, 2), 0.0)
    x[0] = 3e3  # 3,000 standard deviations out
    _, _, var = F.batch_norm_train(x, grad=form)
    _, _, v = normalise_ref(x, (0,), 1e-5)
    np.testing.assert_allclose(np.asarray(var), v.ravel(), rtol=1e-4)


@ONE_PASS
def test_batch_norm_one_pass_synced_like_the_trainer_with_statistics_cotangents(form):
    """Under the trainer's ``shard_map(check_vma=False)`` the per-device gradients of a
    loss that also uses the synced statistics add up to the whole batch's (each device
    holding a quarter of the statistics' terms: without the check, cotangents of the
    replicated statistics are per device)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    x, scale, bias = (jnp.asarray(data(36, (8, 3, 3, 5))), jnp.asarray(data(37, (5,))),
                      jnp.asarray(data(38, (5,))))
    w = jnp.asarray(data(39, x.shape, 0.0))

    def loss(y, mean, var):
        return jnp.sum(jnp.sin(y) * w) + jnp.sum(mean * jnp.arange(5.0)) + jnp.sum(var ** 2)

    def per_device(x, s, b, w_):
        y, mean, var = F.batch_norm_train(x, s, b, axis_name="data", grad=form)
        part = jnp.sum(jnp.sin(y) * w_)
        return (part + (jnp.sum(mean * jnp.arange(5.0)) + jnp.sum(var ** 2)) / 4)[None]

    def sharded(x, s, b):
        return jnp.sum(jax.shard_map(per_device, mesh=mesh, in_specs=(P("data"), P(), P(), P("data")),
                                     out_specs=P("data"), check_vma=False)(x, s, b, w))

    def whole(x, s, b):
        return loss(*F.batch_norm_train(x, s, b, grad="autodiff"))

    (value, grads), (ref, grads_ref) = (
        jax.jit(jax.value_and_grad(f, (0, 1, 2)))(x, scale, bias) for f in (sharded, whole))
    assert_close(value, ref, RTOL[jnp.float32])
    for a, b in zip(grads, grads_ref):
        assert_close(a, b, 1e-4)


def test_batch_norm_grad_argument_picks_the_form():
    x = jnp.asarray(data(40, (2, 3, 3, 4)))

    def names(fn):
        return str(jax.make_jaxpr(fn)(x))

    assert "_affine_relu" not in names(lambda x: F.batch_norm_train(x, grad="autodiff")[0])
    assert "custom_vjp" not in names(lambda x: F.batch_norm_train(x, grad="autodiff")[0])
    closed = names(lambda x: F.batch_norm_train(x, grad="closed_form")[0])
    assert "_moments" in closed and "_affine_relu" not in closed
    explicit = names(lambda x: F.batch_norm_train(x, grad="explicit")[0])
    assert "_moments" in explicit and "_affine_relu" in explicit
    # On the CPU "auto" is the explicit form (measured faster there: docs/BENCHMARKS.md).
    assert names(lambda x: F.batch_norm_train(x)[0]) == explicit
    with pytest.raises(ValueError, match=r"batch_norm_train: grad must be .*'fused'"):
        F.batch_norm_train(x, grad="fused")


def test_layer_norm_axes_and_affine():
    # Each call jitted (axes and eps static): one program per case, not an eager op at a time.
    layer_norm = jax.jit(F.layer_norm, static_argnames=("axes", "eps"))
    x = data(13, (2, 4, 3, 5))
    scale, bias = data(14, (5,)), data(15, (5,))
    z, _, _ = normalise_ref(x, (3,), 1e-5)
    assert_close(layer_norm(x, scale, bias), z * scale + bias, RTOL[jnp.float32])
    s3, b3 = data(16, (4, 3, 5)), data(17, (4, 3, 5))
    z, _, _ = normalise_ref(x, (1, 2, 3), 1e-6)
    assert_close(layer_norm(x, s3, b3, axes=(1, 2, -1), eps=1e-6), z * s3 + b3, RTOL[jnp.float32])
    # Non-trailing axes: the parameters broadcast over the others.
    s1 = data(18, (4, 3))
    z, _, _ = normalise_ref(x, (1, 2), 1e-5)
    assert_close(layer_norm(x, s1, axes=(2, 1)), z * s1[None, :, :, None], RTOL[jnp.float32])


def test_group_norm_matches_reference():
    x = data(19, (2, 3, 4, 6))
    scale, bias = data(20, (6,)), data(21, (6,))
    # Channel c is in group c // (C / G): reshape the channel axis as (G, C / G).
    xg = x.reshape(2, 3, 4, 3, 2)
    z, _, _ = normalise_ref(xg, (1, 2, 4), 1e-5)
    assert_close(F.group_norm(x, 3, scale, bias), z.reshape(x.shape) * scale + bias, RTOL[jnp.float32])
    # One group = layer norm over (H, W, C); C groups = instance norm.
    z, _, _ = normalise_ref(x, (1, 2, 3), 1e-5)
    assert_close(F.group_norm(x, 1), z, RTOL[jnp.float32])
    z, _, _ = normalise_ref(x, (1, 2), 1e-5)
    assert_close(F.group_norm(x, 6), z, RTOL[jnp.float32])


def test_norm_gradients_numerically():
    x, s, b = (jnp.asarray(data(22, (3, 2, 2, 4))), jnp.asarray(data(23, (4,))),
               jnp.asarray(data(24, (4,))))
    tol = dict(order=1, modes=("rev",), atol=NUMERIC_GRAD_TOL, rtol=NUMERIC_GRAD_TOL, eps=1e-2)
    # Each function jitted: its three evaluations (x and x +- eps v) and its vjp run
    # compiled programs, not an eager op at a time; the derivative checked is the same.
    for grad in F.BATCH_NORM_GRADS:
        check_grads(jax.jit(lambda x, s, b: F.batch_norm_train(x, s, b, grad=grad)[0]),
                    (x, s, b), **tol)
    check_grads(jax.jit(lambda x, s, b: F.batch_norm_train(x, s, b, relu=True)[0]), (x, s, b),
                **tol)
    check_grads(jax.jit(lambda x, s, b: F.layer_norm(x, s, b)), (x, s, b), **tol)
    check_grads(jax.jit(lambda x, s, b: F.group_norm(x, 2, s, b)), (x, s, b), **tol)


ERRORS = [
    (lambda: F.batch_norm(np.zeros((2, 3)), np.zeros(4), np.zeros(3)), r"batch_norm: mean must have shape \(3,\).*\(2, 3\).*\(4,\)"),
    (lambda: F.batch_norm_train(np.zeros((2, 3)), np.zeros(2)), r"batch_norm_train: scale must have shape \(3,\)"),
    (lambda: F.batch_norm_train(np.zeros(3)), r"batch_norm_train: x must have rank >= 2"),
    (lambda: F.batch_norm_train(np.zeros((2, 3)), grad="fast"), r"batch_norm_train: grad must be 'auto' or one of \('explicit', 'autodiff', 'closed_form'\), got 'fast'"),
    (lambda: F.layer_norm(np.zeros((2, 3)), np.zeros(2)), r"layer_norm: scale must have shape \(3,\)"),
    (lambda: F.layer_norm(np.zeros((2, 3)), axes=2), r"layer_norm: axes \(2,\) out of range for x shape \(2, 3\)"),
    (lambda: F.group_norm(np.zeros((2, 4, 4, 6)), 4), r"group_norm: num_groups=4 must be a positive int dividing the 6 channels"),
    (lambda: F.group_norm(np.zeros((2, 4, 4, 6)), 3, np.zeros(3)), r"group_norm: scale must have shape \(6,\)"),
]


@pytest.mark.parametrize("call,match", ERRORS)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.torch
def test_norms_match_torch_with_gradients():
    torch = pytest.importorskip("torch")
    tf = torch.nn.functional
    x, s, b = data(25, (4, 5, 3, 6)), data(26, (6,)), data(27, (6,))
    g = data(28, x.shape, offset=0.0)
    to_nchw = lambda a: torch.tensor(a.transpose(0, 3, 1, 2), requires_grad=True)
    cases = {
        "batch_norm_train": (lambda x, s, b: F.batch_norm_train(x, s, b, eps=1e-3)[0],
                             lambda xt, st, bt: tf.batch_norm(xt, None, None, st, bt, training=True, eps=1e-3)),
        "batch_norm_train closed_form": (
            lambda x, s, b: F.batch_norm_train(x, s, b, eps=1e-3, grad="closed_form")[0],
            lambda xt, st, bt: tf.batch_norm(xt, None, None, st, bt, training=True, eps=1e-3)),
        "group_norm": (lambda x, s, b: F.group_norm(x, 3, s, b),
                       lambda xt, st, bt: tf.group_norm(xt, 3, st, bt)),
    }
    for name, (ours, theirs) in cases.items():
        # value and vjp as one compiled program, not an eager op at a time
        y, grads = jax.jit(lambda x, s, b, g: (lambda y, vjp: (y, vjp(g)))(
            *jax.vjp(ours, x, s, b)))(x, s, b, jnp.asarray(g))
        xt, st, bt = to_nchw(x), torch.tensor(s, requires_grad=True), torch.tensor(b, requires_grad=True)
        yt = theirs(xt, st, bt)
        yt.backward(torch.tensor(g.transpose(0, 3, 1, 2)))
        assert_close(y, yt.detach().numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])
        assert_close(grads[0], xt.grad.numpy().transpose(0, 2, 3, 1), 1e-4)
        assert_close(grads[1], st.grad.numpy(), 1e-4)
        assert_close(grads[2], bt.grad.numpy(), GRAD_RTOL)
    # LayerNorm over (H, W, C) = torch's normalized_shape=(C, H, W) in NCHW.
    s3, b3 = data(29, (5, 3, 6)), data(30, (5, 3, 6))
    y = F.layer_norm(x, s3, b3, axes=(1, 2, 3))
    yt = tf.layer_norm(torch.tensor(x.transpose(0, 3, 1, 2)), (6, 5, 3),
                       torch.tensor(s3.transpose(2, 0, 1)), torch.tensor(b3.transpose(2, 0, 1)))
    assert_close(y, yt.numpy().transpose(0, 2, 3, 1), RTOL[jnp.float32])


def _activations_moved(fn, *args):
    """Bytes the compiled CPU program reads and writes (XLA's cost analysis), in units of
    the first argument's size."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return cost["bytes accessed"] / args[0].nbytes


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="counts XLA:CPU's compiled program")
def test_explicit_batch_norm_moves_the_activation_fewest_times():
    """The training BatchNorm's compiled forward and backward on the CPU, in activation-sized
    reads and writes: forward 6 (x for the sum, x for the centred squares written and read
    back for their sum, x read and y written), backward 8 more (dy summed, dy*x written and
    read back for its sum, dy and x read and dx written); a folded ReLU adds 3 (the masked
    dy written and read back).  XLA:CPU's fast per-channel sum is a matrix-vector product,
    which does not fuse its elementwise producer: that is the 2 per product sum above the
    ideal 3 + 5.  Autodiff (the old default) moves more, and none of this may regress."""
    x = jnp.asarray(data(50, (8, 16, 16, 64)))
    dy = jnp.asarray(data(51, x.shape, 0.0))
    c = jnp.ones((64,))

    def step(grad, relu):
        def run(x, dy):
            out, pull = jax.vjp(
                lambda x, s, b: F.batch_norm_train(x, s, b, grad=grad, relu=relu), x, c, c)
            return out[0], pull((dy, jnp.zeros_like(c), jnp.zeros_like(c)))
        return run

    moved = {(g, r): _activations_moved(step(g, r), x, dy)
             for g in F.BATCH_NORM_GRADS for r in (False, True)}
    forward = _activations_moved(lambda x: F.batch_norm_train(x, c, c, grad="explicit")[0], x)
    assert forward <= 6.5, forward
    assert moved["explicit", False] <= 14.5 and moved["explicit", True] <= 17.5, moved
    assert moved["explicit", False] < moved["closed_form", False], moved
    for r in (False, True):
        assert moved["explicit", r] < moved["autodiff", r], moved


@pytest.mark.parametrize("grad", ["explicit", "autodiff", "closed_form"])
def test_a_bad_impl_is_one_line_whatever_the_form(grad):
    """``impl`` chooses the explicit form's reductions; every form checks it (a typo given
    with ``grad="autodiff"`` was accepted silently)."""
    with pytest.raises(ValueError, match=r"^batch_norm_train: impl must be one of .*, got 'bogus'$"):
        F.batch_norm_train(jnp.ones((4, 3)), grad=grad, impl="bogus")
