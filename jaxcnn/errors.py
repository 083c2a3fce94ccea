"""The project's error classes, in one leaf module that imports nothing of jaxcnn.

Each is re-exported where it was first defined (``jaxcnn.train.config.ConfigError``,
``jaxcnn.data.dataset.DataError``, ``jaxcnn.train.checkpoint.CheckpointError``,
``jaxcnn.export.ExportError``, ``jaxcnn.predict.PredictError``, ``WorkdirError`` and ``TrainingStopped`` in ``jaxcnn/train/run.py``,
``jaxcnn.parallel.distributed.DistributedError``, ``jaxcnn.data.loader.DataWorkerDied``), so any layer can raise them without
importing the layer that reports them.
"""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem, found before any compute starts.

    Attributes:
        path: dotted key the problem is about (``""`` for the whole file).
        source: the file or override the key came from, when known.
    """

    def __init__(self, message: str, *, path: str = "", source: str | None = None):
        self.path = path
        self.source = source
        if source:
            message = f"{message} [from {source}]"
        super().__init__(message.replace("\n", " "))


class SettingError(ValueError):
    """A setting that a library function cannot run, naming its own argument.

    ``str(e)`` is ``"<setting>: <problem>"``: ``setting`` is the argument's name, dotted into a
    mapping argument (``pipeline.microbatches``) or an argument's part (``mesh.pipe``, the pipe
    axis of the mesh given). ``mentions``: the other arguments ``problem`` names (as whole
    words), so that a caller that knows where it took the arguments from (the trainer: config
    keys) can catch the error at the call and name those instead (:meth:`phrase`).
    """

    def __init__(self, setting: str, problem: str, *, mentions: tuple = ()):
        self.setting, self.problem, self.mentions = setting, problem, tuple(mentions)
        super().__init__(f"{setting}: {problem}")

    def under(self, name: str) -> "SettingError":
        """The same problem, named as part of the caller's argument ``name``."""
        return SettingError(f"{name}.{self.setting}", self.problem, mentions=self.mentions)

    def phrase(self, name_of) -> str:
        """``problem`` with each mentioned argument ``m`` named ``name_of(m)``."""
        import re
        text = self.problem
        for m in self.mentions:
            text = re.sub(rf"(?<![\w.]){re.escape(m)}(?![\w])", lambda _: name_of(m), text)
        return text


class DataError(ValueError):
    """A data file or array is malformed; the message names the file or array and the problem."""


class BadImageError(DataError):
    """One image (a file of an image folder, or a record of a record file) cannot be used:
    unreadable, not an image, corrupt or truncated, or a record whose checksum does not
    match. With ``data.on_bad_image: skip`` the loader counts it and moves on."""


class CheckpointError(Exception):
    """A checkpoint could not be saved or restored; the message names the path and the cause."""


class CheckpointCorruptError(CheckpointError):
    """The files of a checkpoint are damaged or incomplete (as opposed to not matching the target)."""


class ConfigChangedError(CheckpointError):
    """Resuming would continue a run under a config that changes its training math."""


class ExportError(ValueError):
    """A model, parameter file or option that export cannot handle; the message
    names the layer path, kind, file or option at fault."""


class PredictError(ValueError):
    """An image or model that ``jaxcnn-predict`` cannot use; the message names the file."""


class KernelUnsupported(NotImplementedError):
    """A kernel backend cannot run this call (dtype, channel count, stride, jax version...);
    the message is one line naming the reason.  Dispatchers catch it and take another path."""


class WorkdirError(RuntimeError):
    """The run directory cannot be used, or the run's outputs cannot be written to it: one line
    naming the directory or file and the reason (exit code 2 from ``jaxcnn-train``)."""


class DistributedError(RuntimeError):
    """The processes of a multi-process run could not connect, or lost each other.

    ``must_exit`` is True when JAX's own connection attempt is still under way in a
    background thread (it cannot be cancelled) or JAX's exit hook would wait for a lost
    peer: report the error, then end the process with ``os._exit`` as ``jaxcnn-train``
    does; a normal exit would leave XLA to end it, with SIGABRT and a C++ stack trace.
    """

    def __init__(self, message: str, *, must_exit: bool = False):
        super().__init__(message)
        self.must_exit = must_exit


class DataWorkerDied(RuntimeError):
    """A data loader's worker process died while the loader ran (killed by a signal, the
    out-of-memory killer's SIGKILL most often, or ended with a nonzero exit code): the message
    names the worker, its pid and how it ended."""


class TrainingStopped(RuntimeError):
    """Training stopped early: a non-finite loss under ``nan_policy: stop``."""
