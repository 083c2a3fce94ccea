"""jaxcnn: pure-functional convolutional networks for JAX.

Plain functions over plain arrays (NHWC images, HWIO kernels), layers as
``(init, apply)`` pairs, a model zoo, mixed-precision policies and a
config-driven trainer. ``jaxcnn.predict(source, images, top_k=5)`` classifies image files
with a trained run or an exported model (``jaxcnn-predict``).

Importing it changes nothing process-wide (no ``XLA_FLAGS``, no malloc settings); on a
CPU, ``jaxcnn.cpu.configure()`` before the first JAX computation opts in to both.
"""
from jaxcnn import cpu, functional, layers, models, precision, interop
from jaxcnn.summary import summary
from jaxcnn.predict import predict  # the function; the module is sys.modules["jaxcnn.predict"]

__version__ = "0.1.0"
__all__ = ["cpu", "functional", "layers", "models", "precision", "interop", "summary",
           "predict", "__version__"]
