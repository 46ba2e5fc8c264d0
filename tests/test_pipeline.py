"""Pipeline schedules: bit-exact, bubbles and memory as the papers derive, pictures, errors."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from simcluster import report
from simcluster.engine import DeadlockError, simulate
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.pipeline import UniformPipeline, pipeline_uniform, uniform_cluster
from simcluster.parallel.pipeline_schedules import PipelineShape, Schedule, describe
from simcluster.parallel.reference import reference
from simcluster.program.mesh import DeviceMesh
from simcluster.viz.pipeline_picture import picture

from composed_runs import run_composed


@settings(max_examples=8)  # the all-pairs test (test_composed.py) covers the combinations
@given(schedule=st.sampled_from(list(Schedule)), p=st.integers(1, 4), groups=st.integers(1, 2), v=st.integers(1, 2),
       extra_layers=st.integers(0, 2), dp=st.sampled_from([1, 2]), precision=st.sampled_from(["fp32", "bf16"]),
       recompute=st.sampled_from(["none", "selective", "full"]), dropout=st.sampled_from([0.0, 0.1]),
       seed=st.integers(0, 50))
def test_bit_exact_against_one_device(schedule, p, groups, v, extra_layers, dp, precision, recompute, dropout, seed):
    v = v if schedule is Schedule.INTERLEAVED else 1
    p = p + p % 2 if schedule is Schedule.DUALPIPE else p  # DualPipe: an even number of stages
    m = {Schedule.INTERLEAVED: p * groups, Schedule.DUALPIPE: 2 * p * groups}.get(schedule, groups + p - 1)
    layers = p * (2 if schedule is Schedule.ZB_V else v) + extra_layers  # p need not divide the layer count
    model = ModelConfig(layers=layers, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False,
                      dropout=dropout, recompute=recompute, seed=seed)
    data = TrainingConfig(model=model, global_batch=dp * m, micro_batches=m, steps=3, precision=precision)
    got, _ = run_composed(data, dp=dp, pp=p, schedule=schedule, virtual=v)
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


def in_flight(trace, p):
    """Per stage: the most activation memory held at once, in micro-batches of a whole stage's layers."""
    from simcluster.parallel.pipeline import ACTIVATION

    peaks = trace.memory_peaks()
    return [peaks[s]["activations"] / ACTIVATION for s in range(p)]


