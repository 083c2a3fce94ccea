"""Loading a dataset by name, as a config file names it."""
from jaxcnn.data.cifar import load_cifar10
from jaxcnn.data.dataset import Dataset
from jaxcnn.data.mnist import load_mnist
from jaxcnn.data.npz import load_npz
from jaxcnn.data.synthetic import SyntheticSpec, synthetic_dataset

NAMES = ("mnist", "cifar10", "npz", "synthetic")


def load_dataset(name: str, path=None, **options) -> Dataset:
    """Loads the in-memory dataset called ``name``.

    Arguments:
        name: ``"mnist"`` (path optional: None is the packaged 10,000-digit sample),
            ``"cifar10"`` (path: directory of the binary ``.bin`` files), ``"npz"`` (path:
            the ``.npz`` file; options ``num_classes``, ``name``) or ``"synthetic"`` (no path;
            options ``image_shape``, ``num_classes``, ``num_train``, ``num_test``, ``seed``).
        path: where the files are.
        **options: passed to the loader.

    Returns:
        A `Dataset` with mean/std set.

    For synthetic throughput runs that never materialise a dataset, use
    `jaxcnn.data.synthetic_batch` instead.
    """
    if name == "mnist":
        return load_mnist(path, **options)
    if name in ("cifar10", "npz") and path is None:
        raise ValueError(f"load_dataset: dataset {name!r} needs a path")
    if name == "cifar10":
        return load_cifar10(path, **options)
    if name == "npz":
        return load_npz(path, **options)
    if name == "synthetic":
        if path is not None:
            raise ValueError("load_dataset: the synthetic dataset takes no path")
        spec_fields = {k: options.pop(k) for k in SyntheticSpec._fields if k in options}
        if "image_shape" in spec_fields:
            spec_fields["image_shape"] = tuple(spec_fields["image_shape"])
        sizes = {"num_train": options.pop("num_train", 1024), "num_test": options.pop("num_test", 256),
                 "seed": options.pop("seed", 0)}
        if options:
            raise ValueError(f"load_dataset: unknown options for 'synthetic': {sorted(options)}")
        return synthetic_dataset(SyntheticSpec(**spec_fields), **sizes)
    raise ValueError(f"load_dataset: unknown dataset {name!r}; expected one of {list(NAMES)}")
