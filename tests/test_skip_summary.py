"""The suite hooks of tests/conftest.py: the one-line summary of why tests were skipped,
property tests running half their examples, and the order the tests are handed out in."""
import importlib.util
import pathlib

# Loaded by path: other test folders have a conftest.py of their own, and which one a plain
# ``import conftest`` finds depends on the order pytest collected them in.
_spec = importlib.util.spec_from_file_location(
    "_suite_conftest", pathlib.Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


class _Report:
    def __init__(self, reason, skipped=True):
        self.skipped, self.longrepr = skipped, ("tests/x.py", 3, f"Skipped: {reason}")


class _Reporter:
    def __init__(self, reports):
        self.stats, self.lines = {"skipped": reports}, []

    def write_line(self, line):
        self.lines.append(line)


def test_skip_reasons_are_grouped_with_counts():
    reporter = _Reporter([
        _Report("could not import 'torch': No module named 'torch'"),
        _Report("could not import 'torch': No module named 'torch'"),
        _Report("the triton package is needed (No module named 'triton'); pip install triton"),
        _Report("jax 0.10.2 has no Pallas Triton lowering: boom\nmore detail"),
        _Report("could not import 'onnx': No module named 'onnx'"),
        _Report("torch absent", skipped=False),  # not a skip: left out
    ])
    conftest.pytest_terminal_summary(reporter)
    assert reporter.lines == ["skipped 5: torch absent (2); triton absent (1); "
                              "jax 0.10.2 has no Pallas Triton lowering: boom (1); onnx absent (1)"]


def test_nothing_printed_without_skips():
    reporter = _Reporter([])
    conftest.pytest_terminal_summary(reporter)
    assert reporter.lines == []


def test_property_tests_run_half_their_examples(monkeypatch):
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=40, deadline=None)
    @given(st.integers())
    def many(x):
        pass

    @settings(max_examples=12, deadline=None)
    @given(st.integers())
    def few(x):
        pass

    class Item:
        def __init__(self, obj):
            self.obj = obj

    monkeypatch.delenv("JAXCNN_TEST_ALL_EXAMPLES", raising=False)
    conftest._halve_examples([Item(many), Item(many), Item(few), Item(len)])
    assert many._hypothesis_internal_use_settings.max_examples == 20  # halved once, not per item
    assert few._hypothesis_internal_use_settings.max_examples == 10
    assert many._hypothesis_internal_use_settings.deadline is None  # the rest kept


def test_the_long_dry_run_goes_first_and_the_short_functional_tests_last():
    class Item:
        def __init__(self, path):
            self.path = pathlib.Path(__file__).parent / path
            self.obj = None

    paths = ["data/test_a.py", "functional/test_b.py", "interop/test_c.py", "test_gpu_check.py",
             "train/test_d.py", "functional/test_a.py", "test_readme.py", "data/test_0.py"]
    items = [Item(p) for p in paths]
    conftest.pytest_collection_modifyitems(None, items)
    tests = pathlib.Path(__file__).parent
    assert [str(i.path.relative_to(tests)) for i in items] == [
        "test_gpu_check.py", "data/test_a.py", "interop/test_c.py", "train/test_d.py", "test_readme.py",
        "data/test_0.py", "functional/test_b.py", "functional/test_a.py"]
