"""Security: no unsafe deserialisation in the source, bounded reads of hostile files, run directories
created with the user's umask, and checkpoint cleanup that never follows a symbolic link."""
import ast
import gzip
import io
import logging
import os
import shutil
import tracemalloc
import zipfile
import zlib

import numpy as np
import pytest

from jaxcnn.data import DataError, load_cifar10, load_mnist, load_npz
from jaxcnn.data.cifar import TEST_FILES, TRAIN_FILES
from jaxcnn.train.checkpoint import CheckpointManager
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import load_config
from jaxcnn.train._build import build_run, init_state
from reliability_lib import ROOT, step_dirs, tiny_args, tiny_npz

# ------------------------------------------------------------------ source scan

SCANNED = ["jaxcnn", "pallas_kernels", "scripts"]
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal", "joblib"}
UNSAFE_YAML = {"load", "load_all", "unsafe_load", "unsafe_load_all", "full_load", "full_load_all",
               "Loader", "UnsafeLoader", "FullLoader", "CLoader", "CUnsafeLoader", "CFullLoader"}


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """Code (not comments or strings) that deserialises unsafely or evaluates text.

    Flags: importing or using pickle-family modules; ``allow_pickle=True``; ``yaml.load`` and the
    other unsafe PyYAML loaders; ``eval``/``exec``; ``torch.load`` without ``weights_only=True``.
    """
    hits = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            hits += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in UNSAFE_MODULES:
                hits.append(f"{where}: from {node.module} import ...")
            if node.module == "yaml":
                hits += [f"{where}: from yaml import {a.name}" for a in node.names if a.name in UNSAFE_YAML]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in UNSAFE_MODULES:
                hits.append(f"{where}: {node.value.id}.{node.attr}")
            elif node.value.id == "yaml" and node.attr in UNSAFE_YAML:
                hits.append(f"{where}: yaml.{node.attr}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("eval", "exec"):
                hits.append(f"{where}: {func.id}(")
            for kw in node.keywords:
                if kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant) and kw.value.value is False):
                    hits.append(f"{where}: allow_pickle={ast.unparse(kw.value)}")
            if isinstance(func, ast.Attribute) and func.attr == "load" and ast.unparse(func.value) == "torch":
                safe = any(kw.arg == "weights_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                           for kw in node.keywords)
                if not safe:
                    hits.append(f"{where}: torch.load without weights_only=True")
    return hits


def test_scanner_finds_each_unsafe_pattern():
    """The scan below can fail: each pattern it looks for is found in a sample, and nothing in prose is."""
    bad = ["import pickle", "import dill as d", "from pickle import loads", "x = pickle.loads(b)",
           "np.load(f, allow_pickle=True)", "np.load(f, allow_pickle=flag)", "yaml.load(text)",
           "yaml.unsafe_load(text)", "yaml.load(t, Loader=yaml.FullLoader)", "from yaml import Loader",
           "eval('1+1')", "exec(code)", "torch.load(path)", "torch.load(path, weights_only=False)"]
    for line in bad:
        assert unsafe_calls(line), line
    fine = ['"""Never pickle; yaml.load is unsafe; eval( is banned."""', "# import pickle",
            "np.load(f, allow_pickle=False)", "yaml.safe_load(t)", "jax.eval_shape(f)", "model.evaluate(x)",
            "torch.load(p, weights_only=True)", "s = 'allow_pickle=True'"]
    for line in fine:
        assert not unsafe_calls(line), line


def test_package_source_has_no_unsafe_deserialisation_or_eval():
    files = [p for d in SCANNED if (ROOT / d).is_dir() for p in sorted((ROOT / d).rglob("*.py"))]
    assert len(files) > 40
    hits = [h for p in files for h in unsafe_calls(p.read_text(encoding="utf-8"), str(p.relative_to(ROOT)))]
    assert hits == []


# ------------------------------------------------------------------ hostile files

def _peak_bytes(fn):
    """Largest traced allocation total while ``fn`` runs (NumPy reports its buffers to tracemalloc)."""
    tracemalloc.start()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak


def _mnist_dir(directory, rng, n=8):
    def idx(magic, array):
        return magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape) + \
            array.astype(np.uint8).tobytes()
    for prefix in ("train", "t10k"):
        (directory / f"{prefix}-images-idx3-ubyte").write_bytes(idx(0x803, rng.integers(0, 256, (n, 28, 28))))
        (directory / f"{prefix}-labels-idx1-ubyte").write_bytes(idx(0x801, rng.integers(0, 10, n)))


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize("dims", [(2**32 - 1,) * 3, (60_000_000, 28, 28)])
def test_mnist_hostile_header_is_refused_without_allocating(tmp_path, compress, dims):
    """Headers claiming 2**96 or 47 GB of pixels over a few real bytes: refused, < 8 MiB allocated."""
    _mnist_dir(tmp_path, np.random.default_rng(0))
    hostile = (0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims) + bytes(4096)
    (tmp_path / "train-images-idx3-ubyte").write_bytes(gzip.compress(hostile) if compress else hostile)

    def load():
        with pytest.raises(DataError, match="train-images-idx3-ubyte"):
            load_mnist(tmp_path)
    assert _peak_bytes(load) < 8 * 2**20


