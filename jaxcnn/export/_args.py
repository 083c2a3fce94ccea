"""How export errors name an argument: as the Python argument (``model='x'``) when
:func:`jaxcnn.export.export` or :func:`jaxcnn.export.load_source` is called from Python, as
the command-line flag (``--model 'x'``) under ``jaxcnn-export``, which wraps its call in
:func:`command_line_flags`.  (The Python functions said ``--model`` to Python callers.)"""
from __future__ import annotations

import contextlib
import contextvars

# Python argument -> jaxcnn-export flag.  "preprocessing=False" and "raw_image=True" are one
# flag's whole meaning.
FLAGS = {
    "model": "--model", "out": "--out", "format": "--format", "image_shape": "--input-shape",
    "num_classes": "--num-classes", "model_options": "--model-option", "quantize": "--quantize",
    "prune": "--prune", "fine_tune_steps": "--fine-tune-steps", "fine_tune_dir": "--fine-tune-dir",
    "preprocessing=False": "--no-preprocessing", "raw_image=True": "--raw-image", "layout": "--layout",
    "batch": "--batch", "opset": "--opset",
}

_CLI = contextvars.ContextVar("jaxcnn_export_cli_flags", default=False)


@contextlib.contextmanager
def command_line_flags():
    """Within: errors name ``jaxcnn-export``'s flags instead of the Python arguments."""
    token = _CLI.set(True)
    try:
        yield
    finally:
        _CLI.reset(token)


def on_command_line() -> bool:
    """Whether errors are for ``jaxcnn-export`` (inside :func:`command_line_flags`)."""
    return _CLI.get()


def arg(name: str, value: str | None = None, *, cli_value: str | None = None) -> str:
    """``name`` as the caller wrote it: ``--model`` / ``model``, or with a value
    ``--model 'x'`` / ``model='x'``.

    Arguments:
        name: the Python argument (a key of :data:`FLAGS`).
        value: its value as text (``repr(x)``, or a placeholder such as ``NAME``).
        cli_value: the value as the command line spells it, when that differs
            (``--input-shape 32,32,1`` for ``image_shape=(32, 32, 1)``).
    """
    if on_command_line():
        flag = FLAGS[name]
        text = cli_value if cli_value is not None else value
        return flag if text is None else f"{flag} {text}"
    return name if value is None else f"{name}={value}"
