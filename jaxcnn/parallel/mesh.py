"""The device mesh: one ``jax.sharding.Mesh`` with named axes ``("data", "model")``,
and ``"pipe"`` / ``"spatial"`` between them when a run asks for pipeline stages or
spatial shards.

``mesh: {data: -1, model: 1}`` in a config becomes a mesh over all devices
(of every process) whose ``data`` axis takes whatever the other axes leave; every
size problem is a :class:`jaxcnn.errors.SettingError` naming the axis (``mesh.model``).

Axis order, outermost first: ``data, pipe, spatial, model``.  ``pipe`` and
``spatial`` are present only when their size is above 1, so a plain data/model
mesh keeps its two axes (and its checkpoints their shardings); read any axis
size with :func:`axis_size`, which gives 1 for an absent axis.

Device layout: by default the devices (process by process, each process's in
turn) fill the axes in that same order, so the innermost axes stay inside a
process: ``data 2 x pipe 4`` over two processes of 4 devices puts each data
shard's 4 pipeline stages in one process.  ``mesh.order`` (``make_mesh(...,
order=...)``) names the axes in the order the devices fill them instead:
``order: [pipe]`` (the axes left out follow in the default order) puts stages
0-1 of both data shards on process 0 and stages 2-3 on process 1, so the
stages, not the data shards, are spread over the processes.
"""
from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jaxcnn.errors import SettingError

DATA, MODEL = "data", "model"
PIPE, SPATIAL = "pipe", "spatial"
AXES = (DATA, MODEL)
ALL_AXES = (DATA, PIPE, SPATIAL, MODEL)  # mesh order, outermost first


def axis_size(mesh: Mesh, name: str) -> int:
    """The size of axis ``name`` of ``mesh``; 1 when the mesh has no such axis."""
    return dict(mesh.shape).get(name, 1)


def mesh_shape(data: int, model: int, device_count: int, *, allow_subset: bool = False,
               pipe: int = 1, spatial: int = 1) -> tuple[int, int]:
    """Resolve ``-1`` and check that the axis sizes fit ``device_count`` devices.

    Arguments:
        data: devices on the data axis, or -1 for all the other axes leave.
        model: devices on the model axis (>= 1).
        device_count: devices available.
        allow_subset: accept explicit sizes that use fewer devices than there
            are (single-process runs: the mesh takes the first ones).
        pipe, spatial: devices on the pipeline and spatial axes (>= 1).

    Returns:
        ``(data, model)`` as positive ints with ``data * pipe * spatial * model ==
        device_count`` (``<=`` with ``allow_subset``).

    Raises:
        SettingError: naming ``mesh.model``, ``mesh.pipe``, ``mesh.spatial`` or
            ``mesh.data`` when the sizes do not fit.
    """
    others = 1
    for key, size in (("model", model), ("pipe", pipe), ("spatial", spatial)):
        if size < 1:
            raise SettingError(f"mesh.{key}", f"expected a positive int, got {size}")
        others *= size
        if others > device_count or device_count % others:
            raise SettingError(f"mesh.{key}", f"{size} does not divide the {device_count} available devices"
                               + (f" (with the other axes: {others} devices)" if others != size else ""))
    if data == -1:
        data = device_count // others
    fits = data * others <= device_count if allow_subset else data * others == device_count
    if data < 1 or not fits:
        shown = [(k, v) for k, v in (("data", data), ("pipe", pipe), ("spatial", spatial), ("model", model))
                 if k in AXES or v > 1]
        raise SettingError("mesh.data", f"{' x '.join(k for k, _ in shown)} = "
                           f"{' x '.join(str(v) for _, v in shown)} = {data * others} devices, but "
                           f"{device_count} {'is' if device_count == 1 else 'are'} available "
                           f"(use mesh.data=-1 to take the rest)")
    return data, model


def device_order(order: Sequence[str] | None) -> tuple[str, ...]:
    """The four axes in the order the device list fills them, outermost first: the axes
    ``order`` names, then the others in the default order ``data, pipe, spatial, model``.

    Raises:
        SettingError: naming ``mesh.order`` for an unknown or repeated axis name.
    """
    order = tuple(order or ())
    for i, name in enumerate(order):
        if name not in ALL_AXES:
            raise SettingError("mesh.order", f"unknown axis {name!r}; expected names from {list(ALL_AXES)}")
        if name in order[:i]:
            raise SettingError("mesh.order", f"axis {name!r} is named twice in {list(order)}")
    return order + tuple(a for a in ALL_AXES if a not in order)


