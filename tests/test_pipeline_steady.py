"""Meta mode at any micro-batch count (simcluster/run/pipeline_steady.py): a pipeline's steady rounds
simulated twice give the report of simulating every micro-batch, byte for byte; a step's cost does not
grow with its micro-batches."""

import json
from dataclasses import replace
from unittest import mock

import pytest

from simcluster.config.scenario import build
from simcluster.config.schema import ModelSection, ParallelSection
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.run import pipeline_steady, runner, steady

M = 48  # micro-batches a step, each rank: enough for every schedule's two short runs to cost half
BASE = ["run.numerics=meta", "run.steps=1", "model.micro_batch=1", "model.tied_head=false", "model.layers=4",
        "parallel.zero=1", "parallel.pp=2"]
LAYOUTS = [
    ["parallel.dp=4"],
    ["parallel.dp=2", "parallel.tp=2", "parallel.sp=true", "parallel.overlap_grad_reduce=false",
     "parallel.recompute=full", "model.dropout=0.1"],
    ["parallel.dp=4", "parallel.schedule=interleaved", "parallel.virtual_stages=2"],
    ["parallel.dp=4", "parallel.schedule=zb-h1"],
    ["parallel.dp=4", "parallel.schedule=zb-v"],
    ["parallel.dp=4", "parallel.schedule=dualpipe"],
    ["parallel.dp=1", "parallel.pp=4", "parallel.cp=2", "parallel.attention=ring", "model.layers=8"],
    ["model.arch=llama", "model.kv_heads=2", "parallel.dp=1", "parallel.tp=4", "parallel.recompute=selective"],
    ["cluster.nodes=2", "cluster.gpus_per_node=4", "parallel.dp=2", "parallel.tp=2", "parallel.zero=0"],
]


def scenario(sets, m=M):
    sc = build({}, [*BASE, *sets])
    return build({}, [*BASE, *sets, f"model.global_batch={sc.parallel.dp * m}"])


def every_micro_batch(sc):
    with mock.patch.object(runner, "_rounds", lambda sc, faults: None):
        return runner.run_scenario(sc)


@pytest.mark.parametrize("layout,steps", [(i, 1) for i in range(len(LAYOUTS))] + [(1, 2), (3, 2), (8, 2)])
def test_repeated_rounds_give_the_report_of_simulating_every_micro_batch(layout, steps):
    """Every schedule that settles into rounds, and hybrids of it, in one step or two (a round more in
    each): the same report JSON as simulating all M micro-batches, from two runs of fewer."""
    sc = scenario([*LAYOUTS[layout], f"run.steps={steps}"])
    once, every = runner.run_scenario(sc), every_micro_batch(sc)
    assert once.result.micro is not None and once.result.micro[1] == M and once.result.micro[0] < M // 2
    assert every.result.micro is None and len(every.result.trace) > len(once.result.trace)
    assert json.dumps(once.report, sort_keys=True) == json.dumps(every.report, sort_keys=True)


@pytest.mark.parametrize("layout", [2, 5])
def test_repeated_rounds_of_repeated_steps(layout):
    """Seven steps: steps 1-2 and 1-3 (steady.py), each from two short runs; the report of simulating
    every micro-batch of every step."""
    sc = scenario([*LAYOUTS[layout], "run.steps=7"])
    once = runner.run_scenario(sc)
    with mock.patch.object(runner, "_rounds", lambda sc, faults: None), \
            mock.patch.object(runner, "_repeats", lambda sc, faults: False):
        every = runner.run_scenario(sc)
    assert once.result.micro is not None and once.result.repeated[0] == 4 and every.result.repeated is None
    assert json.dumps(once.report, sort_keys=True) == json.dumps(every.report, sort_keys=True)


def test_a_million_micro_batches_cost_two_short_runs(simulated):
    """Only two short runs are simulated, whatever the micro-batch count; the report counts them all."""
    small, million = runner.run_scenario(scenario(LAYOUTS[0])), runner.run_scenario(scenario(LAYOUTS[0], 10**6))
    first, second = pipeline_steady.micro_counts(small.scenario.model, small.scenario.parallel).counts
    assert [data.micro_batches for data in simulated] == [first, second, first, second]
    shown, m, period = million.result.micro
    assert m == 10**6 and million.report["trace_events"] > 10**6
    assert million.report["total_time_ns"] == small.report["total_time_ns"] + (10**6 - M) * period
    assert million.report["memory_peak_bytes"] == small.report["memory_peak_bytes"]


def test_rounds_that_never_repeat_are_all_simulated(monkeypatch):
    """ZeRO-3 behind a pipeline reduce-scatters every micro-batch's gradients on a stream that falls
    further behind each round: no two rounds are alike. Not even tried (no plan); and tried, the short
    runs are refused, every micro-batch is simulated, and the report is the full simulation's."""
    sc = scenario(["parallel.dp=4", "parallel.zero=3"])
    assert pipeline_steady.micro_counts(sc.model, sc.parallel) is None
    every = every_micro_batch(sc)
    tried = pipeline_steady.micro_counts(sc.model, replace(sc.parallel, zero=1))
    monkeypatch.setattr(pipeline_steady, "micro_counts", lambda model, parallel: tried)
    once = runner.run_scenario(sc)
    assert once.result.micro is None
    assert json.dumps(once.report, sort_keys=True) == json.dumps(every.report, sort_keys=True)


