"""Fault injection ([faults], engine/faults.py) and goodput ([goodput], simcluster/report/goodput.py)."""

import math

import numpy as np
import pytest

from simcluster.cli import main
from simcluster.config.scenario import ScenarioError, build
from simcluster.report import goodput
from simcluster.run.runner import run_scenario

META = ["run.numerics=meta", "run.steps=2"]


def run(*sets):
    return run_scenario(build({}, [*META, *sets]))


def kernels(outcome, rank):
    return [e for e in outcome.result.full_trace() if e.rank == rank and e.stream == "compute"]


def test_a_straggler_runs_its_kernels_slower_from_its_time():
    base = run()
    at_us = base.report["total_time_ns"] / 2e3
    slow = run("faults.straggler_rank=3", "faults.straggler_factor=3", f"faults.straggler_from_us={at_us}")
    before, after = kernels(base, 3), kernels(slow, 3)
    assert [e.name for e in before] == [e.name for e in after]
    # each kernel starting at or after the time lasts ceil(3 d); earlier ones are unchanged
    for b, a in zip(before, after):
        want = math.ceil(3 * (b.end - b.start)) if a.start >= at_us * 1e3 else b.end - b.start
        assert a.end - a.start == want, (b, a)
    assert any(a.start >= at_us * 1e3 for a in after)
    assert [(e.start, e.end) for e in kernels(base, 5) if e.end <= at_us * 1e3] == \
        [(e.start, e.end) for e in kernels(slow, 5) if e.end <= at_us * 1e3]
    assert slow.report["step_time_ns"] > base.report["step_time_ns"]
    later = run("faults.straggler_rank=3", f"faults.straggler_from_us={10 * at_us}")
    assert list(later.result.trace) == list(base.result.trace)  # slows nothing the run reaches


def test_a_degraded_nic_slows_a_collective_across_nodes_by_its_factor():
    """Two nodes of one GPU, a large all-reduce (bandwidth-bound): half the NIC bandwidth on one rank
    nearly doubles its time; half the NVLink bandwidth, which it does not cross, changes nothing."""
    sets = ["run.program=allreduce", "parallel.dp=2", "cluster.nodes=2", "cluster.gpus_per_node=1",
            "model.global_batch=64", "model.seq=1024", "model.hidden=1024"]

    def comm_time(*extra):
        o = run(*sets, *extra)
        return sum(e.end - e.start for e in o.result.trace if e.rank == 0 and e.kind == "all_reduce")
    base = comm_time()
    half = comm_time("faults.degraded_rank=1", "faults.degraded_factor=0.5")
    assert 1.9 < half / base <= 2.0
    assert comm_time("faults.degraded_rank=1", "faults.degraded_link=\"nvlink\"", "faults.degraded_factor=0.5") == base


def test_a_failed_rank_hangs_its_peers_and_their_watchdogs_name_it():
    base = run()
    at = base.report["total_time_ns"] // 2
    o = run("faults.failed_rank=2", f"faults.failed_at_us={at / 1e3}", "faults.watchdog_s=2")
    hang = o.result.hang
    assert hang is not None and hang.rank == 2 and hang.at_ns == at
    assert [s.rank for s in hang.stuck] == [0, 1, 3, 4, 5, 6, 7]  # every other rank waits
    for s in hang.stuck:
        assert 2 in s.missing and 2 not in s.joined and s.rank in s.joined
        assert set(s.joined) | set(s.missing) == set(range(8)) and s.seq >= 1
        assert s.began_ns >= at - base.report["total_time_ns"]  # (it began where the rank stopped)
        assert "SeqNum" in s.line() and "never joined: 2" in s.line()
    # the stall is drawn on the waiting ranks' lanes until their watchdogs fire
    stalls = [e for e in o.result.trace if "hung" in e.name]
    assert {e.rank for e in stalls} == {0, 1, 3, 4, 5, 6, 7}
    assert all(e.end - e.start == 2 * 10**9 for e in stalls)
    assert o.result.trace.end == hang.end_ns
    assert not [e for e in o.result.trace if e.rank == 2 and e.end > at]  # the failed rank does nothing more
    assert "hung" in o.report["verification"]["status"]
    assert o.report["faults"]["hang"]["watchdog"][0]["missing"] == [2]


def test_a_rank_that_fails_after_the_end_changes_nothing():
    base = run()
    late = run("faults.failed_rank=2", f"faults.failed_at_us={base.report['total_time_ns']}")
    assert late.result.hang is None and list(late.result.trace) == list(base.result.trace)


def test_faults_break_folding():
    layout = ("parallel.dp=4", "parallel.tp=2")
    o = run(*layout, "faults.straggler_rank=1")
    assert o.result.fold is None and "faults" in o.result.unfolded_because
    assert run(*layout).result.fold is not None  # (the same scenario without faults folds)


