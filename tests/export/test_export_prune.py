"""Magnitude pruning: exact sparsity, the magnitude order, channel structure,
exclusions, and masks that survive fine-tuning (see test_export_mnist.py)."""
import numpy as np
import pytest
from export_cases import init_model

from jaxcnn import layers as L
from jaxcnn.export import ExportError, magnitude_prune, sparsity_report


def _model():
    model = L.serial(("c1", L.Conv2D(8, 3)), L.Relu(), ("c2", L.Conv2D(6, 3)), L.Flatten(),
                     ("fc", L.Linear(5)))
    params, _ = init_model(model, (8, 8, 2))
    return model, params


def test_global_unstructured_prunes_the_smallest_weights():
    model, params = _model()
    pruned, masks = magnitude_prune(model, params, 0.6)
    ws = [(params[k]["w"], pruned[k]["w"]) for k in ("c1", "c2", "fc")]
    total = sum(w.size for w, _ in ws)
    assert sum(int(np.sum(p == 0)) for _, p in ws) == round(0.6 * total)
    kept = np.concatenate([np.abs(w[p != 0]) for w, p in ws])
    dropped = np.concatenate([np.abs(w[p == 0]) for w, p in ws])
    assert kept.min() >= dropped.max()
    report = sparsity_report(model, pruned)
    assert report["prunable_sparsity"] == pytest.approx(round(0.6 * total) / total)
    np.testing.assert_array_equal(pruned["c1"]["b"], params["c1"]["b"])  # biases untouched


def test_per_layer_and_exclude():
    model, params = _model()
    pruned, _ = magnitude_prune(model, params, 0.5, scope="layer", exclude=("fc",))
    report = sparsity_report(model, pruned)["layers"]
    for k in ("c1", "c2"):
        assert report[k]["zeros"] == round(0.5 * report[k]["size"])
    assert report["fc"]["zeros"] == 0


@pytest.mark.parametrize("scope", ["layer", "global"])
def test_channel_pruning_removes_whole_filters(scope):
    model, params = _model()
    pruned, masks = magnitude_prune(model, params, 0.5, scope=scope, structure="channel")
    for k in ("c1", "c2"):
        w = pruned[k]["w"].reshape(-1, pruned[k]["w"].shape[-1])
        dead = np.all(w == 0, axis=0)
        assert np.all((w != 0) | dead)                       # a channel is all or nothing
        np.testing.assert_array_equal(pruned[k]["b"][dead], 0)
        assert 0 < dead.sum() < dead.size or scope == "global"
    if scope == "layer":
        assert np.all(np.all(pruned["c1"]["w"].reshape(-1, 8) == 0, axis=0).sum() == 4)
    np.testing.assert_array_equal(pruned["fc"]["w"], params["fc"]["w"])   # logits layer kept
    assert "fc.w" not in masks


def test_bad_sparsity():
    model, params = _model()
    with pytest.raises(ExportError, match="sparsity"):
        magnitude_prune(model, params, 1.0)
    with pytest.raises(ExportError, match="structure"):
        magnitude_prune(model, params, 0.5, structure="blocks")
