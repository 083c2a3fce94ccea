"""The library's layering (docs/design/layers.md), read from the source with ast.

Every import counts, at module level or inside a function, of a module of ``jaxcnn`` or
``pallas_kernels``; a package's ``__init__`` stands for the package. A module importing its
own ancestor package (``from jaxcnn.layers import combinators`` inside ``jaxcnn.layers``) is
not an edge back up. No two modules, and no two packages (``jaxcnn.train``,
``jaxcnn.parallel``, ``pallas_kernels``, ...), may import each other, directly or round a
longer loop; and two edges the layering forbids are checked by name.
"""
import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxcnn", "pallas_kernels")


def _modules() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, a package under its own name."""
    found = {}
    for top in PACKAGES:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _imported_names(tree: ast.AST, package: str, known) -> set[str]:
    """The dotted names a module's imports refer to; ``package`` resolves relative imports."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + [base] if base else anchor)
            for alias in node.names:  # `from pkg import mod` names the module, else the package
                full = f"{base}.{alias.name}"
                names.add(full if full in known else base)
    return names


def _owner(name: str, known) -> str | None:
    """The longest known module that ``name`` is or lies inside, or None (not ours)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def module_graph() -> dict[str, set[str]]:
    known = _modules()
    graph = {}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {_owner(n, known) for n in _imported_names(ast.parse(path.read_text()), package, known)}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def package_of(module: str) -> str:
    """``jaxcnn.train.loop`` -> ``jaxcnn.train``; ``jaxcnn.errors`` stays; ``pallas_kernels.x`` ->
    ``pallas_kernels``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "jaxcnn" and len(parts) > 1 else parts[0]


def package_graph(graph) -> dict[str, set[str]]:
    packages = {}
    for module, targets in graph.items():
        mine = package_of(module)
        edges = packages.setdefault(mine, set())
        for target in targets:
            theirs = package_of(target)
            packages.setdefault(theirs, set())
            if theirs != mine and not mine.startswith(theirs + "."):
                edges.add(theirs)
    return packages


