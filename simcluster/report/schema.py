"""The JSON report's schema (draft 2020-12): what `simcluster run --json` prints, versioned. A reader
checks `report_version`; a field's meaning changes only with a new version (1: the step time as the
steady step, the first step and initialisation apart). docs/report.schema.json is a copy a test keeps
current, and the test validates the report of every library scenario against it."""

from __future__ import annotations

from typing import Any

from simcluster.config.json_schema import DIALECT, scenario_schema

REPORT_VERSION = 1

INT, NUMBER, BOOL, STRING = ({"type": "integer"}, {"type": "number"}, {"type": "boolean"}, {"type": "string"})
NS = {"type": "integer", "minimum": 0, "description": "nanoseconds of simulated time"}


def _by_rank(value: dict[str, Any], what: str) -> dict[str, Any]:
    """A mapping from each rank (its number, as a string; in numeric order) to `value`."""
    return {"type": "object", "description": f"{what}, by rank", "propertyNames": {"pattern": "^[0-9]+$"},
            "additionalProperties": value}


def _object(properties: dict[str, Any], description: str, required: bool = True) -> dict[str, Any]:
    return {"type": "object", "description": description, "properties": properties,
            **({"required": sorted(properties)} if required else {})}


def _nullable(table: dict[str, Any]) -> dict[str, Any]:
    """A scenario table's schema, each key also null (unset: the report writes what a scenario leaves out)."""
    if table.get("type") != "object":
        return table
    return {**table, "properties": {k: {**v, "type": [v["type"], "null"],
                                        **({"enum": [*v["enum"], None]} if "enum" in v else {})}
                                    for k, v in table["properties"].items()}}


def report_schema() -> dict[str, Any]:
    scenario = scenario_schema()
    memory = _object({"capacity_bytes": INT, "peak_bytes": INT, "fits": BOOL, "ranks_over": INT},
                     "the largest rank's peak against its device's memory (bytes)")
    verification = {"type": "object", "description": "the verdict against one device", "required": ["mode"],
                    "properties": {"mode": {"enum": ["exact", "fast", "meta"]}, "passed": BOOL, "bit_exact": BOOL,
                                   "outputs_compared": INT, "status": STRING}}
    timing = {
        "steps": {"type": "integer", "minimum": 1, "description": "training steps run"},
        "step_time_ns": {**NS, "description": "the steady step, or a one-step run's only step (ns)"},
        "steady_step_ns": {"type": ["integer", "null"], "minimum": 0,
                           "description": "the mean of the steps after the first (null for one step)"},
        "first_step_ns": {**NS, "description": "the first step, what follows its optimizer included"},
        "init_ns": {**NS, "description": "initialisation: before the first forward pass"},
        "total_time_ns": {**NS, "description": "the whole run: initialisation, the first step and the rest"},
    }
    rates = {"tokens_per_s": NUMBER, "mfu": NUMBER, "hfu": NUMBER, "tflops_per_gpu": NUMBER,
             "model_flops_per_step": NUMBER, "hardware_flops_per_step": NUMBER, "compute_idle_fraction": NUMBER,
             "mfu_causal": NUMBER, "model_flops_causal_per_step": NUMBER}
    properties = {
        "report_version": {"const": REPORT_VERSION},
        "scenario": {"type": "object", "description": "the scenario run (a key left unset: null)",
                     "additionalProperties": False, "required": ["name", "model", "cluster", "parallel", "run"],
                     "properties": {k: _nullable(v) for k, v in scenario["properties"].items()
                                    if k not in ("compare", "at_scale")}},
        "world_size": {"type": "integer", "minimum": 1}, "parameters": INT,
        "mesh": _object({a: {"type": "integer", "minimum": 1} for a in ("dp", "pp", "cp", "tp")}, "the mesh's degrees"),
        "cluster": {"type": "object", "description": "the cluster's figures, as the run used them"},
        **timing, **rates,
        "busy_ns": _by_rank({"type": "object", "additionalProperties": NS}, "busy time per stream (ns)"),
        "compute_ns_by_kind": _by_rank(
            _object({"gemm": NS, "attention": NS, "other": NS},
                    "the compute stream's kernel time by kind: GEMMs (timed by their shape: every matmul and einsum, "
                    "an unfused attention's batched products), the fused attention kernels, every other kernel "
                    "(elementwise, norms, the loss, the optimizer)"),
            "the compute stream's kernel time by kind (ns)"),
        "communication": {"type": "array", "description": "per group and collective"},
        "communication_overlap": {"type": "object"},
        "memory_peak_bytes": _by_rank({"type": "object", "additionalProperties": INT}, "peak bytes per category"),
        "memory": memory, "trace_events": INT, "verification": verification,
    }
    layer = _object({"layer": INT, "tokens_per_expert": {"type": "array", "items": INT},
                     "computed_per_expert": {"type": "array", "items": INT}, "dropped": INT, "imbalance": NUMBER},
                    "one MoE layer: tokens that chose each expert, tokens each computed, the busiest over the mean")
    experts = _object({"routing": STRING, "step": INT, "experts": INT, "top_k": INT,
                       "layers": {"type": "array", "items": layer}},
                      "a mixture of experts' routing in the last step (report/experts.py)")
    passes = {"forward": INT, "backward": INT, "recompute": INT}
    one_layer = _object({"layer": STRING, "forward_ns": NS, "backward_ns": NS, "recompute_ns": NS,
                         "kernels": _object(passes, "kernels launched by each pass")},
                        "rank 0's first transformer layer: each pass's kernels back to back at the cluster's rates, "
                        "no waits (engine/layer.py), to hold beside a profiler's trace of one layer")
    return {"$schema": DIALECT, "title": "simcluster report", "type": "object",
            "description": f"What `simcluster run --json` prints (report_version {REPORT_VERSION}); optional "
                           "sections: faults, goodput, target, checkpoint, experts, layer, torch.",
            "required": sorted(properties), "properties": properties | {"experts": experts, "layer": one_layer}}
