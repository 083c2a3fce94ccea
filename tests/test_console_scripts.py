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
