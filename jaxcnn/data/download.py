"""Checksum-verified downloads. Nothing here runs unless called; nothing is fetched at import.

A file is streamed to a temporary file beside its destination while its SHA-256 is computed,
and moved into place with `os.replace` only when the digest matches, so an interrupted or
tampered download never leaves a file under the final name.
"""
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.parse
import urllib.request

from jaxcnn.data.dataset import DataError
from jaxcnn.data.mnist import MNIST_FILES

_CHUNK = 1 << 20
# The largest MNIST file is under 10 MB; refuse a server that sends far more.
DEFAULT_MAX_BYTES = 256 << 20


def sha256_of(path) -> str:
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, path, *, sha256: str, timeout: float = 60.0, max_bytes: int = DEFAULT_MAX_BYTES):
    """Downloads ``url`` to ``path`` if the content's SHA-256 is ``sha256``.

    Arguments:
        url: an ``http://`` or ``https://`` URL.
        path: destination file; its directory must exist. Left untouched on any failure.
        sha256: expected hex digest (case-insensitive).
        timeout: socket timeout in seconds.
        max_bytes: abort when the response grows past this many bytes.

    Returns:
        ``path``.

    Raises:
        DataError naming the URL: unsupported scheme, HTTP or network error, response too
        large, or checksum mismatch (expected and received digests both shown).
    """
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in ("http", "https"):
        raise DataError(f"{url}: only http and https downloads are supported, not {scheme!r}")
    path = os.fspath(path)
    expected = sha256.lower()
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=os.path.dirname(path) or ".")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    for chunk in iter(lambda: response.read(_CHUNK), b""):
                        size += len(chunk)
                        if size > max_bytes:
                            raise DataError(f"{url}: response is larger than the {max_bytes}-byte limit")
                        digest.update(chunk)
                        out.write(chunk)
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
                raise DataError(f"{url}: download failed ({err})") from err
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != expected:
            raise DataError(f"{url}: sha256 mismatch: expected {expected}, got {digest.hexdigest()} "
                            f"({size} bytes); not saved")
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    return path


def download_mnist(dest, *, base_url: str, sha256: dict, files=MNIST_FILES, timeout: float = 60.0,
                   max_bytes: int = DEFAULT_MAX_BYTES):
    """Downloads the MNIST IDX files into ``dest``, each checked against its SHA-256.

    Files already in ``dest`` with the right digest are kept without a request.

    Arguments:
        dest: directory to write into (created if missing); afterwards it can be passed to
            `jaxcnn.data.load_mnist`.
        base_url: URL of the directory serving the files (``base_url/<file name>``).
        sha256: mapping from each file name to its expected hex digest; every file needs one,
            so nothing unverified is ever saved.
        files: file names to fetch; the four standard gzipped MNIST names by default.
        timeout: socket timeout in seconds, per request.
        max_bytes: per-file size limit.

    Returns:
        The list of paths written or kept, in the order of ``files``.

    Raises:
        ValueError when a file has no digest; DataError naming the URL on a failed download or
        a checksum mismatch.
    """
    missing = [name for name in files if name not in sha256]
    if missing:
        raise ValueError(f"download_mnist: no sha256 given for {missing}")
    dest = os.fspath(dest)
    os.makedirs(dest, exist_ok=True)
    paths = []
    for name in files:
        path = os.path.join(dest, name)
        if not (os.path.isfile(path) and sha256_of(path) == sha256[name].lower()):
            url = base_url.rstrip("/") + "/" + urllib.parse.quote(name)
            download_file(url, path, sha256=sha256[name], timeout=timeout, max_bytes=max_bytes)
        paths.append(path)
    return paths
