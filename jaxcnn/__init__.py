"""jaxcnn: pure-functional convolutional networks for JAX.

Plain functions over plain arrays (NHWC images, HWIO kernels), layers as
``(init, apply)`` pairs, a model zoo, mixed-precision policies and a
config-driven trainer.

Importing it changes nothing process-wide (no ``XLA_FLAGS``, no malloc settings); on a
CPU, ``jaxcnn.cpu.configure()`` before the first JAX computation opts in to both.
"""
from jaxcnn import cpu, functional, layers, models, precision, interop
from jaxcnn.summary import summary

__version__ = "0.1.0"
__all__ = ["cpu", "functional", "layers", "models", "precision", "interop", "summary",
           "__version__"]
