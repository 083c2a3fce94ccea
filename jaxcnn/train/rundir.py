"""The run directory: the one place its layout is written down.

A run directory holds::

    config.resolved.yaml      the config the run trains under (config_history/: earlier ones)
    run_meta.json             what ran, where (argv, versions, devices, git commit)
    preprocessing.json        what the model expects of its input (jaxcnn.data.preprocessing)
    metrics.jsonl             one JSON record per log/eval interval (tb/: TensorBoard events)
    checkpoints/<step>/       orbax checkpoints (checkpoints.log: the detail of their errors)
    params.npz | params.safetensors   the final parameters and model state
    .jaxcnn-train.lock        held (flock) by the trainer while it runs: one trainer at a time

Everything that reads or writes one of these (the trainer, ``jaxcnn-eval``, ``jaxcnn-export``,
``jaxcnn-plot``, fine-tuning) names it through :class:`RunDir`.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import jax

from jaxcnn import _host_memory
from jaxcnn.data.files import write_bytes_whole
from jaxcnn.data.preprocessing import PREPROCESSING_FILE
from jaxcnn.errors import WorkdirError
from jaxcnn.train.config import path_keys
from jaxcnn.train._memory import fmt_bytes

PARAM_FORMATS = ("npz", "safetensors")


def _dotted(config, key: str):
    """``config[a][b]`` for ``key = "a.b"`` (a `Config` or plain mapping); None when absent."""
    node = config
    for part in key.split("."):
        try:
            node = node[part]
        except (KeyError, TypeError, IndexError, AttributeError):
            return None
    return node


class RunDir:
    """The paths of one run directory (nothing is created until something is written)."""

    CONFIG = "config.resolved.yaml"
    CONFIG_HISTORY = "config_history"
    META = "run_meta.json"
    PREPROCESSING = PREPROCESSING_FILE
    METRICS = "metrics.jsonl"
    TENSORBOARD = "tb"
    CHECKPOINTS = "checkpoints"
    CHECKPOINTS_LOG = "checkpoints.log"
    PARAM_FILES = tuple(f"params.{fmt}" for fmt in PARAM_FORMATS)
    LOCK = ".jaxcnn-train.lock"
    # Every name the trainer writes in a run directory (nothing else may write over them).
    ENTRIES = (CONFIG, CONFIG_HISTORY, META, PREPROCESSING, METRICS, TENSORBOARD, CHECKPOINTS,
               CHECKPOINTS_LOG, LOCK) + PARAM_FILES

    def __init__(self, path):
        self.path = os.fspath(path)

    def __repr__(self):
        return f"RunDir({self.path!r})"

    def __fspath__(self):
        return self.path

    def _join(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def config(self) -> str:
        return self._join(self.CONFIG)

    @property
    def config_history(self) -> str:
        return self._join(self.CONFIG_HISTORY)

    @property
    def meta(self) -> str:
        return self._join(self.META)

    @property
    def preprocessing(self) -> str:
        return self._join(self.PREPROCESSING)

    @property
    def metrics(self) -> str:
        return self._join(self.METRICS)

    @property
    def tensorboard(self) -> str:
        return self._join(self.TENSORBOARD)

    @property
    def checkpoints(self) -> str:
        return self._join(self.CHECKPOINTS)

    @property
    def checkpoints_log(self) -> str:
        return self._join(self.CHECKPOINTS_LOG)

    def problem(self) -> str | None:
        """Why this path is no run directory ``jaxcnn-train`` wrote (one line), or None."""
        if not os.path.exists(self.path):
            return f"{self.path}: no such run directory"
        if not os.path.isdir(self.path):
            hint = ""
            stem, ext = os.path.splitext(os.path.basename(self.path))
            if ext.lower() in (".yaml", ".yml"):
                hint = f" (this config's run is in runs/{stem} unless --workdir said otherwise)"
            return (f"{self.path} is a file, not a run directory: give the directory jaxcnn-train "
                    f"wrote{hint}")
        if not os.path.isfile(self.config):
            return f"{self.config} does not exist: not a jaxcnn run directory"
        return None

    def moved_path_hint(self, key: str, value, *, moved_only: bool = False) -> str:
        """For a relative path in the run's config that is missing here (``jaxcnn-eval`` run from
        another directory than the training): where the run was started, from ``run_meta.json``.
        ``moved_only``: nothing unless the run is known to have started elsewhere."""
        if not isinstance(value, str) or os.path.isabs(value):
            return ""
        try:
            with open(self.meta, encoding="utf-8") as f:
                started = json.load(f).get("cwd")
        except (OSError, ValueError, AttributeError):
            started = None
        if isinstance(started, str) and started != os.getcwd():
            return (f" (relative to the current directory, {os.getcwd()}; the run was started in {started}: "
                    f"run from there, or give {key}=...)")
        if moved_only:
            return ""
        what = "the data is" if key.startswith("data.") else "it is"
        return f" (relative to the current directory, {os.getcwd()}; give {key}=... where {what})"

    def explain_missing_path(self, message: str, values=None, *, moved_only: bool = False) -> str:
        """``message`` (a one-line error) with :meth:`moved_path_hint` added when it says that one
        of the input path keys (``config.path_keys("input")``: read again, relative to the directory
        the run was started in) does not exist: every command that reads a saved run (eval,
        export, predict, a resumed training) says so the same way. ``values``: the keys' values
        (a config), else the run's ``config.resolved.yaml``."""
        key = next((k for k in path_keys("input") if message.startswith(f"{k}: ")), None)
        if key is None or "does not exist" not in message or "relative to the current directory" in message:
            return message
        value = _dotted(values, key) if values is not None else _dotted(self._saved_config(), key)
        return message + self.moved_path_hint(key, value, moved_only=moved_only)

    def _saved_config(self):
        import yaml
        try:
            with open(self.config, encoding="utf-8") as f:
                return yaml.safe_load(f)
        except (OSError, ValueError, yaml.YAMLError):
            return None

    def params(self, fmt: str) -> str:
        """``params.<fmt>`` (``fmt``: "npz" or "safetensors")."""
        if fmt not in PARAM_FORMATS:
            raise ValueError(f"parameter format must be one of {PARAM_FORMATS}, got {fmt!r}")
        return self._join(f"params.{fmt}")

    def find_params(self) -> str | None:
        """The run's final parameter file (``params.npz`` first), or None before training ends."""
        for name in self.PARAM_FILES:
            if os.path.isfile(self._join(name)):
                return self._join(name)
        return None

    def lock(self):
        """Takes the run directory for this process (an exclusive ``flock`` on `LOCK`, released
        when the process ends), or raises ``WorkdirError`` naming the process that holds it: a
        second ``jaxcnn-train`` on the same directory (the same command run twice) wrote its
        checkpoints, metrics and ``params.npz`` over the first's. Returns the open lock file
        (keep it open). A file system without locks (some network mounts) is not refused."""
        import fcntl
        path = self._join(self.LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise WorkdirError(f"{self.path} is in use by another jaxcnn-train (it holds {path}); wait for "
                               f"it to end, or give another --workdir") from None
        except OSError:  # no locks on this file system: nothing to guard with
            pass
        return os.fdopen(fd, "r")  # the file stays empty: a run directory's bytes change only by its run

    def write_meta(self, argv, config_path, data=None) -> None:
        """``run_meta.json``: :func:`run_metadata`, and ``data``: the fingerprint of an image
        folder's or record directory's data (`jaxcnn.data.ImageData.fingerprint`), which a
        resume compares."""
        meta = run_metadata(argv, config_path)
        if data is not None:
            meta["data"] = data
        # a full disk leaves the one an earlier start wrote
        write_bytes_whole(self.meta, json.dumps(meta, indent=2).encode())

    def read_meta(self) -> dict:
        """``run_meta.json`` as written (``{}`` when missing, unreadable or not an object)."""
        try:
            with open(self.meta, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def save_params(self, fmt: str, trees, save) -> str | None:
        """Write ``params.<fmt>`` with ``save(path, *trees)``, a writer that writes whole or not
        at all (`jaxcnn.interop.save_npz`, `~jaxcnn.interop.save_safetensors`), so an old
        parameter file is never half overwritten.

        Returns:
            None, or the one-line reason it could not be written (a full disk): the partial
            file is removed and everything else is kept.
        """
        path = self.params(fmt)
        try:
            save(path, *trees)
        except OSError as e:
            return f"cannot write {path} ({e.strerror or e}); the partial file was removed"
        return None

    def check_writable(self, what: str = "workdir") -> None:
        """:func:`check_workdir` on this directory."""
        check_workdir(self.path, what)


def run_metadata(argv, config_path) -> dict:
    """What ran, where: ``run_meta.json``."""
    def version(name):
        try:
            from importlib.metadata import version as v
            return v(name)
        except Exception:  # not installed: record the absence
            return None

    commit = None
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=os.path.dirname(os.path.abspath(__file__)))
        commit = (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        commit = None
    return {
        "argv": list(argv or sys.argv), "config": config_path, "cwd": os.getcwd(), "start_time": time.time(),
        "host": platform.node(), "python": platform.python_version(),
        "versions": {n: version(n) for n in ("jaxcnn", "jax", "jaxlib", "optax", "orbax-checkpoint",
                                             "numpy")},
        "backend": jax.default_backend(),
        # Whether jaxcnn's glibc malloc settings are on: they trade resident memory for speed.
        "host_malloc": _host_memory.status(),
        "devices": [str(d) for d in jax.devices()], "process_count": jax.process_count(),
        "git_commit": commit,
    }

def default_workdir(config_path: str, overrides=()) -> str:
    """``runs/<config file stem>`` under the current directory, ``runs/<stem>-<data folder
    name>`` when ``overrides`` give ``data.path`` (one config on other data is another run:
    the shapes example and your own photos, both from ``configs/shapes_folder.yaml``, shared
    ``runs/shapes_folder``); for a run directory's own ``config.resolved.yaml``, that run
    directory (it trained a new run in ``runs/config.resolved`` instead of resuming the run).
    The same command names the same directory, so running it again resumes."""
    folder = os.path.dirname(config_path) or "."
    if os.path.basename(config_path) == RunDir.CONFIG and os.path.isfile(RunDir(folder).meta):
        return folder
    stem = os.path.splitext(os.path.basename(config_path))[0]
    data = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "data.path"]
    if not data or data[-1] in ("", "null", "~"):
        return os.path.join("runs", stem)
    name = os.path.basename(os.path.normpath(os.path.expanduser(data[-1])))
    if os.path.splitext(name)[1].lower() == ".npz":  # a data file: its name without the extension
        name = os.path.splitext(name)[0]
    return os.path.join("runs", f"{stem}-{name}" if name not in ("", ".", "..") else stem)


def check_workdir(workdir: str, what: str = "workdir") -> None:
    """Check, before any compute, that the run can write to ``workdir``; nothing is left behind
    (a missing ``workdir`` is created by the run itself once its config has passed every check).

    An existing ``workdir`` must be a directory where a file can be written; a missing one must
    be creatable under its nearest existing parent; its disk must not be full. The checks
    really write (a file, or a directory), then remove what they wrote: ``os.access`` says yes
    to root on a read-only mount's files, and knows no quota.

    Arguments:
        workdir: the run directory.
        what: how the message names it (``"--workdir"``, ``"logging.workdir"``).

    Raises:
        WorkdirError: it is a file (or a parent is), cannot be created, is not writable
            (permissions, read-only file system) or its disk is full.
    """
    where = f"{what} {workdir}" if what.startswith("--") else f"{what}: {workdir}"
    if os.path.exists(workdir):
        if not os.path.isdir(workdir):
            from jaxcnn.data.files import file_kind
            kind = "a file" if os.path.isfile(workdir) else file_kind(os.stat(workdir).st_mode)
            raise WorkdirError(f"{where} is {kind}, not a directory")
        probe = None
        try:
            fd, probe = tempfile.mkstemp(prefix=".jaxcnn-write-test-", dir=workdir)
            with os.fdopen(fd, "wb") as f:
                f.write(b"\0" * 4096)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:
            raise WorkdirError(f"{where} is not writable ({e.strerror or e})") from None
        finally:
            if probe is not None:
                try:
                    os.remove(probe)
                except OSError:
                    pass
        existing = workdir
    else:
        existing = os.path.dirname(os.path.abspath(workdir))
        while not os.path.exists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise WorkdirError(f"{where} cannot be created: {existing} is not a directory")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".jaxcnn-write-test-", dir=existing))
        except OSError as e:
            raise WorkdirError(f"{where} cannot be created in {existing} ({e.strerror or e})") from None
    free = _free_disk(existing)
    if free is not None and free < _MIN_FREE_DISK:
        raise WorkdirError(f"{where} is on a full disk ({fmt_bytes(free)} free; the run writes "
                           "checkpoints, metrics and parameters there)")

# Below this much free space in the run directory a run is refused before it starts.
_MIN_FREE_DISK = 1 << 20

def _free_disk(path):
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize
