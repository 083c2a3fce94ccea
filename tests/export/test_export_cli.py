"""``jaxcnn-export``'s command line and parameter files: a forged ``.npz`` header is refused
before anything is allocated (export and ``model.init_from``), bad options are one line
and exit code 2, the report names the file really written, and the preprocessing built
into ONNX and StableHLO graphs normalises each channel as the trainer does."""
import io
import json
import os
import zipfile

import jax
import numpy as np
import pytest

from jaxcnn import interop, models
from jaxcnn.export.cli import main
from jaxcnn.train.cli import train_main


def _forged_npz(path, member):
    """An npz whose ``member`` header claims 10**12 float32 (3.64 TiB) over 64 bytes of data."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)})
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member + ".npy", header.getvalue() + b"\0" * 64)
    return str(path)


def _one_line_error(capsys, prog):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{prog}: error:"), err
    return err


def test_forged_header_is_refused_before_reading(tmp_path, capsys):
    path = _forged_npz(tmp_path / "forged.npz", "params/fc1.w")
    net = models.get("mnist_cnn", num_classes=10)
    like = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), (1, 28, 28, 1))[:2])
    for template in (like, None):   # with the model's shapes, and bounded by the file alone
        with pytest.raises(ValueError, match=r"forged\.npz: array 'params/fc1\.w' declares shape"):
            interop.load_npz(path, like=template)
    assert main([path, "--model", "mnist_cnn", "--format", "onnx", "--out",
                 str(tmp_path / "a.onnx")]) == 2
    err = _one_line_error(capsys, "jaxcnn-export")
    assert "forged.npz" in err and "params/fc1.w" in err


def test_forged_header_as_init_from(tmp_path, capsys):
    path = _forged_npz(tmp_path / "forged.npz", "params/conv1.w")
    tiny = ["data.source=synthetic", "data.image_size=[28,28,1]", "data.num_train=32",
            "data.num_eval=8", "data.batch_size=16", "model.name=lenet5", "train.steps=1",
            "logging.progress=none", "checkpoint.enabled=false", f"model.init_from={path}"]
    assert train_main([os.path.join("configs", "lenet5_mnist.yaml"), *tiny,
                       "--workdir", str(tmp_path / "run")]) == 2
    err = _one_line_error(capsys, "jaxcnn-train")
    assert "model.init_from" in err and "forged.npz" in err and "params/conv1.w" in err


def test_npz_shapes_are_checked_against_the_model_before_reading(tmp_path, monkeypatch):
    interop.save_npz(tmp_path / "p.npz", {"fc1": {"w": np.zeros((4, 5), np.float32)}})
    net = models.get("mnist_cnn", num_classes=10)
    like = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), (1, 28, 28, 1))[:2])

    def no_reading(*args, **kwargs):
        raise AssertionError("np.load was called before the shapes were checked")
    monkeypatch.setattr(np, "load", no_reading)
    with pytest.raises(ValueError, match=r"key 'params/fc1\.w' has shape \(4, 5\)"):
        interop.load_npz(tmp_path / "p.npz", like=like)


def test_safetensors_shapes_are_checked_before_reading(tmp_path, monkeypatch):
    import safetensors

    from jaxcnn.interop import arrays
    interop.save_safetensors(tmp_path / "p.safetensors", {"fc1": {"w": np.zeros((4, 5), np.float32)}})
    net = models.get("mnist_cnn", num_classes=10)
    like = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), (1, 28, 28, 1))[:2])
    real = safetensors.safe_open

    class NoReading:   # safe_open whose files refuse get_tensor
        def __init__(self, *args, **kwargs):
            self.file = real(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def __getattr__(self, name):
            assert name != "get_tensor", "a tensor was read before the shapes were checked"
            return getattr(self.inner, name)
    monkeypatch.setattr(arrays.safetensors, "safe_open", NoReading)
    with pytest.raises(ValueError, match=r"key 'params/fc1\.w' has shape \(4, 5\)"):
        interop.load_safetensors(tmp_path / "p.safetensors", like=like)
    # A header claiming 10**12 floats over 64 bytes: refused by safetensors' own bounds check.
    monkeypatch.setattr(arrays.safetensors, "safe_open", real)
    header = json.dumps({"params/fc1.w": {"dtype": "F32", "shape": [10**6, 10**6],
                                          "data_offsets": [0, 4 * 10**12]}}).encode()
    forged = tmp_path / "forged.safetensors"
    forged.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 64)
    with pytest.raises(ValueError, match="forged.safetensors: not a readable .safetensors file"):
        interop.load_safetensors(forged, like=like)


@pytest.mark.parametrize("argv, match", [
    (["--model-option", "a=["], "option 'a'"),
    (["--calibration-batches", "-1"], "--calibration-batches"),
    (["--calibration-batches", "0"], "--calibration-batches"),
])
def test_bad_options_are_one_line(tmp_path, capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        main(["params.npz", "--model", "mnist_cnn", "--format", "onnx", "--out",
              str(tmp_path / "a.onnx"), *argv])
    assert e.value.code == 2
    err = _one_line_error(capsys, "jaxcnn-export")
    assert match in err and "Traceback" not in err


def test_a_file_that_is_no_parameter_file_is_named_before_asking_for_model(tmp_path, capsys):
    """A config file or a PyTorch pickle: it asked for --model NAME first, then said 'unknown
    parameter file type'; now the file type, and for a .pth the conversion to safetensors."""
    for name, needle in [("mnist_cnn.yaml", "unknown parameter file type '.yaml'; expected a .npz or "
                                            ".safetensors file or a run directory"),
                         ("w.pth", "a PyTorch .pth file is a pickle, which jaxcnn never loads; convert it once "
                                   "where torch is installed: safetensors.torch.save_file(torch.load(")]:
        (tmp_path / name).write_bytes(b"model: {}\n")
        assert main([str(tmp_path / name), "--format", "onnx", "--out", str(tmp_path / "a.onnx")]) == 2
        err = _one_line_error(capsys, "jaxcnn-export")
        assert f"{tmp_path / name}: {needle}" in err, err
    assert not (tmp_path / "a.onnx").exists()


