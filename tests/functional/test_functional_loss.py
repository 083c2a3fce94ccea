"""cross_entropy and top-k accuracy against numpy float64 references and PyTorch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxcnn import functional as F

RTOL = 1e-5          # float32 loss vs float64 reference, relative
GRAD_RTOL = 1e-5


def log_softmax_ref(logits):
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def ce_ref(logits, labels, eps):
    """Per-example loss of the smoothed target (1 - eps) one_hot + eps / K."""
    k = logits.shape[-1]
    target = (1 - eps) * np.eye(k)[labels] + eps / k
    return -(target * log_softmax_ref(logits)).sum(axis=-1)


def batch(seed, n=16, k=10, scale=3.0):
    rng = np.random.default_rng(seed)
    return ((rng.standard_normal((n, k)) * scale).astype(np.float32),
            rng.integers(0, k, size=n).astype(np.int32))


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 999), st.sampled_from([0.0, 0.1, 0.5, 1.0]),
       st.sampled_from(["mean", "sum", "none"]))
def test_cross_entropy_matches_reference(seed, eps, reduction):
    logits, labels = batch(seed)
    loss = F.cross_entropy(logits, labels, label_smoothing=eps, reduction=reduction)
    ref = ce_ref(logits, labels, eps)
    ref = {"mean": ref.mean(), "sum": ref.sum(), "none": ref}[reduction]
    assert loss.dtype == jnp.float32
    np.testing.assert_allclose(loss, ref, rtol=RTOL, atol=RTOL)


def test_cross_entropy_where_mask_and_extra_axes():
    logits, labels = batch(1, n=12)
    mask = np.arange(12) % 3 != 0
    ref = ce_ref(logits, labels, 0.1)
    # Each call jitted (its options static): one program per case, not an eager op at a time.
    cross_entropy = jax.jit(F.cross_entropy, static_argnames=("label_smoothing", "reduction"))
    got = cross_entropy(logits, labels, label_smoothing=0.1, where=mask)
    np.testing.assert_allclose(got, ref[mask].mean(), rtol=RTOL)
    got = cross_entropy(logits, labels, label_smoothing=0.1, where=mask, reduction="sum")
    np.testing.assert_allclose(got, ref[mask].sum(), rtol=RTOL)
    got = cross_entropy(logits, labels, label_smoothing=0.1, where=mask, reduction="none")
    np.testing.assert_allclose(got, np.where(mask, ref, 0), rtol=RTOL, atol=1e-7)
    # Masked entries get no gradient.
    g = jax.jit(jax.grad(lambda z: F.cross_entropy(z, labels, where=mask)))(jnp.asarray(logits))
    assert np.all(np.asarray(g)[~mask] == 0) and np.all(np.abs(np.asarray(g)[mask]).sum(-1) > 0)
    # Leading axes: (2, 6, K) logits with (2, 6) labels.
    got = cross_entropy(logits.reshape(2, 6, 10), labels.reshape(2, 6), reduction="none")
    np.testing.assert_allclose(got, ce_ref(logits, labels, 0.0).reshape(2, 6), rtol=RTOL)


def test_cross_entropy_computes_in_float32_for_bf16_logits():
    logits, labels = batch(2, scale=20.0)
    lb = jnp.asarray(logits, jnp.bfloat16)
    loss = F.cross_entropy(lb, labels, label_smoothing=0.1)
    assert loss.dtype == jnp.float32
    # Exact to float32 on the bf16-rounded logits, i.e. no bf16 arithmetic inside.
    np.testing.assert_allclose(loss, ce_ref(np.asarray(lb, np.float32), labels, 0.1).mean(), rtol=RTOL)


def test_cross_entropy_gradient_is_softmax_minus_target():
    logits, labels = batch(3)
    g = jax.grad(lambda z: F.cross_entropy(z, labels, label_smoothing=0.2))(jnp.asarray(logits))
    target = 0.8 * np.eye(10)[labels] + 0.02
    np.testing.assert_allclose(g, (np.exp(log_softmax_ref(logits)) - target) / 16, rtol=1e-4, atol=1e-7)


def top_k_ref(logits, labels, k):
    order = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return (order == labels[:, None]).any(axis=-1)


@pytest.mark.parametrize("k", [1, 3, 10])
def test_top_k(k):
    logits, labels = batch(4, n=64)
    np.testing.assert_array_equal(F.top_k_correct(logits, labels, k), top_k_ref(logits, labels, k))
    mask = np.arange(64) < 40
    np.testing.assert_allclose(F.top_k_accuracy(logits, labels, k), top_k_ref(logits, labels, k).mean())
    np.testing.assert_allclose(F.top_k_accuracy(logits, labels, k, where=mask),
                               top_k_ref(logits, labels, k)[mask].mean(), rtol=1e-6)


def test_top_k_ties_count_for_the_label():
    logits = np.array([[1.0, 1.0, 0.0], [2.0, 1.0, 1.0]], np.float32)
    np.testing.assert_array_equal(F.top_k_correct(logits, np.array([1, 2]), 1), [True, False])
    np.testing.assert_array_equal(F.top_k_correct(logits, np.array([1, 2]), 2), [True, True])


ERRORS = [
    (lambda: F.cross_entropy(np.zeros((4, 3)), np.zeros(5, np.int32)), r"cross_entropy: labels shape \(5,\) .*\(4, 3\)"),
    (lambda: F.cross_entropy(np.zeros((4, 3)), np.zeros(4)), r"cross_entropy: labels must be integer"),
    (lambda: F.cross_entropy(np.zeros((4, 3)), np.zeros(4, np.int32), reduction="avg"), r"cross_entropy: reduction must be one of"),
    (lambda: F.cross_entropy(np.zeros((4, 3)), np.zeros(4, np.int32), label_smoothing=1.5), r"cross_entropy: label_smoothing"),
    (lambda: F.cross_entropy(np.zeros((4, 3)), np.zeros(4, np.int32), where=np.ones(3, bool)), r"cross_entropy: where shape \(3,\)"),
    (lambda: F.top_k_correct(np.zeros((4, 3)), np.zeros(4, np.int32), k=0), r"top_k_correct: k must be a positive int"),
    (lambda: F.top_k_accuracy(np.zeros((4, 3)), np.zeros((4, 1), np.int32)), r"top_k_correct: labels shape \(4, 1\)"),
]


@pytest.mark.parametrize("call,match", ERRORS)
def test_bad_arguments_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.torch
@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(eps, reduction):
    torch = pytest.importorskip("torch")
    logits, labels = batch(5)
    loss, vjp = jax.vjp(lambda z: F.cross_entropy(z, labels, label_smoothing=eps, reduction=reduction),
                        jnp.asarray(logits))
    zt = torch.tensor(logits, requires_grad=True)
    lt = torch.nn.functional.cross_entropy(zt, torch.tensor(labels, dtype=torch.long),
                                           label_smoothing=eps, reduction=reduction)
    ct = np.random.default_rng(6).standard_normal(np.shape(loss)).astype(np.float32)
    lt.backward(torch.tensor(ct))
    np.testing.assert_allclose(loss, lt.detach().numpy(), rtol=RTOL)
    np.testing.assert_allclose(vjp(jnp.asarray(ct))[0], zt.grad.numpy(), rtol=1e-4, atol=GRAD_RTOL)
    topk = torch.topk(torch.tensor(logits), 3).indices.numpy()
    np.testing.assert_array_equal(F.top_k_correct(logits, labels, 3), (topk == labels[:, None]).any(-1))