@pytest.mark.parametrize("t_f,t_b,t_w", TIMES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16)])
def test_zb_v_against_1f1b_and_zb_h1(p, m, t_f, t_b, t_w):
    """Qi et al. 2024, section 6: two chunks per stage in a V. Its bubble: at T_F = T_B = T_W exactly
    the last stage's wait for the first micro-batch's forward through p-1 half-stage chunks,
    (p-1) T_F/2 (the least any schedule on this placement can have: the paper's 'zero bubble' up to
    that ramp), and below ZB-H1's (p-1)(T_F + T_B - T_W) for the other times; its memory: p
    micro-batches in flight on every stage, the most 1F1B holds on its first (1x 1F1B, balanced)."""
    zb_v = uniform(Schedule.ZB_V, p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    h1 = bubbles(uniform(Schedule.ZB_H1, p, m, t_f=t_f, t_b=t_b, t_w=t_w), p)
    one = uniform(Schedule.ONE_F_ONE_B, p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    if t_f == t_b == t_w:
        assert bubbles(zb_v, p) == [(p - 1) * t_f // 2] * p
    assert all(v < h for v, h in zip(bubbles(zb_v, p), h1))
    assert in_flight(zb_v, p) == [p] * p == [max(in_flight(one, p))] * p


@pytest.mark.parametrize("t_f,t_b,t_w", TIMES)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 12), (6, 12), (8, 16), (8, 24)])
def test_dualpipe_against_the_deepseek_v3_table(p, m, t_f, t_b, t_w):
    """DeepSeek-V3 report, Table 2: DualPipe's bubble (p/2-1)(F&B + B - 3W), with B the whole backward
    (t_b + t_w) and F&B a forward and a backward of two micro-batches, which DualPipe overlaps and which
    run back to back (F + B) in this uniform pipeline, with no communication to overlap: an upper bound
    here, and at T_F = T_B = T_W exactly (p/2-1) T_F; its activations p+1 micro-batches on every stage
    (1F1B: p on the first), its parameters twice (two copies: tests/test_composed.py runs it bit-exact)."""
    run = uniform(Schedule.DUALPIPE, p, m, t_f=t_f, t_b=t_b, t_w=t_w)
    b = t_b + t_w
    bound = (p // 2 - 1) * ((t_f + b) + b - 3 * t_w)
    assert all(x <= bound for x in bubbles(run, p))
    if t_f == t_b == t_w:
        assert bubbles(run, p) == [(p // 2 - 1) * t_f] * p
    assert in_flight(run, p) == [p + 1] * p


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


def _read(text):
    """The picture's rows, blocks joined: stage -> [(column, label)] (one block or several)."""
    rows, offset = {}, 0
    for block in text.split("\n\n"):
        lines = [line for line in block.splitlines() if not line.startswith("(")]
        for line in lines:
            name, cells = line.split(": ", 1)
            row = rows.setdefault(name, [])
            row += [(offset + c, label) for c, label in enumerate(cells.split(" ")) if not label.startswith(".")]
        offset += len(lines[0].split(": ", 1)[1].split(" "))
    return rows


PICTURED = [(Schedule.GPIPE, 4, 8, 1), (Schedule.ONE_F_ONE_B, 4, 8, 1), (Schedule.INTERLEAVED, 4, 8, 2),
            (Schedule.ZB_H1, 4, 8, 1), (Schedule.ZB_V, 4, 8, 1), (Schedule.DUALPIPE, 4, 8, 1)]


@pytest.mark.parametrize("t_f,t_b,t_w", TIMES[1:])
@pytest.mark.parametrize("schedule,p,m,v", PICTURED, ids=[s.value for s, *_ in PICTURED])
def test_the_picture_draws_every_pass_in_its_schedules_order_at_any_width(schedule, p, m, v, t_f, t_b, t_w):
    """At every width from 40 to 200 columns: no line wider than the page, each stage's row is its
    schedule's own pass list (pipeline_schedules.describe: F3.5 where a stage runs several chunks) in
    order, every pass drawn once, and a
    micro-batch's forward passes go down the stages left to right, its backward passes back up (the
    old time-scaled picture hid 3 to 13 passes and drew a forward on stage 2 before stage 1's)."""
    trace = uniform(schedule, p, m, v, t_f=t_f, t_b=t_b, t_w=t_w)
    listed = [line.split(": ", 1)[1].split(" ") for line in describe(schedule, PipelineShape(p, m, v)).splitlines()]
    for width in range(40, 201, 8):
        text = picture(trace, list(range(p)), width=width)
        assert max(len(line) for line in text.splitlines()) <= width
        rows = _read(text)
        assert [[label for _, label in rows[f"stage {s}"]] for s in range(p)] == listed
        if v == 1 and schedule not in (Schedule.ZB_V, Schedule.DUALPIPE):  # (one chunk a stage, in order)
            at = {(s, label): c for s in range(p) for c, label in rows[f"stage {s}"]}
            for j in range(m):
                assert all(at[s, f"F{j}"] < at[s + 1, f"F{j}"] < at[s + 1, f"B{j}"] < at[s, f"B{j}"]
                           for s in range(p - 1))


def test_the_pipeline_svg_draws_every_pass_and_needs_nothing_from_outside():
    """The SVG holds the whole picture at any width (the terminal screenshot was cut at the page):
    one box a pass, each titled with its label, in the text picture's columns; no font or file to
    fetch."""
    from simcluster.viz.pipeline_picture import grid, svg

    trace = uniform(Schedule.INTERLEAVED, 4, 8, 2, t_f=1200, t_b=2400, t_w=600)
    drawn = svg(trace, [0, 1, 2, 3], title="interleaved")
    listed = " ".join(describe(Schedule.INTERLEAVED, PipelineShape(4, 8, 2)).replace("\n", " ").split(" "))
    titles = re.findall(r"<title>([^<]+)</title>", drawn)
    assert sorted(titles) == sorted(w for w in listed.split(" ") if not w.startswith("stage") and w[0] in "FBW")
    xs = [int(x) for x in re.findall(r'<rect x="(\d+)" y="30"', drawn)]  # stage 0's boxes, left to right
    assert xs == sorted(xs) and len(xs) == len(grid(trace, [0, 1, 2, 3]).rows[0])
    assert "url(" not in drawn and "@import" not in drawn and "font-face" not in drawn
    assert drawn.count("http") == 1  # the xmlns


def test_schedules_are_printable_data():
    assert describe("1f1b", PipelineShape(2, 3)) == "stage 0: F0 F1 B0 F2 B1 B2\nstage 1: F0 B0 F1 B1 F2 B2"
    assert describe("gpipe", PipelineShape(2, 2)) == "stage 0: F0 F1 B1 B0\nstage 1: F0 F1 B1 B0"
    assert describe("interleaved", PipelineShape(2, 2, 2)).splitlines()[0] == (
        "stage 0: F0.0 F1.0 F0.2 F1.2 B0.2 B1.2 B0.0 B1.0")
    # by hand from the rules in the builders' docstrings. ZB-V: stage 0 holds chunks 0 and 3 of 4,
    # stage 1 chunks 1 and 2 (the V); built for max(m, 2p - 1) = 3 micro-batches, micro-batch 2 left out
    assert describe("zb-v", PipelineShape(2, 2)) == (
        "stage 0: F0.0 F1.0 F0.3 B0.3 W0.3 F1.3 B1.3 W1.3 B0.0 W0.0 B1.0 W1.0\n"
        "stage 1: F0.1 F0.2 F1.1 F1.2 B0.2 W0.2 B0.1 W0.1 B1.2 W1.2 B1.1 W1.1")
    # DualPipe: micro-batches 0, 1 enter at stage 0 (chunks 0, 1), 2, 3 at stage 1 (chunks 2, 3)
    assert describe("dualpipe", PipelineShape(2, 4)) == (
        "stage 0: F0.0 F2.3 F1.0 B2.3 F3.3 B0.0 B3.3 B1.0 W1.0\n"
        "stage 1: F2.2 F0.1 F3.2 B0.1 F1.1 B2.2 B1.1 B3.2 W3.2")


def activation_peaks(schedule, p, m):
    model = ModelConfig(layers=p, hidden=64, heads=4, ffn_hidden=128, seq=16, vocab=32, tied_head=False)
    data = TrainingConfig(model=model, global_batch=m, micro_batches=m, steps=1)
    _, run = run_composed(data, pp=p, schedule=schedule, mode="meta")
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
    ("zb-v", 3, 4, 1, 5, "ZB-V cuts the layers into 2 x p = 6 chunks: 5 layers are too few"),
    ("dualpipe", 3, 6, 1, 4, "DualPipe needs an even number of stages \\(p=3\\)"),
    ("dualpipe", 2, 3, 1, 4, "an even micro-batch count of at least 2p = 4 \\(m=3\\)"),
    ("dualpipe", 4, 6, 1, 4, "at least 2p = 8 \\(m=6\\)"),
])
def test_invalid_configurations(schedule, p, m, v, layers, message):
    model = ModelConfig(layers=layers, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False)
    with pytest.raises(Exception, match=message):
        run_composed(TrainingConfig(model=model, global_batch=m, micro_batches=m), pp=p, mode="meta", schedule=schedule,
                 virtual=v)


def test_dualpipe_without_summing_its_two_copies_is_caught(monkeypatch):
    """Each copy of a layer saw half the micro-batches: stepping on its own half diverges from one device."""
    from simcluster.parallel.dp_wrap import DPWrap

    init = DPWrap.__init__

    def alone(self, *args, **kw):
        init(self, *args, **kw | {"twin": None})

    model = ModelConfig(layers=2, hidden=4, heads=2, ffn_hidden=6, seq=3, vocab=7, tied_head=False, seed=1)
    data = TrainingConfig(model=model, global_batch=4, micro_batches=4, steps=2, precision="bf16")
    got, _ = run_composed(data, pp=2, schedule="dualpipe")
    assert report.verification("exact", reference(data), got)["bit_exact"]
    monkeypatch.setattr(DPWrap, "__init__", alone)
    got, _ = run_composed(data, pp=2, schedule="dualpipe")
    assert not report.verification("exact", reference(data), got)["bit_exact"]
