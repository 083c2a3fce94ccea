"""The CPU lowerings behind impl="auto" (jaxcnn.functional._cpu_lowering):
forward values and gradients against lax.conv_general_dilated / reduce_window."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import lax

from jaxcnn import _geometry as geo
from jaxcnn import functional as F
from jaxcnn.functional import _cpu_lowering as C
from numeric import assert_close

# fp32 against fp32 lax (conftest: matmul precision "highest"); the two sum
# in different orders, so a few ulps of the largest term.  bf16 against the
# fp32 reference: 8 mantissa bits, sums over up to ~100 terms.
RTOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}
SETTINGS = settings(max_examples=10, deadline=None)
POOL_SETTINGS = settings(max_examples=6, deadline=None)
DIMS = ("NHWC", "HWIO", "NHWC")


def lax_conv(x, w, stride, pads, dilation):
    """The reference: the input zero-padded first, then lax's VALID convolution (whose
    gradient has no negative pad: XLA:CPU miscomputes some, openxla/xla#48713)."""
    x = jnp.pad(x, ((0, 0), *pads, (0, 0)))
    return lax.conv_general_dilated(x, w, stride, ((0, 0), (0, 0)), rhs_dilation=dilation,
                                    dimension_numbers=DIMS)


def fenced_lax_conv(x, w, stride, pads, dilation):
    """:func:`lax_conv` for a jitted program: its padded input behind an optimization barrier,
    so the reference stays the eager ops' computation, a pad and then a VALID convolution
    (jitted without the barrier, XLA folds the pad into the convolution's padding, the form
    under test); the barrier's transpose fences the cotangent in the same way, so the
    gradient's slice stays apart as the eager ops keep it."""
    x = lax.optimization_barrier(jnp.pad(x, ((0, 0), *pads, (0, 0))))
    return lax.conv_general_dilated(x, w, stride, ((0, 0), (0, 0)), rhs_dilation=dilation,
                                    dimension_numbers=DIMS)


def _as_conv2d_calls(rewrite):
    """A rewrite called as conv2d calls it: pads wider than the window less one applied first."""
    def conv(x, w, stride, pads, dilation):
        x, pads = geo.pad_beyond_window(x, pads, geo.dilated(w.shape[:2], dilation))
        return rewrite(x, w, stride, pads, dilation)
    return conv


patch_conv = _as_conv2d_calls(C._conv_patch_wgrad)
stored_conv = _as_conv2d_calls(C._conv_stored_input)


# Both custom_jvp rewrites of the convolution: im2col weight gradient, and XLA's own
# with the input fenced off.
REWRITES = pytest.mark.parametrize("conv", [patch_conv, stored_conv], ids=["patches", "stored"])


def random_case(seed, n, hw, c, o, k, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, *hw, c)), dtype)
    w = jnp.asarray(rng.standard_normal((*k, c, o)) / np.sqrt(k[0] * k[1] * c), dtype)
    return x, w


geometry = st.fixed_dictionaries({
    "k": st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "stride": st.tuples(st.integers(1, 2), st.integers(1, 2)),
    "dilation": st.tuples(st.integers(1, 2), st.integers(1, 2)),
    "pads": st.tuples(st.tuples(st.integers(0, 2), st.integers(0, 2)),
                      st.tuples(st.integers(0, 2), st.integers(0, 2))),
    "c": st.integers(1, 5), "o": st.integers(1, 6), "seed": st.integers(0, 2**31 - 1),
})


def test_patches_against_a_loop():
    x, _ = random_case(0, 2, (6, 7), 3, 1, (1, 1))
    kh, kw, (sh, sw), (dh, dw), pads = 2, 3, (2, 1), (1, 2), ((1, 0), (2, 1))
    cols = np.asarray(C.patches(x, (kh, kw), (sh, sw), pads, (dh, dw)))
    xp = np.pad(np.asarray(x), ((0, 0), *pads, (0, 0)))
    oh = (xp.shape[1] - dh * (kh - 1) - 1) // sh + 1
    ow = (xp.shape[2] - dw * (kw - 1) - 1) // sw + 1
    assert cols.shape == (2, oh, ow, kh * kw * 3)
    for i in range(oh):
        for j in range(ow):
            for a in range(kh):
                for b in range(kw):
                    got = cols[:, i, j, (a * kw + b) * 3:(a * kw + b + 1) * 3]
                    np.testing.assert_array_equal(got, xp[:, i * sh + a * dh, j * sw + b * dw])


