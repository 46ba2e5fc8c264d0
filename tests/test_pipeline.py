"""Pipeline schedules: bit-exact, bubbles and memory as the papers derive, pictures, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.engine import DeadlockError, simulate
from simcluster.model.gpt import GPTConfig
from simcluster.parallel.data_parallel import DPConfig, reference
from simcluster.parallel.pipeline import UniformPipeline, pipeline_uniform, uniform_cluster
from simcluster.parallel.pipeline_schedules import PipelineShape, Schedule, describe
from simcluster.program.mesh import DeviceMesh
from simcluster.viz.pipeline_picture import picture

from plans import run_plan


@settings(max_examples=8)  # the all-pairs test (test_composed.py) covers the combinations
@given(schedule=st.sampled_from(list(Schedule)), p=st.integers(1, 4), groups=st.integers(1, 2), v=st.integers(1, 2),
       extra_layers=st.integers(0, 2), dp=st.sampled_from([1, 2]), precision=st.sampled_from(["fp32", "bf16"]),
       recompute=st.sampled_from(["none", "selective", "full"]), dropout=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 50))
def test_bit_exact_against_one_device(schedule, p, groups, v, extra_layers, dp, precision, recompute, dropout, seed):
    v = v if schedule is Schedule.INTERLEAVED else 1
    m = p * groups if schedule is Schedule.INTERLEAVED else groups + p - 1  # interleaving needs m % p == 0
    layers = p * v + extra_layers  # p need not divide the layer count
    model = GPTConfig(layers=layers, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False,
                      dropout=dropout, recompute=recompute, seed=seed)
    data = DPConfig(model=model, global_batch=dp * m, micro_batches=m, steps=3, precision=precision)
    got, _ = run_plan(data, dp=dp, pp=p, schedule=schedule, virtual=v)
    verdict = report.verification("exact", reference(data), got)
    assert verdict["bit_exact"], verdict["mismatches"]
    assert verdict["outputs_compared"] == 3 + 5 * len(model.parameter_shapes())  # + first-step gradients


def uniform(schedule, p, m, v=1, t_f=1000, t_b=1000, t_w=1000):
    cfg = UniformPipeline(micro_batches=m, schedule=schedule, virtual=v, t_f=t_f, t_b=t_b, t_w=t_w)
    return simulate(pipeline_uniform, cfg, mesh=DeviceMesh(pp=p), cluster=uniform_cluster(p), mode="meta").trace


def bubbles(trace, p):
    """Per stage: the step's length minus the stage's compute."""
    return [trace.end - sum(e.duration for e in trace.lane(s, "compute")) for s in range(p)]


TIMES = [(1200, 1200, 1200), (1200, 2400, 600), (3600, 1200, 2400)]  # divisible by every v used: whole ns per chunk


@pytest.mark.parametrize("t_f,t_b,t_w", TIMES)
@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8), (3, 7)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m(schedule, p, m, t_f, t_b, t_w):
    trace = uniform(schedule, p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    ideal = m * (t_f + t_b + t_w)
    assert bubbles(trace, p) == [(p - 1) * (t_f + t_b + t_w)] * p
    assert bubbles(trace, p)[0] / ideal == pytest.approx((p - 1) / m, abs=1e-12)


@pytest.mark.parametrize("t_f,t_b,t_w", TIMES)
@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (2, 6, 3), (4, 4, 4)])
def test_interleaved_bubble_is_p_minus_1_over_vm(p, m, v, t_f, t_b, t_w):
    trace = uniform(Schedule.INTERLEAVED, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
    ideal = m * (t_f + t_b + t_w)
    for b in bubbles(trace, p):
        assert b * v == (p - 1) * (t_f + t_b + t_w)
        assert b / ideal == pytest.approx((p - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("t_f,t_b,t_w", [(1000, 1000, 1000), (1000, 1500, 800), (2000, 1000, 1000)])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (3, 6)])
def test_zb_h1_bubble_against_1f1b(p, m, t_f, t_b, t_w):
    """Qi et al. 2024, Table 2: (p-1)(T_F + T_B - T_W) against 1F1B's (p-1)(T_F + T_B + T_W)."""
    zb = bubbles(uniform(Schedule.ZB_H1, p, m, t_f=t_f, t_b=t_b, t_w=t_w), p)
    base = bubbles(uniform(Schedule.ONE_F_ONE_B, p, m, t_f=t_f, t_b=t_b, t_w=t_w), p)
    assert zb == [(p - 1) * (t_f + t_b - t_w)] * p
    assert base == [(p - 1) * (t_f + t_b + t_w)] * p


