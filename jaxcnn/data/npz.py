"""Datasets stored as a ``.npz`` file holding ``x_train``, ``y_train``, ``x_test`` and ``y_test``.

Images are NHWC or NHW (a channel axis is added), ``uint8`` or any float dtype (converted to
float32 and taken as already on the unit scale); labels are 1-D integers. The file is opened
with ``allow_pickle=False``, and each array's ``.npy`` header is checked against the size the
zip directory records before NumPy allocates room for it.
"""
import math
import os
import zipfile
import zlib

import numpy as np

from jaxcnn.data.dataset import DataError, Dataset, channel_mean_std, check_dataset
from jaxcnn.data.files import check_regular_file

KEYS = ("x_train", "y_train", "x_test", "y_test")
DEFAULT_MAX_BYTES = 8 << 30


# Deflate expands at most about 1032-fold: a member claiming more than this many bytes per
# stored byte lies about its size (zip directories are as easy to forge as .npy headers).
_MAX_DEFLATE_RATIO = 1100


def npz_headers(path, keys=None) -> dict:
    """The shape and dtype of arrays in an ``.npz`` file, read from the ``.npy`` headers alone.

    Every number that would size an allocation is checked before any array is read: each
    header's shape and dtype against the size the zip directory records for its member, and
    those sizes against the bytes the file holds. Used by the dataset loader here and by
    ``jaxcnn.interop.load_npz`` for parameter files.

    Arguments:
        path: the ``.npz`` file.
        keys: the array names to read (each must be present), or None for every ``.npy`` member.

    Returns:
        ``{name: (shape, dtype, nbytes)}``.

    Raises:
        DataError naming the file and the array: unreadable zip, missing array, bad or
        pickled (object dtype) header, or a declared size that the file does not hold.
    """
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable .npz file ({err})") from err
    with archive:
        members = {info.filename: info for info in archive.infolist()}
        if keys is None:
            keys = [n[:-4] for n in members if n.endswith(".npy")]
        try:
            file_bytes = os.path.getsize(path)
        except OSError as err:
            raise DataError(f"{path}: cannot read ({err})") from err
        if sum(info.compress_size for info in members.values()) > file_bytes:
            raise DataError(f"{path}: its zip directory claims more bytes than the "
                            f"{file_bytes}-byte file holds")
        out = {}
        for key in keys:
            info = members.get(key + ".npy")
            if info is None:
                raise DataError(f"{path}: missing array {key!r} (has {sorted(n[:-4] for n in members)})")
            limit = info.compress_size * (1 if info.compress_type == zipfile.ZIP_STORED
                                          else _MAX_DEFLATE_RATIO)
            if info.file_size > limit:
                raise DataError(f"{path}: array {key!r} claims {info.file_size} bytes but its "
                                f"zip member stores {info.compress_size}")
            try:
                with archive.open(info) as member:
                    version = np.lib.format.read_magic(member)
                    if version == (1, 0):
                        shape, _, dtype = np.lib.format.read_array_header_1_0(member)
                    elif version == (2, 0):
                        shape, _, dtype = np.lib.format.read_array_header_2_0(member)
                    else:
                        raise ValueError(f"unsupported .npy format version {version}")
                    header_bytes = member.tell()
            except ValueError as err:
                raise DataError(f"{path}: array {key!r} has a bad .npy header ({err})") from err
            except (OSError, EOFError, zlib.error, zipfile.BadZipFile, NotImplementedError, RuntimeError) as err:
                # A damaged or unsupported (compressed with an unknown method, encrypted) zip member.
                raise DataError(f"{path}: cannot read array {key!r} ({type(err).__name__}: {err})") from err
            if dtype.hasobject:
                raise DataError(f"{path}: array {key!r} has dtype {dtype}, which needs pickle; refused")
            nbytes = math.prod(shape) * dtype.itemsize
            if header_bytes + nbytes != info.file_size:
                raise DataError(f"{path}: array {key!r} declares shape {shape} {dtype} ({nbytes} bytes) "
                                f"but its member holds {info.file_size - header_bytes}")
            out[key] = (tuple(shape), dtype, nbytes)
        return out


