"""The model registry: build a zoo model by name.

Each family module registers its builders with :func:`register`; users call
:func:`get`, :func:`names` and :func:`default_input_shape`.  A builder is a
function of keyword-only options (``num_classes`` among them) returning a
:class:`jaxcnn.layers.base.Layer`.
"""
from __future__ import annotations

import difflib
import inspect
from typing import Callable, NamedTuple

from jaxcnn.layers.base import Layer
from jaxcnn.layers.combinators import whole_model


class _Entry(NamedTuple):
    builder: Callable[..., Layer]
    input_shape: tuple[int, int, int, int]


_MODELS: dict[str, _Entry] = {}


def register(name: str, input_shape: tuple[int, int, int, int]):
    """Decorator registering ``builder`` under ``name``.

    Arguments:
        name: registry name, e.g. ``"resnet18"``.
        input_shape: the model's usual input ``(1, H, W, C)`` (NHWC).
    """
    def decorate(builder):
        if name in _MODELS:
            raise ValueError(f"model {name!r} is registered twice")
        _MODELS[name] = _Entry(builder, tuple(input_shape))
        return builder
    return decorate


def _entry(name: str) -> _Entry:
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {names()}") from None


def get(name: str, *, num_classes: int | None = None, **options) -> Layer:
    """Build the model registered as ``name``.

    Arguments:
        name: one of :func:`names`.
        num_classes: size of the classifier output; ``None`` keeps the model's
            default (10 for the MNIST models, 1000 for the ImageNet ones).
        **options: family options (e.g. ``cifar_stem=True`` for ResNets,
            ``width_mult`` for MobileNetV2); unknown options are a ValueError.

    Returns:
        The model as a Layer (wrapped in :func:`jaxcnn.layers.whole_model`); its
        input is ``(N, H, W, C)`` images and its output ``(N, num_classes)``
        logits, in the policy's ``output_dtype`` under a precision policy.
    """
    builder = _entry(name).builder
    accepted = inspect.signature(builder).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(_unknown_options(name, unknown, sorted(accepted)))
    if num_classes is not None:
        if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 1:
            raise ValueError(f"model {name!r}: num_classes must be a positive int, "
                             f"got {num_classes!r}")
        options["num_classes"] = num_classes
    return whole_model(builder(**options))


def _unknown_options(name: str, unknown: list, known: list) -> str:
    """The one line for options ``name`` does not take: a close spelling, and where weights
    come from for ``pretrained`` (no weights ship with jaxcnn, none are downloaded)."""
    line = f"model {name!r} got unknown option(s) {unknown}; it accepts {known}"
    if "pretrained" in unknown:
        return (line + "; jaxcnn downloads no weights: load a torchvision state_dict with "
                "jaxcnn.interop.from_torch_state_dict (or a config's model.init_from)")
    close = difflib.get_close_matches(unknown[0], known, n=1, cutoff=0.6)
    return line + (f"; did you mean {close[0]!r}?" if close else "")


def names() -> list[str]:
    """The registered model names, sorted."""
    return sorted(_MODELS)


def default_input_shape(name: str) -> tuple[int, int, int, int]:
    """The usual input shape ``(1, H, W, C)`` of model ``name`` (NHWC, batch 1).

    Models ending in global or adaptive pooling accept other sizes too; the
    ResNets with ``cifar_stem=True`` are meant for 32x32 inputs.
    """
    return _entry(name).input_shape
