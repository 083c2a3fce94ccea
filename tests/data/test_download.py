"""Checksum-verified downloads against a local HTTP server (never the network)."""
import functools
import hashlib
import http.server
import os
import threading

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
