"""Meta mode at any step count (simcluster/run/steady.py): identical steps simulated once give the report of
simulating every step, byte for byte; a run's cost does not grow with its steps."""

import json
from unittest import mock

import pytest

from simcluster.config.scenario import ScenarioError, build
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.run import runner, steady

PIPE = ["model.tied_head=false", "model.micro_batch=1", "model.layers=4"]
LAYOUTS = [
    [],
    ["parallel.zero=0"],
    ["parallel.zero=1", "parallel.overlap_grad_reduce=false"],
    ["parallel.zero=2", "model.micro_batch=1"],
    ["parallel.dp=4", "parallel.tp=2", "parallel.sp=true", "model.dropout=0.1"],
    ["parallel.dp=2", "parallel.pp=2", "parallel.tp=2", *PIPE],
    ["parallel.dp=4", "parallel.pp=2", "parallel.schedule=interleaved", "parallel.virtual_stages=2", *PIPE],
    ["parallel.dp=2", "parallel.pp=4", "parallel.schedule=zb-h1", *PIPE],
    ["parallel.dp=2", "parallel.pp=4", "parallel.schedule=gpipe", "parallel.recompute=full", *PIPE],
    ["parallel.dp=2", "parallel.cp=2", "parallel.tp=2", "parallel.attention=ring"],
    ["parallel.dp=4", "parallel.cp=2", "parallel.attention=ulysses", "parallel.zero_over=dp"],
    ["model.arch=llama", "model.kv_heads=2", "parallel.dp=2", "parallel.tp=4", "parallel.cp=1",
     "parallel.recompute=selective"],
    ["cluster.nodes=2", "cluster.gpus_per_node=4", "parallel.dp=4", "parallel.tp=2"],
]


def report(sets, *, every_step=False):
    sc = build({}, ["run.numerics=meta", *sets])
    if every_step:
        with mock.patch.object(runner, "_repeats", lambda sc, faults: False):
            return runner.run_scenario(sc)
    return runner.run_scenario(sc)


@pytest.mark.parametrize("steps", [6, 7, 10])
@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_repeated_steps_give_the_report_of_simulating_every_step(layout, steps):
    """Every layout family, three step counts: the same report JSON as simulating every step."""
    sets = [*LAYOUTS[layout], f"run.steps={steps}"]
    once, every = report(sets), report(sets, every_step=True)
    assert once.result.repeated == (steps - steady.SIMULATED, once.result.repeated[1])
    assert every.result.repeated is None and len(every.result.trace) > len(once.result.trace)
    assert json.dumps(once.report, sort_keys=True) == json.dumps(every.report, sort_keys=True)


def test_a_billion_steps_cost_five(simulated):
    """Only a 2-step and a 3-step run are simulated, whatever run.steps says; the report counts them all."""
    seven, billion = report(["run.steps=7"]), report(["run.steps=1000000000"])
    assert [data.steps for data in simulated] == [2, 3, 2, 3]
    assert billion.report["steps"] == 10**9
    period = billion.result.repeated[1]
    assert billion.report["total_time_ns"] == seven.report["total_time_ns"] + (10**9 - 7) * period
    assert billion.report["memory_peak_bytes"] == seven.report["memory_peak_bytes"]


def test_steps_that_do_not_repeat_are_all_simulated(monkeypatch):
    """When the third step is not the second again, every step runs -- and a count too large to run is
    refused then, with its estimate."""
    monkeypatch.setattr(steady, "period", lambda two, three: None)
    o = report(["run.steps=7"])
    assert o.result.repeated is None and o.report["steps"] == 7
    with pytest.raises(ScenarioError, match="meta mode would replay at least"):
        report(["run.steps=1000000000"])


def ev(start, end, name="k"):
    return TraceEvent(0, "compute", "forward", name, start, end)


def trace(events, memory=()):
    t = Trace(events, [(0, "compute")])
    t.memory = tuple(memory)
    return t


def test_the_period_is_found_only_when_the_last_step_repeats():
    two = trace([ev(0, 5), ev(10, 15, "O0"), ev(20, 25, "O1")])
    assert steady.period(two, trace([*two, ev(30, 35, "O2")])) == 10  # (labels may name the step)
    assert steady.period(two, trace([*two, ev(30, 36)])) is None  # the step took longer
    assert steady.period(two, trace([ev(0, 5), ev(11, 16), ev(20, 25), ev(30, 35)])) is None  # step 2 moved
    held = [MemoryEvent(0, 20, "activations", "a", 8)]
    grows = trace([*two, ev(30, 35)], [*held, MemoryEvent(0, 30, "activations", "a", 8)])
    assert steady.period(trace(list(two), held), grows) is None  # memory that is never released


OFFLOAD = ["parallel.zero=3", "parallel.offload_optimizer=nvme", "parallel.offload_params=cpu"]


