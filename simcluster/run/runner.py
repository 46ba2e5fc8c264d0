"""Run a scenario: build the mesh and cluster, run its program, verify it, and report."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from simcluster import checkpoint
from simcluster import report as _report
from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.engine import RunResult, simulate
from simcluster.engine.faults import Faults
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.totals import Totals
from simcluster.parallel.composed import router_statistics
from simcluster.report import critical_batch, experts, goodput
from simcluster.run import budget, pipeline_steady, steady
from simcluster.run.job import Job, faults_of, job_of


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    result: RunResult
    report: dict[str, Any]

    def __repr__(self) -> str:  # (the default would print the whole scenario, trace and report)
        r = self.report
        return (f"Outcome({self.scenario.name!r}: {r.get('world_size')} ranks, step {r.get('step_time_ns')} ns, "
                f"verification {r.get('verification', {}).get('status') or r.get('verification', {}).get('passed')}"
                f"{f', {len(self.variants)} variants' if self.variants else ''})")
    variants: tuple[tuple[str, "Outcome"], ...] = ()


def run_all(sc: Scenario, on_variant: Any = None, *, fold: bool = True, trace: bool = True) -> Outcome:
    """The scenario, or each of its [compare] variants (the first variant's run stands for the whole).
    `on_variant(i, n, label)` is told before each variant runs (for a progress display). `fold`, `trace`:
    see run_scenario."""
    if not sc.variants:
        return run_scenario(sc, fold=fold, trace=trace)
    for _, v in sc.variants:  # (before the first runs: a comparison that cannot finish is refused whole)
        budget.check(v, fold)
    outcomes = []
    for i, (label, v) in enumerate(sc.variants):
        if on_variant is not None:
            on_variant(i, len(sc.variants), label)
        outcomes.append((label, run_scenario(v, fold=fold, trace=trace)))
    outcomes = tuple(outcomes)
    first = outcomes[0][1]
    report = {"scenario": sc.as_dict(), "variants": [dict(o.report, variant=label) for label, o in outcomes]}
    return Outcome(sc, first.result, report, outcomes)


def run_scenario(sc: Scenario, *, fold: bool = True, trace: bool = True) -> Outcome:
    """Run one scenario on the emulator. `fold`: in meta mode, let one rank stand for its identical peers
    (data-parallel replicas, tensor-parallel peers; engine/fold.py): the same trace and report, at a
    fraction of the cost. `trace`: keep every event for views and exports; without, the same report
    at less time and memory (the result's trace has no events)."""
    budget.check(sc, fold)
    checkpoint.check_scenario(sc)
    with checkpoint.saving(sc):  # (the folder locked until the checkpoint is complete)
        return _run_scenario(sc, fold, trace)


def _run_scenario(sc: Scenario, fold: bool, trace: bool) -> Outcome:
    faults = faults_of(sc)
    aims = _aims(sc)
    job = job_of(sc, fold=fold)
    result, totals = _steady(sc, fold) if _repeats(sc, faults) else (None, None)
    if result is None and _rounds(sc, faults):
        result, totals = _steady_micro(sc, fold)
    if result is None:
        budget.check(sc, fold, repeat=False)  # (every step is simulated after all)
        result = simulate(job.program, *job.args, mesh=job.mesh, cluster=sc.cluster_spec(), mode=job.mode,
                          cost_dtype=sc.model.dtype, fold=job.fold, faults=faults, events=trace)
    verdict = job.check(result.results) if result.hang is None else {
        "mode": job.mode, "status": f"not applicable: the run hung (rank {result.hang.rank} failed)"}
    rep = _report.build(sc, result, parameters=job.parameters, flops=job.flops, tokens=job.tokens,
                        verdict=verdict, steps=job.steps, totals=totals)
    if faults is not None:
        rep["faults"] = {"injected": faults.describe(), "hang": None if result.hang is None else result.hang.as_dict()}
    if sc.goodput.interruptions_per_gpu_hour is not None:
        rep["goodput"] = goodput.account(sc.goodput, step_s=rep["step_time_ns"] * 1e-9, gpus=sc.world_size,
                                         parameters=job.parameters, dtype=sc.model.dtype)
    if aims:
        rep["target"] = critical_batch.account(sc.target, step_s=rep["step_time_ns"] * 1e-9, tokens_per_step=job.tokens,
                                      gpus=sc.world_size)
    return Outcome(sc, result, rep | checkpoints(sc, job, result.results) | _experts(sc, job, result))


def _experts(sc: Scenario, job: Job, result: RunResult) -> dict[str, Any]:
    """The report's `experts` entry (report/experts.py) for a model with a mixture of experts."""
    if sc.run.program != "transformer" or not sc.model.moe_experts or result.hang is not None:
        return {}
    counts = None if job.mode == "meta" else router_statistics(result.results)  # (meta: stated, no counts)
    return experts.account(job.args[0].model, sc.run.steps - 1, counts, sc.model.global_batch)


def _aims(sc: Scenario) -> bool:
    """Whether the scenario has a [target] (report/critical_batch.py), checked."""
    t = sc.target
    if t.b_noise_tokens is None and t.e_min_tokens is None:
        return False
    if not (t.b_noise_tokens and t.e_min_tokens) or sc.run.program != "transformer":
        raise ScenarioError("[target] needs both target.b_noise_tokens and target.e_min_tokens above 0, and "
                            "run.program = 'transformer'")
    return True


def _repeats(sc: Scenario, faults: Faults | None) -> bool:
    """Whether a run may simulate its identical steps once (steady.py): meta mode, more steps than
    that costs, no fault (a fault from a time breaks the repetition)."""
    return (sc.run.numerics == "meta" and sc.run.program == "transformer" and faults is None
            and sc.run.steps > steady.SIMULATED + 2)


def _steady(sc: Scenario, fold: bool) -> tuple[RunResult | None, Totals | None]:
    """Steps 1-2 and 1-3 simulated (each with its pipeline rounds simulated twice where they repeat:
    `_as_is`); when the third step repeats the second, the run's totals over all its steps, and the
    3-step result (whose trace is what views draw). (None, None) when it does not."""
    runs = [_as_is(replace(sc, run=replace(sc.run, steps=steps)), fold)
            for steps in (steady.SIMULATED - 1, steady.SIMULATED)]
    (two, two_totals), (three, three_totals) = runs
    if steady.period(two.trace, three.trace) is None:
        return None, None
    more = sc.run.steps - steady.SIMULATED
    return (replace(three, repeated=(more, three_totals.end - two_totals.end)),
            three_totals.extended(two_totals, more))


def _as_is(sc: Scenario, fold: bool) -> tuple[RunResult, Totals]:
    """A meta-mode run of `sc` and its totals: its pipeline rounds simulated twice where they repeat
    (pipeline_steady.py), else every micro-batch."""
    result, totals = _steady_micro(sc, fold) if _rounds(sc, None) else (None, None)
    if result is not None and totals is not None:
        return result, totals
    job = job_of(sc, fold=fold)
    result = simulate(job.program, *job.args, mesh=job.mesh, cluster=sc.cluster_spec(), mode=job.mode,
                      cost_dtype=sc.model.dtype, fold=job.fold)
    return result, Totals.of(result.trace)


def _rounds(sc: Scenario, faults: Faults | None) -> pipeline_steady.Micro | None:
    """The micro-batch counts a meta-mode pipeline run may simulate instead of all of them
    (pipeline_steady.py); None where it may not (a fault, a checkpoint, or nothing to gain)."""
    r = sc.run
    if r.numerics != "meta" or r.program != "transformer" or faults is not None or r.save_checkpoint \
            or r.resume:
        return None
    return pipeline_steady.micro_counts(sc.model, sc.parallel)


def _steady_micro(sc: Scenario, fold: bool) -> tuple[RunResult | None, Totals | None]:
    """Runs of m0 and m0 + u micro-batches a step (and m0 + 2u, ... while the last one's new rounds do
    not repeat those before and the runs stay cheap); when they do, the totals of all m and the last
    run (what views draw). (None, None) when they do not."""
    micro = _rounds(sc, None)
    assert micro is not None
    d, b = sc.parallel.dp, sc.model.micro_batch
    counts, runs = list(micro.counts), []
    with gc_paused():  # (one pause over the short runs and their comparison: engine/gcpause.py)
        while True:
            for m in counts[len(runs):]:
                job = job_of(replace(sc, model=replace(sc.model, global_batch=d * b * m)), fold=fold)
                runs.append(simulate(job.program, *job.args, mesh=job.mesh, cluster=sc.cluster_spec(),
                                     mode=job.mode, cost_dtype=sc.model.dtype, fold=job.fold))
            p = steady.grown(runs[-2].trace, runs[-1].trace, sc.run.steps)
            if p is not None:
                before, last = Totals.of(runs[-2].trace), Totals.of(runs[-1].trace)
                return replace(runs[-1], micro=(counts[-1], micro.m, p)), last.extended(before, micro.more(counts[-1]))
            if len(counts) == 2 + pipeline_steady.MOVES or not micro.affordable(counts + [counts[-1] + micro.unit]):
                return None, None
            counts.append(counts[-1] + micro.unit)


def checkpoints(sc: Scenario, job: Job, results: list[Any]) -> dict[str, Any]:
    """The report's `checkpoint` entry: where the run resumed, and the checkpoint it saved (its manifest
    written now that every rank has written its file)."""
    ck = checkpoint.of(sc)
    if ck is None:
        return {}
    out: dict[str, Any] = {}
    if ck.resume:
        out["resumed"] = {"from": ck.resume, "step": checkpoint.start_step(sc)}
    if ck.save:
        out |= checkpoint.commit(sc, [r["checkpoint"] for r in results], dict(job.mesh.sizes),
                                 job.args[0].model.parameter_shapes())
    return {"checkpoint": out}
