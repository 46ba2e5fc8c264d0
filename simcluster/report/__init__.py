"""The report of a run: plain data (JSON-ready) derived from the trace and the verification.

Renderers (viz/) and `--json` read this; nothing here prints.
"""

from __future__ import annotations

import json

from typing import Any, Callable

import numpy as np

from simcluster.config.scenario import Scenario
from simcluster.engine import RunResult
from simcluster.engine.fold import Fold
from simcluster.engine.totals import KINDS, Totals
from simcluster.report.schema import REPORT_VERSION


def communication(totals: Totals) -> list[dict[str, Any]]:
    """Per (group axis, collective): calls, bytes sent and time, per rank (the busiest rank)."""
    rows = []
    for (group, kind), ranks in sorted(totals.comm.items()):
        rows.append({"group": group, "collective": kind,
                     "calls_per_rank": max(v[0] for v in ranks.values()),
                     "bytes_per_rank": max(v[1] for v in ranks.values()),
                     "time_ns_per_rank": max(v[2] for v in ranks.values())})
    return rows


def idle_fraction(totals: Totals, fold: Fold | None = None) -> float:
    """Mean over ranks of the compute stream's idle share of the run: the bubbles, whatever made them."""
    end = totals.end
    if not end:
        return 0.0
    busy_compute = dict(totals.compute)
    if fold is not None:
        busy_compute = fold.by_rank(busy_compute)
    return sum(1 - ns / end for ns in busy_compute.values()) / len(busy_compute)


def overlap(totals: Totals, fold: Fold | None = None) -> dict[str, Any]:
    """Per rank, the time some communication runs and how much of it runs under computation (HTA's
    comm/comp overlap is hidden / communication); `hidden_fraction`: the same summed over ranks."""
    per = totals.overlap if fold is None else fold.by_rank(totals.overlap)
    comm, hidden = sum(v[0] for v in per.values()), sum(v[1] for v in per.values())
    return {"hidden_fraction": round(hidden / comm, 6) if comm else 0.0,
            "per_rank": {str(r): {"communication_ns": v[0], "hidden_ns": v[1]} for r, v in sorted(per.items())}}


def busy(totals: Totals, fold: Fold | None = None) -> dict[str, dict[str, int]]:
    per = {r: dict(streams) for r, streams in totals.busy.items()}  # (ranks in order, streams by first event)
    if fold is not None:
        per = fold.by_rank(per, rename=True)
    return {str(rank): streams for rank, streams in per.items()}


def by_kind(totals: Totals, fold: Fold | None = None) -> dict[str, dict[str, int]]:
    """Per rank, its compute stream's kernel time by kind: GEMMs, fused attention, every other kernel."""
    per = totals.kinds if fold is None else fold.by_rank(totals.kinds)
    return {str(rank): dict(zip(KINDS, ns)) for rank, ns in sorted(per.items())}


def first_mismatches(expected: dict[str, Any], got: dict[str, Any], limit: int = 5) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in list(expected) + [k for k in got if k not in expected]:
        if len(out) >= limit:
            break
        if name not in expected or name not in got:
            out.append({"output": name, "problem": "missing from the reference" if name not in expected
                        else "missing from the parallel run"})
            continue
        a, b = np.asarray(expected[name]), np.asarray(got[name])
        if a.shape != b.shape:
            out.append({"output": name, "problem": f"shape {list(b.shape)} instead of {list(a.shape)}"})
            continue
        if a.tobytes() == b.tobytes():
            continue
        bad = np.argwhere((a != b) | (np.isnan(a) != np.isnan(b)) if a.dtype.kind == "f" else a != b)
        if not len(bad):  # equal values, different bytes (e.g. -0.0 against 0.0)
            bad = np.argwhere(np.signbit(a) != np.signbit(b)) if a.dtype.kind == "f" else bad
        index = [int(i) for i in bad[0]] if len(bad) else []
        out.append({"output": name, "index": index,
                    "expected": float(a[tuple(index)]) if a.ndim else float(a),
                    "got": float(b[tuple(index)]) if b.ndim else float(b),
                    "elements_differing": int(len(bad))})
    return out