@pytest.fixture(scope="module")
def params_file(tmp_path_factory):
    net = models.get("mnist_cnn", num_classes=10)
    params, state, _ = net.init(jax.random.PRNGKey(0), (1, 28, 28, 1))
    path = str(tmp_path_factory.mktemp("params") / "w.npz")
    interop.save_npz(path, *jax.device_get((params, state)))
    return path


@pytest.mark.parametrize("fmt, out, better", [("stablehlo", "m.onnx", "'{tmp}/m' (any name but those extensions)"),
                                               ("onnx", "m.NPZ", "'{tmp}/m.onnx'"),
                                               ("npz", "m.safetensors", "'{tmp}/m.npz'"),
                                               ("safetensors", "m.npz", "'{tmp}/m.safetensors'")])
def test_an_out_named_for_another_format_is_refused(params_file, tmp_path, capsys, fmt, out, better):
    """``--format stablehlo --out m.onnx`` wrote a StableHLO module that jaxcnn-predict (and
    onnxruntime) then read as a broken ONNX file; ``--format onnx --out m.npz`` a "parameter file"."""
    out = str(tmp_path / out)
    assert main([params_file, "--model", "mnist_cnn", "--format", fmt, "--out", out]) == 2
    err = _one_line_error(capsys, "jaxcnn-export")
    ext = os.path.splitext(out)[1].lower()
    assert f"--out {out!r} has the {ext} extension of the" in err, err
    assert f"give --out {better.format(tmp=tmp_path)}" in err, err
    assert os.listdir(tmp_path) == []