@jax.jit(static_argnames=("conv", "args"))
def _value_and_pullback(x, w, dy, *, conv, args):
    """A convolution's value and VJP of ``dy``, as one compiled program per geometry (as in a
    jitted model) instead of a compile for each of its many eager ops.  The rewrite and its
    reference are compiled apart: in one program XLA shares (CSEs) their identical
    convolutions, even behind optimization barriers, and would compare one with itself."""
    y, vjp = jax.vjp(lambda x, w: conv(x, w, *args), x, w)
    return y, vjp(dy)


@REWRITES
@SETTINGS
@given(g=geometry)
def test_rewritten_conv_matches_lax_forward_and_gradients(conv, g):
    x, w = random_case(g["seed"], 2, (7, 6), g["c"], g["o"], g["k"])
    args = (g["stride"], g["pads"], g["dilation"])
    window = [(k - 1) * d + 1 for k, d in zip(g["k"], g["dilation"])]
    if any(n + sum(p) < win for n, p, win in zip((7, 6), g["pads"], window)):
        return  # kernel larger than the padded input: conv2d rejects it before lowering
    # The lax reference as one compiled program too (its pad fenced off: fenced_lax_conv),
    # instead of a compilation for each of its eager ops and their gradients.
    y_shape = jax.eval_shape(lambda: lax_conv(x, w, *args)).shape
    dy = jnp.asarray(np.random.default_rng(g["seed"] + 1).standard_normal(y_shape), jnp.float32)
    y_ref, grads_ref = _value_and_pullback(x, w, dy, conv=fenced_lax_conv, args=args)
    y, grads = _value_and_pullback(x, w, dy, conv=conv, args=args)
    assert y.shape == y_ref.shape
    assert_close(y, y_ref, RTOL[jnp.float32])
    for got, want in zip(grads, grads_ref):
        assert_close(got, want, RTOL[jnp.float32])


@REWRITES
def test_gradient_with_respect_to_one_argument_only(conv):
    x, w = random_case(1, 3, (9, 9), 4, 5, (3, 3))
    args = ((1, 1), ((1, 1), (1, 1)), (1, 1))

    def loss(conv):
        return lambda x, w: jnp.sum(jnp.sin(conv(x, w, *args)))

    for argnums in (0, 1):
        got = jax.jit(jax.grad(loss(conv), argnums=argnums))(x, w)
        want = jax.grad(loss(lax_conv), argnums=argnums)(x, w)
        assert_close(got, want, RTOL[jnp.float32])


@REWRITES
def test_forward_mode_and_second_order(conv):
    x, w = random_case(2, 2, (8, 8), 3, 4, (3, 3))
    tx, tw = random_case(3, 2, (8, 8), 3, 4, (3, 3))
    args = ((2, 2), ((1, 0), (0, 1)), (1, 1))

    # Each derivative of each convolution is one jitted program (the reference's pad fenced
    # off: fenced_lax_conv), instead of a compilation per eager op; the rewrite and the
    # reference are compiled apart, so XLA cannot share a convolution between them.
    def tangent(conv):
        return jax.jit(lambda x, w: jax.jvp(lambda x, w: conv(x, w, *args), (x, w), (tx, tw))[1])

    assert_close(tangent(conv)(x, w), tangent(fenced_lax_conv)(x, w), RTOL[jnp.float32])

    def gw_norm(conv):
        return lambda x: jnp.sum(jax.grad(lambda w: jnp.sum(conv(x, w, *args) ** 2))(w) ** 2)

    assert_close(jax.jit(jax.grad(gw_norm(conv)))(x),
                 jax.jit(jax.grad(gw_norm(fenced_lax_conv)))(x), RTOL[jnp.float32])


