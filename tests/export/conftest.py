"""Fixtures of the export tests; the helpers live in ``export_cases``."""
import pytest

from export_cases import ZooCase


@pytest.fixture(scope="session")
def zoo_case():
    """``zoo_case(name)`` -> a cached :class:`ZooCase`."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = ZooCase(name)
        return cache[name]
    return get