def test_the_pictures():
    """Drawn by hand from the schedules' rules (unit passes, no communication time)."""
    assert picture(uniform(Schedule.GPIPE, 3, 2, t_w=0), [0, 1, 2]) == (
        "stage 0: F0 F1 .. .. .. .. B1 B0\n"
        "stage 1: .. F0 F1 .. .. B1 B0 ..\n"
        "stage 2: .. .. F0 F1 B1 B0 .. ..")
    assert picture(uniform(Schedule.ONE_F_ONE_B, 2, 3, t_w=0), [0, 1]) == (
        "stage 0: F0 F1 .. B0 F2 B1 .. B2\n"
        "stage 1: .. F0 B0 F1 B1 F2 B2 ..")
    assert picture(uniform(Schedule.ZB_H1, 2, 3), [0, 1]) == (
        "stage 0: F0 F1 .. B0 W0 F2 B1 W1 B2 W2\n"
        "stage 1: .. F0 B0 F1 B1 W0 F2 B2 W1 W2")


def test_schedules_are_printable_data():
    assert describe("1f1b", PipelineShape(2, 3)) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    assert describe("gpipe", PipelineShape(2, 2)) == "stage 0: F0 F1 B1 B0\nstage 1: F0 F1 B1 B0"
    assert describe("interleaved", PipelineShape(2, 2, 2)).splitlines()[0] == (
        "stage 0: F0.0 F1.0 F0.2 F1.2 B0.2 B1.2 B0.0 B1.0")


def activation_peaks(schedule, p, m):
    model = GPTConfig(layers=p, hidden=64, heads=4, ffn_hidden=128, seq=16, vocab=32, tied_head=False)
    data = DPConfig(model=model, global_batch=m, micro_batches=m, steps=1)
    _, run = run_plan(data, pp=p, schedule=schedule, mode="meta")
    per_micro_batch: dict[str, int] = {}
    for e in run.trace.memory:
        if e.rank == 0 and e.category == "activations" and e.bytes > 0:
            mb = e.name.split(".")[0]
            per_micro_batch[mb] = per_micro_batch.get(mb, 0) + e.bytes
    assert len(set(per_micro_batch.values())) == 1  # every micro-batch holds the same on stage 0
    return run.trace.memory_peaks()[0]["activations"] // per_micro_batch["mb0"]


@pytest.mark.parametrize("p,m", [(2, 6), (4, 8), (3, 3)])
def test_peak_activations_on_stage_0(p, m):
    assert activation_peaks(Schedule.GPIPE, p, m) == m
    assert activation_peaks(Schedule.ONE_F_ONE_B, p, m) == min(p, m)
    assert activation_peaks(Schedule.ZB_H1, p, m) == min(p, m)


def test_broken_schedules_are_caught():
    import simcluster.parallel.pipeline_schedules as sched

    original = sched.BUILDERS[Schedule.ONE_F_ONE_B]
    try:  # stage 0 runs micro-batch 0's backward before its forward
        sched.BUILDERS[Schedule.ONE_F_ONE_B] = lambda shape, s: (
            [("B", 0, 0)] + [op for op in original(shape, s) if op != ("B", 0, 0)] if s == 0 else original(shape, s))
        with pytest.raises(DeadlockError, match="rank 0 waits in recv of bf16\\(0,\\) from rank 1"):
            uniform(Schedule.ONE_F_ONE_B, 2, 2)
        # the last stage forgets micro-batch 1's backward: stage 0 waits for a gradient that never comes
        sched.BUILDERS[Schedule.ONE_F_ONE_B] = lambda shape, s: (
            [op for op in original(shape, s) if op != ("B", 1, 1)] if s == 1 else original(shape, s))
        with pytest.raises(DeadlockError, match="rank 1 has not issued it: rank 1 is finished"):
            uniform(Schedule.ONE_F_ONE_B, 2, 2)
    finally:
        sched.BUILDERS[Schedule.ONE_F_ONE_B] = original


@pytest.mark.parametrize("schedule,p,m,v,layers,message", [
    ("interleaved", 2, 3, 2, 4, "needs the micro-batch count m=3 to be a multiple of p=2"),
    ("1f1b", 5, 4, 1, 4, "5 pipeline stages for 4 layers: every stage needs at least one layer"),
    ("interleaved", 2, 4, 3, 5, "p x v = 2 x 3 = 6 model chunks for 5 layers"),
    ("1f1b", 2, 4, 2, 4, "virtual stages v=2 need the interleaved schedule, not 1f1b"),
])
def test_invalid_configurations(schedule, p, m, v, layers, message):
    model = GPTConfig(layers=layers, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False)
    with pytest.raises(Exception, match=message):
        run_plan(DPConfig(model=model, global_batch=m, micro_batches=m), pp=p, mode="meta", schedule=schedule,
                 virtual=v)


def test_tied_head_with_pipeline_is_a_clear_error():
    model = GPTConfig(layers=2, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=True)
    with pytest.raises(Exception, match="set model.tied_head = false for pipeline parallelism"):
        run_plan(DPConfig(model=model, global_batch=2, micro_batches=2), pp=2, mode="meta")