def _check_headers(path, max_bytes):
    """Reads only the ``.npy`` headers: a header may declare a shape the member does not hold."""
    total = sum(nbytes for _, _, nbytes in npz_headers(path, KEYS).values())
    if total > max_bytes:
        raise DataError(f"{path}: arrays hold {total} bytes, more than the {max_bytes}-byte limit")


def _images(path, key, x):
    if x.ndim == 3:
        x = x[..., None]
    if x.ndim != 4:
        raise DataError(f"{path}: {key} must be (N, H, W, C) or (N, H, W), got shape {x.shape}")
    if x.shape[1] in (1, 3) and x.shape[3] not in (1, 3, 4):  # PyTorch's layout, read as 1- or 3-pixel rows
        raise DataError(f"{path}: {key} has shape {x.shape}, channels first (N, C, H, W, PyTorch's layout); "
                        f"jaxcnn takes channels last (N, H, W, C): save np.transpose({key}, (0, 2, 3, 1))")
    if x.dtype == np.uint8:
        return x
    if not np.issubdtype(x.dtype, np.floating):
        raise DataError(f"{path}: {key} must be uint8 or floating point, got {x.dtype}")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DataError(f"{path}: {key} holds NaN or infinite values")
    return x


def _labels(path, key, y):
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        one_hot = y.ndim == 2 and y.shape[1] > 1 and y.size and bool(np.all((y == 0) | (y == 1))) \
            and bool(np.all(y.sum(axis=1) == 1))
        hint = f"; one-hot rows: save the class indices, {key}.argmax(axis=1)" if one_hot else ""
        raise DataError(f"{path}: {key} must be a 1-D integer array, got {y.dtype} with shape {y.shape}{hint}")
    if y.size and (y.min() < 0 or y.max() > np.iinfo(np.int32).max):
        raise DataError(f"{path}: {key} has labels in [{y.min()}, {y.max()}], expected non-negative int32")
    return y.astype(np.int32)


def load_npz(path, *, num_classes=None, name=None, max_bytes=DEFAULT_MAX_BYTES) -> Dataset:
    """Loads a dataset from an ``.npz`` file.

    Arguments:
        path: ``.npz`` file holding ``x_train``, ``y_train``, ``x_test``, ``y_test``.
        num_classes: number of classes; None infers ``max(label) + 1`` over both splits.
        name: dataset name; None uses the file name without its extension.
        max_bytes: refuse files whose arrays declare more bytes than this in total.

    Returns:
        A `Dataset`: ``(N, H, W, C)`` uint8 or float32 images, int32 labels, mean/std measured
        on the training images.

    Raises:
        DataError: naming the file and array: not a regular file, missing arrays, pickled/object arrays,
            bad shapes or dtypes, mismatched lengths, labels out of range, non-finite pixels.
    """
    path = check_regular_file(path)  # /dev/zero was read until the OOM killer came; a FIFO hung
    _check_headers(path, max_bytes)
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in KEYS}
    except (OSError, ValueError, EOFError, zlib.error, zipfile.BadZipFile, NotImplementedError, RuntimeError) as err:
        raise DataError(f"{path}: cannot read ({err})") from err
    x_train, x_test = (_images(path, k, arrays[k]) for k in ("x_train", "x_test"))
    y_train, y_test = (_labels(path, k, arrays[k]) for k in ("y_train", "y_test"))
    for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
        if len(x) != len(y):
            raise DataError(f"{path}: x_{split} has {len(x)} images but y_{split} has {len(y)} labels")
    if x_train.shape[1:] != x_test.shape[1:] or x_train.dtype != x_test.dtype:
        raise DataError(f"{path}: x_train {x_train.dtype}{x_train.shape[1:]} and x_test "
                        f"{x_test.dtype}{x_test.shape[1:]} differ in image shape or dtype")
    if len(x_train) == 0:
        raise DataError(f"{path}: x_train is empty")
    if num_classes is None:
        num_classes = int(max(y_train.max(), y_test.max(initial=0))) + 1
    if name is None:
        name = os.path.splitext(os.path.basename(path))[0]
    dataset = Dataset(x_train, y_train, x_test, y_test, int(num_classes), name)
    try:
        check_dataset(dataset)
    except DataError as err:
        raise DataError(f"{path}: {err}") from err
    mean, std = channel_mean_std(x_train)
    return dataset._replace(mean=mean, std=std)
