"""timm and torchvision as references for the photometric tests, imported or skipped.

torchvision's compiled ops do not match the venv's torch; its Python transforms import once
``torchvision._meta_registrations`` (which registers those ops) is an empty module. timm
imports torchvision, so the same stub comes first.
"""
import sys
import types

import pytest


def references():
    """``(timm.data.auto_augment, timm.data.random_erasing, torchvision.transforms.functional)``;
    skips the calling test when timm or torchvision is absent."""
    pytest.importorskip("torch")
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    pytest.importorskip("torchvision")
    auto_augment = pytest.importorskip("timm.data.auto_augment")
    random_erasing = pytest.importorskip("timm.data.random_erasing")
    functional = pytest.importorskip("torchvision.transforms.functional")
    return auto_augment, random_erasing, functional