def test_bfloat16_gradients_close_to_float32():
    x, w = random_case(4, 2, (10, 10), 8, 8, (3, 3))
    args = ((1, 1), ((1, 1), (1, 1)), (1, 1))
    dy = jnp.asarray(np.random.default_rng(5).standard_normal((2, 10, 10, 8)), jnp.float32)
    y, vjp = jax.vjp(lambda x, w: patch_conv(x, w, *args), x.astype(jnp.bfloat16),
                     w.astype(jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    _, vjp_ref = jax.vjp(lambda x, w: lax_conv(x, w, *args), x, w)
    for got, want in zip(vjp(dy.astype(jnp.bfloat16)), vjp_ref(dy)):
        assert got.dtype == jnp.bfloat16
        assert_close(got, want, RTOL[jnp.bfloat16])


@pytest.mark.parametrize("force_rewrite", [False, True])
def test_auto_conv2d_matches_xla_on_a_large_shape(force_rewrite, monkeypatch):
    # Above MIN_MACS, so "auto" asks XLA where it lowers the weight gradient
    # (or is told YNNPACK, to force the rewrite); either way values and
    # gradients, bias included, equal impl="xla".
    x, w = random_case(6, 16, (18, 18), 16, 32, (3, 3))
    b = jnp.linspace(-1.0, 1.0, 32)
    assert 16 * 16 * 16 * 9 * 16 * 32 >= C.MIN_MACS
    if force_rewrite:
        monkeypatch.setattr(C, "xla_wgrad_uses_ynnpack", lambda *args: True)
    else:
        assert isinstance(C.xla_wgrad_uses_ynnpack(
            (16, 18, 18, 16), (3, 3, 16, 32), np.dtype(np.float32), (1, 1),
            ((0, 0), (0, 0)), (1, 1)), bool)

    def loss(impl):
        return lambda x, w, b: jnp.sum(jnp.tanh(F.conv2d(x, w, b, padding=1, impl=impl)))

    assert "custom_jvp" in str(jax.make_jaxpr(loss("auto"))(x, w, b))
    jaxpr = str(jax.make_jaxpr(jax.grad(loss("auto"), argnums=1))(x, w, b))
    # without YNNPACK the weight gradient is XLA's, reading the fenced input
    assert ("cond" in jaxpr) != (force_rewrite or C.xla_wgrad_uses_ynnpack(
        (16, 18, 18, 16), (3, 3, 16, 32), np.dtype(np.float32), (1, 1), ((1, 1), (1, 1)), (1, 1)))
    got = jax.jit(jax.value_and_grad(loss("auto"), argnums=(0, 1, 2)))(x, w, b)
    want = jax.value_and_grad(loss("xla"), argnums=(0, 1, 2))(x, w, b)
    for a, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert_close(a, e, RTOL[jnp.float32])


def test_auto_keeps_xla_for_small_grouped_and_impl_xla():
    x, w = random_case(7, 2, (6, 6), 4, 4, (3, 3))
    pads = ((0, 0), (0, 0))
    assert C.conv2d_rewrite(x, w, stride=(1, 1), pads=pads, dilation=(1, 1), groups=1) is None
    big_x, big_w = random_case(8, 64, (20, 20), 32, 32, (3, 3))
    assert C.conv2d_rewrite(big_x, big_w[:, :, :16], stride=(1, 1), pads=pads,
                            dilation=(1, 1), groups=2) is None
    jaxpr = str(jax.make_jaxpr(lambda x, w: F.conv2d(x, w, impl="xla"))(big_x, big_w))
    assert "custom_jvp" not in jaxpr


def test_fence_returns_its_input_bitwise():
    for first in (1.5, -0.0, np.nan):
        x = np.random.default_rng(11).standard_normal((2, 3, 4)).astype(np.float32)
        x[0, 0, 0] = first
        got = np.asarray(jax.jit(C._fence)(jnp.asarray(x)))
        # the NaN branch adds 0.0: only the sign of a zero could change, and x has none there
        np.testing.assert_array_equal(got, x)
        assert np.signbit(got[0, 0, 0]) == np.signbit(x[0, 0, 0]) or np.isnan(first)
    hlo = jax.jit(lambda x: C._fence(x * 2.0).T).lower(jnp.ones((8, 4))).compile().as_text()
    assert "conditional" in hlo  # XLA kept the fence


def test_configure_xla_flags():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    added = C.configure_xla_flags(env)
    import jaxlib
    checked = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) in C._FLAG_CHECKED_JAXLIB
    assert added == checked
    if checked:
        assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=8 {C.XLA_CPU_FLAG}"
        assert not C.configure_xla_flags(env)  # already set: left alone
        assert env["XLA_FLAGS"].count("ynn_fusion_type") == 1
    off = {"JAXCNN_CPU_XLA_FLAGS": "0"}
    assert not C.configure_xla_flags(off) and "XLA_FLAGS" not in off
    own = {"XLA_FLAGS": "--xla_cpu_experimental_ynn_fusion_type="}
    assert not C.configure_xla_flags(own)
    assert own["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type="


# ---- the weight-gradient decision: a lookup, never a compilation -----------------------------

COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration",
                  "/jax/core/compile/jaxpr_to_mlir_module_duration")


def test_wgrad_decision_compiles_nothing_inside_a_trace(monkeypatch):
    """Regression: the decision compiled a program of its own while the user's function was
    traced (it failed under pmap's abstract mesh).  Tracing a large conv's gradient, with
    a fresh shape and the decision's memo cleared, lowers and compiles nothing."""
    x, w = random_case(13, 16, (19, 19), 16, 32, (3, 3))
    assert 16 * 17 * 17 * 9 * 16 * 32 >= C.MIN_MACS
    events, asked = [], []

    def listener(name, *args, **kwargs):
        events.append(name)

    decide = C.xla_wgrad_uses_ynnpack
    getattr(decide, "cache_clear", lambda: None)()
    monkeypatch.setattr(C, "xla_wgrad_uses_ynnpack", lambda *a: asked.append(a) or decide(*a))
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.make_jaxpr(jax.grad(lambda w: jnp.sum(F.conv2d(x, w, impl="auto") ** 2)))(w)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert asked  # the decision ran, inside the trace
    assert not [e for e in events if e in COMPILE_EVENTS], events


@pytest.mark.parametrize("devices", [1, 2])
def test_pmap_train_step_on_mnist_cnn(devices):
    """Regression: parallel.strategy=pmap crashed on mnist_cnn (whose conv2 is above
    MIN_MACS on each device) with 'Passing lowering_platforms ... AbstractMesh'."""
    import optax
    from jaxcnn import precision as P
    from jaxcnn.models import get as get_model
    from jaxcnn.parallel import ParallelPlan, make_mesh
    from jaxcnn.train.state import create_train_state
    from jaxcnn.train.step import make_train_step
    model, tx, shape = get_model("mnist_cnn"), optax.sgd(0.01), (2 * devices, 28, 28, 1)
    assert 2 * 24 * 24 * 9 * 32 * 64 >= C.MIN_MACS  # conv2 per device takes the decision
    state = jax.device_get(create_train_state(model, tx, jax.random.PRNGKey(0), shape,
                                              loss_scale=P.make_loss_scale("none")))
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), state)
    plan = ParallelPlan(make_mesh(devices, 1, devices=jax.devices()[:devices]), model, shape,
                        abstract, strategy="pmap")
    step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name))
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=shape).astype(np.float32),
             "label": rng.integers(0, 10, shape[0]).astype(np.int32)}
    state, metrics = step(plan.shard_state(state), plan.put_batch(batch))
    assert np.isfinite(float(metrics["loss"])) and int(state.step) == 1


