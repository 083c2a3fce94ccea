"""load_dataset: dispatch by name and its refusals."""
import numpy as np
import pytest

from jaxcnn.data import load_dataset


def test_names_dispatch(tmp_path, rng, fmt):
    assert load_dataset("mnist").x_train.shape == (8000, 28, 28, 1)
    (tmp_path / "c").mkdir()
    for name in [f"data_batch_{i}.bin" for i in range(1, 6)] + ["test_batch.bin"]:
        (tmp_path / "c" / name).write_bytes(fmt.cifar_records(rng, 1).tobytes())
    assert load_dataset("cifar10", tmp_path / "c").x_train.shape == (5, 32, 32, 3)
    np.savez(tmp_path / "d.npz", x_train=np.zeros((2, 3, 3), np.uint8), y_train=np.array([0, 1]),
             x_test=np.zeros((1, 3, 3), np.uint8), y_test=np.array([1]))
    assert load_dataset("npz", tmp_path / "d.npz", num_classes=3).num_classes == 3


def test_refusals():
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="dataset 'cifar10' needs a path"):
        load_dataset("cifar10")
    with pytest.raises(ValueError, match=r"unknown options for 'synthetic': \['colour'\]"):
        load_dataset("synthetic", colour=True)
    with pytest.raises(ValueError, match="takes no path"):
        load_dataset("synthetic", "somewhere")
