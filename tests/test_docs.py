"""The documentation site (``docs/``, built by ``mkdocs build --strict`` in ``.ci/run``).

The config reference is generated from the schema: regenerated here in memory, it must equal
the committed page. The guides' code blocks are checked as the README's are
(``tests/test_readme.py``): every ``jaxcnn.a.b`` name resolves, and each Python block marked
``<!-- runs in tests/test_docs.py -->`` runs as written."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _config_reference():
    path = os.path.join(ROOT, "scripts", "config_reference.py")
    spec = importlib.util.spec_from_file_location("config_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_config_reference_is_generated_from_the_current_schema():
    reference = _config_reference()
    with open(reference.OUT, encoding="utf-8") as f:
        committed = f.read()
    assert committed == reference.render(), f"docs/reference/config.md is stale: run `{reference.FIX}`"


def test_the_config_reference_lists_every_key():
    from jaxcnn.train.config import fields
    with open(_config_reference().OUT, encoding="utf-8") as f:
        text = f.read()
    missing = [key for key, _ in fields() if f"| `{key}` |" not in text]
    assert not missing, missing