def test_ynnpack_takes_convolutions_reads_the_flag():
    assert C.ynnpack_takes_convolutions("")  # XLA's default gives it convolutions
    assert not C.ynnpack_takes_convolutions(f"--xla_force_host_platform_device_count=8 {C.XLA_CPU_FLAG}")
    assert not C.ynnpack_takes_convolutions("--xla_cpu_experimental_ynn_fusion_type=")
    assert C.ynnpack_takes_convolutions(
        "--xla_cpu_experimental_ynn_fusion_type=individual_dot,individual_convolution")
    # the last occurrence wins, as in XLA's parser
    assert C.ynnpack_takes_convolutions(
        f"{C.XLA_CPU_FLAG} --xla_cpu_experimental_ynn_fusion_type=individual_convolution")


_WGRAD_RULE_CHILD = """
import json, sys
import jaxcnn.cpu
jaxcnn.cpu.configure(malloc=False)  # jaxcnn's XLA flag, unless JAXCNN_CPU_XLA_FLAGS=0
import numpy as np, jax, jax.numpy as jnp
from jaxcnn.functional import _cpu_lowering as C
out = []
for x_shape, w_shape, dtype, stride, pads, dilation in json.loads(sys.argv[1]):
    x, w = jax.ShapeDtypeStruct(x_shape, dtype), jax.ShapeDtypeStruct(w_shape, dtype)
    pads = tuple(map(tuple, pads))
    conv = lambda x, w: C._xla_conv(x, w, tuple(stride), pads, tuple(dilation))
    y = jax.eval_shape(conv, x, w)
    wgrad = lambda x, dy: jax.vjp(lambda w_: conv(x, w_), jnp.zeros(w_shape, dtype))[1](dy)[0]
    hlo = jax.jit(wgrad).lower(x, y).compile().as_text()
    out.append(["ynn_fusion" in hlo, C.xla_wgrad_uses_ynnpack(
        tuple(x_shape), tuple(w_shape), np.dtype(dtype), tuple(stride), pads, tuple(dilation))])
print(json.dumps(out))
"""


