"""The 1F1B pipeline schedule (``parallel.pipeline.schedule: 1f1b``): its timetable, checked
against the dependencies of a pipeline from the outside, and a step that gives GPipe's numbers
(one device with ``accumulate=M``, BatchNorm per micro-batch in order)."""
import jax
import numpy as np
import pytest

from jaxcnn.parallel import Pipeline
from jaxcnn.parallel.pipeline import BACKWARD, FORWARD, IDLE, one_f_one_b

from _helpers import MOMENTUM, batches, max_diff
from test_parallel_pipeline import (SHAPE, _assert_run_matches, _model, _plan, _reference, pipelined_run,
                                    run_bn_net, shape_of)

# 1F1B against GPipe, float32: of each leaf's largest value.  The two schedules run the same
# stage programs in the same order, but XLA fuses them into different programs: bit for bit
# until the CPU's per-channel sums reduced over three axes (N, H, W/g; the width-only fold),
# since then up to 1.3e-6 (a BatchNorm net's bias, 2 steps on data x pipe).
SAME_RTOL = 1e-5
_CASES = [(1, 1), (1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 3), (3, 7), (4, 1), (4, 3), (4, 4), (4, 8),
          (5, 12), (8, 3), (8, 8), (8, 16)]


def _ticks(table, S, M):
    """``{(kind, s, m): tick}`` read off the table; every F and B of every stage exactly once."""
    seen = {}
    for t in range(table.ticks):
        for s in range(S):
            kind, m = int(table.op[t, s]), int(table.micro[t, s])
            assert kind in (IDLE, FORWARD, BACKWARD)
            if kind == IDLE:
                continue
            assert 0 <= m < M and (kind, s, m) not in seen, (t, s, kind, m)
            seen[(kind, s, m)] = t
    assert set(seen) == {(k, s, m) for k in (FORWARD, BACKWARD) for s in range(S) for m in range(M)}
    return seen


@pytest.mark.parametrize("S,M", _CASES)
def test_timetable_runs_every_op_once_after_its_inputs(S, M):
    """M < S, M = S and M > S: forwards after the previous stage's forward of the micro-batch
    (sent a tick earlier), backwards the tick after the next stage's backward (the cotangent is
    used on arrival: no cotangent buffers; never at the tick an activation arrives) and after
    the stage's own forward; forwards and
    backwards of a stage in micro-batch order; at most S - s micro-batches between forward and
    backward on stage s; 2 (M + S - 1) ticks, GPipe's two scans together."""
    table = one_f_one_b(S, M)
    assert table.op.shape == table.micro.shape == table.slot.shape == table.store.shape == (table.ticks, S)
    assert table.ticks == 2 * (M + S - 1)
    at = _ticks(table, S, M)
    for s in range(S):
        for m in range(M):
            if s > 0:
                assert at[(FORWARD, s, m)] > at[(FORWARD, s - 1, m)]
            if s < S - 1:
                assert at[(BACKWARD, s, m)] == at[(BACKWARD, s + 1, m)] + 1
            assert at[(BACKWARD, s, m)] > at[(FORWARD, s, m)]
            if m > 0:
                assert at[(FORWARD, s, m)] > at[(FORWARD, s, m - 1)]
                assert at[(BACKWARD, s, m)] > at[(BACKWARD, s, m - 1)]
        for t in range(table.ticks):
            in_flight = sum(at[(FORWARD, s, m)] <= t < at[(BACKWARD, s, m)] for m in range(M))
            assert in_flight <= S - s, (s, t, in_flight)
    # an activation (sent by s - 1's forward) and a cotangent (sent by s + 1's backward) never
    # reach a stage at the same tick: the scan carries one receive buffer for both
    for t in range(1, table.ticks):
        for s in range(1, S - 1):
            assert not (table.op[t - 1, s - 1] == FORWARD and table.op[t - 1, s + 1] == BACKWARD), (t, s)
    # GPipe's bubble: each stage is busy 2M of the ticks
    assert all(int(np.sum(table.op[:, s] != IDLE)) == 2 * M for s in range(S))


