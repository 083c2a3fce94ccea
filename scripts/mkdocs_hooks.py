"""mkdocs hook (mkdocs.yml ``hooks:``): API pages name public names where users reach them.

A page of ``docs/reference/api/`` says ``::: jaxcnn.train.run``, the name a user types. griffe
reads source without running it, so it cannot see that such a name is a function sharing its
name with a submodule (``jaxcnn.train.run`` and ``jaxcnn.functional.linear``: the functions,
not the modules) or one a package loads on first use (PEP 562). Before the page is rendered, each
such directive is pointed at the object's own module, found by importing the name (the page sets
``show_root_full_path: false`` so the heading keeps the short name). A name that does not import
is left as written, for griffe to report.
"""
from __future__ import annotations

import importlib
import inspect
import re

_DIRECTIVE = re.compile(r"^::: (jaxcnn(?:\.\w+)+)[ \t]*$", flags=re.M)


def defining_path(name: str) -> str:
    """``name`` as griffe finds it: ``module.qualname`` of the function or class it names, or
    ``name`` itself for a module or anything that does not import."""
    parent, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(parent), attr)
    except (ImportError, AttributeError):
        return name
    if inspect.ismodule(obj) or not hasattr(obj, "__qualname__") or not hasattr(obj, "__module__"):
        return name
    return f"{obj.__module__}.{obj.__qualname__}"


def on_page_markdown(markdown, page, **kwargs):
    """Rewrite the API pages' directives to the objects' defining modules."""
    if not page.file.src_uri.startswith("reference/api/"):
        return markdown
    return _DIRECTIVE.sub(lambda match: f"::: {defining_path(match.group(1))}", markdown)