@pytest.mark.parametrize("flag", ["default", "jaxcnn"])
def test_wgrad_lookup_matches_xla_compiled_choice(flag):
    """The lookup against what XLA really does (compiled in a fresh process, where XLA reads
    the flags: with jaxcnn's flag, and with XLA's default that gives YNNPACK convolutions)."""
    import json
    import os
    import subprocess
    import sys
    cases = [  # batch or channels past 16 or not, kernel/output past the input, strides, dilation
        [(16, 26, 26, 32), (3, 3, 32, 64), "float32", (1, 1), ((0, 0), (0, 0)), (1, 1)],
        [(8, 12, 12, 3), (3, 3, 3, 32), "bfloat16", (2, 2), ((1, 1), (1, 1)), (1, 1)],
        [(17, 10, 10, 3), (3, 3, 3, 4), "float16", (1, 2), ((0, 0), (0, 0)), (1, 2)],
        [(16, 10, 10, 3), (3, 3, 3, 16), "float32", (1, 1), ((0, 0), (0, 0)), (1, 1)],
        [(32, 4, 4, 8), (5, 5, 8, 8), "float32", (1, 1), ((1, 1), (1, 1)), (1, 1)],
        [(32, 5, 5, 8), (3, 3, 8, 24), "float32", (1, 1), ((2, 2), (2, 2)), (1, 1)],
        [(32, 9, 9, 8), (3, 3, 8, 24), "float32", (2, 2), ((3, 3), (0, 1)), (2, 2)],
    ]
    env = dict(os.environ, XLA_FLAGS="", JAXCNN_CPU_XLA_FLAGS="0" if flag == "default" else "1")
    out = subprocess.run([sys.executable, "-c", _WGRAD_RULE_CHILD, json.dumps(cases)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    for case, (compiled, lookup) in zip(cases, results):
        assert compiled == lookup, (flag, case, compiled, lookup)
    if flag == "default":  # the cases cover both answers
        assert {r[0] for r in results} == {True, False}


# ---- max pooling ---------------------------------------------------------------------------

pool_geometry = st.fixed_dictionaries({
    "k": st.tuples(st.integers(1, 3), st.integers(1, 3)),
    "h": st.integers(3, 7), "w": st.integers(3, 7), "c": st.integers(1, 3),
    "seed": st.integers(0, 2**31 - 1),
})


def first_max_pool_ref(x, k):
    """Forward and first-max-wins input gradient (of sum(y * g)) by loops, float64."""
    x = np.asarray(x, np.float64)
    n, h, w, c = x.shape
    oh, ow = h // k[0], w // k[1]
    y = np.zeros((n, oh, ow, c))
    where = np.zeros((n, oh, ow, c, 2), int)
    for i in range(oh):
        for j in range(ow):
            win = x[:, i * k[0]:(i + 1) * k[0], j * k[1]:(j + 1) * k[1]].reshape(n, -1, c)
            first = np.argmax(win, axis=1)  # numpy's argmax returns the first maximum
            y[:, i, j] = np.take_along_axis(win, first[:, None], 1)[:, 0]
            where[:, i, j, :, 0] = i * k[0] + first // k[1]
            where[:, i, j, :, 1] = j * k[1] + first % k[1]
    return y, where


@POOL_SETTINGS
@given(pool_geometry)
def test_max_pool_reshape_matches_reduce_window_and_first_max_gradient(g):
    k = g["k"]
    if g["h"] < k[0] or g["w"] < k[1]:
        return
    rng = np.random.default_rng(g["seed"])
    # Few distinct values, so most windows hold ties.
    x = jnp.asarray(rng.integers(-2, 3, (2, g["h"], g["w"], g["c"])), jnp.float32)

    def pool(impl):
        return lambda x: F.max_pool2d(x, k, impl=impl)

    assert "reduce_window" not in str(jax.make_jaxpr(pool("auto"))(x))  # the reshape form ran
    y_ref, where = first_max_pool_ref(x, k)
    gy = rng.standard_normal(y_ref.shape).astype(np.float32)

    def forward_backward(impl):  # one compiled program per lowering
        def run(x):
            y, vjp = jax.vjp(pool(impl), x)
            return y, vjp(gy)[0]
        return jax.jit(run)

    y, dx = forward_backward("auto")(x)
    y_xla, dx_xla = forward_backward("xla")(x)
    np.testing.assert_array_equal(y, y_xla)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(dx, dx_xla)
    want = np.zeros(x.shape)
    n, oh, ow, c = y.shape
    for b in range(n):
        for i in range(oh):
            for j in range(ow):
                for ch in range(c):
                    r, s = where[b, i, j, ch]
                    want[b, r, s, ch] += gy[b, i, j, ch]
    np.testing.assert_array_equal(dx, want)


def jvp(fn):
    """fn's value and jvp as one compiled program (not an eager op at a time)."""
    return jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,)))


