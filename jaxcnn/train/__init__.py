"""Config-driven training: config -> data -> step -> loop.

``jaxcnn-train CONFIG [key=value ...]`` trains from a YAML file; :func:`run` does the same from
Python, with a file, a mapping or a loaded config. The pieces are usable on their own: :class:`TrainState`, :func:`make_train_step` (a ``TrainStep`` holding
the pure ``step(state, batch) -> (state, metrics)``), :func:`load_config`.

The life of a run is one function, :func:`jaxcnn.train.run.train`, in the module
``jaxcnn/train/run.py``; ``jaxcnn.train.run`` is the function :func:`run`, not that module
(imported here, after the submodule of the same name, so the package attribute stays the
function; the module is ``sys.modules["jaxcnn.train.run"]``).
"""
from jaxcnn.train.config import ConfigError, load_config, to_dict
from jaxcnn.train.state import TrainState, create_train_state
from jaxcnn.train.step import make_eval_step, make_train_step
from jaxcnn.train.run import run  # noqa: E402  (binds the function over the submodule's name)

__all__ = ["ConfigError", "TrainState", "create_train_state", "load_config", "make_eval_step",
           "make_train_step", "run", "to_dict"]
