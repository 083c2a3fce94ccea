"""The suite's one-line summary of why tests were skipped (tests/conftest.py)."""
import conftest


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