def test_max_pool_reshape_forward_mode_and_second_order():
    rng = np.random.default_rng(12)
    x = jnp.asarray(rng.integers(-2, 3, (2, 6, 4, 3)), jnp.float32)  # ties in most windows
    t = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def pool(impl):
        return lambda x: F.max_pool2d(x, (2, 2), impl=impl)

    y, ty = jvp(pool("auto"))(x, t)
    y_ref, ty_ref = jvp(pool("xla"))(x, t)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(ty, ty_ref)
    xs = x + 0.01 * t  # distinct values, so second derivatives are well defined

    def curvature(impl):
        return lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(pool(impl)(x))))(x) * x)

    assert_close(jax.jit(jax.grad(curvature("auto")))(xs),
                 jax.jit(jax.grad(curvature("xla")))(xs), RTOL[jnp.float32])


def test_max_pool_reshape_propagates_nan_and_inf():
    x = np.zeros((1, 4, 4, 1), np.float32)
    x[0, 0, 1, 0] = np.nan
    x[0, 2, 2, 0] = -np.inf
    x[0, 3, 3, 0] = np.inf
    x[0, 0, 2:4, 0] = -np.inf
    y = F.max_pool2d(jnp.asarray(x), 2, impl="auto")
    np.testing.assert_array_equal(y, F.max_pool2d(jnp.asarray(x), 2, impl="xla"))
    assert np.isnan(y[0, 0, 0, 0]) and y[0, 1, 1, 0] == np.inf and y[0, 0, 1, 0] == 0


@pytest.mark.parametrize("kwargs", [dict(kernel_size=2, dilation=2),
                                    dict(kernel_size=2, stride=3),
                                    dict(kernel_size=(5, 2), padding=(2, 1)),
                                    dict(kernel_size=3, stride=2, padding=1, dtype=jnp.float16),
                                    dict(kernel_size=3, stride=2, padding=1, dtype=jnp.int32)])
def test_max_pool_other_geometries_keep_reduce_window(kwargs):
    """Dilation, gaps without padding, windows over 9 taps and unmeasured dtypes keep XLA."""
    dtype = kwargs.pop("dtype", jnp.float32)
    x = jnp.asarray(np.random.default_rng(9).integers(-50, 50, (2, 7, 7, 3)), dtype)
    jaxpr = str(jax.make_jaxpr(lambda x: F.max_pool2d(x, impl="auto", **kwargs))(x))
    assert "reduce_window" in jaxpr or "argmax" in jaxpr
    np.testing.assert_array_equal(F.max_pool2d(x, impl="auto", **kwargs),
                                  F.max_pool2d(x, impl="xla", **kwargs))


# ---- overlapping / padded max pooling (strided taps) ----------------------------------------

# (kernel, stride, padding, ceil_mode): ResNet's stem, stride 1, ceil_mode overhangs, unequal
# axes, stride = kernel with padding, overlap on one axis only.
OVERLAP_GEOMETRIES = [(3, 2, 1, False), (3, 1, 1, False), (3, 2, 1, True), (3, 2, 0, True),
                      ((2, 3), (1, 2), (1, 1), True), (2, 2, 1, False),
                      ((3, 1), (2, 1), (1, 0), False), (2, 1, 0, False)]


def _tied_input(rng, shape, dtype):
    """Small integers (ties in most windows); from the second sample on, mostly -inf with
    NaN and inf, so that some windows see only -inf and padding, and some hold NaN before,
    after or between maxima."""
    x = rng.integers(-2, 3, shape).astype(np.float32)
    u = rng.random(shape)
    u[0] = 1.0
    x[u < 0.7] = -np.inf
    x[(u >= 0.7) & (u < 0.8)] = np.nan
    x[(u >= 0.8) & (u < 0.83)] = np.inf
    return jnp.asarray(x, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("geometry", OVERLAP_GEOMETRIES)
def test_max_pool_overlapping_matches_reduce_window_value_and_gradient(geometry, dtype):
    """Value and gradient equal reduce_window's (jax.vjp) exactly: the same tap chosen per
    window (first maximum, XLA's rule with -inf, NaN and padding), integer cotangents so
    that sums are exact in bfloat16 too."""
    k, s, p, ceil = geometry
    rng = np.random.default_rng(OVERLAP_GEOMETRIES.index(geometry))
    x = _tied_input(rng, (2, 8, 7, 3), dtype)

    def pool(impl):
        return lambda x: F.max_pool2d(x, k, stride=s, padding=p, ceil_mode=ceil, impl=impl)

    for fn in (pool("auto"), jax.grad(lambda x: jnp.sum(pool("auto")(x)))):
        jaxpr = str(jax.make_jaxpr(fn)(x))
        assert "reduce_window" not in jaxpr and "select_and" not in jaxpr  # the taps ran
    def value_and_pullback(impl):  # one compiled program per lowering, forward and vjp
        return jax.jit(lambda x, ct: (lambda y, vjp: (y, vjp(ct)[0]))(*jax.vjp(pool(impl), x)))

    ct = jnp.asarray(rng.integers(1, 9, jax.eval_shape(pool("auto"), x).shape), dtype)
    y, dx = value_and_pullback("auto")(x, ct)
    y_xla, dx_xla = value_and_pullback("xla")(x, ct)
    assert y.dtype == dtype and y.shape == y_xla.shape
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_xla, np.float32))
    np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(dx_xla, np.float32))


