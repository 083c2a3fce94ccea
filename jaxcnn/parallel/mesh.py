"""The device mesh: one ``jax.sharding.Mesh`` with named axes ``("data", "model")``.

``mesh: {data: -1, model: 1}`` in a config becomes a mesh over all devices
(of every process) whose ``data`` axis takes whatever ``model`` leaves; every
size problem is a ``ValueError`` whose message starts with the key (the trainer
reports it as a config error; this package knows nothing of the config schema).
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DATA, MODEL = "data", "model"
AXES = (DATA, MODEL)


def mesh_shape(data: int, model: int, device_count: int, *, allow_subset: bool = False) -> tuple[int, int]:
    """Resolve ``-1`` and check that the axis sizes fit ``device_count`` devices.

    Arguments:
        data: devices on the data axis, or -1 for all the model axis leaves.
        model: devices on the model axis (>= 1).
        device_count: devices available.
        allow_subset: accept explicit sizes that use fewer devices than there
            are (single-process runs: the mesh takes the first ones).

    Returns:
        ``(data, model)`` as positive ints with ``data * model == device_count``
        (``<=`` with ``allow_subset``).

    Raises:
        ValueError: naming ``mesh.model`` or ``mesh.data`` when the sizes do not fit.
    """
    if model < 1:
        raise ValueError(f"mesh.model: expected a positive int, got {model}")
    if model > device_count or device_count % model:
        raise ValueError(f"mesh.model: {model} does not divide the {device_count} available devices")
    if data == -1:
        data = device_count // model
    fits = data * model <= device_count if allow_subset else data * model == device_count
    if data < 1 or not fits:
        raise ValueError(f"mesh.data: data x model = {data} x {model} = {data * model} devices, but "
                         f"{device_count} are available (use mesh.data=-1 to take the rest)")
    return data, model


def make_mesh(data: int = -1, model: int = 1, *, devices: Sequence | None = None) -> Mesh:
    """A ``(data, model)`` mesh over ``devices`` (all devices of all processes by default).

    Both axes are ``AxisType.Auto`` (classic GSPMD propagation): the newer
    ``jax.make_mesh`` default, Explicit, would put shardings into the types and
    reject ops without a sharding rule (convolutions on sharded channels).

    Arguments:
        data: data-axis size or -1.
        model: model-axis size.
        devices: the devices to use, in mesh order; None = ``jax.devices()``
            (in a single process, explicit sizes may take only the first ones).

    Returns:
        A ``jax.sharding.Mesh`` with axis names ``("data", "model")``.
    """
    subset = devices is None and jax.process_count() == 1
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(data, model, len(devices), allow_subset=subset)
    auto = (jax.sharding.AxisType.Auto,) * 2
    if shape[0] * shape[1] == len(jax.devices()):
        return jax.make_mesh(shape, AXES, axis_types=auto)
    devices = devices[:shape[0] * shape[1]]
    return Mesh(np.asarray(devices, dtype=object).reshape(shape), AXES, axis_types=auto)


def mesh_from_config(cfg, *, devices: Sequence | None = None) -> Mesh:
    """:func:`make_mesh` from a config's ``mesh`` section (``cfg.mesh.data``, ``cfg.mesh.model``)."""
    return make_mesh(cfg.mesh.data, cfg.mesh.model, devices=devices)


def check_batch(mesh: Mesh, batch_size: int, *, path: str = "data.batch_size") -> None:
    """Check that a global batch splits evenly over the data axis and the processes.

    Arguments:
        mesh: the mesh.
        batch_size: the global batch size.
        path: the config key to name in the error.

    Raises:
        ValueError: when ``batch_size`` is not a multiple of the data-axis size
            or of the number of processes.
    """
    data = mesh.shape[DATA]
    if batch_size % data:
        raise ValueError(f"{path}: global batch {batch_size} does not divide over the {data} devices "
                         f"of the mesh's data axis (mesh.data={data}); use a multiple of {data}")
    procs = jax.process_count()
    if batch_size % procs:
        raise ValueError(f"{path}: global batch {batch_size} does not divide over {procs} processes")
