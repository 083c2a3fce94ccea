"""The README's Python names resolve as a reader would type them: every ``jaxcnn.a.b`` in a code
span of README.md, after ``import jaxcnn.a`` (the longest importable module), read as
attributes from ``jaxcnn`` down. (``jaxcnn.predict.load_predictor`` did not: ``jaxcnn.predict``
is the function.)"""
import importlib
import os
import re

import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _names():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    text = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    names = set()
    for span in blocks + re.findall(r"`([^`]+)`", text):  # a span may go over a line break
        span = re.sub(r"([\"']).*?\1", "", span)  # keys in quotes, such as "jaxcnn.preprocessing"
        names.update(re.findall(r"(?<![\w.])jaxcnn(?:\.\w+)+", span))
    return sorted(names)


def _resolve(name):
    parts = name.split(".")
    for end in range(len(parts), 0, -1):  # `import jaxcnn.a.b` as far as it is a module
        try:
            importlib.import_module(".".join(parts[:end]))
            break
        except ImportError:
            continue
    obj = importlib.import_module("jaxcnn")
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def test_the_readme_names_something():
    assert {"jaxcnn.cpu.configure", "jaxcnn.models.get", "jaxcnn.export.export"} <= set(_names())


@pytest.mark.parametrize("name", _names())
def test_readme_name_resolves(name):
    try:
        _resolve(name)
    except AttributeError as e:
        pytest.fail(f"README.md names `{name}`, which does not resolve: {e}")
