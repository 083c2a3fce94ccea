"""jaxcnn: pure-functional convolutional networks for JAX.

Plain functions over plain arrays (NHWC images, HWIO kernels), layers as
``(init, apply)`` pairs, a model zoo, mixed-precision policies and a
config-driven trainer.
"""
from jaxcnn import _host_memory

try:  # first: before anything can start a JAX backend
    _host_memory.configure_malloc()
except Exception:  # noqa: BLE001  (a speed setting must never break the import)
    pass

from jaxcnn import functional, layers, models, precision, interop  # noqa: E402
from jaxcnn.summary import summary  # noqa: E402

__version__ = "0.1.0"
__all__ = ["functional", "layers", "models", "precision", "interop", "summary", "__version__"]
