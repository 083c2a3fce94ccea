"""StableHLO export: every zoo model serialised with a symbolic batch, reloaded
and run in a fresh Python process that never imports jaxcnn; its logits must
equal (bit for bit) what the exported module gives in this process, and
jaxcnn's own eval-mode logits to float32 rounding."""
import contextlib
import json
import subprocess
import sys

import jax
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


# Where a serialised module (almost all of it its weights) is larger than this, neither this
# process nor the child stores its compiled program in the suite's persistent compilation
# cache: the program holds the weights as constants, and JAX compresses each entry it writes
# (zlib, or zstandard where installed; zlib here), which took longer than the compilation it
# would save the child (jax 0.11.2, 2 cores: resnet18's 45 MB, 4.5 s to compile and store
# against 2.0 s to compile; vgg16_bn's 62 MB, 5.5 s against 1.2 s).  The smaller modules go
# through the cache: the child loads what this process compiled.
STORE_BELOW_BYTES = 20_000_000
_MIN_COMPILE_TIME = "jax_persistent_cache_min_compile_time_secs"


@contextlib.contextmanager
def _cache_writes(store: bool):
    """Within it, this process stores what it compiles in the persistent compilation cache only
    if ``store``."""
    before = getattr(jax.config, _MIN_COMPILE_TIME)
    jax.config.update(_MIN_COMPILE_TIME, before if store else float("inf"))
    try:
        yield
    finally:
        jax.config.update(_MIN_COMPILE_TIME, before)


# The normal suite reloads one model of each kind of layer (plain conv/pool, VGG with
# BatchNorm, basic residual blocks, depthwise inverted residuals); -m slow the whole zoo.
FAST_ZOO = ("lenet5", "mnist_cnn", "mobilenet_v2", "resnet18", "vgg16_bn")


@pytest.mark.parametrize("names", [
    pytest.param(FAST_ZOO, id="one-per-kind"),
    pytest.param(tuple(sorted(ZOO)), id="whole-zoo", marks=pytest.mark.slow)])
def test_zoo_models_reload_in_a_fresh_process(zoo_case, tmp_path, names):
    names = list(names)
    exported, sizes = {}, {}
    for name in names:
        case = zoo_case(name)
        data = export_stablehlo(case.model, case.params, case.state, case.image_shape,
                                path=tmp_path / f"{name}.stablehlo")
        np.save(tmp_path / f"{name}.npy", case.x)
        exported[name], sizes[name] = load_stablehlo(data), len(data)
        assert str(exported[name].in_avals[0].shape[0]) == "b"
    # This process runs the exported modules first, at both batch sizes; the child, given the
    # suite's compilation cache, loads the executables of the smaller ones instead of compiling
    # the same programs again, and compiles the larger ones itself (STORE_BELOW_BYTES; it stores
    # nothing).  The child deserialises and runs every module: what it computes must equal, bit
    # for bit, what runs here.
    here = {}
    for name in names:
        x = zoo_case(name).x
        with _cache_writes(sizes[name] < STORE_BELOW_BYTES):
            here[name] = np.asarray(exported[name].call(x))
            if name in BATCH1:
                here[name + "_batch1"] = np.asarray(exported[name].call(x[:1]))
    env = {k: v for k, v in xla_cache.subprocess_env().items() if k != "PYTHONPATH"}
    env[_MIN_COMPILE_TIME.upper()] = "inf"
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
