"""timm and torchvision as references for the photometric tests, imported or skipped.

timm imports torchvision, so torchvision is imported first, as `torchvision_ref` does it.
"""
import pytest

from torchvision_ref import torchvision_transforms


def references():
    """``(timm.data.auto_augment, timm.data.random_erasing, torchvision.transforms.functional)``;
    skips the calling test when timm or torchvision is absent."""
    functional = torchvision_transforms().functional
    auto_augment = pytest.importorskip("timm.data.auto_augment")
    random_erasing = pytest.importorskip("timm.data.random_erasing")
    return auto_augment, random_erasing, functional
