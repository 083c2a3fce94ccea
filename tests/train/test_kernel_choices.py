"""``model.impl`` and ``model.batch_norm_grad``: the train and eval steps trace the layers with
the chosen kernels and BatchNorm backward, and the trainer passes the config's choice on."""
import os

import jax
import numpy as np
import optax
import pytest

from jaxcnn import functional as F
from jaxcnn import layers as L
from jaxcnn import precision as P
from jaxcnn.train import loop
from jaxcnn.train.config import load_config
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import kernel_choices, make_eval_step, make_train_step

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
NET = L.serial(("conv", L.Conv2D(4, 3, padding=1)), ("bn", L.BatchNorm()), L.Relu(),
               L.MaxPool2D(2), L.Flatten(), ("fc", L.Linear(3)))
SHAPE = (2, 8, 8, 2)


def _setup():
    tx = optax.sgd(0.1)
    state = create_train_state(NET, tx, jax.random.PRNGKey(0), SHAPE,
                               loss_scale=P.make_loss_scale("none"))
    rng = np.random.default_rng(0)
    batch = {"image": rng.standard_normal(SHAPE).astype(np.float32),
             "label": np.array([0, 2], np.int32)}
    return tx, state, batch


def _jaxpr(fn, *args) -> str:
    return str(jax.make_jaxpr(fn)(*args))


def test_train_step_traces_the_chosen_kernels():
    tx, state, batch = _setup()
    text = {(impl, bn): _jaxpr(make_train_step(NET, tx, impl=impl, batch_norm_grad=bn), state, batch)
            for impl in ("auto", "xla", "pallas") for bn in ("auto", "autodiff", "closed_form")}
    # Pallas kernels show as pallas_call. On the CPU "auto" is XLA and the autodiff backward.
    for (impl, bn), t in text.items():
        assert ("pallas_call" in t) == (impl == "pallas"), (impl, bn)
    for impl in ("auto", "xla", "pallas"):
        assert text[impl, "auto"] == text[impl, "autodiff"] != text[impl, "closed_form"]
    assert text["auto", "closed_form"] == text["xla", "closed_form"]


def test_eval_step_traces_the_chosen_kernels():
    _, state, batch = _setup()
    for impl in ("auto", "xla", "pallas"):
        text = _jaxpr(make_eval_step(NET, impl=impl), state.params, state.state, batch)
        assert ("pallas_call" in text) == (impl == "pallas")


def test_same_losses_whichever_backward_and_auto_keeps_an_enclosing_choice():
    tx, state, batch = _setup()
    _, auto = jax.jit(make_train_step(NET, tx))(state, batch)
    _, closed = jax.jit(make_train_step(NET, tx, batch_norm_grad="closed_form"))(state, batch)
    np.testing.assert_allclose(closed["loss"], auto["loss"], rtol=1e-6)
    np.testing.assert_allclose(closed["grad_norm"], auto["grad_norm"], rtol=1e-4)
    # "auto" in the step leaves a choice made around the tracing in place (bench_train's way).
    with F.default_batch_norm_grad("closed_form"):
        enclosed = _jaxpr(make_train_step(NET, tx), state, batch)
    assert enclosed == _jaxpr(make_train_step(NET, tx, batch_norm_grad="closed_form"), state, batch)
    assert enclosed != _jaxpr(make_train_step(NET, tx), state, batch)
    with kernel_choices("xla", "autodiff"), F.default_impl("pallas"):
        assert "pallas_call" in _jaxpr(make_eval_step(NET), state.params, state.state, batch)


def test_bad_names_fail_when_the_step_is_made():
    tx, _, _ = _setup()
    with pytest.raises(ValueError, match="impl must be one of"):
        make_train_step(NET, tx, impl="cudnn")
    with pytest.raises(ValueError, match="grad must be 'auto' or one of"):
        make_train_step(NET, tx, batch_norm_grad="fused")
    with pytest.raises(ValueError, match="impl must be one of"):
        make_eval_step(NET, impl="triton")


def test_trainer_passes_the_config_choices(monkeypatch):
    seen = {}
    real = loop.make_train_step

    def spy(*args, **kwargs):
        seen.update(impl=kwargs.get("impl"), bn=kwargs.get("batch_norm_grad"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "make_train_step", spy)
    cfg = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"), [
        "model.impl=xla", "model.batch_norm_grad=closed_form", "train.steps=1",
        "data.batch_size=8", "checkpoint.enabled=false", "logging.progress=none",
        "train.eval_every=null"])
    assert (cfg.model.impl, cfg.model.batch_norm_grad) == ("xla", "closed_form")
    default = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"))
    assert (default.model.impl, default.model.batch_norm_grad) == ("auto", "auto")
    import tempfile
    with tempfile.TemporaryDirectory() as work:
        loop.train(cfg, work)
    assert seen == {"impl": "xla", "bn": "closed_form"}
