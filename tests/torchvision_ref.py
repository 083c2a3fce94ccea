"""torchvision's transforms as a test reference on the CPU: imported without its compiled ops, and
fed the random numbers of a numpy generator so that its output can be compared pixel for pixel."""
import sys
import types

import pytest


def torchvision_transforms():
    """torchvision, imported for its PIL transforms only: its compiled ops need the torch it was
    built for, and a stand-in for ``torchvision._meta_registrations`` lets it import without
    them (skipped where torch or torchvision is not installed; one installed that does not
    import is a failure)."""
    pytest.importorskip("torch")
    if "torchvision" not in sys.modules:
        sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    return pytest.importorskip("torchvision.transforms")


class _TorchDrawingFrom:
    """Stands in for ``torch`` inside torchvision's transforms module: its random draws
    (``empty(1).uniform_``, ``rand``, ``randint``) come from a numpy generator, so torchvision
    is fed the very numbers ours draws; everything else is torch."""

    def __init__(self, torch, rng):
        self._torch, self._rng = torch, rng

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def empty(self, *shape):
        torch, rng = self._torch, self._rng

        class Uniform:
            def uniform_(self, lo, hi):
                return torch.tensor([rng.uniform(float(lo), float(hi))], dtype=torch.float64)
        return Uniform()

    def rand(self, *shape):
        return self._torch.tensor([self._rng.random()], dtype=self._torch.float64)

    def randint(self, low, high, size):
        return self._torch.tensor([int(self._rng.integers(low, high))])


def feed_draws(monkeypatch, T, rng):
    """Until the test ends, torchvision's random transforms draw from ``rng`` (`_TorchDrawingFrom`)."""
    import torch
    monkeypatch.setattr(sys.modules[type(T.RandomCrop(1)).__module__], "torch", _TorchDrawingFrom(torch, rng))
