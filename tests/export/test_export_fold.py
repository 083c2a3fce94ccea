"""BatchNorm folding: the folded model's eval-mode output equals the original's
to float32 rounding (max error <= 1e-5 of the output scale), no BatchNorm is
left where one follows a conv/linear layer, and the result is a normal model."""
import numpy as np
import pytest
from export_cases import eval_logits, init_model, random_init

from jaxcnn import layers as L
from jaxcnn import models
from jaxcnn.export import fold_batch_norm
from jaxcnn.export.fold import batch_norm_paths, fold_pair


def _assert_same(model, params, state, x):
    ref = eval_logits(model, params, state, x)
    folded = fold_batch_norm(model, params, state)
    out = eval_logits(*folded, x)
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    return folded


def test_resnet18_cifar_stem_folds_exactly():
    model = models.get("resnet18", num_classes=10, cifar_stem=True)
    params, state = random_init(model, (16, 16, 3))
    x = np.random.default_rng(0).normal(size=(4, 16, 16, 3)).astype(np.float32)
    f_model, f_params, f_state = _assert_same(model, params, state, x)
    assert batch_norm_paths(model) and not batch_norm_paths(f_model)
    assert f_state == {}
    # names are kept: the projection shortcut's conv now has a bias
    assert set(f_params["layer2"]["0"]["downsample"]["0"]) == {"w", "b"}


def test_linear_bn_and_unfoldable_bn():
    # BN after a grouped, dilated conv and after a bias-free Linear fold; the BN that
    # starts the model has no conv before it and is kept.
    model = L.serial(L.BatchNorm(), L.Conv2D(4, 3, groups=2, dilation=2), L.BatchNorm(eps=1e-3),
                     L.Relu(), L.Flatten(), L.Linear(5, use_bias=False), L.BatchNorm(), L.Linear(2))
    params, state = init_model(model, (7, 7, 2))
    x = np.random.default_rng(1).normal(size=(3, 7, 7, 2)).astype(np.float32)
    f_model, _, _ = _assert_same(model, params, state, x)
    assert batch_norm_paths(f_model) == ["0"]


def test_fold_pair_formula():
    rng = np.random.default_rng(2)
    w, b = rng.normal(size=(2, 2, 3, 4)), rng.normal(size=4)
    bn_p = {"scale": rng.uniform(0.5, 2, 4), "bias": rng.normal(size=4)}
    bn_s = {"mean": rng.normal(size=4), "var": rng.uniform(0.1, 2, 4)}
    w2, b2 = fold_pair(w.astype(np.float32), b.astype(np.float32), bn_p, bn_s, 1e-5)
    x = rng.normal(size=(2 * 2 * 3,))
    y_ref = (x @ w.reshape(-1, 4) + b - bn_s["mean"]) / np.sqrt(bn_s["var"] + 1e-5) \
        * bn_p["scale"] + bn_p["bias"]
    assert w2.dtype == np.float32
    np.testing.assert_allclose(x @ w2.reshape(-1, 4).astype(np.float64) + b2, y_ref, rtol=1e-5)


@pytest.mark.parametrize("name", ["mobilenet_v2", "vgg16_bn"])
def test_zoo_models_with_batchnorm(zoo_case, name):
    case = zoo_case(name)
    folded = fold_batch_norm(case.model, case.params, case.state)
    assert not batch_norm_paths(folded[0])
    out = eval_logits(*folded, case.x)
    np.testing.assert_allclose(out, case.logits, rtol=0, atol=1e-5 * np.abs(case.logits).max())