def test_the_command_line_says_hung_with_exit_status_4(capsys):
    code = main(["run", "--set", "run.numerics=meta", "--set", "faults.failed_rank=5", "--set",
                 "faults.failed_at_us=100", "--set", "faults.watchdog_s=1", "--json"])
    err = capsys.readouterr().err
    assert code == 4 and "the run hung: rank 5 failed" in err and "watchdog caught collective" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("sets,words", [
    (["faults.failed_rank=8"], "faults.failed_rank = 8 is not a rank"),
    (["faults.degraded_rank=1", "faults.degraded_factor=0"], "must be above 0"),
    (["faults.straggler_factor=0.5"], "at least 1"),
    (["faults.failed_rank=1", "faults.watchdog_s=0"], "watchdog_s must be above 0"),
])
def test_faults_that_cannot_be_are_refused(sets, words):
    with pytest.raises(ScenarioError, match=words):
        run(*sets)


# -- goodput -------------------------------------------------------------------------------------------
def simulated_goodput(tau, c, r, m, segments=200_000, seed=0):
    """The same process by Monte Carlo: interruptions at exponential times; a failed segment is lost and
    a restart follows (itself interruptible)."""
    rng = np.random.default_rng(seed)
    wall, done = 0.0, 0
    while done < segments:
        x = rng.exponential(m)
        if x >= tau + c:
            wall += tau + c
            done += 1
            continue
        wall += x
        while True:  # restart
            y = rng.exponential(m)
            if y >= r:
                wall += r
                break
            wall += y
    return done * tau / wall


@pytest.mark.parametrize("tau,c,r,m", [(3000.0, 60.0, 600.0, 11000.0), (600.0, 30.0, 120.0, 2000.0)])
def test_the_goodput_formula_matches_a_simulation_of_the_process(tau, c, r, m):
    assert goodput.segment_goodput(tau, c, r, m) == pytest.approx(simulated_goodput(tau, c, r, m, 100_000), rel=0.01)


def test_the_best_interval_approaches_young_and_daly():
    """The numerical optimum vs Young's sqrt(2CM): the gap shrinks with C/M and stays within the order
    sqrt(C/2M) of Young's first-order derivation; Daly's higher-order estimate is closer still."""
    m, r = 10_000.0, 300.0
    gaps = []
    for c in (100.0, 10.0, 1.0):
        best = goodput.best_tau(c, r, m)
        young, daly = goodput.young(c, m), goodput.daly(c, m)
        gap = abs(best / young - 1)
        assert gap < math.sqrt(c / (2 * m))
        assert abs(best / daly - 1) < gap / 3
        for other in (0.8 * best, 1.25 * best):
            assert goodput.segment_goodput(other, c, r, m) < goodput.segment_goodput(best, c, r, m)
        gaps.append(gap)
    assert gaps[0] > gaps[1] > gaps[2]


def test_the_report_gives_goodput_and_its_best_interval():
    o = run("goodput.interruptions_per_gpu_hour=0.5", "goodput.storage_gbyte_per_s=0.001", "goodput.restart_s=1")
    g = o.report["goodput"]
    assert g["mtbf_s"] == pytest.approx(3600 / (0.5 * 8))
    assert g["checkpoint_bytes"] == 14 * o.report["parameters"]  # bf16: master, two moments, working copy
    assert g["step_s"] == o.report["step_time_ns"] * 1e-9
    k = g["best_every_steps"]
    for other in (max(1, k // 2), k + 1, 2 * k):
        if other != k:
            assert goodput.segment_goodput(other * g["step_s"], g["checkpoint_s"], 1.0, g["mtbf_s"]) <= g["best_goodput"]
    fixed = run("goodput.interruptions_per_gpu_hour=0.5", "goodput.storage_gbyte_per_s=0.001", "goodput.restart_s=1",
                f"goodput.checkpoint_every_steps={2 * k}")
    assert fixed.report["goodput"]["goodput"] < g["best_goodput"]


def test_interruptions_far_more_often_than_a_step_leave_no_goodput():
    """(A fuzzer's find: exp overflowed.) A million interruptions an hour on every GPU: nothing trains."""
    assert goodput.segment_goodput(10.0, 1.0, 600.0, 1e-6) == 0.0
    o = run("goodput.interruptions_per_gpu_hour=1e9", "goodput.restart_s=0.1")
    assert o.report["goodput"]["best_goodput"] == 0.0


def test_faults_at_scale_are_refused_when_every_rank_would_run(capsys):
    """Faults turn folding off: a 16,384-GPU scenario would simulate every rank (tens of GB here), so
    it is refused up front with its estimate, as --no-fold is; folded, the same scenario runs."""
    assert main(["run", "goodput_16k", "--set", "faults.straggler_rank=3", "--json"]) == 2
    err = capsys.readouterr().err
    assert "1,024 copies" in err and "[faults] turn folding off" in err and len(err.strip().splitlines()) == 1
    assert main(["run", "goodput_16k", "--no-fold", "--json"]) == 2
    assert "--no-fold" in capsys.readouterr().err


def test_a_fault_that_cannot_act_is_warned_about():
    """Issue 36: a degraded NIC on a run whose ranks share one node changes nothing; it is said, as inert
    parallel.* settings are. The same fault across two nodes is not warned about."""
    one_node = build({}, ["faults.degraded_rank=0", "parallel.dp=8"])
    assert any("faults.degraded_link = 'nic' does nothing here" in w for w in one_node.warnings())
    two_nodes = build({}, ["faults.degraded_rank=0", "parallel.dp=16", "cluster.nodes=2", "model.global_batch=16"])
    assert not any(w.startswith("faults.") for w in two_nodes.warnings())
