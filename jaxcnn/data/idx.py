"""Reader for the IDX format of the MNIST files, gzip-compressed or raw.

An IDX file is a big-endian header, ``00 00 <type> <ndim>`` then ``ndim`` 32-bit sizes,
followed by the items in row-major order. MNIST images use magic ``0x00000803`` (uint8,
3 dims) and labels ``0x00000801`` (uint8, 1 dim).

The header is never trusted: the payload size it implies is checked against a cap and,
for raw files, against the file size before anything is read; gzip payloads are read in
chunks so that memory grows only with bytes that really arrive.
"""
import gzip
import os
import zlib

import numpy as np

from jaxcnn.data.dataset import DataError
from jaxcnn.data.files import check_regular_file

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801
# Full MNIST training images are 47 MB; anything past this cap is refused as hostile.
DEFAULT_MAX_BYTES = 1 << 30
_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _read_exact(stream, size, path, what):
    """Reads ``size`` bytes in chunks, so a lying header cannot make us allocate ahead of the data."""
    parts, have = [], 0
    while have < size:
        chunk = stream.read(min(_CHUNK, size - have))
        if not chunk:
            raise DataError(f"{path}: truncated {what}: expected {size} bytes, file ends after {have}")
        parts.append(chunk)
        have += len(chunk)
    return b"".join(parts)


def _parse_header(stream, path, expected_magic, max_bytes, raw_size):
    magic_bytes = _read_exact(stream, 4, path, "header")
    magic = int.from_bytes(magic_bytes, "big")
    if expected_magic is not None and magic != expected_magic:
        raise DataError(f"{path}: bad magic 0x{magic:08x}, expected 0x{expected_magic:08x}")
    if magic_bytes[:2] != b"\0\0" or magic_bytes[2] not in _IDX_DTYPES:
        raise DataError(f"{path}: bad magic 0x{magic:08x}, not an IDX file")
    dtype = np.dtype(_IDX_DTYPES[magic_bytes[2]])
    ndim = magic_bytes[3]
    dims_bytes = _read_exact(stream, 4 * ndim, path, "header")
    dims = tuple(int.from_bytes(dims_bytes[i:i + 4], "big") for i in range(0, 4 * ndim, 4))
    payload = int(np.prod(dims, dtype=object)) * dtype.itemsize  # exact integer, no overflow
    header_size = 4 + 4 * ndim
    if payload > max_bytes:
        raise DataError(f"{path}: header dims {dims} imply {payload} bytes of data, more than the "
                        f"{max_bytes}-byte limit")
    # An empty array (a dim of 0) still needs the product of its other dims to fit numpy's index
    # range: dims (0, 15598649, 4144701587, ...) made numpy refuse the reshape with "too big".
    extent = int(np.prod([d for d in dims if d], dtype=object)) * dtype.itemsize
    if payload == 0 and extent > max_bytes:
        raise DataError(f"{path}: header dims {dims} describe an empty array whose other dims "
                        f"({extent} bytes) exceed the {max_bytes}-byte limit")
    if raw_size is not None and header_size + payload != raw_size:
        raise DataError(f"{path}: header dims {dims} imply {header_size + payload} bytes, "
                        f"but the file has {raw_size}")
    return dtype, dims, payload


def read_idx(path, *, expected_magic=None, max_bytes=DEFAULT_MAX_BYTES) -> np.ndarray:
    """Reads an IDX file, gzip-compressed or raw (told apart by the gzip magic bytes, not the name).

    Arguments:
        path: file path.
        expected_magic: if given, the 32-bit magic the file must have (e.g. `IMAGES_MAGIC`).
        max_bytes: refuse files whose header declares a payload larger than this.

    Returns:
        An array of the declared shape in native byte order (``uint8`` for MNIST).

    Raises:
        DataError: naming the file: bad magic, truncated data, trailing bytes, sizes that
            disagree with the header, payload over ``max_bytes``, corrupt gzip stream.
    """
    path = check_regular_file(path)  # opening a FIFO blocks; a device never ends
    try:
        with open(path, "rb") as raw:
            compressed = raw.read(2) == _GZIP_MAGIC
            raw.seek(0)
            if compressed:
                stream = gzip.GzipFile(fileobj=raw, mode="rb")
                raw_size = None
            else:
                stream = raw
                raw_size = os.fstat(raw.fileno()).st_size
            dtype, dims, payload = _parse_header(stream, path, expected_magic, max_bytes, raw_size)
            data = _read_exact(stream, payload, path, "data")
            extra = stream.read(1)
            if extra:
                raise DataError(f"{path}: trailing bytes after the {payload} bytes declared by dims {dims}")
    except (OSError, EOFError, zlib.error) as err:
        if isinstance(err, FileNotFoundError):
            raise DataError(f"{path}: file not found") from err
        raise DataError(f"{path}: cannot read ({err})") from err
    return np.frombuffer(data, dtype).reshape(dims).astype(dtype.newbyteorder("="))


def read_idx_images(path, *, max_bytes=DEFAULT_MAX_BYTES) -> np.ndarray:
    """Reads an MNIST image file.

    Arguments:
        path: IDX file with magic ``0x00000803``.
        max_bytes: payload cap, see `read_idx`.

    Returns:
        ``(N, rows, cols, 1)`` ``uint8`` images (NHWC).
    """
    images = read_idx(path, expected_magic=IMAGES_MAGIC, max_bytes=max_bytes)
    if images.shape[0] == 0 or images.shape[1] == 0 or images.shape[2] == 0:
        raise DataError(f"{os.fspath(path)}: empty image dims {images.shape}")
    return images[..., None]


def read_idx_labels(path, *, num_classes=10, max_bytes=DEFAULT_MAX_BYTES) -> np.ndarray:
    """Reads an MNIST label file and checks every label is in ``[0, num_classes)``.

    Arguments:
        path: IDX file with magic ``0x00000801``.
        num_classes: labels must be smaller than this.
        max_bytes: payload cap, see `read_idx`.

    Returns:
        ``(N,)`` ``int32`` labels.
    """
    labels = read_idx(path, expected_magic=LABELS_MAGIC, max_bytes=max_bytes)
    if labels.size and labels.max() >= num_classes:
        bad = int(np.argmax(labels >= num_classes))
        raise DataError(f"{os.fspath(path)}: label {int(labels[bad])} at index {bad} is out of range "
                        f"0..{num_classes - 1}")
    return labels.astype(np.int32)
