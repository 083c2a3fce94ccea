"""Checksum-verified downloads against a local HTTP server (never the network)."""
import functools
import hashlib
import http.server
import os
import socket
import threading
import time

import numpy as np
import pytest

from jaxcnn.data import MNIST_FILES, DataError, download_file, download_mnist, load_mnist


@pytest.fixture
def server(tmp_path, rng, fmt):
    """Serves four small MNIST files from tmp_path/served on 127.0.0.1; yields (base_url, digests, requests)."""
    served = tmp_path / "served"
    served.mkdir()
    x = rng.integers(0, 256, (5, 4, 4), dtype=np.uint8)
    fmt.write_mnist_dir(served, x, np.arange(5), x[:2], np.arange(2))
    digests = {name: hashlib.sha256((served / name).read_bytes()).hexdigest() for name in MNIST_FILES}
    requests = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self):
            requests.append(self.path)
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(served)))
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", digests, requests
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_download_verify_and_load(tmp_path, server):
    base_url, digests, requests = server
    dest = tmp_path / "mnist"
    paths = download_mnist(dest, base_url=base_url, sha256=digests)
    assert paths == [os.path.join(dest, name) for name in MNIST_FILES]
    assert sorted(os.listdir(dest)) == sorted(MNIST_FILES)  # no temporary files left
    assert load_mnist(dest).x_train.shape == (5, 4, 4, 1)
    assert len(requests) == 4
    # A second call finds verified files and sends no request.
    download_mnist(dest, base_url=base_url.rstrip("/"), sha256={k: v.upper() for k, v in digests.items()})
    assert len(requests) == 4


def test_checksum_mismatch_is_refused_and_nothing_is_written(tmp_path, server):
    base_url, digests, _ = server
    dest = tmp_path / "mnist"
    wrong = dict(digests, **{"t10k-images-idx3-ubyte.gz": "0" * 64})
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte.gz: sha256 mismatch: expected 0{64}, got "
                                        + digests["t10k-images-idx3-ubyte.gz"]):
        download_mnist(dest, base_url=base_url, sha256=wrong)
    assert "t10k-images-idx3-ubyte.gz" not in os.listdir(dest)
    assert not [name for name in os.listdir(dest) if name.endswith(".part")]


def test_corrupted_local_file_is_replaced(tmp_path, server):
    base_url, digests, requests = server
    dest = tmp_path / "mnist"
    dest.mkdir()
    (dest / "train-labels-idx1-ubyte.gz").write_bytes(b"stale")
    download_mnist(dest, base_url=base_url, sha256=digests, files=["train-labels-idx1-ubyte.gz"])
    assert hashlib.sha256((dest / "train-labels-idx1-ubyte.gz").read_bytes()).hexdigest() == \
        digests["train-labels-idx1-ubyte.gz"]
    assert requests == ["/train-labels-idx1-ubyte.gz"]


def test_http_error_and_size_limit(tmp_path, server):
    base_url, digests, _ = server
    with pytest.raises(DataError, match=r"absent.gz: download failed \(HTTP Error 404"):
        download_file(base_url + "absent.gz", tmp_path / "absent.gz", sha256="0" * 64)
    with pytest.raises(DataError, match="larger than the 10-byte limit"):
        download_file(base_url + MNIST_FILES[0], tmp_path / "f.gz", sha256=digests[MNIST_FILES[0]], max_bytes=10)
    assert os.listdir(tmp_path) == ["served"]


def test_refusals_before_any_request(tmp_path):
    with pytest.raises(ValueError, match=r"no sha256 given for \['t10k-labels-idx1-ubyte.gz'\]"):
        download_mnist(tmp_path, base_url="http://127.0.0.1:9/", sha256={n: "0" * 64 for n in MNIST_FILES[:3]})
    with pytest.raises(DataError, match="only http and https downloads are supported, not 'file'"):
        download_file("file:///etc/hostname", tmp_path / "x", sha256="0" * 64)


