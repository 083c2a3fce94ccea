"""Test setup shared by the whole suite.

Eight host CPU devices are requested before JAX is imported anywhere, so the
multi-device tests can build meshes on a CPU-only machine.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxcnn's glibc malloc settings keep each process's peak heap; the suite's workers run
# many shapes, so they keep glibc's defaults.  tests/test_host_memory.py checks the
# settings in fresh processes.
os.environ.setdefault("JAXCNN_CPU_MALLOC", "0")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