def cycles(graph) -> list[list[str]]:
    """The strongly connected components of more than one node (iterative Tarjan), sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _edges_into(graph, sources: str, targets) -> list[str]:
    return sorted(f"{m} -> {t}" for m, ts in graph.items() if m == sources or m.startswith(sources + ".")
                  for t in ts if any(t == p or t.startswith(p + ".") for p in targets))


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert package_graph({"jaxcnn.x.m": {"jaxcnn.y.n"}, "jaxcnn.y.n": {"jaxcnn.x"},
                          "jaxcnn.x": set()}) == {"jaxcnn.x": {"jaxcnn.y"}, "jaxcnn.y": {"jaxcnn.x"}}


def test_imports_resolve_inside_functions_and_relative():
    known = {"jaxcnn", "jaxcnn.train", "jaxcnn.train.loop", "jaxcnn.export", "jaxcnn.export.prune"}
    tree = ast.parse("def f():\n    from jaxcnn.export import prune\n    from . import loop\n"
                     "    from ..export.prune import x\n    import jaxcnn.train.loop.sub\n")
    names = _imported_names(tree, "jaxcnn.train", known)
    assert {_owner(n, known) for n in names} == {"jaxcnn.export.prune", "jaxcnn.train.loop"}


def test_no_import_cycle_between_modules():
    assert cycles(module_graph()) == []


def test_no_import_cycle_between_packages():
    assert cycles(package_graph(module_graph())) == []


@pytest.mark.parametrize("lower, upper", [
    ("pallas_kernels", ("jaxcnn.functional", "jaxcnn.layers")),
    ("jaxcnn.parallel", ("jaxcnn.train",)),
])
def test_a_lower_layer_imports_nothing_of_an_upper_one(lower, upper):
    assert _edges_into(module_graph(), lower, upper) == []


# -- every function stays readable, and the run directory's layout is written once --------------

def _docstring_nodes(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of a module, its classes and functions."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


# The stated exceptions to the 80-line rule. A kernel body: the function named ``body`` nested in
# a kernel builder of pallas_kernels (one kernel, read in one piece). It does not count towards
# its builder's lines either.
KERNEL_BODY = "body"
# The run function: the module-level ``train`` of jaxcnn/train/run.py, the life of a training run
# read top to bottom in banner-marked sections (as big_vision's train.py). It alone: the
# functions nested in it, and every other function of its module, keep the rule.
RUN_FUNCTION = (pathlib.Path("jaxcnn", "train", "run.py"), "train")


def _is_function(node) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))


def long_functions(path: pathlib.Path, limit: int, *, kernel_bodies: bool = False,
                   run_function: str | None = None) -> list[str]:
    """``file:line name (n lines)`` of each function over ``limit`` lines; with
    ``kernel_bodies``, nested ``body`` functions neither count nor are counted; with
    ``run_function``, the module-level function of that name is not counted (the functions
    nested in it are)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    run_functions = {id(n) for n in tree.body if _is_function(n) and n.name == run_function}

    def exempt(node) -> bool:
        return kernel_bodies and node.name == KERNEL_BODY

    out = []
    for node in ast.walk(tree):
        if not _is_function(node) or exempt(node) or id(node) in run_functions:
            continue
        lines = node.end_lineno - node.lineno + 1
        lines -= sum(n.end_lineno - n.lineno + 1 for n in ast.walk(node)
                     if n is not node and _is_function(n) and exempt(n))
        if lines > limit:
            out.append(f"{path.name}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_function_in_the_library_is_over_80_lines(tmp_path):
    run_path, run_name = RUN_FUNCTION
    too_long = [f for path in sorted((ROOT / "jaxcnn").rglob("*.py"))
                for f in long_functions(path, 80, run_function=run_name if path == ROOT / run_path else None)]
    too_long += [f for path in sorted((ROOT / "pallas_kernels").rglob("*.py"))
                 for f in long_functions(path, 80, kernel_bodies=True)]
    assert not too_long, too_long
    sample = tmp_path / "sample.py"  # the check itself: it sees a long function, and a kernel body
    sample.write_text("def f():\n" + "    x = 1\n" * 90)
    assert long_functions(sample, 80) == ["sample.py:1 f (91 lines)"]
    sample.write_text("def f():\n    def body():\n" + "        x = 1\n" * 90 + "    return body\n")
    assert long_functions(sample, 80, kernel_bodies=True) == []
    assert long_functions(sample, 80) == ["sample.py:1 f (93 lines)", "sample.py:2 body (91 lines)"]


def test_the_run_function_is_the_one_long_function_of_its_module(tmp_path):
    """The run function's exception covers it alone: not a function nested in it, not another
    function of the same name elsewhere in the module, and it is long (the exception is used)."""
    run_path, run_name = RUN_FUNCTION
    assert long_functions(ROOT / run_path, 80) == [
        f for f in long_functions(ROOT / run_path, 0) if f.split()[1] == run_name]
    assert long_functions(ROOT / run_path, 80) != []
    sample = tmp_path / "sample.py"
    sample.write_text("def train():\n" + "    x = 1\n" * 90)
    assert long_functions(sample, 80) == ["sample.py:1 train (91 lines)"]
    assert long_functions(sample, 80, run_function="train") == []
    sample.write_text("def train():\n    def save():\n" + "        x = 1\n" * 90 + "    return save\n"
                      "class C:\n    def train(self):\n" + "        x = 1\n" * 90)
    assert long_functions(sample, 80, run_function="train") == [
        "sample.py:2 save (91 lines)", "sample.py:95 train (91 lines)"]


RUN_DIR_NAMES = {"config.resolved.yaml", "config_history", "run_meta.json", "metrics.jsonl",
                 "checkpoints.log", "params.npz", "params.safetensors", "preprocessing.json"}


def layout_literals(path: pathlib.Path) -> list[str]:
    """String literals (docstrings aside) that spell a run-directory file name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstring_nodes(tree)
    return [f"{path.relative_to(ROOT)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docs and node.value in RUN_DIR_NAMES]


def test_the_run_directory_layout_is_spelled_in_one_module():
    """``RunDir`` (jaxcnn/train/rundir.py) names the run directory's files; the preprocessing
    record's name is the data layer's, which RunDir takes. Nothing else spells them."""
    owners = {"jaxcnn/train/rundir.py", "jaxcnn/data/preprocessing.py"}
    found = [hit for path in _modules().values() if str(path.relative_to(ROOT)) not in owners
             for hit in layout_literals(path)]
    assert not found, found
    assert layout_literals(ROOT / "jaxcnn" / "train" / "rundir.py")  # the check sees literals