def test_out_is_the_file_written(params_file, tmp_path, capsys):
    base = ["--model", "mnist_cnn", "--format", "npz"]
    assert main([params_file, *base, "--out", str(tmp_path)]) == 2   # an existing directory
    assert "is a directory" in _one_line_error(capsys, "jaxcnn-export")
    assert not os.path.exists(str(tmp_path) + ".npz")
    out = str(tmp_path / "exported")
    assert main([params_file, *base, "--out", out]) == 0
    assert f"wrote npz to {out}.npz\n" in capsys.readouterr().out
    assert os.path.isfile(out + ".npz") and not os.path.exists(out)
    assert main([params_file, *base, "--out", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["out"] == out + ".npz"


@pytest.mark.parametrize("fmt", ["stablehlo", "onnx", "npz", "safetensors"])
def test_a_full_disk_keeps_the_earlier_export_and_leaves_no_partial_file(params_file, tmp_path, capsys,
                                                                          monkeypatch, fmt):
    """An export over a full disk: one line, the file an earlier export wrote at --out left as it
    was, and no half-written file (the model, or a parameter file, was written in place)."""
    import errno

    from jaxcnn.data import files
    if fmt == "onnx":
        pytest.importorskip("onnx")
    out = tmp_path / f"model.{fmt}"
    out.write_bytes(b"the earlier export")
    whole = files.write_whole

    def full_disk(path, write):
        def half_then_enospc(partial):
            write(partial)
            with open(partial, "r+b") as f:
                f.truncate(os.path.getsize(partial) // 2)
            raise OSError(errno.ENOSPC, "No space left on device", partial)
        return whole(path, half_then_enospc)
    for module in ("jaxcnn.data.files", "jaxcnn.export.onnx_export", "jaxcnn.interop.arrays"):
        monkeypatch.setattr(f"{module}.write_whole", full_disk)
    assert main([params_file, "--model", "mnist_cnn", "--format", fmt, "--out", str(out)]) == 2
    err = _one_line_error(capsys, "jaxcnn-export")
    assert "No space left on device" in err, err
    assert out.read_bytes() == b"the earlier export" and os.listdir(tmp_path) == [out.name]


def test_out_in_a_missing_directory_is_named_before_any_work(params_file, tmp_path, capsys, monkeypatch):
    """It ended, after loading and converting the model, on "[Errno 2] No such file or
    directory: '.../x.onnx'", which names neither --out nor what is missing."""
    from jaxcnn.export import pipeline
    monkeypatch.setattr(pipeline, "load_source", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    (tmp_path / "f").write_text("")
    for out, why in [(tmp_path / "nope" / "x.onnx", "does not exist"), (tmp_path / "f" / "x.onnx", "is not a directory")]:
        assert main([params_file, "--model", "mnist_cnn", "--format", "onnx", "--out", str(out)]) == 2
        err = _one_line_error(capsys, "jaxcnn-export")
        assert f"--out '{out}': its directory {out.parent} {why}" in err, err


def test_an_input_shape_the_parameters_do_not_fit_names_the_option(params_file, tmp_path, capsys):
    """It blamed the parameter file ("w.npz: does not match the expected parameters: key
    'params/fc1.w' ...") for what --input-shape had changed."""
    assert main([params_file, "--model", "mnist_cnn", "--format", "npz", "--input-shape", "32,32,1",
                 "--out", str(tmp_path / "x.npz")]) == 2
    err = _one_line_error(capsys, "jaxcnn-export")
    assert "--input-shape 32,32,1: the parameters do not fit the model at that input (" in err, err
    assert "key 'params/fc1.w' has shape (9216, 128), expected (12544, 128)" in err, err


def test_out_never_overwrites_the_source(params_file, tmp_path, capsys):
    """``--out runs/x/params.npz`` replaced a run's trained parameters with the pruned export (and
    a StableHLO file went over its config.resolved.yaml); ``--out`` naming the parameter file it
    reads overwrote it too."""
    import shutil
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(params_file, run / "params.npz")
    import yaml

    from jaxcnn.train.config import load_config, to_dict
    config = to_dict(load_config(os.path.join(os.path.dirname(__file__), "..", "..", "configs", "mnist_cnn.yaml")))
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(config))
    (run / "checkpoints").mkdir()
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    for out, owned in [("params.npz", "params.npz"), ("params", "params.npz"),  # npz adds the extension
                       ("config.resolved.yaml", "config.resolved.yaml"), ("checkpoints/x.onnx", "checkpoints")]:
        fmt = "npz" if out.startswith("params") else "onnx"
        assert main([str(run), "--format", fmt, "--out", str(run / out)]) == 2
        err = _one_line_error(capsys, "jaxcnn-export")
        assert f"is the run's own {owned} in {run}: it would be overwritten" in err, err
    copy = tmp_path / "w.npz"
    shutil.copy(params_file, copy)
    assert main([str(copy), "--model", "mnist_cnn", "--format", "npz", "--prune", "0.5", "--out", str(copy)]) == 2
    assert f"is the source file {copy}: it would be overwritten" in _one_line_error(capsys, "jaxcnn-export")
    assert copy.read_bytes() == open(params_file, "rb").read()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert main([str(run / "params.npz"), "--model", "mnist_cnn", "--format", "npz", "--out",
                 str(run / "pruned.npz")]) == 0  # a new file beside them is fine


@pytest.mark.parametrize("pixel_dtype", ["uint8", "float32"])
def test_preprocessing_in_the_graph_is_per_channel(pixel_dtype):
    """Three channels with their own mean/std, in both layouts and both pixel dtypes: the
    exported graph on raw pixels equals the network on ``Preprocessing.apply``'d ones."""
    from export_cases import init_model

    from jaxcnn import layers as L
    from jaxcnn.data.preprocessing import Preprocessing
    from jaxcnn.export import export_onnx, export_stablehlo, load_stablehlo
    ort = pytest.importorskip("onnxruntime")
    model = L.serial(("c", L.Conv2D(4, 3)), L.Flatten(), ("fc", L.Linear(5)))
    params, state = init_model(model, (6, 6, 3))
    prep = Preprocessing((6, 6, 3), pixel_dtype, (0.1, 0.5, 0.9), (0.2, 0.3, 0.05))
    rng = np.random.default_rng(0)
    raw = (rng.integers(0, 256, (4, 6, 6, 3)).astype(np.uint8) if pixel_dtype == "uint8"
           else rng.random((4, 6, 6, 3), np.float32))
    ref = np.asarray(model.apply(params, state, prep.apply(raw), train=False)[0])
    for layout, x in (("nhwc", raw), ("nchw", raw.transpose(0, 3, 1, 2))):
        proto = export_onnx(model, params, state, (6, 6, 3), layout=layout, preprocessing=prep)
        session = ort.InferenceSession(proto.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        np.testing.assert_allclose(session.run(None, {"input": x})[0], ref, rtol=1e-5, atol=1e-5)
        exported = load_stablehlo(export_stablehlo(model, params, state, (6, 6, 3), layout=layout,
                                                   preprocessing=prep))
        assert str(exported.in_avals[0].dtype) == pixel_dtype
        np.testing.assert_allclose(np.asarray(exported.call(x)), ref, rtol=1e-5, atol=1e-5)


def test_a_torch_state_dict_exports_like_the_same_parameters(params_file, tmp_path, capsys):
    """A PyTorch state dict saved as safetensors (what model.init_from takes from torchvision) was
    "unexpected key ...; keys must start with 'params/' or 'state/'": it is converted, its classifier
    width read from it, and exports as the same parameters in jaxcnn's own file do."""
    from safetensors.numpy import save_file
    params, state = interop.load_npz(params_file)
    torch_names = {k: np.asarray(v) for k, v in interop.to_torch_state_dict("mnist_cnn", params, state).items()}
    assert "conv1.weight" in torch_names and torch_names["conv1.weight"].shape == (32, 1, 3, 3)
    torch_file = str(tmp_path / "torch.safetensors")
    save_file(torch_names, torch_file)
    out = str(tmp_path / "from_torch.npz")
    assert main([torch_file, "--model", "mnist_cnn", "--format", "npz", "--out", out]) == 0
    got, got_state = interop.load_npz(out)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                                 jax.tree_util.tree_leaves_with_path(got)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    ort = pytest.importorskip("onnxruntime")
    assert main([torch_file, "--model", "mnist_cnn", "--format", "onnx", "--out", str(tmp_path / "t.onnx")]) == 0
    assert main([params_file, "--model", "mnist_cnn", "--format", "onnx", "--out", str(tmp_path / "j.onnx")]) == 0
    x = np.random.default_rng(0).normal(size=(3, 28, 28, 1)).astype(np.float32)
    runs = [ort.InferenceSession(str(tmp_path / f)).run(None, {"input": x})[0] for f in ("t.onnx", "j.onnx")]
    np.testing.assert_array_equal(runs[0], runs[1])
    capsys.readouterr()
    assert main([torch_file, "--model", "mnist_cnn", "--num-classes", "7", "--format", "npz",
                 "--out", str(tmp_path / "x.npz")]) == 2
    assert "key 'fc2.weight' has shape (10, 128), the model's is (7, 128)" in _one_line_error(capsys, "jaxcnn-export")


def test_export_from_python_names_its_arguments_the_command_line_its_flags(params_file, tmp_path, capsys):
    """jaxcnn.export.export() said '--model', '--out', '--input-shape' to Python callers."""
    from jaxcnn.export import ExportError, export
    cases = [  # (export's keyword arguments, what Python is told, what jaxcnn-export says, its argv)
        (dict(format="npz"), "a parameter file needs model=NAME (one of [",
         "a parameter file needs --model NAME (one of [", []),
        (dict(format="stablehlo", model="mnist_cnn", out="m.onnx"),
         "out='{tmp}/m.onnx' has the .onnx extension of the onnx format, but format is stablehlo; "
         "give out='{tmp}/m' (any name but those extensions), or format='onnx'",
         "--out '{tmp}/m.onnx' has the .onnx extension of the onnx format, but --format is stablehlo; "
         "give --out '{tmp}/m' (any name but those extensions), or --format onnx",
         ["--model", "mnist_cnn"]),
        (dict(format="npz", model="mnist_cnn", image_shape=(32, 32, 1)),
         "image_shape=(32, 32, 1): the parameters do not fit the model at that input (",
         "--input-shape 32,32,1: the parameters do not fit the model at that input (",
         ["--model", "mnist_cnn", "--input-shape", "32,32,1"]),
        (dict(format="npz", model="mnist_cnn", quantize="int8", fine_tune_steps=2),
         "quantize and fine_tune_steps need training data: pass a run directory",
         "--quantize and --fine-tune-steps need training data: pass a run directory",
         ["--model", "mnist_cnn", "--quantize", "int8", "--fine-tune-steps", "2"]),
        (dict(format="npz", model="mnist_cnn", quantize="int8"),
         "quantize needs training data: pass a run directory",
         "--quantize needs training data: pass a run directory",
         ["--model", "mnist_cnn", "--quantize", "int8"]),
    ]
    for kwargs, python, cli, argv in cases:
        out = str(tmp_path / kwargs.pop("out", "x.npz"))
        for _ in range(2):  # the command line's wording does not stay behind
            with pytest.raises(ExportError) as info:
                export(params_file, out, **kwargs)
            message = str(info.value)
            assert python.format(tmp=tmp_path) in message and "--" not in message, message
            assert main([params_file, "--format", kwargs["format"], "--out", out, *argv]) == 2
            assert cli.format(tmp=tmp_path) in _one_line_error(capsys, "jaxcnn-export")
    assert os.listdir(tmp_path) == []
