"""The README's Python names resolve as a reader would type them: every ``jaxcnn.a.b`` in a code
span of README.md, after ``import jaxcnn.a`` (the longest importable module), read as
attributes from ``jaxcnn`` down. (``jaxcnn.predict.load_predictor`` did not: ``jaxcnn.predict``
is the function.)"""
import importlib
import os
import re

import numpy as np
import pytest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")
BENCHMARKS = os.path.join(os.path.dirname(README), "docs", "BENCHMARKS.md")
# A measured figure: a ratio (2.2x, not 3x3) or a percentage with decimals (98.75%), or seconds.
FIGURE = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?x(?!\w)|\d[\d,]*\.\d+%|\d+ s\b)")


def _names():
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    text = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    names = set()
    for span in blocks + re.findall(r"`([^`]+)`", text):  # a span may go over a line break
        span = re.sub(r"([\"']).*?\1", "", span)  # keys in quotes, such as "jaxcnn.preprocessing"
        names.update(re.findall(r"(?<![\w.])jaxcnn(?:\.\w+)+", span))
    return sorted(names)


def _resolve(name):
    parts = name.split(".")
    for end in range(len(parts), 0, -1):  # `import jaxcnn.a.b` as far as it is a module
        try:
            importlib.import_module(".".join(parts[:end]))
            break
        except ImportError:
            continue
    obj = importlib.import_module("jaxcnn")
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def _prose(path):
    """The text of ``path`` outside its code blocks."""
    with open(path, encoding="utf-8") as f:
        return re.sub(r"^```[^\n]*\n.*?^```", "", f.read(), flags=re.S | re.M)


def test_the_readme_is_short_and_keeps_its_two_commands():
    """Under about 150 lines (the rest is in docs/); the set-up command and the test command that
    .ci/run runs, character for character."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert len(text.splitlines()) <= 150
    with open(os.path.join(os.path.dirname(README), ".ci", "run"), encoding="utf-8") as f:
        [ci_command] = re.findall(r"^TEST_CMD='(.*)'$", f.read(), flags=re.M)
    assert f"```bash\n{ci_command}\n```" in text
    assert ('```bash\npython3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
            'jaxcnn-train configs/mnist_cnn.yaml\n```') in text


def test_the_readmes_figures_are_the_benchmarks():
    """Each figure lives in docs/BENCHMARKS.md; the README quotes it from there."""
    figures = FIGURE.findall(_prose(README))
    assert {f[-1] for f in figures} >= {"%", "s", "x"}  # the accuracy, a time and a ratio
    with open(BENCHMARKS, encoding="utf-8") as f:
        benchmarks = f.read()
    assert [f for f in figures if f not in benchmarks] == []


def test_the_readme_names_something():
    assert {"jaxcnn.cpu.configure", "jaxcnn.models.get", "jaxcnn.export.export"} <= set(_names())


@pytest.mark.parametrize("name", _names())
def test_readme_name_resolves(name):
    try:
        _resolve(name)
    except AttributeError as e:
        pytest.fail(f"README.md names `{name}`, which does not resolve: {e}")


def _runnable_blocks():
    """The README's Python blocks marked ``<!-- runs in tests/test_readme.py -->``."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^<!-- runs in tests/test_readme\.py -->\n```python\n(.*?)^```", text, flags=re.S | re.M)


def test_some_readme_examples_are_marked_to_run():
    blocks = _runnable_blocks()
    assert len(blocks) >= 2 and any("ParallelPlan" in b for b in blocks)