@pytest.fixture
def tricky_server():
    """127.0.0.1 server with redirects and a slow drip; yields (base_url, ftp_url, ftp_connections)."""
    payload = b"x" * 64
    ftp = socket.socket()
    ftp.bind(("127.0.0.1", 0))
    ftp.listen(4)
    ftp.settimeout(0.05)
    ftp_connections, stop = [], threading.Event()

    def ftp_listener():  # counts connections; closes each at once
        while not stop.is_set():
            try:
                conn, _ = ftp.accept()
            except OSError:
                continue
            ftp_connections.append(1)
            conn.close()

    ftp_url = f"ftp://127.0.0.1:{ftp.getsockname()[1]}/x"

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path.startswith("/redirect/"):
                self.send_response(302)
                self.send_header("Location", {"/redirect/ftp": ftp_url, "/redirect/file": "file:///etc/hostname",
                                              "/redirect/ok": "/payload"}[self.path])
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/payload":
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)
            elif self.path in ("/drip/body", "/drip/headers"):  # one byte every 0.1 s, for up to 30 s
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(payload) * 5}\r\n\r\n".encode()
                if self.path == "/drip/body":
                    self.wfile.write(head)
                    head = b""
                try:
                    for byte in [head[i:i + 1] for i in range(len(head))] + [b"x"] * 300:
                        self.wfile.write(byte)
                        self.wfile.flush()
                        time.sleep(0.1)
                except OSError:
                    pass

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threads = [threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True),
               threading.Thread(target=ftp_listener, daemon=True)]
    for t in threads:
        t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", hashlib.sha256(payload).hexdigest(), ftp_connections
    finally:
        stop.set()
        httpd.shutdown()
        httpd.server_close()
        for t in threads:
            t.join()
        ftp.close()


def test_redirects_to_other_schemes_are_refused(tmp_path, tricky_server):
    """Regression: urllib follows a redirect to ftp:// (and would then fetch over FTP)."""
    base_url, digest, ftp_connections = tricky_server
    with pytest.raises(DataError, match=r"redirect/ftp: refused a redirect to ftp://127.0.0.1:\d+/x: "
                                        r"only http and https downloads are supported, not 'ftp'"):
        download_file(base_url + "redirect/ftp", tmp_path / "x", sha256=digest, timeout=5)
    assert ftp_connections == []  # no FTP connection was even attempted
    with pytest.raises(DataError, match="redirect/file: .*file:///etc/hostname"):  # urllib's own refusal
        download_file(base_url + "redirect/file", tmp_path / "x", sha256=digest, timeout=5)
    # http redirects are still followed
    download_file(base_url + "redirect/ok", tmp_path / "ok", sha256=digest, timeout=5)
    assert (tmp_path / "ok").read_bytes() == b"x" * 64
    assert sorted(os.listdir(tmp_path)) == ["ok"]


@pytest.mark.parametrize("part", ["headers", "body"])
def test_overall_deadline_against_a_trickling_server(tmp_path, tricky_server, part):
    """Regression: one byte every 0.1 s never trips a 2 s per-read timeout, so the download
    ran for as long as the server liked; the deadline ends it (headers or body)."""
    base_url, digest, _ = tricky_server
    start = time.monotonic()
    with pytest.raises(DataError, match=rf"drip/{part}: download did not finish within its 1 s deadline"):
        download_file(base_url + f"drip/{part}", tmp_path / "x", sha256=digest, timeout=2, deadline=1)
    assert time.monotonic() - start < 2.5
    assert os.listdir(tmp_path) == []  # the partial file is gone
    with pytest.raises(ValueError, match="deadline must be positive"):
        download_file(base_url + "payload", tmp_path / "x", sha256=digest, deadline=0)


@pytest.mark.parametrize("name", ["../x", "sub/x", "..", ".", "", "/abs", "a\\b"])
def test_file_names_that_leave_dest_are_refused(tmp_path, name):
    """Regression: files=["../x"] wrote next to dest, not in it.  Refused before any request
    (the base URL has nothing listening)."""
    dest = tmp_path / "d"
    with pytest.raises(ValueError, match=r"download_mnist: file name .* is not a plain file name"):
        download_mnist(dest, base_url="http://127.0.0.1:9/", sha256={name: "0" * 64}, files=[name])
    assert not (tmp_path / "x").exists() and not (tmp_path / "abs").exists()
