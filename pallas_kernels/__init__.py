"""Pallas kernels for jaxcnn's convolution and pooling ops.

Empty for now: the kernels (each with a ``jax.custom_vjp`` wrapper) arrive
with step 4.  Until then ``jaxcnn.functional`` ops raise
``NotImplementedError`` for ``impl="pallas"`` and run XLA for ``impl="auto"``.
"""
