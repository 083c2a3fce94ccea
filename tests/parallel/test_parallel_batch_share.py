"""Which rows of every batch each process loads (parallel.distributed.batch_shares), read from
a mesh's devices: fake devices carrying a process_index stand for a multi-process mesh, and the
answer is checked against a brute-force reference (the rows of every data shard a process's
devices hold, enumerated), besides hand-worked layouts."""
import types

import jax
import numpy as np
import pytest

from jaxcnn.parallel.distributed import batch_share, batch_shares
from jaxcnn.parallel.mesh import device_grid, make_mesh


class FakeDevice(types.SimpleNamespace):
    def __repr__(self):
        return f"D{self.id}@p{self.process_index}"


def fake_devices(processes: int, per_process: int) -> list:
    """``processes * per_process`` devices, process by process (jax.devices()'s order)."""
    return [FakeDevice(id=p * per_process + i, process_index=p)
            for p in range(processes) for i in range(per_process)]


def fake_mesh(devices, sizes: dict, order=None):
    """What make_mesh lays out (its device_grid), over fake devices (jax.sharding.Mesh needs
    real ones)."""
    grid, names = device_grid(devices, sizes, order)
    return types.SimpleNamespace(devices=grid, axis_names=names)


def reference_rows(mesh, process: int, batch: int) -> list:
    """Every row of a ``batch``-row global batch that some device of ``process`` holds:
    device at data index i holds rows [i * B/D, (i + 1) * B/D)."""
    n_data = mesh.devices.shape[0]
    rows = set()
    for i in range(n_data):
        if any(d.process_index == process for d in mesh.devices[i].reshape(-1)):
            rows.update(range(i * batch // n_data, (i + 1) * batch // n_data))
    return sorted(rows)


LAYOUTS = [  # processes, devices per process, axis sizes, mesh.order, expected {process: share}
    (1, 8, {"data": 8}, None, {0: (0, 1)}),
    (2, 4, {"data": 8}, None, {0: (0, 2), 1: (1, 2)}),                       # the usual split
    (2, 4, {"data": 4, "model": 2}, None, {0: (0, 2), 1: (1, 2)}),
    (2, 4, {"data": 2, "pipe": 4}, None, {0: (0, 2), 1: (1, 2)}),            # pipe inside a process
    (2, 4, {"data": 2, "pipe": 4}, ["pipe"], {0: (0, 1), 1: (0, 1)}),        # stages across processes
    (2, 4, {"data": 1, "pipe": 8}, None, {0: (0, 1), 1: (0, 1)}),
    (4, 2, {"data": 2, "pipe": 4}, None, {0: (0, 2), 1: (0, 2), 2: (1, 2), 3: (1, 2)}),
    (4, 2, {"data": 2, "pipe": 4}, ["pipe"], {0: (0, 1), 1: (0, 1), 2: (0, 1), 3: (0, 1)}),
    (4, 2, {"data": 4, "pipe": 2}, ["pipe"], {0: (0, 2), 1: (1, 2), 2: (0, 2), 3: (1, 2)}),
    (8, 1, {"data": 4, "pipe": 2}, None, {p: (p // 2, 4) for p in range(8)}),
    (4, 4, {"data": 4, "pipe": 4}, None, {p: (p, 4) for p in range(4)}),
    (4, 4, {"data": 8, "model": 2}, None, {p: (p, 4) for p in range(4)}),
    (2, 4, {"data": 1, "model": 8}, None, {0: (0, 1), 1: (0, 1)}),           # model across processes
    (2, 4, {"data": 2, "spatial": 4}, ["spatial"], {0: (0, 1), 1: (0, 1)}),
]


@pytest.mark.parametrize("processes,per_process,sizes,order,expected", LAYOUTS)
def test_batch_shares_of_several_layouts(processes, per_process, sizes, order, expected):
    mesh = fake_mesh(fake_devices(processes, per_process), sizes, order)
    shares = batch_shares(mesh)
    assert shares == expected
    batch = 16 * mesh.devices.shape[0]
    for process, (index, count) in shares.items():
        rows = list(range(index * batch // count, (index + 1) * batch // count))
        assert rows == reference_rows(mesh, process, batch), (process, index, count)
    # the input makers' split: the same (index, count) the trainer used before, for the usual layouts
    if all(len({d.process_index for d in shard.reshape(-1)}) == 1 for shard in mesh.devices) and \
            mesh.devices.shape[0] % processes == 0:
        assert shares == {p: (p, processes) for p in range(processes)}


def test_random_device_orders_agree_with_the_reference_or_are_refused():
    """Shuffled device orders (as a hand-built device list might give): every accepted layout
    loads each process exactly the rows its devices hold; every refused one is one line naming
    mesh.data, and really has a process whose shards are not one aligned block of the common size."""
    rng = np.random.default_rng(0)
    accepted = refused = 0
    for trial in range(300):
        processes, per_process = [(2, 4), (4, 2), (2, 2), (4, 4)][trial % 4]
        n = processes * per_process
        n_data = int(rng.choice([d for d in (1, 2, 4, 8) if n % d == 0]))
        devices = fake_devices(processes, per_process)
        order = rng.permutation(n)
        mesh = fake_mesh([devices[i] for i in order], {"data": n_data, "pipe": n // n_data})
        held = {p: sorted({i for i in range(n_data) for d in mesh.devices[i].reshape(-1)
                           if d.process_index == p}) for p in range(processes)}
        k = {len(s) for s in held.values()}
        feedable = len(k) == 1 and all(s == list(range(s[0], s[0] + len(s))) and s[0] % len(s) == 0
                                       for s in held.values())
        if feedable:
            shares = batch_shares(mesh)
            batch = 4 * n_data
            for p, (index, count) in shares.items():
                assert list(range(index * batch // count, (index + 1) * batch // count)) == \
                    reference_rows(mesh, p, batch)
            accepted += 1
        else:
            with pytest.raises(ValueError) as err:
                batch_shares(mesh)
            assert str(err.value).startswith("mesh.data: process ") and "\n" not in str(err.value)
            refused += 1
    assert accepted > 50 and refused > 50, (accepted, refused)


def test_a_non_contiguous_layout_is_refused_in_one_line():
    # data 4 x pipe 2 over 2 processes with shards 0 and 2 on process 0: no contiguous run of rows
    p0, p1 = [FakeDevice(id=i, process_index=0) for i in range(4)], [FakeDevice(id=4 + i, process_index=1)
                                                                      for i in range(4)]
    grid = np.asarray([[p0[0], p0[1]], [p1[0], p1[1]], [p0[2], p0[3]], [p1[2], p1[3]]], dtype=object)
    with pytest.raises(ValueError) as err:
        batch_shares(types.SimpleNamespace(devices=grid[..., None], axis_names=("data", "pipe", "model")))
    assert str(err.value) == (
        "mesh.data: process 0 holds devices of data shards [0, 2] of the data 4 x pipe 2 x model 1 mesh, "
        "not a contiguous block; the trainer loads each process one contiguous run of every batch's rows: "
        "lay the devices out (mesh.order, mesh.pipe, mesh.data) so that each process's data shards are "
        "neighbours")
    from jaxcnn.errors import ConfigError
    from jaxcnn.train._plan import parallel_config_errors  # the trainer: exit 2 naming the key
    with pytest.raises(ConfigError) as err, parallel_config_errors():
        batch_shares(types.SimpleNamespace(devices=grid[..., None], axis_names=("data", "pipe", "model")))
    assert err.value.path == "mesh.data"
    # blocks of different sizes (process 0: shards 0-1, process 1: shard 2, process 2: shard 3)
    devices = fake_devices(4, 2)
    grid = np.asarray([[devices[0], devices[1]], [devices[2], devices[3]], [devices[4], devices[5]],
                       [devices[6], devices[7]]], dtype=object)
    for d in devices[2:4]:
        d.process_index = 0
    for d in devices[4:]:
        d.process_index = 1 + (d.id - 4) // 2
    with pytest.raises(ValueError, match=r"^mesh\.data: process 0 holds devices of data shards 0-1 of the "
                                         r"data 4 x pipe 2 mesh while process 1 holds data shard 2; .*same number"):
        batch_shares(types.SimpleNamespace(devices=grid, axis_names=("data", "pipe")))


def test_batch_share_of_this_process_and_the_plan():
    """In this (single) process every mesh loads the whole batch; a process that holds no device
    of the mesh is named."""
    mesh = make_mesh(2, 1, pipe=4)
    assert batch_share(mesh) == (0, 1)
    with pytest.raises(ValueError, match="^mesh.data: process 3 holds no device of the mesh"):
        batch_share(mesh, 3)


def test_make_mesh_order_fills_the_axes_in_that_order():
    devices = jax.devices()
    mesh = make_mesh(2, 1, pipe=4, order=["pipe"])
    assert mesh.axis_names == ("data", "pipe", "model")
    # pipe outermost: stage s holds devices 2s, 2s+1 (data shards 0, 1)
    assert [[mesh.devices[d, s, 0].id for s in range(4)] for d in range(2)] == \
        [[devices[2 * s + d].id for s in range(4)] for d in range(2)]
    assert list(make_mesh(2, 1, pipe=4, order=["data", "pipe"]).devices.reshape(-1)) == devices
    model_first = make_mesh(4, 2, order=["model"])
    assert [[d.id for d in row] for row in model_first.devices] == \
        [[devices[4 * m + i].id for m in range(2)] for i in range(4)]
    mesh = make_mesh(2, 1, pipe=4, order=["pipe"], devices=devices[::-1])  # the given order, then filled
    assert mesh.devices[0, 0, 0] == devices[-1] and mesh.devices[1, 0, 0] == devices[-2]
    for order, needle in ((["layer"], "mesh.order: unknown axis 'layer'"),
                          (["pipe", "data", "pipe"], "mesh.order: axis 'pipe' is named twice")):
        with pytest.raises(ValueError, match=f"^{needle}"):
            make_mesh(2, 1, pipe=4, order=order)


def test_setup_reads_mesh_order_from_the_config():
    from jaxcnn.train.config import load_config
    from jaxcnn.train._build import abstract_state, build_run
    from jaxcnn.train._plan import make_plan
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = load_config(os.path.join(root, "configs", "lenet5_mnist.yaml"),
                      ["data.source=synthetic", "data.image_size=[28,28,1]", "data.num_train=32",
                       "data.num_eval=8", "data.batch_size=16", "mesh.data=2", "mesh.pipe=4",
                       "mesh.order=[pipe]", "parallel.pipeline.microbatches=2"])
    run = build_run(cfg)
    plan = make_plan(cfg, run.model, run.input_shape, abstract_state(run))
    devices = jax.devices()
    assert [[plan.mesh.devices[d, s, 0] for s in range(4)] for d in range(2)] == \
        [[devices[2 * s + d] for s in range(4)] for d in range(2)]
    assert plan.batch_share == (0, 1)
    assert plan.eval_rows(8) == 8 and plan.eval_rows(7) == 8  # padded to whole data shards
