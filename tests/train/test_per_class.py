"""The eval step: its confusion counts against numpy, its uint8 input normalised on the device;
the per-class record (recall, precision) against its definition, and the console table."""
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn.train import metrics
from jaxcnn.train.step import make_eval_step


def test_eval_sums_count_the_confusion_of_the_unmasked_rows_as_numpy_does():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(64, 7)).astype(np.float32)
    labels = rng.integers(0, 7, 64)
    mask = rng.random(64) < 0.8
    sums = make_eval_step(SimpleNamespace(apply=None)).sums(
        jnp.asarray(logits), {"label": jnp.asarray(labels), "mask": jnp.asarray(mask)})
    expected = np.zeros((7, 7))
    np.add.at(expected, (labels[mask], logits[mask].argmax(-1)), 1)
    np.testing.assert_array_equal(np.asarray(sums["confusion"]), expected)
    assert float(sums["top1_sum"]) == np.trace(expected) and float(sums["count"]) == mask.sum()
    top5 = (np.argsort(-logits, -1)[:, :5] == labels[:, None]).any(-1)
    assert float(sums["top5_sum"]) == (top5 & mask).sum()
    # Past MAX_CONFUSION_CLASSES no matrix is counted (ImageNet-21k's would be 1.8 GB).
    wide = jnp.zeros((2, 1001))
    assert "confusion" not in make_eval_step(SimpleNamespace(apply=None)).sums(
        wide, {"label": jnp.zeros(2, jnp.int32)})


def test_per_class_recall_and_precision_and_the_table():
    confusion = [[3, 1, 0], [0, 2, 0], [1, 0, 0]]  # class "c" is never predicted
    report = metrics.per_class(np.asarray(confusion, np.float32), ["a", "bb", "c"])
    assert report == {"classes": ["a", "bb", "c"], "images": [4, 2, 1],
                      "recall": [0.75, 1.0, 0.0], "precision": [0.75, 2 / 3, None],
                      "confusion": confusion}
    assert metrics.per_class_lines(report) == [
        "class   images    recall  precision",
        "a            4    0.7500     0.7500",
        "bb           2    1.0000     0.6667",
        "c            1    0.0000        n/a",
        "confusion (rows: true class, columns: predicted, in the order above)",
        "a          3     1     0",
        "bb         0     2     0",
        "c          1     0     0"]


def test_the_eval_step_normalises_uint8_images_as_the_host_did():
    """``make_eval_step(image_norm=)`` takes ``uint8`` batches (an image folder's evaluation, sent
    as bytes like training's) and gives the sums of the float32 batch the host used to normalise."""
    import jax
    from jaxcnn.data.dataset import normalize
    from jaxcnn.models import get
    model = get("mnist_cnn", num_classes=7)
    params, state, _ = model.init(jax.random.PRNGKey(0), (4, 28, 28, 3))
    pixels = np.random.default_rng(1).integers(0, 256, (4, 28, 28, 3), np.uint8)
    labels = np.arange(4) % 7
    norm = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    got = jax.jit(make_eval_step(model, image_norm=norm).step)(params, state, {"image": pixels, "label": labels})
    want = jax.jit(make_eval_step(model).step)(params, state, {"image": normalize(pixels, *norm), "label": labels})
    for key in want:
        np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), rtol=1e-5, atol=1e-6, err_msg=key)
    assert float(want["loss_sum"]) > 1.0  # an untrained head: the loss is far from 0
    with pytest.raises(TypeError, match=r"uint8 images are normalised on the device, which needs image_norm"):
        make_eval_step(model).step(params, state, {"image": pixels, "label": labels})
