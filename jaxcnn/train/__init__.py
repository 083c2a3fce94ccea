"""Config-driven training: config -> data -> step -> loop.

``jaxcnn-train CONFIG [key=value ...]`` trains from a YAML file; :func:`run` does the same from
Python, with a file, a mapping or a loaded config. The pieces are usable on their own: :class:`TrainState`, :func:`make_train_step` (a ``TrainStep`` holding
the pure ``step(state, batch) -> (state, metrics)``), :func:`load_config`.
"""
from jaxcnn.train.config import ConfigError, load_config, to_dict
from jaxcnn.train.state import TrainState, create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step

__all__ = ["ConfigError", "TrainState", "create_train_state", "load_config", "make_eval_step",
           "make_train_step", "run", "to_dict"]


def __getattr__(name):
    """``run`` is imported when first asked for: the loop brings the data pipeline, orbax and
    the parallel engines, which the config and the steps alone do not need."""
    if name == "run":
        from jaxcnn.train.loop import run
        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
