"""Tests for jaxcnn.precision: policies, matmul precision, loss scaling."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from jaxcnn import precision as P

F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16


# --- policy parsing -----------------------------------------------------------

@pytest.mark.parametrize("name, fields, master, loss_scale", [
    ("fp32", (F32, F32, F32), None, "none"),
    ("bf16", (F32, BF16, F32), None, "none"),
    ("bf16_params", (BF16, BF16, F32), F32, "none"),
    ("fp16", (F32, F16, F32), None, "dynamic"),
    ("FP16", (F32, F16, F32), None, "dynamic"),
    (" f32 ", (F32, F32, F32), None, "none"),
    ("bfloat16", (F32, BF16, F32), None, "none"),
    ("float16", (F32, F16, F32), None, "dynamic"),
])
def test_presets(name, fields, master, loss_scale):
    p = P.Policy.parse(name)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == fields
    assert p.master_dtype is master and p.needs_master_copy == (master is not None)
    assert p.default_loss_scale == loss_scale
    assert p.overrides == ()
    assert P.get_policy(name) == p


@pytest.mark.parametrize("spec, fields", [
    ("p=f32,c=bf16,o=f32", (F32, BF16, F32, None)),
    ("c=bf16", (F32, BF16, F32, None)),
    ("o=f16, p=bf16", (BF16, F32, F16, None)),
    ("compute=float16,param=float32,output=bfloat16", (F32, F16, BF16, None)),
    ("C=BF16,P=BF16,M=F32", (BF16, BF16, F32, F32)),
    ("master=fp32,param=bf16", (BF16, F32, F32, F32)),
])
def test_string_forms(spec, fields):
    p = P.Policy.parse(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype, p.master_dtype) == fields
    assert P.Policy.parse(p.to_string()) == p


@given(st.tuples(*[st.sampled_from(["f32", "bf16", "f16"])] * 3), st.permutations([0, 1, 2]),
       st.booleans())
def test_string_forms_any_order(dtypes, order, long_keys):
    keys = ("param", "compute", "output") if long_keys else ("p", "c", "o")
    spec = ",".join(f"{keys[i]}={dtypes[i]}" for i in order)
    p = P.Policy.parse(spec)
    assert (p.param_dtype, p.compute_dtype, p.output_dtype) == tuple(P.parse_dtype(d) for d in dtypes)
    assert p.default_loss_scale == ("dynamic" if "f16" in dtypes[:2] else "none")


def test_mapping_spec_and_dtype_objects():
    p = P.get_policy({"param": "bf16", "c": np.dtype("float16"), "output": jnp.float32})
    assert p == P.Policy(BF16, F16, F32)
    # dtypes given as numpy or jnp objects canonicalise to the same (hashable) policy
    assert hash(P.get_policy({"c": np.float16})) == hash(P.Policy.parse("c=f16"))


@pytest.mark.parametrize("spec, fragment", [
    ("", "bad precision policy"),
    ("fp8", "unknown precision preset 'fp8'"),
    ("mixed", "unknown precision preset"),
    ("p=f32,x=bf16", "bad policy key 'x'"),
    ("p=f64", "unknown dtype 'f64'"),
    ("p=f32,c", "bad policy item 'c'"),
    ("p=f32,param=bf16", "sets param_dtype twice"),
    ("p=bf16,m=bf16", "master dtype equals the param dtype"),
    (None, "bad precision policy None"),
    (3, "bad precision policy 3"),
])
def test_parse_errors(spec, fragment):
    with pytest.raises(ValueError, match=fragment) as info:
        P.get_policy(spec)
    msg = str(info.value)
    if "master" not in fragment and "f64" not in fragment:
        # the message lists the forms and every preset
        assert "p=f32,c=bf16,o=f32" in msg and all(name in msg for name in P.PRESETS)


def test_non_float_dtype_rejected():
    with pytest.raises(ValueError, match="unsupported policy dtype"):
        P.get_policy({"c": jnp.int32})


def test_policy_ignores_platform(monkeypatch):
    expected = {name: P.Policy.parse(name) for name in P.PRESETS}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert {name: P.Policy.parse(name) for name in P.PRESETS} == expected
    assert P.Policy.parse("bf16").compute_dtype is BF16


# --- per-layer overrides ------------------------------------------------------

def test_for_layer_defaults():
    p = P.get_policy("bf16_params")
    for kind in P.DEFAULT_FP32_KINDS:
        q = p.for_layer(kind)
        assert (q.param_dtype, q.compute_dtype, q.output_dtype) == (BF16, F32, F32)
    assert p.for_layer("conv2d") is p and p.for_layer("relu") is p


def test_for_layer_overrides_from_config():
    base = P.get_policy("bf16", overrides={
        "batch_norm": "bf16",          # compute batch_norm in bf16 after all
        "conv2d": "fp32",              # preset name: sets the compute dtype only
        "linear": "c=f16,o=bf16",      # key=value: missing keys from the base
        "softmax": P.Policy(F32, F16, F16),
    })
    assert base.for_layer("batch_norm").compute_dtype is BF16
    assert base.for_layer("conv2d") == P.Policy(F32, F32, F32)
    assert base.for_layer("linear") == P.Policy(F32, F16, BF16)
    assert base.for_layer("softmax") == P.Policy(F32, F16, F16)
    assert base.for_layer("layer_norm").compute_dtype is F32   # untouched default
    assert base.for_layer("max_pool2d") is base
    assert base.default_loss_scale == "dynamic"                # an override computes in f16
    # a later override replaces an earlier one for the same kind; others stay
    again = base.with_overrides({"conv2d": "bf16"})
    assert again.for_layer("conv2d").compute_dtype is BF16
    assert again.for_layer("linear") == base.for_layer("linear")
    assert len(again.overrides) == len(base.overrides)
    hash(again)  # policies stay hashable (usable as jit static arguments)


@pytest.mark.parametrize("overrides, fragment", [
    ({"batch_norm": "fp64"}, "override for 'batch_norm'.*unknown precision preset"),
    ({"conv2d": "c=f8"}, "override for 'conv2d'.*unknown dtype 'f8'"),
    ({"conv2d": 32}, "override for 'conv2d' must be a string or Policy"),
    ({"batch norm": "fp32"}, "override key 'batch norm' is not a layer kind"),
    ([("batch_norm", "fp32")], "must be a mapping"),
])
def test_override_errors(overrides, fragment):
    with pytest.raises(ValueError, match=fragment):
        P.get_policy("bf16", overrides)


def _mixed_tree():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(3, 2)), F32),
        "h": jnp.asarray(rng.normal(size=(4,)), F16),
        "np": rng.normal(size=(2,)).astype(np.float32),
        "count": jnp.arange(3, dtype=jnp.int32),
        "mask": jnp.array([True, False]),
        "bytes": np.arange(4, dtype=np.uint8),
        "key": jax.random.key_data(jax.random.key(1)),
        "nested": [jnp.ones((2,), BF16), 7],
    }


@pytest.mark.parametrize("method, target", [
    ("cast_to_compute", BF16), ("cast_to_param", F16), ("cast_to_output", F32)])
def test_casts_touch_only_floating_leaves(method, target):
    policy = P.Policy(param_dtype=F16, compute_dtype=BF16, output_dtype=F32)
    tree = _mixed_tree()
    out = getattr(policy, method)(tree)
    for name in ("w", "h", "np"):
        assert out[name].dtype == target
        np.testing.assert_array_equal(np.asarray(out[name]),
                                      np.asarray(tree[name]).astype(np.dtype(target)))
    assert out["nested"][0].dtype == target
    for name in ("count", "mask", "bytes", "key"):
        assert out[name].dtype == tree[name].dtype
        np.testing.assert_array_equal(out[name], tree[name])
    assert out["nested"][1] == 7


def test_cast_for():
    tree = _mixed_tree()
    assert P.cast_for(None, "conv2d", tree) is tree
    policy = P.get_policy("fp16", {"linear": "bf16"})
    assert P.cast_for(policy, "conv2d", tree)["w"].dtype == F16
    assert P.cast_for(policy, "batch_norm", tree)["h"].dtype == F32
    assert P.cast_for(policy, "linear", tree)["w"].dtype == BF16
    assert P.cast_for(policy, "linear", tree)["count"].dtype == jnp.int32
    traced = jax.jit(lambda t: P.cast_for(policy, "conv2d", t))({"w": tree["w"], "c": tree["count"]})
    assert traced["w"].dtype == F16 and traced["c"].dtype == jnp.int32


# --- matmul precision -----------------------------------------------------------

def _dot_precision(name):
    x = jnp.ones((4, 4), F32)
    with P.matmul_precision_context(name):
        text = jax.jit(lambda a, b: a @ b).lower(x, x).as_text()
    (line,) = [l for l in text.splitlines() if "dot_general" in l]
    return line


@pytest.mark.parametrize("name, hlo", [
    ("default", "DEFAULT"), ("high", "HIGH"), ("HIGHEST", "HIGHEST"),
    ("bfloat16", "DEFAULT"), ("tensorfloat32", "HIGH"), ("float32", "HIGHEST")])
def test_matmul_precision_context(name, hlo):
    assert f"precision = [{hlo}, {hlo}]" in _dot_precision(name)


def test_matmul_precision_none_keeps_setting_and_bad_names():
    with jax.default_matmul_precision("high"):
        assert "precision = [HIGH, HIGH]" in _dot_precision(None)
    assert P.check_matmul_precision(None) is None
    for bad in ("fast", "", 3):
        with pytest.raises(ValueError, match="unknown matmul_precision"):
            P.matmul_precision_context(bad)


# --- loss scaling ---------------------------------------------------------------

HPARAMS = dict(growth_interval=3, growth_factor=4.0, backoff_factor=0.25, min_scale=4.0, max_scale=256.0)


def _meta(ls):
    return {f: getattr(ls, f) for f in type(ls)._meta_fields}


def test_dynamic_loss_scale_under_jit_keeps_hyperparameters():
    ls = P.make_loss_scale("dynamic", scale=16.0, **HPARAMS)
    step = jax.jit(lambda s, finite: s.adjust(finite))
    history = []
    for finite in [True] * 3 + [True] * 3 + [True] * 3 + [True] * 2 + [False] * 4 + [True]:
        ls = step(ls, jnp.asarray(finite))
        assert isinstance(ls, P.DynamicLossScale) and _meta(ls) == HPARAMS
        assert ls.loss_scale.dtype == F32 and ls.counter.dtype == jnp.int32
        history.append((float(ls.loss_scale), int(ls.counter)))
    assert history == [
        (16, 1), (16, 2), (64, 0),        # grows after growth_interval finite steps
        (64, 1), (64, 2), (256, 0),       # reaches max_scale
        (256, 1), (256, 2), (256, 0),     # clamped at max_scale, counter still resets
        (256, 1), (256, 2),
        (64, 0), (16, 0), (4, 0), (4, 0),  # backs off, clamped at min_scale (not jmp's 1.0)
        (4, 1)]
    assert step._cache_size() == 1


def test_loss_scale_survives_tree_ops():
    ls = P.make_loss_scale("dynamic", scale=8.0, **HPARAMS)
    mapped = jax.tree_util.tree_map(lambda x: x + 0, ls)
    assert _meta(mapped) == HPARAMS and float(mapped.loss_scale) == 8.0
    leaves, treedef = jax.tree_util.tree_flatten(ls)
    assert len(leaves) == 2
    rebuilt = jax.tree_util.tree_unflatten(treedef, leaves)
    assert _meta(rebuilt) == HPARAMS
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ls)[0]]
    assert paths == [".loss_scale", ".counter"]
    # inside lax.cond / scan carries (both need identical tree definitions)
    out = jax.jit(lambda s, c: jax.lax.cond(c, lambda: s.adjust(jnp.array(False)), lambda: s))(
        ls, True)
    assert float(out.loss_scale) == 4.0 and _meta(out) == HPARAMS
    assert jax.tree_util.tree_leaves(P.NoOpLossScale()) == []
    assert len(jax.tree_util.tree_leaves(P.StaticLossScale(2.0))) == 1


def _reference_dynamic(scale, counter, pattern, gi, gf, bf, lo, hi):
    """Plain-Python statement of the dynamic loss-scale rules."""
    out = []
    for finite in pattern:
        if not finite:
            scale, counter = max(scale * bf, lo), 0
        elif counter + 1 == gi:
            scale, counter = min(scale * gf, hi), 0
        else:
            counter += 1
        out.append((scale, counter))
    return out


@functools.lru_cache(maxsize=None)
def _scan_adjust():
    def run(ls, pattern):
        def body(s, finite):
            s = s.adjust(finite)
            return s, (s.loss_scale, s.counter)
        return jax.lax.scan(body, ls, pattern)
    return jax.jit(run)


@settings(max_examples=40, deadline=None)
@given(pattern=st.lists(st.booleans(), min_size=24, max_size=24),
       gi=st.sampled_from([1, 2, 3]),
       factors=st.sampled_from([(2.0, 0.5), (4.0, 0.25), (2.0, 1.0)]),
       bounds=st.sampled_from([(1.0, 2.0 ** 24), (0.5, 8.0)]),
       init=st.sampled_from([0.5, 1.0, 4.0, 8.0]))
def test_dynamic_loss_scale_matches_reference_in_scan(pattern, gi, factors, bounds, init):
    lo, hi = bounds
    init = min(max(init, lo), hi)
    ls = P.DynamicLossScale(init, 0, growth_interval=gi, growth_factor=factors[0],
                            backoff_factor=factors[1], min_scale=lo, max_scale=hi)
    final, (scales, counters) = _scan_adjust()(ls, jnp.asarray(pattern))
    expected = _reference_dynamic(init, 0, pattern, gi, factors[0], factors[1], lo, hi)
    assert list(zip(np.asarray(scales).tolist(), np.asarray(counters).tolist())) == expected
    assert _meta(final) == _meta(ls)


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(growth_interval=0), "growth_interval"),
    (dict(growth_interval=1.5), "growth_interval"),
    (dict(growth_factor=0.5), "growth_factor"),
    (dict(backoff_factor=0.0), "backoff_factor"),
    (dict(backoff_factor=2.0), "backoff_factor"),
    (dict(min_scale=0.0), "min_scale"),
    (dict(min_scale=8.0, max_scale=4.0), "min_scale"),
])
def test_dynamic_loss_scale_bad_hyperparameters(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        P.DynamicLossScale(4.0, 0, **kwargs)


def test_make_loss_scale():
    assert isinstance(P.make_loss_scale(None), P.NoOpLossScale)
    assert isinstance(P.make_loss_scale("NONE"), P.NoOpLossScale)
    static = P.make_loss_scale("static", scale=128)
    assert isinstance(static, P.StaticLossScale) and float(P.current_scale(static)) == 128.0
    dyn = P.make_loss_scale("dynamic")
    assert float(dyn.loss_scale) == 2.0 ** 15 and int(dyn.counter) == 0
    assert (dyn.growth_interval, dyn.min_scale, dyn.max_scale) == (2000, 1.0, 2.0 ** 24)
    assert float(P.current_scale(P.make_loss_scale("noop"))) == 1.0
    assert isinstance(P.make_loss_scale(P.Policy.parse("fp16").default_loss_scale), P.DynamicLossScale)
    with pytest.raises(ValueError, match="unknown loss scale kind 'auto'"):
        P.make_loss_scale("auto")
    with pytest.raises(ValueError, match=r"unknown hyperparameter\(s\) \['growth_interval'\]"):
        P.make_loss_scale("static", growth_interval=3)
    with pytest.raises(ValueError, match="unknown hyperparameter"):
        P.make_loss_scale("none", scale=2.0)
    with pytest.raises(ValueError, match="positive and finite"):
        P.make_loss_scale("dynamic", scale=-1.0)
    with pytest.raises(ValueError, match="boolean scalar"):
        dyn.adjust(jnp.array([True, False]))
    with pytest.raises(ValueError, match="loss_scale must be a scalar"):
        P.StaticLossScale(jnp.ones(2))


@settings(max_examples=25, deadline=None)
@given(k=st.integers(0, 10), seed=st.integers(0, 2 ** 31 - 1))
def test_static_scale_is_exact_in_fp16(k, seed):
    rng = np.random.default_rng(seed)
    # magnitudes in [2**-8, 2**4]: scaled by <= 2**10 they stay normal float16 numbers
    x = (rng.choice([-1.0, 1.0], 64) * 2.0 ** rng.uniform(-8, 4, 64)).astype(np.float16)
    ls = P.StaticLossScale(2.0 ** k)
    scaled, back = _scale_unscale(ls, {"g": jnp.asarray(x), "n": jnp.arange(3)})
    assert scaled["g"].dtype == F16 and scaled["n"].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(scaled["g"]), (x.astype(np.float32) * 2.0 ** k).astype(np.float16))
    np.testing.assert_array_equal(np.asarray(back["g"]), x)
    np.testing.assert_array_equal(back["n"], np.arange(3))


@jax.jit
def _scale_unscale(ls, tree):
    scaled = ls.scale(tree)
    return scaled, ls.unscale(scaled)


def test_unscale_with_scale_beyond_fp16_range():
    # 2**20 does not fit in float16; unscaling float16 gradients must not overflow it
    ls = P.DynamicLossScale(2.0 ** 20, 0)
    g = jnp.asarray([2.0 ** 14, -3 * 2.0 ** 12, 2.0 ** -4, 2.0 ** -6], F16)
    out = jax.jit(ls.unscale)(g)
    assert out.dtype == F16
    np.testing.assert_array_equal(np.asarray(out, np.float32), [2.0 ** -6, -3 * 2.0 ** -8, 2.0 ** -24, 0.0])  # subnormal, then underflow
    # scaling a float16 loss that overflows gives inf, which all_finite catches
    assert not bool(P.all_finite(ls.scale(jnp.asarray(1.0, F16))))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", ["top", "deep", "f16", "bf16"])
def test_all_finite(bad, where):
    tree = {"a": jnp.ones((3,), F32),
            "b": [jnp.zeros((2, 2), F16), {"c": jnp.ones((4,), BF16), "i": jnp.arange(4)}],
            "d": (jnp.ones(()), None)}
    check = jax.jit(P.all_finite)
    assert bool(check(tree)) and check(tree).shape == () and check(tree).dtype == jnp.bool_
    path = {"top": ("a",), "deep": ("d", 0), "f16": ("b", 0), "bf16": ("b", 1, "c")}[where]
    node = tree
    for key in path[:-1]:
        node = node[key]
    if isinstance(node, tuple):
        tree["d"] = (jnp.asarray(bad, F32), None)
    else:
        leaf = node[path[-1]]
        node[path[-1]] = leaf.at[(0,) * leaf.ndim].set(bad)
    assert not bool(check(tree))


def test_all_finite_ignores_non_floating_and_empty():
    assert bool(P.all_finite({}))
    assert bool(P.all_finite({"i": jnp.arange(3), "k": jax.random.key(0), "b": jnp.array([True])}))
    assert not bool(P.all_finite([1.0, float("nan")]))


def test_select_tree():
    a = {"w": jnp.ones((2,)), "n": jnp.int32(3), "k": jax.random.key(1)}
    b = {"w": jnp.zeros((2,)), "n": jnp.int32(5), "k": jax.random.key(2)}
    sel = jax.jit(P.select_tree)
    for pred, expected in ((True, a), (False, b)):
        out = sel(jnp.asarray(pred), a, b)
        np.testing.assert_array_equal(out["w"], expected["w"])
        assert int(out["n"]) == int(expected["n"]) and out["n"].dtype == jnp.int32
        np.testing.assert_array_equal(jax.random.key_data(out["k"]), jax.random.key_data(expected["k"]))
    with pytest.raises(ValueError, match="tree structures differ"):
        P.select_tree(jnp.array(True), a, {"w": a["w"]})
    with pytest.raises(ValueError, match="leaf float32"):
        P.select_tree(jnp.array(True), {"w": a["w"]}, {"w": a["w"].astype(F16)})
    with pytest.raises(ValueError, match="boolean scalar predicate"):
        P.select_tree(jnp.array([True, True]), a, b)


# --- a small fp16 training loop with an injected overflow --------------------------

def _regression_problem():
    rng = np.random.default_rng(42)
    x = rng.normal(size=(32, 4)).astype(np.float32)
    w_true = rng.normal(size=(4, 2)).astype(np.float32)
    params = {"w": jnp.zeros((4, 2), F32), "b": jnp.zeros((2,), F32)}
    return jnp.asarray(x), jnp.asarray(x @ w_true + 0.5), params


def _make_step(policy, tx, x, y):
    def loss_fn(params, mult):
        p, xc = policy.cast_to_compute((params, x))
        pred = xc @ p["w"] + p["b"]
        return jnp.mean((pred.astype(F32) - y) ** 2) * mult

    @jax.jit
    def step(params, opt_state, model_state, ls, mult):
        loss, grads = jax.value_and_grad(lambda p: ls.scale(loss_fn(p, mult)))(params)
        grads = ls.unscale(grads)
        finite = P.all_finite(grads)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state,
               {"count": model_state["count"] + 1})
        params, opt_state, model_state = P.select_tree(finite, new, (params, opt_state, model_state))
        return params, opt_state, model_state, ls.adjust(finite), finite, loss_fn(params, 1.0)

    return step


def test_training_loop_skips_injected_overflow_once():
    x, y, params = _regression_problem()
    tx = optax.sgd(0.1, momentum=0.8)
    policy = P.get_policy("fp16")
    step = _make_step(policy, tx, x, y)
    ls = P.make_loss_scale(policy.default_loss_scale, scale=2.0 ** 10, growth_interval=4)
    opt_state, model_state = tx.init(params), {"count": jnp.int32(0)}
    first_loss = float(jnp.mean(y ** 2))
    n, bad = 30, 6
    for i in range(n):
        mult = 1e4 if i == bad else 1.0   # 1e4 * 2**10 overflows float16 cotangents
        before = (params, opt_state, model_state, ls)
        params, opt_state, model_state, ls, finite, loss = step(params, opt_state, model_state, ls, mult)
        assert bool(finite) == (i != bad)
        if i == bad:
            for new, old in zip(jax.tree_util.tree_leaves((params, opt_state, model_state)),
                                jax.tree_util.tree_leaves(before[:3])):
                np.testing.assert_array_equal(new, old)
            assert float(ls.loss_scale) == float(before[3].loss_scale) / 2 and int(ls.counter) == 0
    assert int(model_state["count"]) == n - 1
    assert step._cache_size() == 1
    assert _meta(ls)["growth_interval"] == 4
    # the scale grew back after the overflow: 2**10 -> 2**11 (step 3) -> 2**10 (overflow)
    # -> then grows every 4 finite steps
    assert float(ls.loss_scale) == 2.0 ** 10 * 2 ** ((n - bad - 1) // 4)
    assert float(loss) < 1e-2 * first_loss

    # same run in float32 without scaling and without the bad step: same parameters
    ref_params, ref_opt = _regression_problem()[2], tx.init(params)
    ref_step = _make_step(P.get_policy("fp32"), tx, x, y)
    ref_ms, noop = {"count": jnp.int32(0)}, P.NoOpLossScale()
    for _ in range(n - 1):
        ref_params, ref_opt, ref_ms, noop, _, _ = ref_step(ref_params, ref_opt, ref_ms, noop, 1.0)
    for got, want in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(ref_params)):
        np.testing.assert_allclose(got, want, atol=5e-3)   # float16 compute (observed 2e-4)


# --- checkpointing ------------------------------------------------------------------

@pytest.mark.parametrize("ls", [
    P.NoOpLossScale(), P.StaticLossScale(512.0),
    P.DynamicLossScale(64.0, 7, growth_interval=5, growth_factor=3.0, backoff_factor=0.125,
                       min_scale=2.0, max_scale=1024.0)])
def test_state_dict_round_trip_through_npz(ls, tmp_path):
    np.savez(tmp_path / "ls.npz", **ls.to_state_dict())
    with np.load(tmp_path / "ls.npz", allow_pickle=False) as f:
        back = P.loss_scale_from_state_dict(dict(f))
    assert type(back) is type(ls) and _meta(back) == _meta(ls)
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(ls)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_state_dict_errors():
    d = P.DynamicLossScale(8.0, 0).to_state_dict()
    with pytest.raises(ValueError, match="holds a 'dynamic' loss scale, not 'static'"):
        P.StaticLossScale.from_state_dict(d)
    del d["min_scale"]
    with pytest.raises(ValueError, match=r"lacks \['min_scale'\]"):
        P.loss_scale_from_state_dict(d)
    with pytest.raises(ValueError, match="no 'kind'"):
        P.loss_scale_from_state_dict({})


def test_orbax_round_trip(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    ls = P.DynamicLossScale(64.0, 3, **HPARAMS)
    tree = {"loss_scale": ls, "step": jnp.int32(9)}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", tree)
        ckpt.wait_until_finished()
        target = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)
        back = ckpt.restore(tmp_path / "ckpt", target)
    assert isinstance(back["loss_scale"], P.DynamicLossScale) and _meta(back["loss_scale"]) == HPARAMS
    assert float(back["loss_scale"].loss_scale) == 64.0 and int(back["loss_scale"].counter) == 3


# --- lower-precision optimiser moments -------------------------------------------------

def test_bf16_first_moment_keeps_its_dtype():
    assert P.parse_dtype(None) is None
    tx = optax.adam(1e-2, mu_dtype=P.parse_dtype("bf16"))
    params = {"w": jnp.linspace(-1.0, 1.0, 6, dtype=F32).reshape(2, 3)}
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for _ in range(3):
        params, state = step(params, state)
    adam = state[0]
    assert adam.mu["w"].dtype == BF16 and adam.nu["w"].dtype == F32
    assert params["w"].dtype == F32


# --- a policy name given to apply ------------------------------------------------------

@functools.cache
def _lenet():
    """LeNet-5, its initial variables and an input, made once for the module's tests (JAX arrays
    are immutable: no test can change them for another); each call traced and lowered the init
    program again."""
    from jaxcnn import models
    model = models.get("lenet5")
    params, state = jax.jit(lambda k: model.init(k, (2, 28, 28, 1))[:2])(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 28, 28, 1), F32)
    return model, params, state, x


@pytest.mark.parametrize("name", ["bf16", "bf16_params", "p=f32,c=f16,o=bf16", " FP32 "])
def test_apply_takes_the_policy_names_the_config_takes(name):
    """The same names as precision.policy (read by get_policy): the same outputs, bit for bit."""
    model, params, state, x = _lenet()
    policy = P.get_policy(name)
    params = policy.cast_to_param(params)
    # jitted, as training and evaluation apply it (the name only decides the casts, at trace time)
    want, got = [jax.jit(lambda p, s, x, pol=pol: model.apply(p, s, x, policy=pol)[0])(params, state, x)
                 for pol in (policy, name)]
    assert got.dtype == want.dtype == policy.output_dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("bad, error, words", [
    ("bf17", ValueError, ["policy='bf17'", "'bf17'", "fp32, bf16, bf16_params, fp16"]),
    ("", ValueError, ["policy=''", "fp32, bf16, bf16_params, fp16"]),
    (jnp.bfloat16, TypeError, ["policy must be", "bfloat16", "fp32, bf16, bf16_params, fp16"]),
    (16, TypeError, ["policy must be", "int 16", "fp32, bf16, bf16_params, fp16"]),
])
def test_apply_refuses_a_bad_policy_naming_it(bad, error, words):
    model, params, state, x = _lenet()
    with pytest.raises(error) as info:
        model.apply(params, state, x, policy=bad)
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message, (word, message)


# --- the whole model's output dtype ------------------------------------------------------

@pytest.mark.parametrize("spec", ["bf16", "fp16", "bf16_params", "p=f32,c=f32,o=bf16", "c=bf16,o=f16"])
def test_a_zoo_model_returns_the_output_dtype(spec):
    """A models.get model returns output_dtype; its unwrapped body (a pipeline stage's view)
    returns the compute dtype, and the two hold the same values (the cast is the only change)."""
    model, params, state, x = _lenet()
    policy = P.get_policy(spec)
    params = policy.cast_to_param(params)
    y, _ = model.apply(params, state, x, policy=policy)
    assert y.dtype == policy.output_dtype
    from jaxcnn import layers as L
    body = L.serial(*model.children)
    inner, _ = body.apply(params, state, x, policy=policy)
    assert inner.dtype == policy.compute_dtype
    np.testing.assert_array_equal(np.asarray(y), np.asarray(inner.astype(policy.output_dtype)))
    # no policy: the layers' own dtype, no cast
    y32, _ = model.apply(P.cast_floating(params, F32), state, x)
    assert y32.dtype == F32


def test_whole_model_wraps_a_composed_model():
    from jaxcnn import layers as L
    net = L.serial(L.Flatten(), L.Linear(3))
    model = L.whole_model(net)
    assert (model.kind, model.children, model.init) == (net.kind, net.children, net.init)
    params, state, _ = model.init(jax.random.key(0), (2, 4, 4, 1))
    x = jax.random.normal(jax.random.key(1), (2, 4, 4, 1), F32)
    y, _ = model.apply(params, state, x, policy="bf16")
    assert y.dtype == F32 and net.apply(params, state, x, policy="bf16")[0].dtype == BF16
    grads = jax.grad(lambda p: jnp.sum(model.apply(p, state, x, policy="bf16")[0] ** 2))(params)
    assert all(g.dtype == F32 for g in jax.tree_util.tree_leaves(grads))