def test_max_pool_overlapping_bf16_gradient_rounds_once():
    """bfloat16 with real-valued cotangents: the taps sum in float32 and round once, XLA
    rounds after each add; both within bfloat16's rounding of the float32 sum."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(-2, 3, (2, 9, 9, 4)), jnp.bfloat16)
    ct = np.asarray(jnp.asarray(rng.standard_normal((2, 5, 5, 4)), jnp.bfloat16), np.float32)

    def grad(impl, dtype):  # one jitted program per lowering and dtype, not one per eager op
        pullback = jax.jit(lambda x, ct: jax.vjp(
            lambda x: F.max_pool2d(x, 3, stride=2, padding=1, impl=impl), x)[1](ct)[0])
        return np.asarray(pullback(x.astype(dtype), jnp.asarray(ct, dtype)), np.float32)

    exact = grad("xla", jnp.float32)  # the same choices: x is exact in float32
    np.testing.assert_array_equal(grad("auto", jnp.bfloat16),
                                  np.asarray(jnp.asarray(exact, jnp.bfloat16), np.float32))
    assert_close(grad("xla", jnp.bfloat16), exact, RTOL[jnp.bfloat16])


def test_max_pool_overlapping_forward_mode_and_second_order():
    """jvp against reduce_window's on distinct values; on ties, the jvp is the transpose
    of the gradient (<jvp(t), c> == <t, vjp(c)>, exact on integers); second order as XLA."""
    rng = np.random.default_rng(13)
    geometry = dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)

    def pool(impl):
        return lambda x: F.max_pool2d(x, impl=impl, **geometry)

    xs = jnp.asarray(rng.permutation(2 * 7 * 6 * 3).reshape(2, 7, 6, 3) - 100.0, jnp.float32)
    t = jnp.asarray(rng.integers(-4, 5, xs.shape), jnp.float32)
    auto_jvp = jvp(pool("auto"))  # compiled once, run on distinct values and on ties
    y, ty = auto_jvp(xs, t)
    y_ref, ty_ref = jvp(pool("xla"))(xs, t)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(ty, ty_ref)

    x = jnp.asarray(rng.integers(-2, 3, xs.shape), jnp.float32)
    _, ty = auto_jvp(x, t)
    c = jnp.asarray(rng.integers(-4, 5, jax.eval_shape(pool("xla"), x).shape), jnp.float32)
    xla_pullback = jax.jit(lambda x, c: jax.vjp(pool("xla"), x)[1](c)[0])
    assert float(jnp.sum(ty * c)) == float(jnp.sum(t * xla_pullback(x, c)))

    smooth = xs / 50.0

    def curvature(impl):
        return lambda x: jnp.sum(jax.grad(lambda x: jnp.sum(jnp.sin(pool(impl)(x))))(x) * x)

    assert_close(jax.jit(jax.grad(curvature("auto")))(smooth),
                 jax.jit(jax.grad(curvature("xla")))(smooth), RTOL[jnp.float32])


def test_max_pool_stem_dispatch_drops_select_and_scatter():
    """ResNet's stem pool on the CPU: the gradient has no select-and-scatter (XLA's has, so
    the check can fail); the undifferentiated float32 value stays reduce_window above
    POOL_TAPS_MAX_ELEMENTS (measured faster there), the taps below it and for bfloat16."""
    def pool(impl):
        return lambda x: F.max_pool2d(x, 3, stride=2, padding=1, impl=impl)

    def grad_hlo(impl, x):
        fn = jax.jit(jax.grad(lambda x: jnp.sum(pool(impl)(x).astype(jnp.float32))))
        return fn.lower(x).as_text()

    stem = jax.ShapeDtypeStruct((16, 112, 112, 64), jnp.float32)
    assert "select_and_scatter" in grad_hlo("xla", stem)
    for x in (stem, jax.ShapeDtypeStruct(stem.shape, jnp.bfloat16)):
        hlo = grad_hlo("auto", x)
        assert "select_and_scatter" not in hlo and "reduce_window" not in hlo
    assert "reduce_window" in str(jax.make_jaxpr(pool("auto"))(stem))
    for small in (jax.ShapeDtypeStruct((128, 24, 24, 64), jnp.float32),
                  jax.ShapeDtypeStruct(stem.shape, jnp.bfloat16)):
        assert "reduce_window" not in str(jax.make_jaxpr(pool("auto"))(small))


def test_max_pool_gradient_is_stored_once_for_a_batch_norm_backward(monkeypatch):
    """The stem's BatchNorm + ReLU + 3x3/2 pool, forward and backward (compiled, not run):
    the pool's input gradient is stored once (a conditional, ``_fence_tangent``), so the
    temporaries stay under 3x the input; without the fence XLA:CPU stores each of the 9
    interior-padded taps for every consumer (over 6x: the check can fail).  The gradient
    equals the one through XLA's reduce_window to float32 rounding (the BatchNorm sums
    fuse differently), and the pool's own gradient exactly, fence or not.

    Measured under jaxcnn's XLA:CPU flag (``jaxcnn.cpu.configure``, which the suite calls),
    the same on jaxlib 0.10.2, 0.11.2 and 0.12.0.1.  Under XLA's default, YNNPACK takes the
    BatchNorm's channel sums, which cannot absorb the gradient's taps, so it is stored once
    with or without the fence (about 2.1x on 0.11.2 and 0.12.0.1): the flag must be in
    effect for the fence to be what this measures."""
    assert C.XLA_CPU_FLAG in C._flags_xla_read().split(), "jaxcnn's XLA:CPU flag is off"
    shape = (4, 32, 32, 16)

    def loss(impl):
        def f(x):
            m, v = x.mean((0, 1, 2)), x.var((0, 1, 2))
            y = jax.nn.relu((x - m) * lax.rsqrt(v + 1e-5))
            return jnp.sum(F.max_pool2d(y, 3, stride=2, padding=1, impl=impl) ** 2)
        return f

    def temp_over_input(fn):
        x = jax.ShapeDtypeStruct(shape, jnp.float32)
        return jax.jit(jax.grad(fn)).lower(x).compile().memory_analysis().temp_size_in_bytes / (4 * np.prod(shape))

    x = jnp.asarray(np.random.default_rng(21).standard_normal(shape), jnp.float32)
    pool_grad = jax.jit(jax.grad(lambda x: jnp.sum(F.max_pool2d(x, 3, stride=2, padding=1) ** 2)))
    fenced, fenced_pool = jax.jit(jax.grad(loss("auto")))(x), pool_grad(x)
    assert "cond" in str(jax.make_jaxpr(jax.grad(loss("auto")))(x))
    assert temp_over_input(loss("auto")) < 3
    assert_close(fenced, jax.jit(jax.grad(loss("xla")))(x), RTOL[jnp.float32])
    monkeypatch.setattr(C, "_fence_tangent", lambda t, index: t)
    assert temp_over_input(loss("auto")) > 6
    np.testing.assert_array_equal(fenced_pool, jax.jit(jax.grad(
        lambda x: jnp.sum(F.max_pool2d(x, 3, stride=2, padding=1) ** 2)))(x))


def test_bench_cpu_pool_script_times_both_lowerings(capsys):
    """scripts/bench_cpu_pool.py at batch 1: a row per shape, its two lowerings equal;
    an unknown shape is a usage error (exit 2, one line)."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "bench_cpu_pool.py")
    spec = importlib.util.spec_from_file_location("bench_cpu_pool", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for name in ("stem128", "tiled"):
        shape, k, s, p = bench.SHAPES[name]
        x = jnp.asarray(np.random.default_rng(0).integers(-3, 3, (1, *shape[1:])), jnp.bfloat16)
        xla, rewrite = bench.pools(x.shape, k, s, p, x.dtype)
        np.testing.assert_array_equal(np.asarray(rewrite(x), np.float32),
                                      np.asarray(xla(x), np.float32))
    assert bench.main(["--shapes", "stem128,tiled", "--batch", "1", "--rounds", "1",
                       "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("stem", "tiled"))]
    assert len(rows) == 2 and all(len(r.split()) >= 10 for r in rows)
    assert bench.main(["--shapes", "nope"]) == 2
    assert "unknown --shapes" in capsys.readouterr().err
