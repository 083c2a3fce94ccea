"""Bad data files and bad configs, generated: always a clear error, never a traceback or a hang.

Hypothesis builds malformed IDX, CIFAR-10 and ``.npz`` files and random YAML configs and
overrides. At the library level every case either loads or raises ``DataError``/``ConfigError``;
through ``train_main --dry-run`` (which builds data, model and optimiser and traces one step
without computing) every case exits 0, or 2 with one ``jaxcnn-train: error:`` line on stderr.
Each case runs under a time limit, so a hang fails the test instead of stalling the suite.
"""
import contextlib
import gzip
import io
import math
import os
import signal
import tempfile

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from jaxcnn.data import DataError, load_cifar10, load_npz, read_idx
from jaxcnn.data.cifar import RECORD_BYTES, TEST_FILES, TRAIN_FILES
from jaxcnn.models import names as model_names
from jaxcnn.train.cli import train_main
from jaxcnn.train.config import SCHEMA, ConfigError, load_config
from reliability_lib import CONFIG

CASE_TIMEOUT_S = 60
FEW = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SOME = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextlib.contextmanager
def time_limit(seconds=CASE_TIMEOUT_S):
    """Fails the case (TimeoutError) if it runs longer than ``seconds``: a hang is a failure."""
    def expire(signum, frame):
        raise TimeoutError(f"case still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cli(args):
    """Runs ``train_main``; returns (exit code, stdout, stderr). argparse's own exit counts as one."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), time_limit():
        try:
            code = train_main(args)
        except SystemExit as e:  # argparse: an override that looks like an option
            code = e.code
    return code, out.getvalue(), err.getvalue()


def assert_clean_exit(args):
    code, out, err = cli(args)
    event(f"exit code {code}")
    assert "Traceback" not in err, err
    if code == 0:
        assert "dry run ok" in out or "--print-config" in args, out
        return code
    lines = err.strip().splitlines()
    assert code == 2, (code, err)
    assert lines and lines[-1].startswith("jaxcnn-train: error: ") and len(lines[-1]) > 25, err
    assert len(lines) == 1, err  # argparse's errors too (no usage, newlines escaped)
    return code


# ---------------------------------------------------------------- generated files

@st.composite
def idx_bytes(draw, magic=None):
    """An IDX file that is usually almost right: plausible header, payload off by a little or a lot,
    sometimes gzip-compressed and then maybe cut short, sometimes a flipped byte, sometimes noise."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.integers(0, 9)) == 0:
        return rng.bytes(draw(st.integers(0, 64)))
    if magic is None:
        type_code, ndim = draw(st.sampled_from([0x08, 0x09, 0x0B, 0x0C, 0x0D, 0x0E, 0x00, 0x07])), draw(st.integers(0, 4))
    else:
        type_code, ndim = magic >> 8 & 0xFF, magic & 0xFF
    dims = draw(st.lists(st.one_of(st.integers(0, 12), st.integers(0, 2**32 - 1)), min_size=ndim, max_size=ndim))
    header = draw(st.sampled_from([b"\0\0", b"\0\0", b"\0\1"])) + bytes([type_code, ndim])
    header += b"".join(d.to_bytes(4, "big") for d in dims)
    itemsize = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}.get(type_code, 1)
    size = math.prod(dims) * itemsize
    size = size if size <= 20_000 else draw(st.integers(0, 64))
    size = max(0, size + draw(st.sampled_from([0, 0, 0, -1, 1, -size // 2, 7])))
    data = header + rng.integers(0, draw(st.sampled_from([10, 256])), size, dtype=np.uint8).tobytes()
    if draw(st.booleans()):
        data = gzip.compress(data)
        if draw(st.integers(0, 3)) == 0:
            data = data[:draw(st.integers(0, len(data)))]
    if data and draw(st.integers(0, 4)) == 0:
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1:]
    return data


def write_mnist(directory, rng, n_train=16, n_test=8):
    """A valid, tiny MNIST directory (raw IDX files)."""
    def idx(magic, array):
        dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
        return magic.to_bytes(4, "big") + dims + array.astype(np.uint8).tobytes()
    files = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        files[f"{prefix}-images-idx3-ubyte"] = idx(0x803, rng.integers(0, 256, (n, 28, 28)))
        files[f"{prefix}-labels-idx1-ubyte"] = idx(0x801, rng.integers(0, 10, n))
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)
    return sorted(files)


@st.composite
def cifar_files(draw):
    """The six CIFAR-10 .bin files: few records, sometimes a partial record, labels up to 12, a file missing."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    files = {}
    for name in TRAIN_FILES + TEST_FILES:
        records = rng.integers(0, 256, (draw(st.integers(0, 3)), RECORD_BYTES), dtype=np.uint8)
        records[:, 0] = rng.integers(0, draw(st.sampled_from([10, 10, 10, 13])), len(records))
        data = records.tobytes() + rng.bytes(draw(st.sampled_from([0, 0, 0, 1, RECORD_BYTES - 1])))
        files[name] = data
    for name in draw(st.lists(st.sampled_from(sorted(files)), max_size=1)):
        del files[name]
    return files


ARRAY_DTYPES = [np.uint8, np.float32, np.float64, np.float16, np.int64, np.int32, np.int8, np.uint32,
                np.bool_, np.complex64, "U3", object]


@st.composite
def npz_bytes(draw):
    """An .npz with some of the four arrays (maybe extra ones), random dtypes and shapes, labels out of
    range, NaN pixels, object arrays (pickled), then maybe a damaged zip."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    keys = draw(st.lists(st.sampled_from(["x_train", "y_train", "x_test", "y_test", "extra"]), unique=True,
                         min_size=2, max_size=5))
    n = draw(st.integers(0, 5))
    arrays = {}
    for key in keys:
        dtype = draw(st.sampled_from(ARRAY_DTYPES + [np.uint8, np.int64] * 3))
        if key.startswith("x"):
            shape = draw(st.sampled_from([(n, 4, 4, 1), (n, 4, 4), (n, 4, 4, 3), (n,), (n, 4, 4, 1, 1), (n + 1, 4, 4)]))
        else:
            shape = draw(st.sampled_from([(n,), (n,), (n, 1), (n + 1,), ()]))
        values = rng.normal(0, 5, shape)
        if dtype is object:
            array = np.empty(shape, object)
        elif dtype == "U3":
            array = values.astype("U3")
        else:
            array = values.astype(dtype)
        if np.issubdtype(array.dtype, np.floating) and array.size and draw(st.integers(0, 3)) == 0:
            array.flat[0] = np.nan
        arrays[key] = array
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    damage = draw(st.sampled_from(["none", "none", "none", "flip", "truncate", "garbage"]))
    if damage == "flip":
        at = draw(st.integers(0, len(data) - 1))
        data = data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1:]
    elif damage == "truncate":
        data = data[:draw(st.integers(0, len(data)))]
    elif damage == "garbage":
        data = rng.bytes(draw(st.integers(0, 200)))
    return data


