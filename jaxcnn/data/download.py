"""Checksum-verified downloads. Nothing here runs unless called; nothing is fetched at import.

A file is streamed to a temporary file beside its destination while its SHA-256 is computed,
and moved into place with `os.replace` only when the digest matches, so an interrupted or
tampered download never leaves a file under the final name.  Only http and https are spoken,
redirects included; a whole download has an overall deadline besides the per-read timeout
(a server that trickles bytes never times a read out); file names are plain names.
"""
import hashlib
import http.client
import os
import socket
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request

from jaxcnn.data.dataset import DataError
from jaxcnn.data.mnist import MNIST_FILES

_CHUNK = 1 << 20
# The largest MNIST file is under 10 MB; refuse a server that sends far more.
DEFAULT_MAX_BYTES = 256 << 20
# Seconds for a whole download (connection, headers, body), whatever the server's pace.
DEFAULT_DEADLINE = 600.0
_SCHEMES = ("http", "https")


class _Deadline:
    """Shuts down every socket a download opened once ``seconds`` have passed, which ends
    any read blocked on it (``expired`` then tells the caller why the read ended)."""

    def __init__(self, seconds: float):
        self.seconds, self.expired = seconds, False
        self._socks, self._lock = [], threading.Lock()
        self._timer = threading.Timer(seconds, self._expire)
        self._timer.daemon = True

    def __enter__(self):
        if self.seconds < float("inf"):
            self._timer.start()
        return self

    def __exit__(self, *exc):
        self._timer.cancel()

    def track(self, sock):
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                self._shutdown(sock)

    def _expire(self):
        with self._lock:
            self.expired = True
            for sock in self._socks:
                self._shutdown(sock)

    @staticmethod
    def _shutdown(sock):
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _tracked(connection_class, deadline):
    class Connection(connection_class):
        def connect(self):
            super().connect()
            deadline.track(self.sock)
    return Connection


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline):
        super().__init__()
        self._deadline = deadline

    def http_open(self, req):
        return self.do_open(_tracked(http.client.HTTPConnection, self._deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline):
        super().__init__()
        self._deadline = deadline

    def https_open(self, req):
        return self.do_open(_tracked(http.client.HTTPSConnection, self._deadline), req,
                            context=self._context)


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http and https URLs only (urllib's own also follows ftp)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urllib.parse.urlsplit(newurl).scheme
        if scheme not in _SCHEMES:
            fp.close()
            raise DataError(f"{req.full_url}: refused a redirect to {newurl}: only http and https "
                            f"downloads are supported, not {scheme!r}")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _opener(deadline):
    return urllib.request.build_opener(_HTTPHandler(deadline), _HTTPSHandler(deadline),
                                       _HttpOnlyRedirects())


def _check_file_name(name) -> None:
    """ValueError unless ``name`` is a plain file name: no directory part, not ``.``/``..``."""
    seps = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if (not isinstance(name, str) or name in ("", ".", "..") or "\0" in name
            or any(sep in name for sep in seps)):
        raise ValueError(f"download_mnist: file name {name!r} is not a plain file name "
                         "(no path separators, '.' or '..')")


def sha256_of(path) -> str:
    """Hex SHA-256 digest of a file."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_file(url: str, path, *, sha256: str, timeout: float = 60.0, max_bytes: int = DEFAULT_MAX_BYTES,
                  deadline: float = DEFAULT_DEADLINE):
    """Downloads ``url`` to ``path`` if the content's SHA-256 is ``sha256``.

    Arguments:
        url: an ``http://`` or ``https://`` URL; redirects are followed to such URLs only.
        path: destination file; its directory must exist. Left untouched on any failure.
        sha256: expected hex digest (case-insensitive).
        timeout: socket timeout in seconds, per connection attempt or read.
        max_bytes: abort when the response grows past this many bytes.
        deadline: abort when the whole download (redirects included) takes longer than this
            many seconds.

    Returns:
        ``path``.

    Raises:
        DataError: naming the URL: unsupported scheme (or a redirect to one), HTTP or network
            error, response too large, deadline passed, or checksum mismatch (expected and
            received digests both shown).
    """
    scheme = urllib.parse.urlsplit(url).scheme
    if not deadline > 0:
        raise ValueError(f"download_file: deadline must be positive, got {deadline!r}")
    if scheme not in _SCHEMES:
        raise DataError(f"{url}: only http and https downloads are supported, not {scheme!r}")
    path = os.fspath(path)
    expected = sha256.lower()
    fd, temp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part", dir=os.path.dirname(path) or ".")
    try:
        digest, size = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as out, _Deadline(deadline) as clock:
            try:
                with _opener(clock).open(url, timeout=min(timeout, deadline)) as response:
                    for chunk in iter(lambda: response.read1(_CHUNK), b""):
                        size += len(chunk)
                        if size > max_bytes:
                            raise DataError(f"{url}: response is larger than the {max_bytes}-byte limit")
                        digest.update(chunk)
                        out.write(chunk)
                        if clock.expired:
                            break
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
                if not clock.expired:
                    raise DataError(f"{url}: download failed ({err})") from err
            if clock.expired:
                raise DataError(f"{url}: download did not finish within its {deadline:g} s deadline "
                                f"({size} bytes received); not saved")
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
                   max_bytes: int = DEFAULT_MAX_BYTES, deadline: float = DEFAULT_DEADLINE):
    """Downloads the MNIST IDX files into ``dest``, each checked against its SHA-256.

    Files already in ``dest`` with the right digest are kept without a request.

    Arguments:
        dest: directory to write into (created if missing); afterwards it can be passed to
            `jaxcnn.data.load_mnist`.
        base_url: URL of the directory serving the files (``base_url/<file name>``).
        sha256: mapping from each file name to its expected hex digest; every file needs one,
            so nothing unverified is ever saved.
        files: file names to fetch; the four standard gzipped MNIST names by default. Plain
            names only: a path separator, ``.`` or ``..`` would write outside ``dest``.
        timeout: socket timeout in seconds, per connection attempt or read.
        max_bytes: per-file size limit.
        deadline: per-file limit in seconds on the whole download.

    Returns:
        The list of paths written or kept, in the order of ``files``.

    Raises:
        ValueError: when a file has no digest or is not a plain file name.
        DataError: naming the URL on a failed download or a checksum mismatch.
    """
    files = list(files)
    for name in files:
        _check_file_name(name)
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
            download_file(url, path, sha256=sha256[name], timeout=timeout, max_bytes=max_bytes,
                          deadline=deadline)
        paths.append(path)
    return paths
