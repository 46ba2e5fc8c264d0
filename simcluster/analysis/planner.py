"""`simcluster plan`: the layouts of one model on one cluster, best first.

Two stages, as an engineer would search:
1. Every combination of TP (inside a node, sequence-parallel unless `--fix sp=0`), PP (1F1B,
   interleaved over two virtual stages, ZB-H1 or ZB-V), CP, DP, ZeRO stage, micro-batch size and
   recomputation that the plan's checks accept is estimated in closed form (estimate.py: memory per
   GPU and step time). Layouts whose estimate exceeds the device by more than `MARGIN` are dropped;
   the rest are ranked by estimated time.
2. The best few distinct layouts (each with its best-estimated ZeRO stage, micro-batch and
   recomputation) are simulated (meta mode, folded; refused up front, with the budget's estimate, where
   they could not finish here) and reported by simulated step time, with MFU,
   peak memory and what bounds them; a simulated peak over the device is marked, as in `run`.
The estimate only chooses what to simulate: every figure in the table is the simulator's.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator

from simcluster.analysis.estimate import BUBBLE, Estimate, Layout, estimate
from simcluster.analysis.workers import in_order
from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.model.config import Recompute, takes_per_op
from simcluster.numerics.divisors import divisors
from simcluster.parallel.parallelism import DISPATCHERS
from simcluster.run import budget
from simcluster.run.runner import run_scenario
from simcluster.topology.presets import PRESETS

MARGIN = 1.1  # an estimate may be this far over the device and still be simulated (the simulator decides)
MICRO_BATCHES = (1, 2, 4, 8, 16)
RECOMPUTE = ("none", "selective", "full")  # and, for a Llama that can take it, torchtitan's per-op "op"


@dataclass(frozen=True)
class Row:
    layout: Layout
    estimate: Estimate
    report: dict[str, Any]  # the simulation's (runner.run_scenario, meta mode)


@dataclass(frozen=True)
class Search:
    examined: int  # combinations of degrees and options
    valid: int  # that the plan's checks accept
    fitting: int  # whose estimate fits the device (within MARGIN)
    estimate_seconds: float  # wall time of stage 1
    rows: tuple[Row, ...]  # simulated, best first

    @property
    def per_minute(self) -> float:
        """Layouts examined per minute of stage 1 (estimation)."""
        return 60.0 * self.examined / max(self.estimate_seconds, 1e-9)


def _divisors(n: int) -> list[int]:
    return divisors(n)


FIELDS = {f.name: int if f.type == "int" else str for f in fields(Layout)}  # what --fix may name, and its type


def parse_fixed(items: list[str]) -> dict[str, tuple[Any, ...]]:
    """`--fix` arguments (`pp=1`, `zero=0,1`, `recompute=full`) as allowed values by layout field."""
    fixed: dict[str, tuple[Any, ...]] = {}
    for item in items:
        name, eq, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not eq or name not in FIELDS or not values.strip():
            raise ScenarioError(f"--fix {item!r}: expected FIELD=VALUE[,VALUE...] with FIELD one of "
                                f"{', '.join(FIELDS)}")
        try:
            fixed[name] = tuple(FIELDS[name](v.strip()) for v in values.split(","))
        except ValueError:
            raise ScenarioError(f"--fix {item!r}: {name} takes {FIELDS[name].__name__} values") from None
        if name == "sp" and not set(fixed[name]) <= {0, 1}:
            raise ScenarioError(f"--fix {item!r}: sp is 1 (sequence parallelism with tp) or 0 (without)")
        policies = [r.value for r in Recompute]
        if name == "recompute" and not set(fixed[name]) <= set(policies):
            raise ScenarioError(f"--fix {item!r}: recompute is one of {', '.join(policies)}")
    return fixed


def layouts(sc: Scenario, fixed: dict[str, tuple[Any, ...]] | None = None) -> Iterator[Layout]:
    """Every combination the search considers (not all valid: `estimate` checks), or those whose
    fields take the `fixed` values. With tp, sequence parallelism is on (it saves memory and the
    replicated elementwise work at no cost in communication) unless `fixed` names sp; the interleaved
    schedule runs two chunks a stage unless `fixed` names other virtual counts."""
    if fixed:
        if "recompute" in fixed and not set(fixed["recompute"]) & set(recomputes(sc.model)):
            raise ScenarioError(f"--fix recompute={','.join(fixed['recompute'])}: this model takes "
                                f"{', '.join(recomputes(sc.model))} (op, torchtitan's per-op policy, is a Llama's "
                                f"with flash attention and no experts)")
        sps = tuple(sorted(set(fixed.get("sp", (1,))), reverse=True))
        virtual = tuple(sorted({v for v in fixed.get("virtual", (2,)) if v > 1})) or (2,)
        yield from (lay for lay in _every(sc, sps, virtual)
                    if all(getattr(lay, f) in vs for f, vs in fixed.items()))
        return
    yield from _every(sc, (1,), (2,))


def recomputes(model: Any) -> tuple[str, ...]:
    """The recomputation policies a model can take: torchtitan's per-op one is its Llama's (flash
    attention, no experts; model/config.py)."""
    return RECOMPUTE + (("op",) if takes_per_op(model.arch, model.attention_kernel, model.moe_experts) else ())


def _every(sc: Scenario, sps: tuple[int, ...], chunks: tuple[int, ...]) -> Iterator[Layout]:
    gpn = sc.cluster.gpus_per_node
    policies = recomputes(sc.model)
    world = sc.cluster.nodes * gpn
    for tp in _divisors(gpn):
        for pp in _divisors(world // tp):
            if pp > sc.model.layers:
                continue
            for cp in [c for c in _divisors(world // (tp * pp)) if c <= 8]:
                dp = world // (tp * pp * cp)
                for ep in _divisors(math.gcd(dp, sc.model.moe_experts)) if sc.model.moe_experts else (1,):
                    for dispatcher in DISPATCHERS if ep > 1 else DISPATCHERS[:1]:
                        yield from _variants(tp, pp, cp, dp, ep, dispatcher, sps, chunks, policies)


def _variants(tp: int, pp: int, cp: int, dp: int, ep: int, dispatcher: str, sps: tuple[int, ...],
              chunks: tuple[int, ...], policies: tuple[str, ...] = RECOMPUTE) -> Iterator[Layout]:
    """A layout's degrees with each ZeRO stage, micro-batch, recomputation, schedule and sp."""
    schedules = [("1f1b", 1)] if pp == 1 else [(s, v) for s in BUBBLE for v in (chunks if s == "interleaved" else (1,))]
    for zero in ((0, 1, 2, 3) if pp == 1 else (0, 1)):  # (pipelines pair with ZeRO-1, as Megatron)
        for mb in MICRO_BATCHES:
            for recompute in policies:
                for schedule, virtual in schedules:
                    for sp in (sps if tp > 1 else sps[:1]):  # (tp 1: no sp either way)
                        yield Layout(tp, pp, cp, dp, zero, mb, recompute, schedule, virtual, sp, ep, dispatcher)