@pytest.mark.parametrize("S,M", _CASES)
def test_timetable_slots_hold_each_input_until_its_backward(S, M):
    """Replaying the stash: each activation is stored the tick after the previous stage's
    forward of it, and every forward and backward of stage s > 0 finds its own micro-batch's
    input in the slot it reads (no slot overwritten before its last use).  Slots: at most
    min(S, M), and as many as the busiest stage has inputs held at once."""
    table = one_f_one_b(S, M)
    at = _ticks(table, S, M)
    assert table.slots == (0 if S == 1 else min(S, M))
    held = 0
    for s in range(1, S):
        contents = [None] * table.slots
        for t in range(table.ticks):
            k = int(table.store[t, s])
            arriving = [m for m in range(M) if at[(FORWARD, s - 1, m)] + 1 == t]
            assert (k >= 0) == bool(arriving), (s, t)
            if arriving:
                assert 0 <= k < table.slots
                contents[k] = arriving[0]
            kind = int(table.op[t, s])
            if kind != IDLE:
                assert contents[int(table.slot[t, s])] == int(table.micro[t, s]), (s, t)
            held = max(held, sum(at[(FORWARD, s - 1, m)] + 1 <= t <= at[(BACKWARD, s, m)] for m in range(M)))
    assert held == table.slots
    assert np.all(table.store[:, 0] == -1)


def test_timetable_of_two_stages_by_hand():
    """S = 2, M = 3: stage 0 warms up with one forward, then both alternate."""
    table = one_f_one_b(2, 3)
    code = {IDLE: ".", FORWARD: "F", BACKWARD: "B"}
    rows = ["".join(f"{code[int(k)]}{int(m) if k else ' '}" for k, m in zip(table.op[:, s], table.micro[:, s]))
            for s in range(2)]
    assert rows == ["F0F1. B0F2B1. B2",
                    ". F0B0F1B1F2B2. "]


def _compare_schedules(name, data_axis, microbatches, steps=1, against_gpipe=True):
    """1F1B against one device with accumulate=M (and GPipe against one device and 1F1B)."""
    model, tx, shape = _model(name), MOMENTUM, shape_of(name)
    ref_m, ref = _reference(model, tx, shape, batches(shape, steps, seed=1), microbatches)
    out = {}
    for schedule in ("1f1b", "gpipe") if against_gpipe else ("1f1b",):
        # the same batches as the reference (and GPipe's run: cached, the GPipe test's where it ran first)
        plan, out[schedule] = pipelined_run(name, data_axis, 4, microbatches, steps, schedule=schedule)
        assert plan.pipeline.schedule == schedule
    got_m, got = out["1f1b"]
    _assert_run_matches(got_m, got, ref_m, ref, steps)
    if not against_gpipe:
        return
    gp_m, gp = out["gpipe"]
    _assert_run_matches(gp_m, gp, ref_m, ref, steps)  # GPipe against one device, as in test_parallel_pipeline.py
    # the same stage programs summed in the same order as GPipe's: equal up to XLA fusing
    # the branches of the two scans' programs apart (SAME_RTOL)
    for g, r in zip(got_m, gp_m):
        np.testing.assert_allclose(g["loss"], r["loss"], rtol=SAME_RTOL)
    for tree in ("params", "state", "opt_state"):
        for a, b in zip(jax.tree_util.tree_leaves(getattr(got, tree)), jax.tree_util.tree_leaves(getattr(gp, tree))):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.max(np.abs(a - b), initial=0.0) <= SAME_RTOL * max(np.max(np.abs(b), initial=0.0), 1e-6)