def relative_error(a: Any, b: Any) -> float:
    """||a - b|| / ||b|| in float64: 0 when equal, inf when the shapes differ or b is zero and a is not."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    diff = float(np.linalg.norm(a - b))
    norm = float(np.linalg.norm(b))
    return 0.0 if diff == 0 else diff / norm if norm else float("inf")


def verification(mode: str, expected: dict[str, Any], got: dict[str, Any],
                 bounds: Callable[[str], float | None] | None = None) -> dict[str, Any]:
    """Byte equality with the single-device run (exact mode); in fast mode, each output that `bounds`
    names within its bound (relative norm error; numerics/tolerance.py), or without `bounds` the
    largest elementwise error within 1e-4 of the largest value."""
    same = [k for k in expected if k in got and np.asarray(expected[k]).tobytes() == np.asarray(got[k]).tobytes()]
    bit_exact = len(same) == len(expected) == len(got)
    out: dict[str, Any] = {"mode": mode, "reference": "the same program on one device",
                           "outputs_compared": len(expected), "outputs": list(expected),
                           "bit_exact": bit_exact, "mismatches": [] if bit_exact else first_mismatches(expected, got)}
    if mode != "fast":
        out["passed"] = bit_exact
        return out
    out["max_relative_error"] = max((float(np.max(np.abs(np.asarray(expected[k], np.float64) - np.asarray(got[k], np.float64))
                                     / (np.max(np.abs(np.asarray(expected[k], np.float64))) + 1e-30)))
                                     for k in expected if k in got), default=0.0)
    if bounds is None:
        out["passed"] = out["max_relative_error"] <= 1e-4 and set(expected) == set(got)
        return out
    rows = [(k, relative_error(got[k], expected[k]) if k in got else float("inf"), b)
            for k in expected if (b := bounds(k)) is not None]
    worst = max(rows, key=lambda r: r[1] / r[2], default=None)
    failed = [{"output": k, "relative_error": e, "bound": b} for k, e, b in rows if not e <= b]
    out["tolerance"] = {
        "rule": "relative norm error per tensor within 6 delta sqrt(2R/3) (simcluster/numerics/tolerance.py)",
        "compared": len(rows), "failed": failed[:5], "failing": len(failed),
        "worst": None if worst is None else {"output": worst[0], "relative_error": worst[1], "bound": worst[2]}}
    out["passed"] = not failed and bool(rows) and set(expected) == set(got)
    routed = [k for k in expected if k.startswith("routing[") and k in got and k not in same]
    if routed:  # (a mixture of experts: discrete choices, which no bound on the numbers before them covers)
        out["routing_differs"] = {"outputs": routed[:5], "count": len(routed), "why": ROUTED_APART}
    return out


ROUTED_APART = ("a token went to another expert: where two experts' scores nearly tie, fast mode's other "
                "roundings can choose the other one, and all that follows takes that route, outside the bound; "
                "a mixture of experts verifies bit for bit in exact mode (run.numerics=exact)")


def host_tiers(peaks: dict[int, dict[str, int]], spec: Any) -> dict[str, dict[str, Any]]:
    """What ranks keep in their host's memory ("cpu") and on its NVMe ("nvme"): the largest rank's peak,
    and the largest node's (its ranks' peaks together), against the node's capacity."""
    out = {}
    for tier, capacity in (("cpu", int(spec.host_memory_gbyte * 2**30)), ("nvme", int(spec.nvme_tbyte * 1e12))):
        if not any(tier in v for v in peaks.values()):
            continue
        nodes: dict[int, int] = {}
        for rank, v in peaks.items():
            nodes[int(rank) // spec.gpus_per_node] = nodes.get(int(rank) // spec.gpus_per_node, 0) + v.get(tier, 0)
        node = max(nodes.values())
        out[tier] = {"peak_bytes_per_rank": max(v.get(tier, 0) for v in peaks.values()), "peak_bytes_per_node": node,
                     "capacity_bytes_per_node": capacity, "fits": node <= capacity}
    return out


def step_times(totals: Totals, steps: int) -> tuple[int, int, int | None]:
    """(initialisation, first step, steady step) in ns, as Megatron-LM and torchtitan users read a step
    time: the steady step is the mean of the steps after the first (None for a run of one step), each
    from one optimizer's end to the next's (engine/steps.py), apart from initialisation (weights made
    before the first forward pass) and from the first step, which fills the pipeline and caches: the
    rest of the run, so that a run of one step is its first step, whatever follows its optimizer (a
    ZeRO all-gather of the updated weights) included, and the three add up to `total_time_ns`."""
    init, first_end, last_end = totals.first_pass or 0, totals.first_step_end, totals.last_step_end
    if steps == 1:
        return init, totals.end - init, None
    if first_end is None or last_end is None:  # (steps not told apart: no optimizer marks them)
        mean = (totals.end - init) // steps
        return init, mean, mean
    return init, totals.end - init - (last_end - first_end), (last_end - first_end) // (steps - 1)


def build(scenario: Scenario, result: RunResult, *, parameters: int, flops: tuple[float, float], tokens: int,
          verdict: dict[str, Any], steps: int | None = None, totals: Totals | None = None) -> dict[str, Any]:
    """`flops`: (model FLOPs by the full-square convention, hardware FLOPs, model FLOPs by the causal
    convention) of the whole run (model/flops.py); `tokens`: per step;
    `steps`: the steps run, when not run.steps (a resumed run); `totals`: the trace's sums, when not
    the trace's own (a run whose identical steps were simulated once: steady.py)."""
    spec = result.cluster.spec
    if steps is None:
        steps = scenario.run.steps if scenario.run.program in ("mlp", "transformer") else 1
    totals = totals or Totals.of(result.trace)
    makespan, fold, world = totals.end, result.fold, result.mesh.world_size
    peak = (spec.peak_tflops if scenario.model.dtype in ("bf16", "fp16") else spec.peak_tflops_fp32) * 1e12
    init, first, steady = step_times(totals, steps)
    step = steady if steady is not None else first
    seconds = step * 1e-9  # (a step's: rates and MFU are per steady step, as Megatron-LM's and torchtitan's)
    peaks = result.trace.memory_peaks()
    if fold is not None:
        peaks = fold.by_rank(peaks)
    capacity = int(spec.memory_gbyte * 2**30)
    highest = max((v["total"] for v in peaks.values()), default=0)
    memory = {"capacity_bytes": capacity, "peak_bytes": highest, "fits": highest <= capacity,
              "ranks_over": sum(1 for v in peaks.values() if v["total"] > capacity)}
    host = host_tiers(peaks, spec)
    if host:
        memory["host"] = host
    return {
        "report_version": REPORT_VERSION,
        "scenario": scenario.as_dict(),
        "world_size": world,
        "mesh": dict(result.mesh.sizes),
        "cluster": spec.as_dict(),
        "parameters": parameters,
        "steps": steps,
        "step_time_ns": step,
        "steady_step_ns": steady,
        "first_step_ns": first,
        "init_ns": init,
        "total_time_ns": makespan,
        "tokens_per_s": round(tokens / seconds, 3) if step else 0.0,
        "model_flops_per_step": flops[0] / steps,
        "hardware_flops_per_step": flops[1] / steps,
        "model_flops_causal_per_step": flops[2] / steps,
        "mfu": round(flops[0] / steps / (seconds * world * peak), 6) if step else 0.0,
        "mfu_causal": round(flops[2] / steps / (seconds * world * peak), 6) if step else 0.0,
        "hfu": round(flops[1] / steps / (seconds * world * peak), 6) if step else 0.0,
        "tflops_per_gpu": round(flops[1] / steps / (seconds * world) / 1e12, 3) if step else 0.0,
        "compute_idle_fraction": round(idle_fraction(totals, fold), 6),
        "busy_ns": busy(totals, fold),
        "compute_ns_by_kind": by_kind(totals, fold),
        "communication_overlap": overlap(totals, fold),
        "communication": communication(totals),
        "memory_peak_bytes": {str(r): v for r, v in sorted(peaks.items())},
        "memory": memory,
        "trace_events": totals.events * (fold.copies if fold else 1),
        "verification": verdict,
    } | ({"layer": result.layer} if result.layer else {})


def ordered(value: Any) -> Any:
    """`value` with every mapping's keys in order, ranks by number ("2" before "10"), names by name."""
    if isinstance(value, dict):
        return {k: ordered(value[k]) for k in sorted(value, key=lambda k: (0, int(k), "") if str(k).isdigit()
                                                     else (1, 0, str(k)))}
    if isinstance(value, list):
        return [ordered(v) for v in value]
    return value


def document(data: Any) -> str:
    """What --json prints: one document, keys in order (ranks by number), the same bytes every run."""
    return json.dumps(ordered(data), indent=2)
