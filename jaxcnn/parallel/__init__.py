"""Data and model parallelism over one ``(data, model)`` device mesh.

* :mod:`~jaxcnn.parallel.mesh`: the mesh from ``mesh: {data: -1, model: 1}``.
* :mod:`~jaxcnn.parallel.rules`: logical axis names of parameters and the rule
  table that maps them to mesh axes (model parallelism, fsdp).
* :mod:`~jaxcnn.parallel.strategies`: a pure train step under ``shard_map``,
  ``pmap`` or ``jit`` with ``NamedSharding``.
* :mod:`~jaxcnn.parallel.pipeline`: pipeline stages over a ``pipe`` axis (GPipe).
* :mod:`~jaxcnn.parallel.spatial`: images split along height over ``spatial``.
* :mod:`~jaxcnn.parallel.distributed`: multi-process runs.
* :mod:`~jaxcnn.parallel.plan`: :class:`ParallelPlan`, all of it for the training loop.

Every setting is an argument; none of this package reads a config. A setting it cannot run is
a :class:`jaxcnn.errors.SettingError` naming the argument.
"""
from jaxcnn.errors import SettingError
from jaxcnn.parallel.distributed import DistributedError, batch_share, global_batch, initialize, to_host
from jaxcnn.parallel.mesh import DATA, MODEL, PIPE, SPATIAL, axis_size, check_batch, make_mesh, mesh_shape
from jaxcnn.parallel.pipeline import Pipeline, pipeline_blocks
from jaxcnn.parallel.plan import ParallelPlan
from jaxcnn.parallel.rules import DEFAULT_RULES, logical_axes, partition_spec
from jaxcnn.parallel.spatial import SpatialLayout, spatial_layout
from jaxcnn.parallel.strategies import STRATEGIES, per_device, wrap_train_step

__all__ = ["DATA", "MODEL", "PIPE", "SPATIAL", "axis_size", "DEFAULT_RULES", "STRATEGIES", "DistributedError",
           "ParallelPlan", "Pipeline", "SettingError", "batch_share", "check_batch", "global_batch",
           "initialize", "logical_axes", "make_mesh", "mesh_shape", "partition_spec", "per_device",
           "pipeline_blocks", "SpatialLayout", "spatial_layout", "to_host", "wrap_train_step"]
