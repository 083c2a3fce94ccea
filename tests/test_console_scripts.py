"""Every console script of pyproject.toml: ``--help`` describes every argument in plain text
(no reStructuredText markup from a docstring), and a bad command line is one line, exit 2.

jaxcnn-plot's description was its module docstring (````jaxcnn-plot RUN_DIR````: ...) with an
undescribed ``run_dir``; jaxcnn-data's likewise, and its bad options printed argparse's usage
block; jaxcnn-export's source, --format, --prune-scope and --prune-structure had no help, and
``--prune abc`` said "invalid _sparsity value"."""
import argparse
import importlib
import pathlib
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def _entry(name):
    module, _, func = SCRIPTS[name].partition(":")
    return getattr(importlib.import_module(module), func)


def _parsers(name, monkeypatch):
    """The parser of ``name --help`` and, for a command with sub-commands, theirs."""
    seen = []
    monkeypatch.setattr(argparse.ArgumentParser, "print_help", lambda self, file=None: seen.append(self))
    with pytest.raises(SystemExit) as e:
        _entry(name)(["--help"])
    assert e.value.code == 0
    parsers = list(seen)
    for action in seen[0]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.extend(action.choices.values())
    return parsers


def test_there_are_console_scripts():
    assert {"jaxcnn-train", "jaxcnn-eval", "jaxcnn-export", "jaxcnn-predict", "jaxcnn-plot",
            "jaxcnn-data"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_help_describes_every_argument_in_plain_text(name, monkeypatch):
    for parser in _parsers(name, monkeypatch):
        assert parser.description and "``" not in parser.description, (parser.prog, parser.description)
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help and "``" not in action.help, (parser.prog, action.option_strings or action.dest)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_bad_option_is_one_line_and_exit_2(name, capsys):
    with pytest.raises(SystemExit) as e:
        _entry(name)(["--no-such-option", "x", "y"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{name}: error: "), err


@pytest.mark.parametrize("argv, needle", [
    (["x", "--format", "npz", "--out", "o", "--prune", "abc"], "argument --prune: expected a fraction in [0, 1), got 'abc'"),
    (["x", "--format", "npz", "--out", "o", "--fine-tune-lr", "-1"], "argument --fine-tune-lr: expected a positive number"),
    (["x", "--format", "npz", "--out", "o", "--num-classes", "0"], "argument --num-classes: expected a positive int"),
])
def test_export_option_values_are_named(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _entry("jaxcnn-export")(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


def test_data_sub_command_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        _entry("jaxcnn-data")(["convert", "--workers", "x", "a", "b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == ("jaxcnn-data convert: error: argument --workers: expected a non-negative int, got 'x' "
                   "(see jaxcnn-data convert --help)\n"), err


# What pip writes for a console script (its wrapper imports the entry point at module level),
# after a hook that holds the first import of NumPy (which every command's import reaches) for a
# while, saying so on stdout: the test's Ctrl-C arrives in the middle of the command's imports.
_WRAPPER = """
import importlib.abc, sys, time
class _Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "numpy":
            sys.meta_path.remove(self)
            print("importing", flush=True)
            time.sleep(30)
        return None
sys.meta_path.insert(0, _Hold())
import re
import sys
from {module} import {func}
if __name__ == "__main__":
    sys.argv[0] = {prog!r}
    sys.exit({func}())
"""


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_ctrl_c_while_the_script_imports_is_one_line_and_exit_130(name, tmp_path):
    """Ctrl-C during a console script's start-up import (``jaxcnn-train --help`` while JAX
    imports) printed a ``KeyboardInterrupt`` traceback from the wrapper's ``from ... import``."""
    import os
    import signal
    import subprocess
    module, _, func = SCRIPTS[name].partition(":")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _WRAPPER.format(module=module, func=func, prog=name),
                             "--help"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "importing\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert (proc.returncode, err) == (130, f"{name}: interrupted\n"), err[-2000:]
    assert out == ""


def test_importing_jaxcnn_imports_nothing_heavy_and_keeps_its_names():
    """``import jaxcnn`` loads its names on first use (what keeps the scripts' start-up
    interruptible); the names are those it always had, ``jaxcnn.predict`` the function even
    once the module of that name is imported."""
    import subprocess
    code = ("import sys; import jaxcnn, jaxcnn._console; assert 'jax' not in sys.modules, 'jax'; "
            "assert 'numpy' not in sys.modules, 'numpy'; "
            "from jaxcnn.predict import load_predictor; import jaxcnn.summary; "
            "from jaxcnn import functional as F, layers, models, precision, interop, cpu, summary; "
            "assert callable(jaxcnn.predict) and jaxcnn.predict.__module__ == 'jaxcnn.predict'; "
            "assert callable(summary) and jaxcnn.summary is summary; "
            "assert F.conv2d and jaxcnn.layers is layers and jaxcnn.__version__ and jaxcnn.data.load_mnist; "
            "assert set(jaxcnn.__all__) <= set(dir(jaxcnn)); "
            "ns = {}; exec('from jaxcnn import *', ns); assert callable(ns['predict'])")
    done = subprocess.run([sys.executable, "-c", code], env=dict(__import__("os").environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("name, argv, option", [
    ("jaxcnn-train", ["configs/mnist_cnn.yaml", "--workdir", ""], "--workdir"),
    ("jaxcnn-train", [""], "config"),
    ("jaxcnn-eval", [""], "run_dir"),
    ("jaxcnn-export", ["runs/x", "--format", "npz", "--out", ""], "--out"),
    ("jaxcnn-export", ["runs/x", "--format", "npz", "--out", "o.npz", "--fine-tune-dir", " "], "--fine-tune-dir"),
    ("jaxcnn-predict", ["runs/x", ""], "IMAGE"),
    ("jaxcnn-data", ["convert", "", "out"], "root"),
    ("jaxcnn-data", ["shapes", ""], "out"),
    ("jaxcnn-plot", ["runs/x", "--out", ""], "--out"),
])
def test_an_empty_path_is_refused_naming_the_argument(name, argv, option, capsys):
    """``--workdir ""`` quietly trained in the default run directory (and an empty ``--out`` or
    ``ROOT`` meant the current directory): one line naming the argument, exit 2."""
    with pytest.raises(SystemExit) as e:
        _entry(name)(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}: expected a path, got " in err, err


@pytest.mark.parametrize("name, missing", [("jaxcnn-train", "config"), ("jaxcnn-eval", "run_dir")])
def test_no_arguments_names_only_what_is_required(name, missing, capsys):
    """argparse listed the optional ``key=value`` overrides as required too."""
    with pytest.raises(SystemExit) as e:
        _entry(name)([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"the following arguments are required: {missing} (" in err and "key=value" not in err, err


def test_train_help_points_to_print_config_and_the_config_reference(capsys):
    """``jaxcnn-train --help`` says where the config keys are listed."""
    with pytest.raises(SystemExit) as e:
        _entry("jaxcnn-train")(["--help"])
    assert e.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--print-config` prints every key" in out and "docs/reference/config.md" in out
    assert (ROOT / "docs" / "reference" / "config.md").is_file()
