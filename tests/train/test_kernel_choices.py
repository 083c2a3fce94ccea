"""``model.impl``, ``model.batch_norm_grad`` and ``model.conv_bn``: the train and eval steps
trace the layers with the chosen kernels and BatchNorm backward, and the trainer passes the
config's choice on."""
import importlib
import os

import jax
import numpy as np
import optax
import pytest

from jaxcnn import layers as L
from jaxcnn import precision as P
from jaxcnn.train.config import load_config
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step

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
    text = {(impl, bn): _jaxpr(make_train_step(NET, tx, choices=L.Choices(impl=impl, batch_norm_grad=bn)).step, state, batch)
            for impl in ("auto", "xla", "pallas")
            for bn in ("auto", "explicit", "autodiff", "closed_form")}
    # Pallas kernels show as pallas_call. On the CPU "auto" is XLA and the explicit BatchNorm.
    for (impl, bn), t in text.items():
        assert ("pallas_call" in t) == (impl == "pallas"), (impl, bn)
    for impl in ("auto", "xla", "pallas"):
        assert text[impl, "auto"] == text[impl, "explicit"] != text[impl, "closed_form"]
        assert text[impl, "autodiff"] not in (text[impl, "explicit"], text[impl, "closed_form"])
    assert text["auto", "closed_form"] == text["xla", "closed_form"]


def test_eval_step_traces_the_chosen_kernels():
    _, state, batch = _setup()
    for impl in ("auto", "xla", "pallas"):
        text = _jaxpr(make_eval_step(NET, choices=L.Choices(impl=impl)).step, state.params, state.state, batch)
        assert ("pallas_call" in text) == (impl == "pallas")


def test_same_losses_whichever_backward():
    tx, state, batch = _setup()
    _, auto = jax.jit(make_train_step(NET, tx).step)(state, batch)
    for form in ("autodiff", "closed_form"):
        _, other = jax.jit(make_train_step(NET, tx, choices=L.Choices(batch_norm_grad=form)).step)(state, batch)
        np.testing.assert_allclose(other["loss"], auto["loss"], rtol=1e-6)
        np.testing.assert_allclose(other["grad_norm"], auto["grad_norm"], rtol=1e-4)


def test_one_jitted_function_retraces_for_each_choice():
    """The choices are arguments of apply, so they key the jit cache: one jitted function
    called with "xla" then "pallas" (or autodiff then closed_form) traces each anew. With the
    old thread-local scopes the second call reused the first trace."""
    _, state, batch = _setup()
    traces = []

    def forward(params, model_state, x, choices):
        traces.append(choices)
        return NET.apply(params, model_state, x, train=True, choices=choices)

    run = jax.jit(forward, static_argnums=3)
    choices = (L.Choices(impl="xla"), L.Choices(impl="pallas"),
               L.Choices(batch_norm_grad="closed_form"))
    for c in choices:
        run(state.params, state.state, batch["image"], c)
    assert tuple(traces) == choices  # each choice traced anew, none served a stale trace
    text = {impl: str(jax.make_jaxpr(forward, static_argnums=3)(
        state.params, state.state, batch["image"], L.Choices(impl=impl)))
        for impl in ("xla", "pallas")}
    assert "pallas_call" not in text["xla"] and "pallas_call" in text["pallas"]
    bn = {g: str(jax.make_jaxpr(forward, static_argnums=3)(
        state.params, state.state, batch["image"], L.Choices(batch_norm_grad=g)))
        for g in ("auto", "explicit", "autodiff", "closed_form")}
    assert "_moments" not in bn["autodiff"] and "_moments" in bn["closed_form"]
    assert bn["auto"] == bn["explicit"] != bn["closed_form"]


def test_choices_are_a_choices_object():
    _, state, batch = _setup()
    with pytest.raises(TypeError,
                       match="choices must be a jaxcnn.layers.Choices or None, got dict"):
        NET.apply(state.params, state.state, batch["image"], choices={"impl": "xla"})


def test_bad_names_fail_when_the_step_is_made():
    tx, _, _ = _setup()
    with pytest.raises(ValueError, match="impl must be one of"):
        make_train_step(NET, tx, choices=L.Choices(impl="cudnn"))
    with pytest.raises(ValueError, match="grad must be 'auto' or one of"):
        make_train_step(NET, tx, choices=L.Choices(batch_norm_grad="fused"))
    with pytest.raises(ValueError, match="impl must be one of"):
        make_eval_step(NET, choices=L.Choices(impl="triton"))
    with pytest.raises(ValueError, match=r"Choices: grad must be 'auto' or one of"):
        L.Choices(batch_norm_grad="fused")
    with pytest.raises(ValueError, match=r"Choices: axis_name must be an axis name"):
        L.Choices(axis_name=["data"])
    with pytest.raises(ValueError, match=r"Choices: conv_bn must be one of"):
        make_train_step(NET, tx, choices=L.Choices(conv_bn="cudnn"))


class _Seen(Exception):
    """Raised by the spy below once it has the trainer's choices."""


def test_trainer_passes_the_config_choices(monkeypatch):
    """The trainer makes its step with the config's choices (the real make_train_step takes
    them, checking every argument the trainer passes). The spy then stops the run, before
    anything is compiled: what the step does with each choice is the tests above (the full
    1-step run compiled and ran mnist_cnn, which has no BatchNorm, for nothing more)."""
    seen = {}
    runner = importlib.import_module("jaxcnn.train.run")  # the module (jaxcnn.train.run is the function)
    real = runner.make_train_step

    def spy(*args, **kwargs):
        choices = kwargs["choices"]
        seen.update(impl=choices.impl, bn=choices.batch_norm_grad, conv_bn=choices.conv_bn)
        real(*args, **kwargs)
        raise _Seen

    monkeypatch.setattr(runner, "make_train_step", spy)
    cfg = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"), [
        "model.impl=xla", "model.batch_norm_grad=closed_form", "model.conv_bn=off",
        "train.steps=1",
        "data.batch_size=8", "checkpoint.enabled=false", "logging.progress=none",
        "train.eval_every=null"])
    assert (cfg.model.impl, cfg.model.batch_norm_grad) == ("xla", "closed_form")
    default = load_config(os.path.join(CONFIGS, "mnist_cnn.yaml"))
    assert (default.model.impl, default.model.batch_norm_grad, default.model.conv_bn) == (
        "auto", "auto", "auto")
    import tempfile
    with tempfile.TemporaryDirectory() as work, pytest.raises(_Seen):
        runner.train(cfg, work)
    assert seen == {"impl": "xla", "bn": "closed_form", "conv_bn": "off"}