def bottleneck(report: dict[str, Any]) -> str:
    """What bounds a simulated step: compute, a communication stream, or the pipeline's bubble."""
    if report["compute_idle_fraction"] < 0.15:
        return "compute"
    total = max(report["total_time_ns"], 1)
    comm: dict[str, int] = {}
    for lanes in report["busy_ns"].values():
        for stream, ns in lanes.items():
            if stream != "compute":
                comm[stream] = max(comm.get(stream, 0), ns)
    stream, ns = max(comm.items(), key=lambda kv: (kv[1], kv[0]), default=("", 0))
    if ns > 0.5 * report["compute_idle_fraction"] * total:
        return f"{stream} {100 * ns / total:.0f} %"
    return "pp bubble" if report["mesh"]["pp"] > 1 else "waits"


def search(sc: Scenario, *, simulate: int = 8, on_simulate: Callable[[int, int, Layout], None] | None = None,
           fold: bool = True, fixed: dict[str, tuple[Any, ...]] | None = None, jobs: int = 1,
           ray: str | None = None) -> Search:
    """Estimate every layout (those with the `fixed` values), simulate the `simulate` best that fit,
    best first; `jobs` simulations at a time, each in a process of its own, or as tasks on a Ray cluster
    (`ray`: workers.py): the same rows, in the same order, however they run."""
    if sc.run.program != "transformer":
        raise ScenarioError(f"plan searches layouts of a model: run.program = 'transformer', not {sc.run.program!r}")
    base = replace(sc, run=replace(sc.run, numerics="meta", verify=False, steps=1))
    start = time.perf_counter()
    examined, estimates = 0, []
    for layout in layouts(base, fixed):
        examined += 1
        e = estimate(base, layout)
        if e is not None:
            estimates.append(e)
    capacity = _capacity(base)
    fitting = sorted((e for e in estimates if e.memory_bytes <= MARGIN * capacity),
                     key=lambda e: (e.seconds, e.memory_bytes, e.layout.label(), e.layout.zero,
                                    e.layout.micro_batch, e.layout.recompute))
    stage1 = time.perf_counter() - start
    chosen = distinct_first(fitting, simulate)
    scenarios = [e.layout.scenario(base) for e in chosen]
    _afford(scenarios, chosen, fold, jobs if ray is None else len(scenarios))  # (Ray's cluster: any width)
    announce = None if on_simulate is None else lambda i: on_simulate(i, len(chosen), chosen[i].layout)
    reports = _simulated(scenarios, fold, jobs, announce, ray)
    rows = [Row(e.layout, e, r) for e, r in zip(chosen, reports)]
    rows.sort(key=lambda r: (not r.report["memory"]["fits"], r.report["step_time_ns"], r.layout.label()))
    return Search(examined, len(estimates), len(fitting), stage1, tuple(rows))