def make_mesh(data: int = -1, model: int = 1, *, devices: Sequence | None = None,
              pipe: int = 1, spatial: int = 1, order: Sequence[str] | None = None) -> Mesh:
    """A ``(data, [pipe], [spatial], model)`` mesh over ``devices`` (all devices of all
    processes by default).

    Both axes are ``AxisType.Auto`` (classic GSPMD propagation): the newer
    ``jax.make_mesh`` default, Explicit, would put shardings into the types and
    reject ops without a sharding rule (convolutions on sharded channels).

    Arguments:
        data: data-axis size or -1.
        model: model-axis size.
        devices: the devices to use, in mesh order; None = ``jax.devices()``
            (in a single process, explicit sizes may take only the first ones).
        pipe: pipeline stages (the ``pipe`` axis, present when above 1).
        spatial: spatial shards of each image (the ``spatial`` axis, present when above 1).
        order: the axes in the order the devices fill them, outermost first (see
            :func:`device_order`); None: the mesh's own order ``data, pipe, spatial, model``.
            ``order=["pipe"]`` with ``data=2, pipe=4`` over two processes of 4 devices puts
            pipeline stages 0-1 on process 0 and 2-3 on process 1 (each process then holds
            devices of both data shards and loads the whole batch).

    Returns:
        A ``jax.sharding.Mesh`` with axis names ``("data", "model")``, with
        ``"pipe"`` and ``"spatial"`` between them when asked for.
    """
    fill = device_order(order)
    given = devices is not None
    subset = not given and jax.process_count() == 1
    devices = list(jax.devices() if devices is None else devices)
    data, model = mesh_shape(data, model, len(devices), allow_subset=subset, pipe=pipe, spatial=spatial)
    sizes = {DATA: data, PIPE: pipe, SPATIAL: spatial, MODEL: model}
    names = tuple(a for a in ALL_AXES if a in AXES or sizes[a] > 1)
    shape = tuple(sizes[a] for a in names)
    auto = (jax.sharding.AxisType.Auto,) * len(names)
    count = int(np.prod(shape))
    filled = tuple(a for a in fill if a in names)
    if filled == names and count == len(jax.devices()) and not given:  # given: their order is the mesh's
        return jax.make_mesh(shape, names, axis_types=auto)
    return Mesh(device_grid(devices[:count], sizes, order)[0], names, axis_types=auto)


def device_grid(devices: Sequence, sizes: dict, order: Sequence[str] | None = None):
    """The devices laid out on the mesh's axes: ``(grid, names)``, ``names`` the axes present
    (``data`` and ``model`` always, ``pipe``/``spatial`` above size 1) in mesh order and
    ``grid`` the object array of ``devices`` with those axes, filled in ``order`` (see
    :func:`device_order`; the list's first device at index 0 of every axis)."""
    names = tuple(a for a in ALL_AXES if a in AXES or sizes.get(a, 1) > 1)
    filled = tuple(a for a in device_order(order) if a in names)
    grid = np.asarray(list(devices), dtype=object).reshape(tuple(sizes.get(a, 1) for a in filled))
    return grid.transpose(tuple(filled.index(a) for a in names)), names


def check_batch(mesh: Mesh, batch_size: int) -> None:
    """Check that a global batch splits evenly over the data axis and the processes.

    Arguments:
        mesh: the mesh.
        batch_size: the global batch size.

    Raises:
        SettingError: naming ``batch_size`` when it is not a multiple of the data-axis size
            or of the number of processes.
    """
    data = mesh.shape[DATA]
    if batch_size % data:
        raise SettingError("batch_size", f"global batch {batch_size} does not divide over the {data} "
                           f"devices of the mesh's data axis (mesh.data={data}); use a multiple of {data}")
    procs = jax.process_count()
    if batch_size % procs:
        raise SettingError("batch_size", f"global batch {batch_size} does not divide over {procs} processes")