# ResNet-18 itself with the slow tests: the zoo model's 14 blocks through the same schedule code as
# small_resnet's 8 (test_parallel_pipeline.py's small_resnet), at three times the compilation.
@pytest.mark.parametrize("name", ["small_resnet", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_resnet_1f1b_matches_gpipe_and_one_device(name):
    """A ResNet on 2 data shards x 4 stages with 2 micro-batches (M < S; micro-batches of 8,
    synced over data, as the GPipe tests: BatchNorm on small maps of fewer examples is
    ill-conditioned): loss, accuracy, gradients, BatchNorm statistics and parameters of one
    step as GPipe and as one device with accumulate=2 (and GPipe's as one device's: its run is
    test_resnet_pipelined_matches_one_device_on_the_same_micro_batches[small_resnet-2]'s, whose
    program the compilation cache holds)."""
    _compare_schedules(name, 2, 2)


# M = 8 (M > S) only: M < S on the same data 2 x pipe 4 layout (2 micro-batches, BatchNorm synced over
# data, against GPipe and one device with the same assertions) is
# test_resnet_1f1b_matches_gpipe_and_one_device, and the M < S timetables are checked from the
# outside by the timetable tests; the running statistics carried from step to step are the same
# code whatever M, checked here over 2 steps.  Its GPipe run and one-device reference are
# test_parallel_pipeline.py::test_batch_norm_per_micro_batch_over_steps's (pipelined_run, _reference).
def test_batch_norm_net_1f1b_on_data_and_pipe_over_steps():
    """The small BatchNorm net on 2 data shards x 4 stages, 8 micro-batches (M > S), 2 steps
    of momentum SGD: running statistics updated per micro-batch in order, synced over data,
    as one device with accumulate=M and as GPipe."""
    _compare_schedules("bn_net", 2, 8, steps=2)


# VGG-11 itself with the slow tests (test_parallel_pipeline.py's small_vgg: its layers, dropout
# p=0.5 twice, at half the compilation).
@pytest.mark.parametrize("name", ["small_vgg", pytest.param("vgg11", marks=pytest.mark.slow)])
def test_vgg_dropout_1f1b_matches_one_device(name):
    """A VGG with dropout (p=0.5) on 4 stages, M = S = 4 (one data shard: the reference
    draws the keys of data shard 0): each micro-batch's masks are the reference's."""
    _compare_schedules(name, 1, 4, against_gpipe=False)


def test_bf16_1f1b_matches_gpipe():
    """bfloat16 compute, data 2 x pipe 4, M = S = 4: two steps of 1F1B as GPipe's (the GPipe
    run is test_parallel_pipeline.py::test_mixed_precision_pipelined_matches_one_device's, which
    compares it with one device; run_bn_net holds it; M > S: the float32 1F1B tests)."""
    out = {}
    for schedule in ("gpipe", "1f1b"):
        metrics, final = run_bn_net("bf16", microbatches=4, schedule=schedule)
        out[schedule] = [float(m["loss"]) for m in metrics], final
    np.testing.assert_allclose(out["1f1b"][0], out["gpipe"][0], rtol=SAME_RTOL)
    assert max_diff(out["1f1b"][1].params, out["gpipe"][1].params) < 1e-6
    assert max_diff(out["1f1b"][1].state, out["gpipe"][1].state) < 1e-6


def test_schedule_key_and_its_errors():
    """Python: Pipeline(schedule=...) and ParallelPlan(pipeline={"schedule": ...}); config:
    parallel.pipeline.schedule with gpipe the default; a bad value is one line naming the key."""
    from jaxcnn.parallel import make_mesh
    from jaxcnn.train._plan import pipeline_spec
    from jaxcnn.train.config import load_config
    model = _model("resnet18")
    assert Pipeline(model, SHAPE, 4, 8).schedule == "gpipe"
    pipe = Pipeline(model, SHAPE, 4, 8, schedule="1f1b")
    assert pipe.stash_slots == 4 and Pipeline(model, SHAPE, 4, 8).stash_slots == 8
    assert pipe.bubble_fraction == pytest.approx(3 / 11)
    with pytest.raises(ValueError, match=r"^schedule: expected one of \('gpipe', '1f1b'\), "
                                         r"got 'pipedream'$"):
        Pipeline(model, SHAPE, 4, 8, schedule="pipedream")
    with pytest.raises(ValueError, match="^pipeline.schedule: "):
        _plan(_model("bn_net"), MOMENTUM, SHAPE, 2, 4, schedule="1F1B")
    import os
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    config = os.path.join(root, "configs", "mnist_cnn.yaml")
    cfg = load_config(config, ["mesh.pipe=4", "parallel.pipeline.microbatches=8"])
    assert cfg.parallel.pipeline.schedule == "gpipe"
    cfg = load_config(config, ["mesh.pipe=4", "parallel.pipeline.microbatches=8", "parallel.pipeline.schedule=1f1b"])
    assert pipeline_spec(cfg)["schedule"] == "1f1b"
    with pytest.raises(ValueError, match="parallel.pipeline.schedule") as err:
        load_config(config, ["parallel.pipeline.schedule=interleaved"])
    assert "\n" not in str(err.value)
    assert make_mesh  # imported for the plan helper's mesh


def test_resume_under_the_other_schedule_is_not_a_config_change():
    """The schedule (and remat) change memory, not the training math: a run resumes under the
    other one."""
    from jaxcnn.train.config import config_changes
    old = {"parallel": {"pipeline": {"schedule": "gpipe", "microbatches": 4}}}
    new = {"parallel": {"pipeline": {"schedule": "1f1b", "microbatches": 4}}}
    assert config_changes(old, new) == []
    assert config_changes(old, {"parallel": {"pipeline": {"schedule": "1f1b", "microbatches": 8}}})
    # nor does recomputing the stages' activations (pipeline or spatial remat)
    for section in ("pipeline", "spatial"):
        assert config_changes({"parallel": {section: {"remat": False}}},
                              {"parallel": {section: {"remat": True}}}) == []


def test_bench_scaling_pipe_rows_per_schedule(capsys):
    """scripts/bench_scaling.py --pipe 2 --schedule gpipe,1f1b: a row per schedule (its stash,
    the same bubble, memory from the compiled step); an unknown schedule is one line, exit 2."""
    import importlib.util
    import json
    import os
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bench_scaling.py"
    spec = importlib.util.spec_from_file_location("bench_scaling", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    # JAX starts here if no test before this one started it: with the suite's 8 devices, not
    # the count the script writes into XLA_FLAGS (the tests after it in this process need 8)
    assert jax.device_count() == 8
    environ = dict(os.environ)  # the script sets XLA_FLAGS as a command-line tool does
    args = ["--model", "lenet5", "--pipe", "2", "--per-device-batch", "8", "--microbatches", "4", "--steps", "0"]
    try:
        assert bench.main(args + ["--schedule", "gpipe,1f1b", "--json"]) == 0
        out = capsys.readouterr().out
        assert bench.main(args + ["--schedule", "gpipe,1F1B"]) == 2
        err = capsys.readouterr().err
    finally:
        os.environ.clear()
        os.environ.update(environ)
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["schedule"], r["stash"]) for r in rows] == [("gpipe", 4), ("1f1b", 2)]
    assert rows[0]["bubble"] == rows[1]["bubble"] == pytest.approx(1 / 5)
    assert all(r["memory_mib"] > 0 for r in rows)
    assert " schedule " in out and "stash" in out
    assert err.strip() == ("bench_scaling: --schedule: expected a comma-separated list of ('gpipe', '1f1b'), "
                           "got '1F1B'")


def test_trainer_dry_run_compiles_the_1f1b_step_and_refuses_a_bad_schedule(tmp_path):
    """jaxcnn-train --dry-run with mesh.data=2 mesh.pipe=4 schedule 1f1b builds and compiles
    the step; an unknown schedule is one line naming the key, exit 2."""
    from test_parallel_pipeline import _train
    micro = "parallel.pipeline.microbatches=4"
    code, out, err = _train(["mesh.data=2", "mesh.pipe=4", micro, "parallel.pipeline.schedule=1f1b",
                             "parallel.pipeline.engine=spmd", "--dry-run"], tmp_path / "a")
    assert code == 0 and "dry run ok" in out and "mesh data 2 x pipe 4" in out, err
    code, out, err = _train(["mesh.pipe=4", micro, "parallel.pipeline.schedule=zigzag"], tmp_path / "b")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "parallel.pipeline.schedule: expected one of 'gpipe', '1f1b', got 'zigzag'" in lines[0]
