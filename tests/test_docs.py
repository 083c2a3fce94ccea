"""The documentation site (``docs/``, built by ``mkdocs build --strict`` in ``.ci/run``).

The config reference is generated from the schema: regenerated here in memory, it must equal
the committed page. The guides' code blocks are checked as the README's are
(``tests/test_readme.py``): every ``jaxcnn.a.b`` name resolves, and each Python block marked
``<!-- runs in tests/test_docs.py -->`` runs as written."""
import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest
import xla_cache

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


# ------------------------------------------------------------------ the guides' code blocks

RUNS = "<!-- runs in tests/test_docs.py -->"
_BLOCK = re.compile(r"^(<!-- [^\n]*-->\n)?```(python|bash)\n(.*?)^```", flags=re.S | re.M)


def _pages():
    """The site's teaching pages: the home page and every guide."""
    guides = os.path.join(DOCS, "guides")
    return [os.path.join(DOCS, "index.md")] + sorted(
        os.path.join(guides, name) for name in os.listdir(guides) if name.endswith(".md"))


def _blocks():
    """``(page, marker, language, code)`` for every Python and bash block of the pages."""
    out = []
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for marker, language, code in _BLOCK.findall(text):
            out.append((os.path.relpath(page, ROOT), marker.strip(), language, code))
    return out


def _runnable(language):
    return [(page, code) for page, marker, lang, code in _blocks() if marker == RUNS and lang == language]


def _runs_elsewhere(page, marker):
    """``<!-- runs in tests/x/test_y.py -->``: that test runs the block, read from the page."""
    m = re.fullmatch(r"<!-- runs in (tests/\S+\.py) -->", marker)
    if m and os.path.isfile(os.path.join(ROOT, m.group(1))):
        with open(os.path.join(ROOT, m.group(1)), encoding="utf-8") as f:
            return f'"{os.path.basename(page)}"' in f.read()
    return False


def test_every_guide_block_says_whether_it_runs():
    """A block runs here or in a test that reads it, or its marker says why not
    (``<!-- not run: needs a GPU -->``)."""
    unmarked = [(page, code.splitlines()[0]) for page, marker, _, code in _blocks()
                if marker != RUNS and not _runs_elsewhere(page, marker)
                and not re.fullmatch(r"<!-- not run: \S.*-->", marker)]
    assert not unmarked, unmarked
    assert len(_runnable("python")) >= 5 and _runnable("bash")


def _page_names():
    names = set()
    for page in _pages():
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for span in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S) + re.findall(r"`([^`\n]+)`", text):
            span = re.sub(r"([\"']).*?\1", "", span)  # keys in quotes, such as "jaxcnn.preprocessing"
            names.update(re.findall(r"(?<![\w.])jaxcnn(?:\.\w+)+", span))
    return sorted(names)


@pytest.mark.parametrize("name", _page_names())
def test_guide_name_resolves(name):
    from test_readme import _resolve
    try:
        _resolve(name)
    except AttributeError as e:
        pytest.fail(f"a guide names `{name}`, which does not resolve: {e}")


def test_every_python_block_parses_and_its_jaxcnn_imports_resolve():
    """Blocks that do not run (a GPU, a download) still parse, and what they import exists."""
    for page, _, language, code in _blocks():
        if language != "python":
            continue
        tree = ast.parse(code, filename=page)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxcnn"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(
                        f"{node.module}.{alias.name}"), f"{page}: from {node.module} import {alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("jaxcnn"):
                        importlib.import_module(alias.name)


def _environment():
    """A fresh process's environment: the suite's compilation cache (the guides' examples
    initialise the same small models, so only the first compiles), this tree first on the
    path, the console scripts of this Python."""
    env = xla_cache.fresh_process_env()
    env["PYTHONPATH"] = ROOT
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # the console scripts
    return env


@pytest.mark.parametrize("page, code", _runnable("python"), ids=lambda v: v if v.endswith(".md") else "")
def test_guide_python_example_runs_as_written(page, code, tmp_path):
    """Each marked Python block runs as written, in a fresh process from an empty directory."""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"


@pytest.mark.parametrize("page, code", _runnable("bash"), ids=lambda v: v if v.endswith(".md") else "")
def test_guide_commands_run_as_written(page, code, tmp_path):
    """Each marked shell block runs as written, from a directory that has the repository's
    ``configs/`` (as the repository root does), stopping at the first failing command."""
    os.symlink(os.path.join(ROOT, "configs"), tmp_path / "configs")
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=_environment(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{page}:\n{done.stderr[-3000:]}"


def test_the_guides_figures_are_the_benchmarks():
    """A guide links to its figures in docs/BENCHMARKS.md; any it quotes are there."""
    from test_readme import BENCHMARKS, FIGURE, _prose
    with open(BENCHMARKS, encoding="utf-8") as f:
        benchmarks = f.read()
    quoted = {(os.path.relpath(page, ROOT), figure) for page in _pages() for figure in FIGURE.findall(_prose(page))}
    assert {q for q in quoted if q[1] not in benchmarks} == set()


# ------------------------------------------------------------------ the API reference

PUBLIC = ("functional", "layers", "models", "precision", "train", "parallel", "data", "export", "interop",
          "predict", "cpu")


def test_every_public_package_has_an_api_page_in_the_site():
    with open(os.path.join(ROOT, "mkdocs.yml"), encoding="utf-8") as f:
        nav = f.read()
    for name in PUBLIC:
        page = f"reference/api/{name}.md"
        with open(os.path.join(DOCS, page), encoding="utf-8") as f:
            assert re.search(rf"^::: jaxcnn\.{name}$", f.read(), flags=re.M), page
        assert f" {page}\n" in nav, page


def test_the_hook_points_griffe_at_functions_named_like_their_modules():
    """``jaxcnn.train.run`` and ``jaxcnn.functional.linear`` (functions named like their
    modules) are documented from their defining modules; modules and unknown names stay."""
    path = os.path.join(ROOT, "scripts", "mkdocs_hooks.py")
    spec = importlib.util.spec_from_file_location("mkdocs_hooks", path)
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    import jaxcnn.functional
    import jaxcnn.train
    run = hooks.defining_path("jaxcnn.train.run")
    assert run == "jaxcnn.train.run.run" and callable(jaxcnn.train.run)
    assert hooks.defining_path("jaxcnn.functional.linear") == "jaxcnn.functional.linear.linear"
    assert hooks.defining_path("jaxcnn.functional") == "jaxcnn.functional"
    assert hooks.defining_path("jaxcnn.functional.no_such_name") == "jaxcnn.functional.no_such_name"
    assert jaxcnn.functional.linear.__name__ == "linear"
