"""StableHLO export: every zoo model serialised with a symbolic batch, reloaded
and run in a fresh Python process that never imports jaxcnn; its logits must
equal (bit for bit) what the exported module gives in this process, and
jaxcnn's own eval-mode logits to float32 rounding."""
import json
import subprocess
import sys

import numpy as np
import pytest
import xla_cache
from export_cases import ZOO, eval_logits, init_model

from jaxcnn import layers as L
from jaxcnn.export import ExportError, export_stablehlo, load_stablehlo

# Runs in the child: only jax and numpy.  argv: directory, model names, names also run at batch 1.
_CHILD = r"""
import json, sys
import numpy as np
from jax import export
names, batch1 = json.loads(sys.argv[2]), json.loads(sys.argv[3])
out = {}
for name in names:
    with open(f"{sys.argv[1]}/{name}.stablehlo", "rb") as f:
        exported = export.deserialize(bytearray(f.read()))
    x = np.load(f"{sys.argv[1]}/{name}.npy")
    out[name] = np.asarray(exported.call(x))
    if name in batch1:
        out[name + "_batch1"] = np.asarray(exported.call(x[:1]))
np.savez(f"{sys.argv[1]}/out.npz", **out)
assert not any(m.startswith("jaxcnn") for m in sys.modules), "the child imported jaxcnn"
"""

# The symbolic batch is checked on every model's signature; running a second batch size
# costs one more compilation per model, so only these run at batch 1 as well.
BATCH1 = ("mnist_cnn", "resnet18", "mobilenet_v2")


# The normal suite reloads one model of each kind of layer (plain conv/pool, VGG with
# BatchNorm, basic residual blocks, depthwise inverted residuals); -m slow the whole zoo.
FAST_ZOO = ("lenet5", "mnist_cnn", "mobilenet_v2", "resnet18", "vgg16_bn")


@pytest.mark.parametrize("names", [
    pytest.param(FAST_ZOO, id="one-per-kind"),
    pytest.param(tuple(sorted(ZOO)), id="whole-zoo", marks=pytest.mark.slow)])
def test_zoo_models_reload_in_a_fresh_process(zoo_case, tmp_path, names):
    names = list(names)
    exported = {}
    for name in names:
        case = zoo_case(name)
        data = export_stablehlo(case.model, case.params, case.state, case.image_shape,
                                path=tmp_path / f"{name}.stablehlo")
        np.save(tmp_path / f"{name}.npy", case.x)
        exported[name] = load_stablehlo(data)
        assert str(exported[name].in_avals[0].shape[0]) == "b"
    # This process runs the exported modules first, at both batch sizes, and stores what it
    # compiles in the suite's compilation cache; the child, given the cache, loads those
    # executables instead of compiling the same programs again.  The child still deserialises
    # and runs every module itself: what it computes must equal, bit for bit, what runs here.
    here = {name: np.asarray(exported[name].call(zoo_case(name).x)) for name in names}
    here.update({name + "_batch1": np.asarray(exported[name].call(zoo_case(name).x[:1]))
                 for name in BATCH1 if name in names})
    env = {k: v for k, v in xla_cache.subprocess_env().items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path), json.dumps(names),
                    json.dumps(BATCH1)], env=env, cwd=tmp_path, check=True, timeout=600)
    with np.load(tmp_path / "out.npz") as out:
        for name in names:
            case = zoo_case(name)
            np.testing.assert_array_equal(out[name], here[name], err_msg=name)
            scale = np.abs(case.logits).max()
            np.testing.assert_allclose(out[name], case.logits, rtol=0, atol=1e-5 * scale,
                                       err_msg=name)
            if name in BATCH1:
                np.testing.assert_array_equal(out[name + "_batch1"], here[name + "_batch1"],
                                              err_msg=name)
                np.testing.assert_allclose(out[name + "_batch1"], case.logits[:1], rtol=0,
                                           atol=1e-5 * scale, err_msg=name)


def test_nchw_layout_and_fixed_batch():
    model = L.serial(L.Conv2D(4, 3, padding=1), L.BatchNorm(), L.Relu(), L.Flatten(), L.Linear(3))
    params, state = init_model(model, (5, 6, 2))
    x = np.random.default_rng(0).normal(size=(3, 5, 6, 2)).astype(np.float32)
    ref = eval_logits(model, params, state, x)
    exported = load_stablehlo(export_stablehlo(model, params, state, (5, 6, 2), batch=3,
                                               layout="nchw"))
    assert exported.in_avals[0].shape == (3, 2, 5, 6)
    np.testing.assert_allclose(np.asarray(exported.call(x.transpose(0, 3, 1, 2))), ref,
                               rtol=1e-6, atol=1e-6)


def test_bad_input():
    with pytest.raises(ExportError, match="not a serialised"):
        load_stablehlo(b"definitely not a module")
    model = L.serial(L.Conv2D(2, 1))
    params, state = init_model(model, (4, 4, 1))
    with pytest.raises(ExportError, match="layout"):
        export_stablehlo(model, params, state, (4, 4, 1), layout="hwcn")
