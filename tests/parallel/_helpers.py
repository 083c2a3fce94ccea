"""Small models, batches and runners shared by the parallel tests."""
import jax
import numpy as np
import optax

from jaxcnn import layers as L
from jaxcnn import precision as P
from jaxcnn.models import get as get_model
from jaxcnn.models.resnet import basic_block
from jaxcnn.parallel import ParallelPlan, make_mesh
from jaxcnn.train.state import create_train_state
from jaxcnn.train.step import make_train_step

MNIST_SHAPE = (16, 28, 28, 1)
BN_SHAPE = (16, 8, 8, 3)


def bn_net(num_classes: int = 10):
    """conv-BN-ReLU stem, one ResNet basic block with a projection, pooling, fc (8 -> 16 channels)."""
    return L.serial(("conv1", L.Conv2D(8, 3, padding=1, use_bias=False)), ("bn1", L.BatchNorm()),
                    ("relu", L.Relu()), ("block", basic_block(8, 16, stride=2)),
                    ("pool", L.GlobalAvgPool2D()), ("fc", L.Linear(num_classes)))


_MODELS = {}


def model_and_shape(name):
    """One model instance per name for the whole session (so jit and init caches hit)."""
    if name not in _MODELS:
        _MODELS[name] = (get_model("mnist_cnn"), MNIST_SHAPE) if name == "mnist_cnn" else (bn_net(), BN_SHAPE)
    return _MODELS[name]


def batches(shape, n, seed=0, num_classes=10):
    rng = np.random.default_rng(seed)
    return [{"image": rng.normal(size=shape).astype(np.float32),
             "label": rng.integers(0, num_classes, shape[0]).astype(np.int32)} for _ in range(n)]


_INIT_CACHE = {}


def init(model, tx, shape, seed=0):
    """A fresh TrainState as host (NumPy) arrays, so every use copies it to devices
    and donating it cannot delete the cached one; cached because the first
    initialisation of a model costs seconds of compilation on a loaded CPU."""
    key = (id(model), id(tx), tuple(shape), seed)
    if key not in _INIT_CACHE:
        state = create_train_state(model, tx, jax.random.PRNGKey(seed), shape,
                                   loss_scale=P.make_loss_scale("none"))
        _INIT_CACHE[key] = (model, tx, jax.device_get(state))  # holding model, tx keeps ids unique
    return _INIT_CACHE[key][2]


def plan_for(model, tx, shape, strategy="shard_map", data=-1, model_axis=1, devices=None, **kw):
    mesh = make_mesh(data, model_axis, devices=devices)
    abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype),
                                      init(model, tx, shape))
    return ParallelPlan(mesh, model, shape, abstract,
                        strategy=strategy, **kw)


def run_plan(plan, model, tx, shape, data):
    """Loss per step and the final state of training on ``plan``."""
    step = plan.wrap_step(make_train_step(model, tx, axis_name=plan.step_axis_name,
                                          sync_batch_norm=plan.sync_batch_norm))
    state = plan.shard_state(init(model, tx, shape))
    losses = []
    for b in data:
        state, m = step(state, plan.put_batch(b))
        losses.append(float(m["loss"]))
    return np.array(losses), state


_SINGLE_CACHE = {}


def run_single(model, tx, shape, data):
    """The same training on one device (the reference; cached per model, optimiser and data)."""
    key = (id(model), id(tx), tuple(shape), tuple(b["image"].tobytes() for b in data))
    if key not in _SINGLE_CACHE:
        _SINGLE_CACHE[key] = _run_single(model, tx, shape, data)
    return _SINGLE_CACHE[key]


def _run_single(model, tx, shape, data):
    step = jax.jit(make_train_step(model, tx).step)
    state = init(model, tx, shape)
    losses = []
    for b in data:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    return np.array(losses), jax.device_get(state)


def max_diff(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    return max((float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
                for x, y in zip(la, lb)), default=0.0)


SGD = optax.sgd(0.01)
MOMENTUM = optax.sgd(0.01, momentum=0.9)
