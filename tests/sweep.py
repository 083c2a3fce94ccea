"""How much of a sweep over kernel tile configurations the default suite lowers.

Lowering every tile configuration the tuner may choose, for every kernel of a call, takes
minutes on two cores (each is a compilation for an abstract H100).  The default suite lowers
a sample: :func:`sample` takes every other one, the first and the last always among them (so
the smallest and the largest tiles are there), and ``mgpu_testlib.cover`` the configurations
that bring a tile field's value not yet lowered; ``JAXCNN_TEST_ALL_EXAMPLES=1``, which the scheduled long run sets, lowers
them all, as it runs all of the property tests' examples (``tests/conftest.py``).
"""
import os

ALL_EXAMPLES_ENV = "JAXCNN_TEST_ALL_EXAMPLES"


def all_examples() -> bool:
    """Whether this run asks for every example and every candidate (the long run's setting)."""
    return os.environ.get(ALL_EXAMPLES_ENV) == "1"


def sample(candidates) -> list:
    """``candidates`` (a sequence) in full with ``JAXCNN_TEST_ALL_EXAMPLES=1``; else those at
    even positions, and the last."""
    candidates = list(candidates)
    if all_examples() or len(candidates) <= 2:
        return candidates
    picked = candidates[::2]
    return picked if picked[-1] is candidates[-1] else picked + candidates[-1:]
