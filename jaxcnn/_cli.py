"""What every console script's command line shares: a parser whose errors are one line.

A leaf module (it imports nothing of jaxcnn), so that ``jaxcnn-data`` (in ``jaxcnn.data``,
below the trainer) parses its command line as ``jaxcnn-train`` does.
"""
from __future__ import annotations

import argparse
import os

EXIT_BAD_INPUT = 2


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit code 2.

    argparse prints its usage first (wrapped onto two lines at 80 columns) and the
    offending argument as given, line breaks included; a bad command line is reported
    like every other bad input instead: ``PROG: error: ...`` on one line. Sub-commands'
    parsers (``add_subparsers``) are of this class too.
    """

    def error(self, message):
        # Control characters (newlines, form feeds, ...) as escapes: one line whatever was typed.
        message = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in message)
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def path_arg(value: str) -> str:
    """An argparse ``type`` for a file or directory argument: an empty one (``--workdir ""``,
    an unset shell variable) is refused, naming the argument, instead of standing for the
    current directory or quietly for the option's default."""
    if not value.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {value!r}")
    return value


def name_list(names, shown: int = 10) -> str:
    """``names`` as a list for an error line: the first ``shown`` and how many more (a folder
    of ImageNet's 1,000 classes named one by one made a line of 12 KB)."""
    names = [str(n) for n in names]
    if len(names) <= shown:
        return str(names)
    return str(names[:shown])[:-1] + f", ... and {len(names) - shown} more]"


def use_compilation_cache(directory) -> bool:
    """Points JAX's persistent compilation cache at ``directory`` (a config's
    ``train.compilation_cache``, ``~`` the home directory; None: off), so that a run repeated with the same programs
    loads them instead of compiling them again.  A cache already chosen (JAX's
    ``JAX_COMPILATION_CACHE_DIR``, or a caller's ``jax.config``) is left as it is.  It must
    run before the process compiles anything: JAX opens its cache once.  Returns whether
    this call set it.  The console scripts call it; the library never does."""
    import jax

    if directory is None or jax.config.jax_compilation_cache_dir:
        return False
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(str(directory)))
    return True
