"""Numeric assertions shared by the test suite (importable as ``numeric``:
pytest puts ``tests/`` on ``sys.path`` for its conftest)."""
import numpy as np


def assert_close(actual, expected, rtol):
    """max |a - e| <= rtol * max(max |e|, 1): a relative error over the whole array."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = max(np.max(np.abs(expected), initial=0.0), 1.0)
    err = np.max(np.abs(actual - expected), initial=0.0)
    assert err <= rtol * scale, f"max abs error {err} > {rtol} * {scale}"


def jaxpr_eqns(jaxpr):
    """Every equation of ``jaxpr`` (a Jaxpr or ClosedJaxpr) in program order, each
    sub-jaxpr's (a ``checkpoint``'s, ``custom_vjp_call``'s, ``cond``'s branches...) in
    place of the equation that holds it, after it."""
    for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)  # a ClosedJaxpr's jaxpr, or a Jaxpr
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner)