def _write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return path


# ---------------------------------------------------------------- library level

@SOME
@given(data=idx_bytes())
@example(data=b"\x00\x00\x08\x04\x00\x00\x00\x00\x00\x00\x00\xee\x049\xf7\x0b \x93~l")  # empty, huge dims
def test_read_idx_loads_or_raises_data_error(data):
    with tempfile.TemporaryDirectory() as tmp, time_limit():
        path = _write(os.path.join(tmp, "f-idx"), data)
        try:
            array = read_idx(path)
        except DataError as e:
            assert path in str(e)
        else:
            assert isinstance(array, np.ndarray) and array.ndim == data_ndim(data)


def data_ndim(data):
    return (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)[3]


@SOME
@given(files=cifar_files())
def test_load_cifar10_loads_or_raises_data_error(files):
    with tempfile.TemporaryDirectory() as tmp, time_limit():
        for name, data in files.items():
            _write(os.path.join(tmp, name), data)
        try:
            dataset = load_cifar10(tmp)
        except DataError as e:
            assert tmp in str(e)
        else:
            assert dataset.x_train.shape[1:] == (32, 32, 3) and dataset.y_train.max(initial=0) < 10


@SOME
@given(data=npz_bytes())
def test_load_npz_loads_or_raises_data_error(data):
    with tempfile.TemporaryDirectory() as tmp, time_limit():
        path = _write(os.path.join(tmp, "d.npz"), data)
        try:
            dataset = load_npz(path)
        except DataError as e:
            assert path in str(e)
        else:
            assert dataset.x_train.ndim == 4 and len(dataset.x_train) == len(dataset.y_train) > 0
            assert np.isfinite(dataset.x_train.astype(np.float64)).all()


# ---------------------------------------------------------------- through the trainer

@FEW
@given(which=st.integers(0, 3), data=idx_bytes(), seed=st.integers(0, 2**16))
def test_train_main_on_damaged_mnist_exits_cleanly(which, data, seed):
    with tempfile.TemporaryDirectory() as tmp:
        names = write_mnist(tmp, np.random.default_rng(seed))
        _write(os.path.join(tmp, names[which]), data)
        assert_clean_exit([CONFIG, f"data.path={tmp}", "data.batch_size=8", "--dry-run"])


