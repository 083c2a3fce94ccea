"""``Choices(conv_bn=...)``: Conv -> BatchNorm -> ReLU chains as fused Mosaic GPU convolutions.

``conv_bn="mosaic"`` runs the chains through ``pallas_kernels.mgpu_fused`` (GPU
interpret mode on this CPU); the reference is the same model with
``conv_bn="off"``, the unfused layers.  Under a bfloat16 policy both store every
activation in bfloat16, at the same points; the fused kernels accumulate in another
order and fold BatchNorm into a scale and shift, and their gradients round their
cotangents at other points, so outputs and gradients are compared at 2e-2 of
``max(1, max |reference|)`` (bfloat16, as the Pallas kernel tests), the new running
statistics (float32, from the same statistics) at 1e-3 relative.

``"auto"`` is a lookup that fuses only with a measured win on a Hopper GPU (tested by
mocking the platform and the cache: nothing is timed).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import layers as L
from jaxcnn.layers import fusion
from jaxcnn.functional import _dispatch
from jaxcnn.functional import conv_bn as fcb
from jaxcnn.models.resnet import bottleneck
from jaxcnn.precision import get_policy
from pallas_kernels import mgpu_conv as mc

F32 = jnp.float32
REASON = mc.unavailable_reason()
needs_mgpu = pytest.mark.skipif(REASON is not None, reason=f"Mosaic GPU: {REASON}")
BF16 = get_policy("bf16")


def _assert_close(got, want, what, tol=2e-2):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite"
    err = float(np.abs(got - want).max()) / max(1.0, float(np.abs(want).max()))
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol}"


def _run(model, params, state, x, ct, fusion):
    choices = L.Choices(conv_bn=fusion)

    def loss(params, x):
        y, new_state = model.apply(params, state, x, train=True, policy=BF16, choices=choices)
        return jnp.sum(y.astype(F32) * ct), (y, new_state)
    def run(params, x):
        (_, (y, new_state)), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
            params, x)
        return y, new_state, grads
    # One compilation, XLA optimisations off: the interpreted kernels compile slowly.
    return jax.jit(run).trace(params, x).lower().compile(
        {"xla_backend_optimization_level": 0})(params, x)


def _kernel_names(model, params, state, x, fusion):
    """The Mosaic forward kernels the training forward launches."""
    jaxpr = str(jax.make_jaxpr(lambda p, x: model.apply(
        p, state, x, train=True, policy=BF16, choices=L.Choices(conv_bn=fusion)))(params, x))
    return set(re.findall(r"jaxcnn_mgpu_conv_fwd\w*", jaxpr))


@needs_mgpu
def test_explicit_choice_gives_the_unfused_chains_values_state_and_gradients():
    """conv -> bn -> relu -> conv -> bn -> relu: the first convolution writes the statistics,
    the second takes BatchNorm + ReLU in its prologue and writes its own; the output, the
    BatchNorm states and the gradients of every parameter and of the input match the
    unfused layers.  (No biases: before a BatchNorm their true gradient is zero, and both
    forms return only their rounding noise; the fused op's bias is tested in
    ``tests/pallas/test_mgpu_fused.py``, before a ReLU.)"""
    model = L.serial(("conv1", L.Conv2D(16, 3, padding=1, use_bias=False)),
                     ("bn1", L.BatchNorm()), ("relu1", L.Relu()),
                     ("conv2", L.Conv2D(16, 1, use_bias=False)), ("bn2", L.BatchNorm()), ("relu2", L.Relu()))
    x_shape = (2, 4, 6, 8)
    params, state, _ = model.init(jax.random.PRNGKey(0), x_shape)
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda p: p + 0.3 * rng.standard_normal(p.shape).astype(np.float32),
                          params)  # BatchNorm affine parameters away from 1 and 0
    x = jnp.asarray(rng.standard_normal(x_shape).astype(np.float32))
    ct = jnp.asarray(rng.standard_normal((2, 4, 6, 16)).astype(np.float32))
    assert _kernel_names(model, params, state, x, "mosaic") == {
        "jaxcnn_mgpu_conv_fwd_stats", "jaxcnn_mgpu_conv_fwd_bnrelu_stats"}
    assert _kernel_names(model, params, state, x, "off") == set()
    y, new_state, grads = _run(model, params, state, x, ct, "mosaic")
    y_ref, state_ref, grads_ref = _run(model, params, state, x, ct, "off")
    assert y.dtype == y_ref.dtype == jnp.bfloat16
    _assert_close(y, y_ref, "output")
    for path, got, want in zip(jax.tree_util.tree_leaves_with_path(new_state),
                               jax.tree.leaves(new_state), jax.tree.leaves(state_ref)):
        if got.dtype == jnp.int32:
            assert int(got) == int(want) == 1
        else:
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3,
                                       err_msg=jax.tree_util.keystr(path[0]))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(grads),
                                 jax.tree.leaves(grads_ref)):
        assert got.dtype == want.dtype
        _assert_close(got, want, f"gradient {jax.tree_util.keystr(path)}")


@needs_mgpu
def test_a_resnet_bottleneck_runs_its_chains_fused():
    """The zoo's bottleneck block (conv1 -> bn1 -> relu1 -> conv2/2 -> bn2 -> relu2 -> conv3 ->
    bn3, projection shortcut): every convolution writes statistics, conv2 and conv3 take the
    previous BatchNorm + ReLU in their prologue, and the block's output and BatchNorm states
    match the unfused block (forward only: the chain test covers the gradients)."""
    block = bottleneck(16, 8, stride=2)  # 16 -> 8 -> 8 -> 32 channels, projection 16 -> 32
    x_shape = (2, 4, 4, 16)
    params, state, _ = block.init(jax.random.PRNGKey(1), x_shape)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(x_shape).astype(np.float32))
    assert _kernel_names(block, params, state, x, "mosaic") == {
        "jaxcnn_mgpu_conv_fwd_stats", "jaxcnn_mgpu_conv_fwd_bnrelu_stats"}

    def forward(fusion):
        fn = jax.jit(lambda p, x: block.apply(p, state, x, train=True, policy=BF16,
                                              choices=L.Choices(conv_bn=fusion)))
        return fn.trace(params, x).lower().compile({"xla_backend_optimization_level": 0})(
            params, x)
    (y, new_state), (y_ref, state_ref) = forward("mosaic"), forward("off")
    _assert_close(y, y_ref, "block output")
    assert set(new_state) == set(state_ref) == {"bn1", "bn2", "bn3", "downsample"}
    for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(state_ref)):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=1e-3, atol=1e-3)


def test_auto_fuses_only_where_a_measured_win_is_cached(monkeypatch):
    """``conv_bn="auto"``: never off a GPU (the chain walk is not even entered), and on a
    Hopper GPU only for a call whose cached verdict says the fused op wins forward and
    backward (the walk only where some call won, over a Conv -> BatchNorm pair); "off" never
    fuses, "mosaic" wherever the kernels run the call."""
    from pallas_kernels import autotune
    x = jax.ShapeDtypeStruct((8, 14, 14, 64), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((3, 3, 64, 64), jnp.bfloat16)
    kw = dict(stride=1, padding=1, dilation=1, groups=1, prologue=True, stats=True)
    assert not fcb.use_fusion("auto", x, w, **kw)  # this CPU
    assert not fusion.active(L.Choices(), train=True)
    assert not fusion.active(L.Choices(conv_bn="mosaic"), train=False)
    monkeypatch.setattr(_dispatch, "_platform", lambda: "gpu")
    monkeypatch.setattr(autotune, "device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(mc, "device_capability", lambda: "9.0")
    seen = []

    def verdict(op, arrays, static, answer=None):
        seen.append((op, static))
        return answer
    for answer, want in ((None, False), ((True, False), False), ((False, True), True)):
        monkeypatch.setattr(autotune, "verdict",
                            lambda op, arrays, static, a=answer: verdict(op, arrays, static, a))
        assert fcb.use_fusion("auto", x, w, **kw) is (want and REASON is None)
    assert seen[-1] == ("conv_bn", dict(stride=(1, 1), padding=((1, 1), (1, 1)),
                                        dilation=(1, 1), prologue=True, stats=True))
    # The chain walk itself: only where this device kind's cache holds a win of a fused call
    # (the shipped table holds none for the H100), and only over a Conv -> BatchNorm pair.
    assert not fusion.active(L.Choices(), train=True)
    monkeypatch.setattr(autotune, "_entries", lambda: {"kernels": {}, "ops": {
        "conv_bn|bfloat16[8, 14, 14, 64]|stats=True": {"fwd_faster": True, "grad_faster": True}}})
    assert fusion.active(L.Choices(), train=True)
    pairs = lambda *kinds: [(str(i), L.Conv2D(4, 3) if k == "c" else L.BatchNorm() if k == "b" else L.Relu())
                            for i, k in enumerate(kinds)]
    assert fusion.has_chain(pairs("c", "b", "r")) and fusion.has_chain(pairs("r", "c", "b"))
    assert not fusion.has_chain(pairs("c", "r", "b")) and not fusion.has_chain(pairs("b", "c"))
    assert not fcb.use_fusion("off", x, w, **kw)
    assert fcb.use_fusion("mosaic", x, w, **kw) is (REASON is None)
    assert not fcb.use_fusion("mosaic", jax.ShapeDtypeStruct((8, 14, 14, 64), F32),
                              jax.ShapeDtypeStruct((3, 3, 64, 64), F32), **kw)


def test_a_bad_conv_bn_choice_is_one_clear_error():
    with pytest.raises(ValueError, match=r"Choices: conv_bn must be one of .*'fused'"):
        L.Choices(conv_bn="fused")


def test_the_chain_walk_is_transparent_where_nothing_fuses():
    """With conv_bn="mosaic" but float32 (no kernel runs it), serial and residual walk their
    children through the fusion code and must give exactly the unfused results: the same
    bits, random keys (dropout) and states."""
    model = L.serial(
        ("conv", L.Conv2D(8, 3, padding=1)), ("bn", L.BatchNorm()), ("relu", L.Relu()),
        ("drop", L.Dropout(0.5)),
        ("block", L.residual(("c1", L.Conv2D(8, 1)), ("b1", L.BatchNorm()), ("r1", L.Relu()),
                             ("c2", L.Conv2D(8, 3, padding=1)), ("b2", L.BatchNorm()),
                             activation=L.Relu())))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 5, 5, 8)).astype(np.float32))
    params, state, _ = model.init(jax.random.PRNGKey(2), x.shape)

    def run(fusion):  # one jitted program per choice: two programs, nothing shared between them
        return jax.jit(lambda p, x: model.apply(p, state, x, train=True, rng=jax.random.PRNGKey(3),
                                                choices=L.Choices(conv_bn=fusion)))(params, x)
    (y, s), (y_ref, s_ref) = run("mosaic"), run("off")
    assert np.array_equal(np.asarray(y), np.asarray(y_ref))
    assert jax.tree.structure(s) == jax.tree.structure(s_ref)
    for a, b in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_batch_norm_from_fused_statistics_syncs_like_the_layer():
    """SyncBatchNorm: the fused path's BatchNorm (from per-device conv statistics, combined
    over the mapped axis) gives the layer's new running statistics and its normalisation."""
    bn = L.BatchNorm(momentum=0.3)
    y = jnp.asarray(np.random.default_rng(4).standard_normal((2, 3, 4, 4, 8)).astype(np.float32)
                    * 2 + 1)  # (devices, N, H, W, C)
    params, state, _ = bn.init(None, y.shape[1:])
    params = {"scale": params["scale"] * 1.5, "bias": params["bias"] - 0.5}
    choices = L.Choices(axis_name="d")

    def fused(y):
        mean, var = jnp.mean(y, (0, 1, 2)), jnp.var(y, (0, 1, 2))  # what the kernel returns
        scale, shift, new = fusion._batch_norm(bn, params, state, y.shape, mean, var, choices)
        return y * scale + shift, new

    def layer(y):
        return bn.apply(params, state, y, train=True, choices=choices)
    # jitted: one program each instead of a compilation per eager op
    (z, new), (z_ref, new_ref) = (jax.jit(jax.vmap(f, axis_name="d"))(y) for f in (fused, layer))
    np.testing.assert_allclose(z, z_ref, rtol=1e-5, atol=1e-5)
    for k in ("mean", "var"):
        np.testing.assert_allclose(new[k], new_ref[k], rtol=1e-6, atol=1e-6)
    assert int(new["count"][0]) == 1
