"""jaxcnn.summary: per-layer rows, totals and MAC counts, checked against
MACs worked out by hand from each layer's shapes and against a naive count
for transposed convolutions."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcnn import functional as F
from jaxcnn import layers as L
from jaxcnn import models, summary
from jaxcnn.summary import count_macs

S = jax.ShapeDtypeStruct


def test_resnet50_macs_match_the_published_figure():
    s = summary(models.get("resnet50"), (1, 224, 224, 3))
    assert abs(s.total_macs - 4.09e9) / 4.09e9 < 0.01
    assert s.total_params == 25_557_032
    # BatchNorm: running mean + var per channel, plus one counter per layer.
    bn_rows = [r for r in s.rows if r.kind == "batch_norm"]
    assert s.total_state == sum(r.params + 1 for r in bn_rows) and len(bn_rows) == 53
    assert s.output_shape == (1, 1000)
    assert s.macs_per_sample == s.total_macs


def test_mnist_cnn_rows_and_totals():
    s = summary(models.get("mnist_cnn"), (1, 28, 28, 1))
    expected = [  # name, kind, output shape, params, MACs (out elements x kernel taps x C_in)
        ("conv1", "conv2d", (1, 26, 26, 32), 32 * 9 + 32, 26 * 26 * 32 * 9 * 1),
        ("relu1", "relu", (1, 26, 26, 32), 0, 0),
        ("conv2", "conv2d", (1, 24, 24, 64), 64 * 9 * 32 + 64, 24 * 24 * 64 * 9 * 32),
        ("relu2", "relu", (1, 24, 24, 64), 0, 0),
        ("pool", "max_pool2d", (1, 12, 12, 64), 0, 0),
        ("dropout1", "dropout", (1, 12, 12, 64), 0, 0),
        ("flatten", "flatten", (1, 9216), 0, 0),
        ("fc1", "linear", (1, 128), 9216 * 128 + 128, 9216 * 128),
        ("relu3", "relu", (1, 128), 0, 0),
        ("dropout2", "dropout", (1, 128), 0, 0),
        ("fc2", "linear", (1, 10), 128 * 10 + 10, 128 * 10),
    ]
    assert [(r.name, r.kind, r.output_shape, r.params, r.macs) for r in s.rows] == expected
    assert s.total_params == 1_199_882
    assert s.total_macs == sum(e[4] for e in expected) == 11_992_448
    assert s.total_state == 0


def test_macs_scale_with_the_batch():
    s1 = summary(models.get("lenet5"), (1, 28, 28, 1))
    s4 = summary(models.get("lenet5"), (4, 28, 28, 1))
    assert s4.total_macs == 4 * s1.total_macs
    assert s4.macs_per_sample == s1.total_macs
    assert s4.total_params == s1.total_params == 61_706


def test_table_is_aligned_and_has_totals():
    s = summary(models.get("mnist_cnn"), (1, 28, 28, 1))
    text = str(s)
    lines = text.splitlines()
    header, rule = lines[0], lines[1]
    assert header.split() == ["Layer", "Kind", "Output", "shape", "Params", "MACs"]
    table = lines[2:2 + len(s.rows)]
    assert [ln.split()[0] for ln in table] == [r.name for r in s.rows]
    # Right-aligned number columns: every row ends where the header does.
    assert {len(ln) for ln in table} == {len(header)} and len(rule) == len(header)
    assert "Trainable params: 1,199,882" in text
    assert "Total MACs: 11,992,448" in text and "per sample: 11,992,448" in text


def test_single_leaf_model_is_its_own_row():
    s = summary(L.Conv2D(8, 3, padding=1), (2, 5, 5, 4))
    assert len(s.rows) == 1 and s.rows[0].name == ""
    assert s.rows[0].macs == 2 * 5 * 5 * 8 * 3 * 3 * 4
    assert "(root)" in str(s)


def test_residual_and_parallel_rows_have_dotted_names():
    block = L.serial(("stem", L.Conv2D(4, 1)),
                     ("res", L.residual(("a", L.Conv2D(4, 3, padding=1)), ("b", L.BatchNorm()))),
                     ("par", L.parallel(("x", L.Linear(3)), ("y", L.Linear(5)))))
    s = summary(block, (1, 6, 6, 2))
    assert [r.name for r in s.rows] == ["stem", "res.a", "res.b", "par.x", "par.y"]
    assert s.output_shape == (1, 6, 6, 8)
    assert [r.macs for r in s.rows] == [36 * 4 * 2, 36 * 4 * 9 * 4, 0, 36 * 4 * 3, 36 * 4 * 5]


@pytest.mark.parametrize("stride, dilation, groups, padding", [
    (1, 1, 1, 0), (2, 1, 1, 1), (1, 2, 2, 2), (2, 1, 4, "SAME"), (3, 2, 1, "VALID")])
def test_conv_macs_are_output_times_kernel_times_group_inputs(stride, dilation, groups, padding):
    x, w = S((2, 11, 9, 8), jnp.float32), S((3, 2, 8 // groups, 12), jnp.float32)
    y = jax.eval_shape(lambda a, b: F.conv2d(a, b, stride=stride, padding=padding,
                                             dilation=dilation, groups=groups), x, w)
    macs = count_macs(lambda a, b: F.conv2d(a, b, stride=stride, padding=padding,
                                            dilation=dilation, groups=groups), x, w)
    assert macs == np.prod(y.shape) * 3 * 2 * (8 // groups)


def _naive_transpose_macs(n, size_in, c_in, c_out, groups, k, stride, pad, dilation, out_pad):
    """A transposed convolution is a direct convolution (stride 1, kernel
    dilation ``dilation``) over the input with ``stride - 1`` zeros inserted
    between elements and ``dilation*(k-1) - pad`` padding before
    (``+ out_pad`` after).  Build that padded, zero-stuffed row explicitly and
    count the taps that do not fall on a stuffed zero."""
    pairs = 1
    for ax in range(2):
        edge = dilation[ax] * (k[ax] - 1) - pad[ax]
        row = ["pad"] * edge
        for i in range(size_in[ax]):
            row += ["x"] + (["hole"] * (stride[ax] - 1) if i < size_in[ax] - 1 else [])
        row += ["pad"] * (edge + out_pad[ax])
        size_out = len(row) - dilation[ax] * (k[ax] - 1)
        pairs *= sum(row[o + t * dilation[ax]] != "hole"
                     for o in range(size_out) for t in range(k[ax]))
    return n * c_out * (c_in // groups) * pairs


@pytest.mark.parametrize("stride, pad, dilation, out_pad, groups", [
    ((1, 1), (0, 0), (1, 1), (0, 0), 1), ((2, 2), (1, 0), (1, 1), (1, 0), 1),
    ((3, 2), (2, 1), (2, 1), (0, 1), 2), ((2, 1), (0, 2), (1, 3), (1, 0), 3)])
def test_transposed_conv_macs_skip_inserted_zeros(stride, pad, dilation, out_pad, groups):
    n, hw, c_in, c_out, k = 2, (5, 4), 6, 12, (3, 4)
    layer = L.ConvTranspose2D(c_out, k, stride=stride, padding=pad, dilation=dilation,
                              output_padding=out_pad, groups=groups)
    s = summary(layer, (n, *hw, c_in))
    assert s.total_macs == _naive_transpose_macs(n, hw, c_in, c_out, groups, k, stride, pad,
                                                 dilation, out_pad)
    if stride == (1, 1):    # nothing inserted: the plain direct-convolution count
        assert s.total_macs == np.prod(s.output_shape) * np.prod(k) * c_in // groups


def test_dot_general_scan_and_cond():
    a, b = S((3, 4, 5), jnp.float32), S((3, 5, 6), jnp.float32)
    assert count_macs(lambda p, q: jnp.einsum("bij,bjk->bik", p, q), a, b) == 3 * 4 * 5 * 6

    def scanned(p, q):
        return jax.lax.scan(lambda c, _: (c @ q[0] @ q[0].T, None), p[0], None, length=7)[0]
    assert count_macs(scanned, a, b) == 7 * (4 * 5 * 6 + 4 * 6 * 5)

    def branchy(flag, p, q):
        return jax.lax.cond(flag, lambda: p[0] @ q[0], lambda: p[0] @ q[0] + p[1] @ q[1])
    assert count_macs(branchy, S((), jnp.bool_), a, b) == 2 * 4 * 5 * 6
    # Work inside nested jit and custom_jvp functions is counted too.
    assert count_macs(jax.jit(lambda p, q: jax.nn.relu(p @ q)), a, b) == 3 * 4 * 5 * 6
