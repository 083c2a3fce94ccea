"""Config-driven training: config -> data -> step -> loop.

``jaxcnn-train CONFIG [key=value ...]`` runs :func:`train`; the pieces are
usable on their own: :class:`TrainState`, :func:`make_train_step` (a ``TrainStep`` holding
the pure ``step(state, batch) -> (state, metrics)``), :func:`load_config`.
"""
from jaxcnn.train.config import ConfigError, load_config, to_dict
from jaxcnn.train.state import TrainState, create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step

__all__ = ["ConfigError", "TrainState", "create_train_state", "load_config", "make_eval_step",
           "make_train_step", "to_dict"]