@pytest.mark.parametrize("index", range(len(_runnable_blocks())))
def test_readme_example_runs_as_written(index, tmp_path):
    """Each marked example runs as written, in a fresh process from an empty directory (the
    README's parallel example gave ``ParallelPlan(make_mesh(...), model, shape, abstract_state)``
    with nothing saying where ``abstract_state`` comes from)."""
    import subprocess
    import sys
    root = os.path.dirname(README)
    import xla_cache
    env = xla_cache.fresh_process_env()
    env["PYTHONPATH"] = root
    done = subprocess.run([sys.executable, "-c", _runnable_blocks()[index]], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _shell_blocks():
    """The README's shell blocks marked ``<!-- runs in tests/test_readme.py -->``."""
    with open(README, encoding="utf-8") as f:
        text = f.read()
    return re.findall(r"^<!-- runs in tests/test_readme\.py -->\n```bash\n(.*?)^```", text, flags=re.S | re.M)


def test_the_readmes_predict_and_export_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The Predict section's commands, as written, in an empty directory holding the main job's
    run directory (here trained for 2 steps): the images made by its one-liner, predicted from
    the run and from its ONNX export."""
    import json
    import shlex
    import subprocess
    import sys

    pytest.importorskip("onnxruntime")
    from jaxcnn._console import export, predict
    from jaxcnn.train.cli import train_main
    [block] = _shell_blocks()
    commands = [shlex.split(line) for line in block.strip().splitlines()]
    assert [c[0] for c in commands] == ["python", "jaxcnn-predict", "jaxcnn-export", "jaxcnn-predict"]
    monkeypatch.chdir(tmp_path)
    root = os.path.dirname(README)
    assert train_main([os.path.join(root, "configs", "mnist_cnn.yaml"), "train.epochs=null", "train.steps=2",
                       "train.compilation_cache=null", "logging.progress=none", "--workdir", "runs/mnist_cnn"]) == 0
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable] + commands[0][1:], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and sorted(os.listdir()) == ["digit0.png", "digit1.png", "digit2.png", "runs"], done.stderr
    capsys.readouterr()
    for command, main in zip(commands[1:], (predict, export, predict)):
        assert main(command[1:]) == 0, command
    out = capsys.readouterr().out
    assert out.startswith("digit0.png\n") and "digit2.png\n" in out
    last = json.loads(out.strip().splitlines()[-1])  # the ONNX export's prediction, with --json
    assert last["source"] == "mnist.onnx" and [p["image"] for p in last["predictions"]] == ["digit0.png"]


SMALLER = ["train.epochs=null", "train.steps=2", "data.batch_size=8", "data.eval_batch_size=8",
           "data.workers=0", "logging.progress=none", "train.compilation_cache=null",
           "optim.schedule.warmup=0", "train.eval_every=null", "checkpoint.every=2"]


def _smaller_blocks():
    """The README's shell blocks marked to run here on fewer images and steps, a command a line."""
    import shlex
    with open(README, encoding="utf-8") as f:
        text = f.read()
    blocks = re.findall(r"^<!-- runs in tests/test_readme\.py, on fewer images and steps -->\n```bash\n(.*?)^```",
                        text, flags=re.S | re.M)
    return [[shlex.split(line) for line in block.strip().splitlines()] for block in blocks]


def _in_a_checkout(tmp_path, monkeypatch):
    """``tmp_path`` as the current directory, its ``configs`` the repository's (the README's
    commands run from the repository root; what they write lands here)."""
    monkeypatch.chdir(tmp_path)
    os.symlink(os.path.join(os.path.dirname(README), "configs"), tmp_path / "configs")


def test_the_readmes_own_folder_commands_run(tmp_path, monkeypatch):
    """Train on your own folder, as written, with :data:`SMALLER`'s overrides (the README's run
    takes minutes): the folder the first command writes trains."""
    from jaxcnn.data.cli import main as data_main
    from jaxcnn.train.cli import train_main
    folder, _ = _smaller_blocks()
    assert [c[0] for c in folder] == ["jaxcnn-data", "jaxcnn-train"]
    _in_a_checkout(tmp_path, monkeypatch)
    assert data_main(folder[0][1:] + ["--train", "4", "--val", "2"]) == 0
    assert train_main(folder[1][1:] + SMALLER + ["--workdir", "runs/shapes"]) == 0
    assert os.path.isfile(tmp_path / "runs" / "shapes" / "params.npz")


def _convert_a_stand_in(fine_tune):
    """The README's conversion one-liner run on a stand-in for torchvision's
    ``resnet18-f37072fd.pth`` (this library's ResNet-18 saved by ``torch.save``: the same keys and
    shapes), in the current directory; returns its ``state_dict``."""
    import subprocess
    import sys

    import jax
    from jaxcnn import interop, models
    torch = pytest.importorskip("torch")
    net = models.get("resnet18", num_classes=1000)
    like = jax.eval_shape(lambda: net.init(jax.random.PRNGKey(0), (1, 64, 64, 3))[:2])
    rng = np.random.default_rng(0)
    params, state = (jax.tree_util.tree_map(
        lambda v: rng.normal(0, 0.05, v.shape).astype(v.dtype) + (1 if v.ndim == 1 else 0), t) for t in like)
    state_dict = interop.to_torch_state_dict("resnet18", params, state)
    torch.save(state_dict, "resnet18-f37072fd.pth")
    assert fine_tune[0][0] == "python"
    done = subprocess.run([sys.executable] + fine_tune[0][1:], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and os.path.isfile("resnet18.safetensors"), done.stderr[-2000:]
    return state_dict


def test_the_readmes_torch_conversion_one_liner_runs(tmp_path, monkeypatch):
    """The fine-tune section's first command, as written: the ``.pth`` becomes a safetensors file
    holding the same tensors (the trainer's use of such a file: the slow test below, and
    tests/train/test_init_from_torch.py::test_the_fine_tune_trains in the default run)."""
    import safetensors.numpy
    _, fine_tune = _smaller_blocks()
    monkeypatch.chdir(tmp_path)
    state_dict = _convert_a_stand_in(fine_tune)
    converted = safetensors.numpy.load_file("resnet18.safetensors")
    assert set(converted) == set(state_dict)
    for name, tensor in state_dict.items():
        assert np.array_equal(converted[name], tensor.numpy()), name


@pytest.mark.slow  # the trainer from such a file: tests/train/test_init_from_torch.py::test_the_fine_tune_trains
def test_the_readmes_fine_tune_commands_run(tmp_path, monkeypatch, capsys):
    """Fine-tune from torchvision's weights, as written, with :data:`SMALLER`'s overrides: the
    converted stand-in starts the fine-tune, its 1000-class head re-initialised for the folder's
    4 classes."""
    from jaxcnn import interop
    from jaxcnn.data.cli import main as data_main
    from jaxcnn.train.cli import train_main
    folder, fine_tune = _smaller_blocks()
    assert [c[0] for c in fine_tune] == ["python", "jaxcnn-train"]
    _in_a_checkout(tmp_path, monkeypatch)
    assert data_main(folder[0][1:] + ["--train", "2", "--val", "2"]) == 0
    _convert_a_stand_in(fine_tune)
    capsys.readouterr()
    assert train_main(fine_tune[1][1:] + SMALLER) == 0
    assert "parameters from resnet18.safetensors" in capsys.readouterr().out
    loaded, _ = interop.load_npz(tmp_path / "runs" / "shapes_resnet18" / "params.npz")
    assert loaded["fc"]["w"].shape == (512, 4)
