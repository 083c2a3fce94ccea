"""jaxcnn: pure-functional convolutional networks for JAX.

Plain functions over plain arrays (NHWC images, HWIO kernels), layers as
``(init, apply)`` pairs, a model zoo, mixed-precision policies and a
config-driven trainer. ``jaxcnn.predict(source, images, top_k=5)`` classifies image files
with a trained run or an exported model (``jaxcnn-predict``).

Importing it changes nothing process-wide (no ``XLA_FLAGS``, no malloc settings); on a
CPU, ``jaxcnn.cpu.configure()`` before the first JAX computation opts in to both.

The public names load on first use (PEP 562): ``import jaxcnn`` imports neither JAX nor
any submodule, so the console scripts (``jaxcnn._console``) are running, with their Ctrl-C
handling in place, before the 0.5-2 s import of JAX starts. ``jaxcnn.functional``,
``from jaxcnn import layers`` and ``jaxcnn.predict(...)`` work as with eager imports.
"""
import importlib
import types

__version__ = "0.1.0"
__all__ = ["cpu", "functional", "layers", "models", "precision", "interop", "summary",
           "predict", "__version__"]

# ``__all__``'s modules, and those an eager ``import jaxcnn`` used to leave loaded (``jaxcnn.data``)
# or a user may reach for: each imported on first use.
_SUBMODULES = {"cpu", "functional", "layers", "models", "precision", "interop", "data", "errors",
               "train", "export", "parallel"}


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(__all__) | {n for n in globals() if n.startswith("__")})


class _Package(types.ModuleType):
    """``jaxcnn.predict`` is the function (``jaxcnn.predict(source, images)``) even after
    ``jaxcnn.predict`` the module has been imported, which binds the module to the package's
    attribute of that name; the module stays ``sys.modules["jaxcnn.predict"]``. (Likewise
    ``jaxcnn.summary``.)"""

    @property
    def predict(self):
        return importlib.import_module(f"{__name__}.predict").predict

    @predict.setter
    def predict(self, value):  # the import system binding the submodule: keep the function
        pass

    @property
    def summary(self):
        return importlib.import_module(f"{__name__}.summary").summary

    @summary.setter
    def summary(self, value):
        pass


import sys as _sys  # noqa: E402

_sys.modules[__name__].__class__ = _Package
del _sys
