"""Data sources and the host-side input pipeline.

Loaders return an in-memory `Dataset` (NHWC images, int32 labels, per-channel mean/std):
`load_mnist` (the packaged 10,000-digit sample by default), `load_cifar10` (binary format),
`load_npz`, `synthetic_dataset`, or `load_dataset(name, path)`. `train_batch` gives the
batch for a step as a pure function of ``(seed, step)``; `eval_batches` covers a test set
with a padding mask; `Prefetcher` prepares batches in a background thread;
`synthetic_batch` makes ImageNet-shaped noise on the fly for throughput runs.

Datasets that do not fit in memory: `ImageData` opens an image folder
(``ROOT/{train,val}/<class>/<image>``, `scan_folder`, `FolderSource`) or the ArrayRecord files
``jaxcnn-data convert`` writes from one (`RecordSource`); `TrainBatches`/`EvalBatches` make a
step's batch (ImageNet crop and flip, or resize and centre crop) and `Loader` runs them in
grain worker processes. `write_shapes_folder` writes a small example folder.
`download_mnist` is the only function that touches the network, and only when called.
"""
from jaxcnn.data.augment import FILE_RECIPE, Augment, as_augment, augment_draws, crop_and_flip, resolve_augment
from jaxcnn.data.cifar import load_cifar10, read_cifar_bin
from jaxcnn.data.dataset import DataError, Dataset, channel_mean_std, check_dataset, normalize, to_unit_scale
from jaxcnn.data.download import download_file, download_mnist, sha256_of
from jaxcnn.data.files import check_regular_file
from jaxcnn.data.folder import FolderSource, scan_folder
from jaxcnn.data.images import ImageData
from jaxcnn.data.loader import EvalBatches, Loader, TrainBatches
from jaxcnn.data.records import RecordSource
from jaxcnn.data.shapes import write_shapes_folder
from jaxcnn.data.idx import read_idx, read_idx_images, read_idx_labels
from jaxcnn.data.mnist import MNIST_FILES, load_mnist, packaged_mnist_dir
from jaxcnn.data.npz import load_npz
from jaxcnn.data.pipeline import batch_indices, eval_batches, process_share, steps_per_epoch, train_batch
from jaxcnn.data.prefetch import Prefetcher
from jaxcnn.data.sources import load_dataset
from jaxcnn.data.synthetic import SyntheticSpec, synthetic_batch, synthetic_dataset

__all__ = [
    "FILE_RECIPE", "Augment", "DataError", "Dataset", "EvalBatches", "FolderSource", "ImageData", "Loader",
    "MNIST_FILES",
    "Prefetcher", "RecordSource", "SyntheticSpec", "TrainBatches", "scan_folder", "write_shapes_folder",
    "as_augment", "augment_draws", "resolve_augment", "batch_indices", "channel_mean_std", "check_dataset",
    "check_regular_file",
    "crop_and_flip",
    "download_file", "download_mnist", "eval_batches", "load_cifar10", "load_dataset", "load_mnist",
    "load_npz", "normalize", "packaged_mnist_dir", "process_share", "read_cifar_bin", "read_idx",
    "read_idx_images", "read_idx_labels", "sha256_of", "steps_per_epoch", "synthetic_batch",
    "synthetic_dataset", "to_unit_scale", "train_batch",
]