def test_only_what_gains_is_planned():
    """No plan where the two short runs would cost more than half the step, for GPipe (which holds
    every micro-batch), without a pipeline, or with a count the unit does not divide."""
    model = ModelSection(global_batch=64, micro_batch=1)
    one_f_one_b = ParallelSection(pp=4, dp=1, schedule="1f1b", zero=1)
    assert pipeline_steady.micro_counts(model, one_f_one_b).counts == (7, 8)
    assert pipeline_steady.micro_counts(replace(model, global_batch=29), one_f_one_b) is None  # 7 + 8 > 29 / 2
    assert pipeline_steady.micro_counts(model, replace(one_f_one_b, schedule="gpipe")) is None
    assert pipeline_steady.micro_counts(model, replace(one_f_one_b, pp=1)) is None
    assert pipeline_steady.micro_counts(model, replace(one_f_one_b, schedule="interleaved")) is None  # 16 + 20 > 32
    assert pipeline_steady.micro_counts(replace(model, global_batch=80), replace(one_f_one_b, schedule="interleaved")).counts \
        == (16, 20)


def ev(start, end, name="k", group=""):
    return TraceEvent(0, "compute", "forward", name, start, end, 0, group)


def trace(events, memory=()):
    t = Trace(events, [(0, "compute")])
    t.memory = tuple(memory)
    return t


def test_the_period_is_found_only_when_the_new_round_repeats_the_last():
    """Round i: [10i, 10i + 5]; a warm-up event at 0 and a cool-down event after the rounds."""
    def run(rounds, last=None, tag=""):
        body = [ev(10 * i, 10 * i + 5, f"F{i}", f"p2p[0->1] tag {i}" if tag else "") for i in range(1, rounds + 1)]
        if last is not None:
            body[-1] = last
        return trace([ev(0, 2), *body, ev(10 * rounds + 10, 10 * rounds + 12, "B")])

    assert steady.grown(run(3), run(4)) == 10  # (labels may name the micro-batch)
    assert steady.grown(run(3, tag="y"), run(4, tag="y")) == 10  # (and a message's tag)
    assert steady.grown(run(3), run(4, last=ev(40, 46))) is None  # the new round took longer
    assert steady.grown(run(3), trace([*list(run(4))[:4], ev(40, 45), ev(51, 53)])) is None  # the end moved
    held = [MemoryEvent(0, 10, "activations", "a", 8), MemoryEvent(0, 15, "activations", "a", -8)]
    b = trace(list(run(3)), held)
    c = trace(list(run(4)), [*held, MemoryEvent(0, 20, "activations", "a", 8)])
    assert steady.grown(b, c) is None  # the new round holds memory the last one did not


@pytest.mark.slow
def test_megatrons_1t_row_from_two_short_runs():
    """benchmarks/megatron_table1.toml row 10 (64 stages, 512 micro-batches): two runs of 67 and 68 give
    the report of simulating all 512."""
    from pathlib import Path

    from simcluster.config.scenario import load

    sc = load(Path(__file__).parent.parent / "benchmarks" / "megatron_table1.toml").variants[9][1]
    once, every = runner.run_scenario(sc, trace=False), every_micro_batch(sc)
    assert once.result.micro[:2] == (68, 512)
    assert json.dumps(once.report, sort_keys=True) == json.dumps(every.report, sort_keys=True)


def test_each_step_puts_its_round_in_and_everything_after_moves_one_period_more():
    """Two steps of [warm-up, rounds, cool-down], each followed by a reduction on another lane (no
    rounds there: P later in step 1's wake, 2P in step 2's)."""
    def run(rounds, steps=2, late=0):
        events, t = [], 0
        for s in range(steps):
            events.append(ev(t, t + 2))
            events += [ev(t + 10 * i, t + 10 * i + 5, f"F{i}") for i in range(1, rounds + 1)]
            end = t + 10 * rounds + 12
            events.append(ev(t + 10 * rounds + 10, end, "B"))
            lag = late if s == 0 else 0
            events.append(TraceEvent(0, "comm:dp", "all_reduce", "", end + lag, end + 3 + lag, 64, "dp"))
            t = end + 3
        return Trace(events, [(0, "compute"), (0, "comm:dp")])

    assert steady.grown(run(3), run(4), steps=2) == 10
    assert steady.grown(run(3), run(4), steps=1) is None  # (two rounds put in, not one)
    assert steady.grown(run(3), run(4, late=1), steps=2) is None  # step 1's reduction moved P + 1


def test_a_deep_zero_bubble_v_pipeline_finds_its_rounds():
    """ZB-V settles into rounds later as its pipeline deepens (from m = 3p + 1 at 8 stages): its window
    starts where they repeat, so 120 micro-batches over 8 stages cost two runs of 28 and 29."""
    sc = build({}, [*BASE, "parallel.pp=8", "parallel.dp=1", "parallel.schedule=zb-v", "model.layers=16",
                    "cluster.gpus_per_node=8", "model.global_batch=120"])
    micro = runner.run_scenario(sc, trace=False).result.micro
    assert micro is not None and micro[:2] == (29, 120)
