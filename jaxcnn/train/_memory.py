"""Will the run fit? The memory a run has and the memory its state and compiled steps need,
checked before anything is allocated (the steps section of :func:`jaxcnn.train.run.train`)."""
from __future__ import annotations

import math
import os

import jax
import numpy as np

from jaxcnn.errors import ConfigError


def fmt_bytes(n: float) -> str:
    """``4.0 TB``, ``23 GB``, ``512 MB`` (decimal units)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            value = n / scale
            return f"{value:.1f} {unit}" if value < 10 else f"{value:.0f} {unit}"
    return f"{int(n)} bytes"

def available_memory(devices):
    """Memory a run can use: ``(bytes, scope)`` where scope is ``"per device"`` (accelerators:
    the device's limit less what is in use) or ``"host"`` (CPU devices share the host's memory:
    :func:`host_available`); None where it cannot be told."""
    devices = list(devices)
    if devices[0].platform != "cpu":
        free = []
        for d in devices:
            try:
                stats = d.memory_stats()
            except Exception:  # a backend without memory statistics: no check
                return None
            if not stats or "bytes_limit" not in stats:
                return None
            free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
        return min(free), "per device"
    free = host_available()
    return (free, "host") if free is not None else None


# cgroup files: (limit, usage) per version; a v1 limit this large is "no limit".
_CGROUP_FILES = {"cgroup2": ("memory.max", "memory.current"),
                 "cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
_NO_LIMIT = 1 << 60


def host_available(root: str = "/") -> int | None:
    """Bytes this process can still allocate on the host: the least of ``MemAvailable`` (or the
    physical memory), the room left under each memory limit of its own cgroup and the cgroups
    above it (cgroup v2 ``memory.max``, v1 ``memory.limit_in_bytes``; a container's limit sits
    on the process's cgroup, not on the root, which is all the check read before), and the
    address space ``ulimit -v`` (``RLIMIT_AS``) leaves. None where none can be read. ``root``
    is where ``/proc`` and ``/sys`` are looked for (tests point it at a made-up tree)."""
    candidates = [_meminfo_available(root)] + _cgroup_room(root)
    if root == "/":
        candidates.append(_address_space_room())
    candidates = [c for c in candidates if c is not None]
    return max(0, min(candidates)) if candidates else None


def _read(root: str, path: str) -> str | None:
    try:
        with open(os.path.join(root, path.lstrip("/")), encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _meminfo_available(root: str) -> int | None:
    for line in (_read(root, "/proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            try:
                return int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                return None
    if root != "/":
        return None
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_room(root: str) -> list:
    """``limit - usage`` of every memory-limited cgroup from this process's own up to its
    hierarchy's mount (v1 and v2 alike)."""
    own = {}  # "cgroup2" / "cgroup" (v1 memory) -> this process's cgroup path
    for line in (_read(root, "/proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            own["cgroup2"] = parts[2]
        elif len(parts) == 3 and "memory" in parts[1].split(","):
            own["cgroup"] = parts[2]
    room = []
    for mount_root, mount_point, kind in _cgroup_mounts(root):
        if kind not in own:
            continue
        relative = os.path.relpath(own[kind], mount_root) if own[kind].startswith(mount_root) else "."
        directory = os.path.normpath(os.path.join(mount_point, relative))
        if _read(root, os.path.join(directory, _CGROUP_FILES[kind][1])) is None:
            directory = mount_point  # a namespaced mount shows this process's cgroup as its root
        room += _limits_up_to(root, directory, mount_point, kind)
    return room


def _cgroup_mounts(root: str) -> list:
    """``(cgroup path of the mount's root, mount point, "cgroup2" | "cgroup")`` of the cgroup v2
    mounts and the v1 memory mounts, from ``/proc/self/mountinfo``."""
    mounts = []
    for line in (_read(root, "/proc/self/mountinfo") or "").splitlines():
        fields, _, tail = line.partition(" - ")
        fields, tail = fields.split(), tail.split()  # ... root mount-point ... - type source options
        if len(fields) < 5 or not tail:
            continue
        options = tail[2].split(",") if len(tail) > 2 else []
        if tail[0] == "cgroup2" or (tail[0] == "cgroup" and "memory" in options):
            mounts.append((fields[3], fields[4], tail[0]))
    return mounts


def _limits_up_to(root: str, directory: str, mount_point: str, kind: str) -> list:
    limit_file, usage_file = _CGROUP_FILES[kind]
    room = []
    while True:
        limit, usage = (_read(root, os.path.join(directory, f)) for f in (limit_file, usage_file))
        try:
            if limit is not None and limit.strip() != "max" and int(limit) < _NO_LIMIT:
                room.append(int(limit) - int(usage or 0))
        except ValueError:
            pass
        if os.path.normpath(directory) == os.path.normpath(mount_point) or directory in ("/", ""):
            return room
        directory = os.path.dirname(directory)


def _address_space_room() -> int | None:
    """What ``ulimit -v`` leaves of this process's address space (None: no limit)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    for line in (_read("/", "/proc/self/status") or "").splitlines():
        if line.startswith("VmSize:"):
            return soft - int(line.split()[1]) * 1024
    return soft


def local_devices(plan) -> list:
    """This process's devices of the mesh: the memory it checks (its host's, or theirs)."""
    return [d for d in plan.mesh.devices.flat if d.process_index == jax.process_index()]

def check_state_memory(plan, available, size_keys) -> int:
    """The training state's bytes (per device, or on the host for CPU devices), from the
    shapes alone: a state that cannot fit is refused before anything is allocated.

    Arguments:
        plan: the parallel plan (its ``abstract_state``, ``mesh``).
        available: :func:`available_memory`'s answer.
        size_keys: ``shape -> ["key=value", ...]``, the config keys that size a parameter of
            that shape (the message names them).

    Raises:
        ConfigError: naming the keys that size it (``model.num_classes=1000000000 ...``).
    """
    leaves = jax.tree_util.tree_leaves_with_path(plan.abstract_state)
    held = {}  # the bytes each device holds (a leaf on some devices only counts on those)
    for _, x in leaves:
        sharding = getattr(x, "sharding", None)
        shape = sharding.shard_shape(x.shape) if sharding is not None else x.shape
        where = frozenset(sharding.device_set) if sharding is not None else frozenset([None])
        held[where] = held.get(where, 0) + math.prod(shape) * np.dtype(x.dtype).itemsize
    everywhere = held.pop(frozenset([None]), 0)  # a leaf without a sharding: on every device
    devices = set().union(*held) if held else set()
    per_device = everywhere + max((sum(b for where, b in held.items() if d in where) for d in devices), default=0)
    if available is None:
        return per_device
    free, scope = available
    need = per_device * (len(local_devices(plan)) if scope == "host" else 1)
    if need > free:
        params = jax.tree_util.tree_leaves_with_path(plan.abstract_state.params)
        path, big = max(params, key=lambda kv: math.prod(kv[1].shape))
        name = "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
        keys = size_keys(big.shape)
        count = sum(math.prod(x.shape) for _, x in params)
        raise ConfigError(f"{', '.join(keys)}: the model's {count:,} parameters and their optimiser "
                          f"state need {fmt_bytes(need)} (largest: {name} {tuple(big.shape)}); this "
                          f"machine has {fmt_bytes(free)} available"
                          f"{' per device' if scope == 'per device' else ''}", path=keys[0].split("=")[0])
    return need

def _step_bytes(compiled):
    """Arguments + outputs + temporaries (less the donated buffers counted twice) of a compiled
    program, per device; None where the backend does not say."""
    if compiled is None:
        return None
    try:
        stats = compiled.memory_analysis()
    except Exception:  # not every backend or wrapper implements it
        return None
    if isinstance(stats, (list, tuple)):
        stats = stats[0] if stats else None
    if stats is None:
        return None
    return max(0, int(stats.argument_size_in_bytes) + int(stats.output_size_in_bytes)
               + int(stats.temp_size_in_bytes) - int(stats.alias_size_in_bytes))

def check_step_memory(compiled, plan, available, keys, what) -> int | None:
    """Refuses a compiled step whose memory (``memory_analysis``) exceeds what is available.

    Raises:
        ConfigError: ``"<keys>: one <what> needs X; this machine has Y available"``.
    """
    return check_bytes(_step_bytes(compiled), plan, available, keys, what)


def check_bytes(per_device, plan, available, keys, what) -> int | None:
    """Refuses a step that needs ``per_device`` bytes on a device when that is not available
    (:func:`check_step_memory`'s check, for a step measured otherwise)."""
    if per_device is None or available is None:
        return per_device
    free, scope = available
    need = per_device * (len(local_devices(plan)) if scope == "host" else 1)
    if need > free:
        raise ConfigError(f"{', '.join(keys)}: one {what} needs {fmt_bytes(need)} of memory; this "
                          f"machine has {fmt_bytes(free)} available"
                          f"{' per device' if scope == 'per device' else ''}", path=keys[0].split("=")[0])
    return need