@FEW
@given(files=cifar_files())
def test_train_main_on_damaged_cifar_exits_cleanly(files):
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            _write(os.path.join(tmp, name), data)
        assert_clean_exit([CONFIG, "data.source=cifar10", f"data.path={tmp}", "data.batch_size=2", "--dry-run"])


@FEW
@given(data=npz_bytes())
def test_train_main_on_damaged_npz_exits_cleanly(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(os.path.join(tmp, "d.npz"), data)
        assert_clean_exit([CONFIG, "data.source=npz", f"data.path={path}", "data.batch_size=1", "--dry-run"])


def _schema_paths(tree=SCHEMA, prefix=""):
    for key, value in tree.items():
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict):
            yield from _schema_paths(value, path + ".")


SCHEMA_PATHS = sorted(_schema_paths())
# Values at the edges of what the run can hold: the int32 step counter, 32-bit seeds, int64/uint64,
# floats beyond int range, and spellings YAML turns into something else (yes -> bool, 1e6 -> '1e6').
BOUNDARY_INTS = [2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -2**31 - 1]
BOUNDARY_TEXT = ["yes", "no", "on", "off", "Yes", "1e6", "1e+06", "1e12", "1e30", "1e-5", "1e400", "1e+06ep",
                 "2147483648st", "1e400ep", ".inf", "-.inf", ".nan", "0x10", "1_000"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.integers(-2**40, 2**40),
                    st.floats(allow_nan=True, allow_infinity=True, width=32),
                    st.sampled_from(BOUNDARY_INTS + [1e6, 1e12, 1e30, 1e-5, 1e308]),
                    st.sampled_from(["", "auto", "1ep", "0.5 epochs", "3st", "-1", "fp16", "p=f32,c=bf16",
                                     "sgd", "cosine", "npz", "synthetic", "[1, 2]", "{a: 1}"] + model_names()
                                    + BOUNDARY_TEXT),
                    st.text(max_size=12))
yaml_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["a", "name", "lr", "1", "data"]), inner,
                                                 max_size=3)), max_leaves=8)
keys = st.one_of(st.sampled_from(SCHEMA_PATHS), st.sampled_from(["model.nam", "base", "optim.lr.x", "a.b", "x"]))

# A valid tiny run the mutations start from: synthetic 12x12 images, so a valid result dry-runs fast.
VALID = {"model": {"name": "mnist_cnn"}, "train": {"steps": 2, "eval_every": None},
         "data": {"source": "synthetic", "image_size": [12, 12, 1], "num_train": 16, "num_eval": 8,
                  "batch_size": 8, "prefetch": 0}}


def _set(tree, dotted, value):
    *parents, last = dotted.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


@SOME
@given(mutations=st.lists(st.tuples(keys, yaml_values), max_size=3),
       overrides=st.lists(st.one_of(st.tuples(keys, yaml_values).map(
           lambda kv: f"{kv[0]}={yaml.safe_dump(kv[1], default_flow_style=True).strip().removesuffix('...').strip()}"),
           st.text(max_size=20)), max_size=3),
       raw=st.one_of(st.none(), st.text(max_size=80)))
def test_random_configs_and_overrides_exit_cleanly(mutations, overrides, raw):
    config = yaml.safe_load(yaml.safe_dump(VALID))
    for key, value in mutations:
        _set(config, key, value)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "run.yaml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(raw if raw is not None else yaml.safe_dump(config))
        # Library level: load_config validates or raises ConfigError, nothing else.
        with time_limit():
            try:
                load_config(path, overrides)
            except ConfigError:
                pass
        assert_clean_exit([path, *overrides, "--dry-run", "--workdir", os.path.join(tmp, "w")])