def distinct_first(ranked: list[Estimate], k: int) -> list[Estimate]:
    """The `k` to simulate: the best-estimated variant (ZeRO stage, micro-batch, recomputation) of each
    of the best distinct layouts (degrees and schedule), best first; where there are fewer than `k`
    layouts, the next variants in order (a search fixed to one layout shows its variants)."""
    best: dict[str, Estimate] = {}  # the first (best) of each layout, in rank order
    for e in ranked:
        best.setdefault(e.layout.label(), e)
    first = list(best.values())[:k]
    taken = {id(e) for e in first}
    return first + [e for e in ranked if id(e) not in taken][:k - len(first)]


def _afford(scenarios: list[Scenario], chosen: list[Estimate], fold: bool, jobs: int) -> None:
    """Refuse, before any starts, simulations that cannot finish here: one the budget refuses alone
    (budget.check), or all of them together past the budget's limit at `jobs` at a time (the bound of
    each by budget.meta_seconds: a lower bound, so a refusal is certain)."""
    for one, e in zip(scenarios, chosen):
        try:
            budget.check(one, fold)
        except ScenarioError as exc:
            raise ScenarioError(f"plan: simulating {e.layout.label()}: {exc}; fix some degrees with --fix or "
                                f"simulate fewer with --simulate") from None
    seconds = sum(budget.meta_seconds(one, fold) for one in scenarios) / max(1, min(jobs, len(scenarios)))
    if seconds > budget.LIMIT_S:
        raise ScenarioError(f"plan: simulating the {len(scenarios)} best layouts would take at least "
                            f"{budget.duration(seconds)} here ({jobs} at a time; the limit is "
                            f"{budget.duration(budget.LIMIT_S)}): simulate fewer with --simulate, or fix some "
                            f"degrees with --fix")


def _report(sc: Scenario, fold: bool) -> dict[str, Any]:
    return run_scenario(sc, fold=fold, trace=False).report


def _simulated(scenarios: list[Scenario], fold: bool, jobs: int, announce: Callable[[int], None] | None,
               ray: str | None = None) -> list[dict[str, Any]]:
    """Each scenario's report: one after the other, `jobs` worker processes at a time, or as Ray tasks
    (workers.py; taken in order: `announce(i)` as the i-th is waited for)."""
    return in_order(_report, scenarios, fold, jobs=jobs, ray=ray, announce=announce)


def _capacity(sc: Scenario) -> float:
    """The device's memory in bytes (as report/ counts it), whatever the scenario's degrees."""
    c = sc.cluster
    figure = c.memory_gbyte
    return (figure if figure is not None else PRESETS[c.preset].memory_gbyte) * 2**30