def test_mnist_gzip_bomb_is_read_only_as_far_as_the_header_says(tmp_path):
    """A gzip stream that inflates to 1 GB after a small valid header: refused at the first extra byte."""
    _mnist_dir(tmp_path, np.random.default_rng(0))
    header = (0x803).to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in (8, 28, 28))
    compressor = zlib.compressobj(9, wbits=31)
    bomb = compressor.compress(header + bytes(8 * 28 * 28))
    chunk = compressor.compress(bytes(2**20))
    bomb += chunk * 1024 + compressor.flush()  # ~1 MB of gzip for 1 GiB of zeros
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(bomb)
    (tmp_path / "train-images-idx3-ubyte").unlink()

    def load():
        with pytest.raises(DataError, match="trailing bytes"):
            load_mnist(tmp_path)
    assert _peak_bytes(load) < 16 * 2**20


def _npy_header(shape, descr="|u1"):
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


@pytest.mark.parametrize("shape", [(10**12, 4, 4), (2**40,)])
def test_npz_member_claiming_terabytes_is_refused_from_its_header(tmp_path, shape):
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x_train.npy", _npy_header(shape) + bytes(64))
        for name, array in (("y_train", np.zeros(2, np.int64)), ("x_test", np.zeros((1, 4, 4), np.uint8)),
                            ("y_test", np.zeros(1, np.int64))):
            buffer = io.BytesIO()
            np.save(buffer, array)
            z.writestr(f"{name}.npy", buffer.getvalue())

    def load():
        with pytest.raises(DataError, match="'x_train' declares shape"):
            load_npz(path)
    assert _peak_bytes(load) < 8 * 2**20


def test_npz_total_over_max_bytes_is_refused(tmp_path):
    path = tiny_npz(tmp_path / "d.npz")
    with pytest.raises(DataError, match="more than the 1000-byte limit"):
        load_npz(path, max_bytes=1000)


def test_cifar_file_of_a_terabyte_is_refused_without_reading(tmp_path):
    """A sparse 1 TB batch file: its size alone refuses it."""
    records = np.zeros((2, 3073), np.uint8)
    for name in TRAIN_FILES + TEST_FILES:
        (tmp_path / name).write_bytes(records.tobytes())
    with open(tmp_path / TRAIN_FILES[0], "r+b") as f:
        try:
            f.truncate(3073 * 325_000_000)  # ~1 TB, a whole number of records
        except OSError as e:
            pytest.skip(f"filesystem cannot hold a sparse 1 TB file: {e}")

    def load():
        with pytest.raises(DataError, match="over the .*-byte limit"):
            load_cifar10(tmp_path)
    assert _peak_bytes(load) < 8 * 2**20


# ------------------------------------------------------------------ run directory

def test_run_files_follow_umask_and_cleanup_never_follows_symlinks(tmp_path, caplog):
    """One tiny run under umask 027, over a checkpoint directory holding (1) a step entry that is a
    link to a directory outside holding a checkpoint and a canary file, (2) an old real step whose
    state/ holds a link to another outside directory. Retention (keep=1) deletes the old steps: both
    canaries survive, the run finishes, and everything it created has no permission the umask forbids."""
    data = tiny_npz(tmp_path / "d.npz")
    work = tmp_path / "w"
    ckpt = work / "checkpoints"
    cfg = load_config(*_split(tiny_args(data)))
    with CheckpointManager(tmp_path / "elsewhere", keep=5) as mgr:
        mgr.save(1, init_state(build_run(cfg))._replace(step=np.int32(1)))  # the run resumes from it
    outside_a, outside_b = tmp_path / "outside_a", tmp_path / "outside_b"
    shutil.copytree(tmp_path / "elsewhere" / "1", outside_a)
    outside_b.mkdir()
    for outside in (outside_a, outside_b):
        (outside / "canary").write_text("must survive")
    ckpt.mkdir(parents=True)
    os.symlink(outside_a, ckpt / "0")
    shutil.copytree(tmp_path / "elsewhere" / "1", ckpt / "1")
    os.symlink(outside_b, ckpt / "1" / "state" / "link")
    before = {p for p in work.rglob("*")}

    old = os.umask(0o027)
    try:
        with caplog.at_level(logging.WARNING, logger="jaxcnn.train.checkpoint"):
            code = train_main(tiny_args(data, "train.steps=6", "checkpoint.every=2", "checkpoint.keep=1",
                                        "logging.log_every=6", "--workdir", str(work)))  # resumes from 1
    finally:
        os.umask(old)
    assert code == 0
    for outside in (outside_a, outside_b):
        assert (outside / "canary").read_text() == "must survive"
    assert len(list(outside_a.rglob("*"))) == len(list((tmp_path / "elsewhere" / "1").rglob("*"))) + 1
    assert step_dirs(ckpt) == ([6], [])  # the old real step 1 was cleaned up, through its link untouched
    assert (ckpt / "0.symlink").is_symlink() and f"{ckpt / '0'} is a symbolic link" in caplog.text

    created = [p for p in work.rglob("*") if p not in before and not p.is_symlink()]
    assert len(created) > 20 and any(p.name == "params.npz" for p in created)
    for p in created:
        mode = p.stat().st_mode & 0o777
        assert mode & 0o027 == 0, f"{p} has mode {oct(mode)} under umask 027"
        assert mode & 0o600 == 0o600, f"{p} has mode {oct(mode)}: not read/write for its owner"


def _split(args):
    return args[0], args[1:]