@pytest.mark.parametrize("text, needle", [
    ("a: &a [*a]\n", "refers to itself"),
    ("x0: &a0 [1,1,1,1,1,1,1,1,1,1]\n" + "".join(
        f"x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)), "YAML aliases"),
    ("model: " + "[" * 1000 + "]" * 1000 + "\n", "nested too deeply"),
    ("model: {name: mnist_cnn}\n" + "#" * (1 << 20), "larger than"),
])
def test_hostile_yaml_is_refused_quickly(tmp_path, text, needle):
    """A billion-laughs alias bomb, a self-referencing alias, deep nesting and a huge file end in a
    ConfigError at once, before the config is copied (they hung or crashed the loader before)."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with time_limit(20):
        code, _, err = cli([str(path), "--print-config"])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    with time_limit(20), pytest.raises(ConfigError, match=needle):
        load_config(path, [])


@pytest.mark.parametrize("override, needle", [
    ("model.options={bogus: 1}", "model.options"),                         # unknown model option
    ("data.image_size=[3,3,1]", "cannot take (3, 3, 1) images"),           # too small for mnist_cnn
    ("data.num_train=4", "data.batch_size: 8 is larger than the training set"),
    ("data.num_eval=100000000", "data.num_eval"),                          # 14 GB of test images
])
def test_config_errors_found_by_building_the_run_exit_2(tmp_path, override, needle):
    """Problems only the model or the data source can see are config errors too, not tracebacks."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(VALID))
    code, _, err = cli([str(path), override, "--dry-run"])
    assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err


def test_npz_images_too_small_for_the_model_do_not_suggest_data_image_size(tmp_path):
    """npz data keep their images' size: the error named ``data.image_size`` (which npz ignores);
    it names the file and says what works."""
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (24, 4, 4), dtype=np.uint8), rng.integers(0, 3, 24)
    np.savez(tmp_path / "small.npz", x_train=x[:16], y_train=y[:16], x_test=x[16:], y_test=y[16:])
    code, _, err = cli([CONFIG, "data.source=npz", f"data.path={tmp_path / 'small.npz'}",
                        "data.batch_size=8", "--dry-run"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"cannot take the (4, 4, 1) images of data.path={tmp_path / 'small.npz'}" in err, err
    assert "data.image_size is not used" in err and "give larger images, or a model" in err, err
    assert "data.image_size or" not in err and "give a larger data.image_size" not in err, err


def test_dry_run_does_not_allocate_a_batch(tmp_path):
    """A huge batch is only traced by --dry-run (it used to build one real batch: 60 GB here); its
    compiled step's memory is checked against the machine's (4.7 TB here: refused, naming the key)."""
    path = tmp_path / "run.yaml"
    cfg = dict(VALID, data=dict(VALID["data"], image_size=[224, 224, 3], batch_size=100_000, num_train=100_000))
    path.write_text(yaml.safe_dump(cfg))
    import tracemalloc
    tracemalloc.start()
    try:
        code, out, err = cli([str(path), "--dry-run"])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert code == 0 or (code == 2 and "data.batch_size=100000" in err and "one train step needs" in err), err
    assert peak < 512 * 2**20, peak


# ---------------------------------------------------------------- only regular files are data

def _special_file(kind, tmp):
    """A path that is not a regular file: /dev/zero (endless), a FIFO (opening it blocks), a
    directory, or a symlink to /dev/zero (the link is followed)."""
    if kind == "dev-zero":
        return "/dev/zero"
    path = os.path.join(tmp, kind)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
    elif kind == "link-to-dev-zero":
        os.symlink("/dev/zero", path)
    return path


SPECIAL = ["dev-zero", "fifo", "directory", "link-to-dev-zero"]


@pytest.mark.parametrize("kind", SPECIAL)
def test_npz_data_path_must_be_a_regular_file(tmp_path, kind):
    """data.source=npz data.path=/dev/zero was read until the OOM killer came (15 GB); a FIFO hung."""
    path = _special_file(kind, str(tmp_path))
    with time_limit(30):
        code, _, err = cli([CONFIG, "data.source=npz", f"data.path={path}", "--dry-run"])
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"data.path: {path!r} is " in err and "not a regular file" in err, err


@pytest.mark.parametrize("kind", SPECIAL)
def test_loaders_refuse_files_that_are_not_regular(tmp_path, kind):
    """Every file-reading loader: the .npz loader, a CIFAR-10 .bin file and an MNIST IDX file
    in their folders, each replaced by a device, FIFO, directory or link to a device."""
    from jaxcnn.data import load_mnist, read_cifar_bin, read_idx
    special = _special_file(kind, str(tmp_path))
    with time_limit(20):
        for load in (load_npz, read_cifar_bin, read_idx):
            with pytest.raises(DataError, match="not a regular file"):
                load(special)
    mnist = tmp_path / "mnist"
    mnist.mkdir()
    names = write_mnist(str(mnist), np.random.default_rng(0))
    os.remove(mnist / names[0])
    os.symlink(special, mnist / names[0])
    cifar = tmp_path / "cifar"
    cifar.mkdir()
    for name in TRAIN_FILES + TEST_FILES:
        (cifar / name).write_bytes(bytes(RECORD_BYTES))
    os.remove(cifar / TRAIN_FILES[2])
    os.symlink(special, cifar / TRAIN_FILES[2])
    with time_limit(20):
        with pytest.raises(DataError, match=f"{names[0]}: is .*not a regular file"):
            load_mnist(str(mnist))
        with pytest.raises(DataError, match=f"{TRAIN_FILES[2]}: is .*not a regular file"):
            load_cifar10(str(cifar))


def _boundary_overrides():
    """Every int key and duration at and past its bound, seeds past 2**32 and 2**64, epochs that
    float formatting turns into '1e+06', and yes/no/on/off for every string key with choices."""
    cases = []
    for path in SCHEMA_PATHS:
        spec = SCHEMA
        for part in path.split("."):
            spec = spec[part]
        if isinstance(spec, dict):
            continue
        kind = spec.item.type if spec.type == "list" and spec.item is not None else spec.type
        if kind in ("int", "duration"):
            for value in (2**31, 2**32, 2**64, "1e30"):
                cases.append((path, f"[12, 12, {value}]" if path == "data.image_size" else value))
        if spec.type == "str" and spec.choices:
            cases += [(path, "yes"), (path, "off")]
    cases += [("train.seed", 2**32 - 1), ("train.steps", 2**31 - 1), ("train.epochs", "1000000"),
              ("train.epochs", "1e6"), ("train.epochs", "0.00001"), ("train.epochs", "1e12"),
              ("train.epochs", "2e9"), ("checkpoint.every", "1e+06ep"), ("logging.log_every", "1e400ep"),
              ("optim.lr", "1" + "0" * 400), ("checkpoint.resume", "yes"), ("distributed.mode", "on")]
    return cases


def test_boundary_values_exit_2_naming_the_key_or_dry_run(tmp_path):
    """Values at the edges (2**31 steps, 2**64 seeds, 1e12 epochs, yes/on for string keys) ended in
    OverflowError tracebacks, a duration error naming no key, or 'got True'. Each now ends in exit 2
    with one line that names the key, or builds: the run (data, model, step count, schedule,
    durations in steps) and its abstract state (the PRNG key from the seed) as the dry run does;
    one real dry run takes the valid extremes together (tracing a step per case would take minutes)."""
    from jaxcnn.train._build import abstract_state, build_run
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(VALID))
    outcomes = {}
    for key, value in _boundary_overrides():
        override = f"{key}={value}"
        code, _, err = cli([str(path), override, "--print-config"])
        if code == 0:  # valid as a config: what the dry run builds must build, or say why
            with time_limit():
                try:
                    abstract_state(build_run(load_config(path, [override])))
                    outcomes[override] = "builds"
                    continue
                except ConfigError as e:
                    code, err = 2, f"jaxcnn-train: error: {e}"
        assert code == 2 and "Traceback" not in err, (override, code, err)
        line = err.strip()
        assert line.startswith("jaxcnn-train: error: "), (override, err)
        assert len(line.splitlines()) == 1 and key.split("[")[0] in line, (override, err)
        outcomes[override] = "exit 2"
    assert outcomes["train.seed=18446744073709551616"] == outcomes["train.steps=2147483648"] == "exit 2"
    assert outcomes["train.epochs=1e6"] == outcomes["train.epochs=1000000"] == "builds"
    assert outcomes["train.epochs=2e9"] == "exit 2"    # valid epochs, but 4e9 steps overflow the counter
    assert outcomes["distributed.mode=on"] == "builds" and outcomes["checkpoint.resume=yes"] == "exit 2"
    code, out, err = cli([str(path), "train.epochs=1e6", "train.seed=4294967295", "data.seed=4294967295",
                          "checkpoint.every=1e+06ep", "distributed.mode=off", "--dry-run"])
    assert code == 0 and "2000000 steps" in out, err


def test_config_file_that_is_a_fifo_or_names_a_key_twice_exits_2(tmp_path):
    """A FIFO as the config file hung the trainer; a key given twice was silently the last one."""
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    with time_limit(20):
        code, _, err = cli([str(fifo), "--dry-run"])
    assert code == 2 and "FIFO" in err and str(fifo) in err and len(err.strip().splitlines()) == 1, err
    dup = tmp_path / "dup.yaml"
    dup.write_text(yaml.safe_dump(VALID) + "train: {steps: 3}\n")
    code, _, err = cli([str(dup), "--dry-run"])
    assert code == 2 and "duplicate key 'train'" in err and len(err.strip().splitlines()) == 1, err