@pytest.mark.parametrize("sets", LAYOUTS + [OFFLOAD, ["faults.straggler_rank=1", "faults.straggler_factor=1.5"]])
def test_the_replays_running_sums_are_the_sums_of_its_events(sets):
    """The sums a report is made of, kept by the replay as it makes each event (engine/totals.py), equal
    those summed from the events afterwards, in the same order (dicts compared by their items)."""
    from simcluster.engine.totals import Totals

    trace = report(["run.steps=2", *sets]).result.trace
    kept = trace.__dict__.pop("totals")
    summed = Totals.of(trace)
    assert summed is not kept and repr(summed) == repr(kept)
    assert kept.events == len(trace) and kept.end == max(e.end for e in trace)
    assert sum(ns for streams in kept.busy.values() for ns in streams.values()) == sum(e.duration for e in trace)


@pytest.mark.parametrize("sets", [LAYOUTS[0], LAYOUTS[5], LAYOUTS[9], OFFLOAD,
                                  ["cluster.nodes=2", "cluster.gpus_per_node=4", "parallel.dp=8", "run.steps=2"]])
def test_a_run_without_its_events_reports_the_same(sets):
    """`run_scenario(trace=False)` keeps no event (what the planner and the benchmarks ask for): the
    same report, byte for byte, as the run that keeps them all (folded and not)."""
    for fold in (True, False):
        sc = build({}, ["run.numerics=meta", *sets])
        full, bare = (runner.run_scenario(sc, fold=fold, trace=t) for t in (True, False))
        assert len(full.result.trace) > 0 and len(bare.result.trace) == 0
        assert json.dumps(bare.report, sort_keys=False) == json.dumps(full.report, sort_keys=False)


@pytest.mark.parametrize("sets", [LAYOUTS[4], LAYOUTS[5], LAYOUTS[7], LAYOUTS[9], LAYOUTS[11], OFFLOAD,
                                  ["cluster.nodes=2", "cluster.gpus_per_node=4", "parallel.dp=4", "parallel.tp=2"]])
def test_calls_ended_at_once_give_the_networks_trace(sets, monkeypatch):
    """A collective that finds its links idle ends at once (engine/timing.py `_claim`): the trace and the
    report are those of moving every call's flows through the network, byte for byte; and some calls
    of every layout are ended at once (the tensor-parallel ones, or the data-parallel ones)."""
    from simcluster.engine import timing

    sc = build({}, ["run.numerics=meta", "run.steps=2", *sets])
    claimed = []
    real = timing.Replay._claim
    monkeypatch.setattr(timing.Replay, "_claim", lambda self, *a: claimed.append(real(self, *a)) or claimed[-1])
    fast = runner.run_scenario(sc, fold=False)
    monkeypatch.setattr(timing.Replay, "_claim", lambda self, *a: False)
    full = runner.run_scenario(sc, fold=False)
    assert any(claimed)
    assert fast.result.trace.to_jsonl() == full.result.trace.to_jsonl()
    assert fast.result.trace.memory == full.result.trace.memory
    assert json.dumps(fast.report) == json.dumps(full.report)


@pytest.mark.parametrize("layout", [0, 2, 3, 5, 6, 7, 9])
def test_the_steady_step_does_not_depend_on_the_steps_run(layout):
    """The step time as Megatron-LM and torchtitan report it (report.step_times): the steady step is the
    same for 2, 3, 4 and 8 steps (8: steps simulated once, steady.py) and is what one more step adds
    to the run; the first step is the one-step run's step; initialisation, the first step and the
    steady steps add up to the run. (The total over the steps, as reported before, gave 1 / 2 / 4 steps
    268 / 250 / 241 us.)"""
    runs = {n: report([*LAYOUTS[layout], f"run.steps={n}"]).report for n in (1, 2, 3, 4, 8)}
    one = runs[1]
    assert one["steady_step_ns"] is None and one["step_time_ns"] == one["first_step_ns"]
    assert one["init_ns"] > 0 and one["init_ns"] + one["first_step_ns"] == one["total_time_ns"]
    steady = {n: r["steady_step_ns"] for n, r in runs.items() if n > 1}
    assert len(set(steady.values())) == 1, steady
    period = runs[3]["total_time_ns"] - runs[2]["total_time_ns"]
    assert steady[2] == period == runs[2]["step_time_ns"]
    for n, r in runs.items():
        assert (r["init_ns"], r["first_step_ns"]) == (one["init_ns"], one["first_step_ns"])
        assert r["init_ns"] + r["first_step_ns"] + (n - 1) * (r["steady_step_ns"] or 0) == r["total_time_ns"]


@pytest.mark.parametrize("layout", [0, 5, 6, 7, 9])
def test_the_steps_marks_read_off_the_streams_are_the_events_own(layout):
    """The replay reads where the steps begin and end off its streams (engine/steps.py); a trace without
    the replay's sums (one a watchdog drew) reads them off its events (Totals.of). The same marks."""
    from simcluster.engine.totals import Totals

    trace = runner.run_scenario(build({}, [*LAYOUTS[layout], "run.steps=3", "run.numerics=meta"]), fold=False).result.trace
    replayed = Totals.of(trace)
    del trace.__dict__["totals"]
    walked = Totals.of(trace)
    marks = lambda t: (t.first_pass, t.first_step_end, t.last_step_end)  # noqa: E731
    assert marks(replayed) == marks(walked) and None not in marks(walked)
    assert walked.first_pass < walked.first_step_end < walked.last_step_end
