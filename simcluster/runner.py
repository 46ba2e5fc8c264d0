"""Run a scenario: build the mesh and cluster, run its program, verify it, and report."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from simcluster import report as _report
from simcluster.engine import RunResult, simulate
from simcluster.model.flops import step_flops
from simcluster.model.gpt import GPTConfig
from simcluster.parallel.allreduce_decomposed import allreduce_decomposed
from simcluster.parallel.collectives_demo import collectives_demo
from simcluster.parallel.data_parallel import DPConfig, reference
from simcluster.parallel.composed import assemble as assemble_composed
from simcluster.parallel.composed import composed
from simcluster.parallel.plan import Plan
from simcluster.parallel.tp_dp_mlp import MLPConfig, assemble, train_mlp
from simcluster.program.mesh import DeviceMesh
from simcluster.scenario import Scenario, ScenarioError
from simcluster.topology.presets import preset


WEIGHT_DECAY = {"gpt": 0.01, "llama": 0.1}  # Megatron-LM's default; the Llama 3 paper's


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    result: RunResult
    report: dict[str, Any]
    variants: tuple[tuple[str, "Outcome"], ...] = ()


def run_all(sc: Scenario, on_variant: Any = None, *, fold: bool = True) -> Outcome:
    """The scenario, or each of its [compare] variants (the first variant's run stands for the whole).
    `on_variant(i, n, label)` is told before each variant runs (for a progress display). `fold`: see
    run_scenario."""
    if not sc.variants:
        return run_scenario(sc, fold=fold)
    outcomes = []
    for i, (label, v) in enumerate(sc.variants):
        if on_variant is not None:
            on_variant(i, len(sc.variants), label)
        outcomes.append((label, run_scenario(v, fold=fold)))
    outcomes = tuple(outcomes)
    first = outcomes[0][1]
    report = {"scenario": sc.as_dict(), "variants": [dict(o.report, variant=label) for label, o in outcomes]}
    return Outcome(sc, first.result, report, outcomes)


def _mlp(sc: Scenario, mesh: DeviceMesh) -> tuple[MLPConfig, int, float]:
    for axis in ("pp", "cp"):
        if sc.parallel[axis] != 1:
            raise ScenarioError(f"run.program = 'mlp' uses dp and tp only; parallel.{axis}={sc.parallel[axis]} "
                                f"needs a program that has that axis")
    m, r = sc.model, sc.run
    with _as_scenario_error():
        cfg = MLPConfig(hidden=m["hidden"], ffn_hidden=m["ffn_hidden"], tokens=m["global_batch"] * m["seq"],
                        steps=r["steps"], lr=r["lr"], seed=r["seed"])
        cfg.check_mesh(mesh.sizes["dp"], mesh.sizes["tp"])
    return cfg, cfg.parameters, 6.0 * cfg.parameters * cfg.tokens * cfg.steps


@contextmanager
def _as_scenario_error() -> Iterator[None]:
    """A configuration the programs reject is the user's mistake: one line, no traceback."""
    try:
        yield
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None


def plan_of(sc: Scenario, mesh: DeviceMesh) -> Plan:
    """The scenario's GPT/Llama layout on `mesh`, checked (a ScenarioError says what is impossible)."""
    m, p, r = sc.model, sc.parallel, sc.run
    dp = mesh.sizes["dp"]
    micro = m["micro_batch"]
    with _as_scenario_error():
        model = GPTConfig(layers=m["layers"], hidden=m["hidden"], heads=m["heads"], ffn_hidden=m["ffn_hidden"],
                          seq=m["seq"], vocab=m["vocab"], causal=m["causal"], arch=m["arch"], kv_heads=m["kv_heads"],
                          attention_kernel=m["attention_kernel"], fused_kernels=m["fused_kernels"],
                          tied_head=m["arch"] == "gpt" if m["tied_head"] is None else m["tied_head"],
                          dropout=m["dropout"], seed=r["seed"], recompute=p["recompute"], dtype=m["dtype"])
        per_rank, rest = divmod(m["global_batch"], dp)
        if rest:
            raise ValueError(f"model.global_batch={m['global_batch']} must be divisible by parallel.dp={dp}")
        if micro is not None and per_rank % micro:
            raise ValueError(f"model.micro_batch={micro} must divide each rank's {per_rank} sequences "
                             f"(global_batch {m['global_batch']} / dp {dp})")
        cfg = DPConfig(model=model, global_batch=m["global_batch"], micro_batches=per_rank // (micro or per_rank),
                       steps=r["steps"], lr=r["lr"], weight_decay=WEIGHT_DECAY[m["arch"]] if r["weight_decay"] is None else r["weight_decay"], clip_grad=r["clip_grad"] or None,
                       precision=m["dtype"], zero=p["zero"], prefetch=p["prefetch"],
                       overlap_grad_reduce=p["overlap_grad_reduce"])
        if p["schedule"] == "interleaved" and p["pp"] > 1 and cfg.micro_batches % p["pp"]:
            raise ValueError(f"the interleaved schedule needs each rank's micro-batch count ({cfg.micro_batches}) "
                             f"to be a multiple of pp={p['pp']}: set model.micro_batch so that global_batch / dp / "
                             f"micro_batch is a multiple of {p['pp']}")
        plan = Plan(data=cfg, sp=p["sp"], attention=p["attention"], schedule=p["schedule"],
                    virtual=p["virtual_stages"], zero_over=p["zero_over"])
        plan.check(**{a: mesh.sizes[a] for a in ("dp", "pp", "cp", "tp")})
    return plan


def run_scenario(sc: Scenario, *, fold: bool = True) -> Outcome:
    """Run one scenario. `fold`: in meta mode, let one rank stand for its identical peers (data-parallel
    replicas, tensor-parallel peers; engine/fold.py): the same trace and report, at a fraction of the cost."""
    spec = sc.cluster_spec()
    mesh = DeviceMesh(**{a: sc.parallel[a] for a in ("dp", "pp", "cp", "tp")})
    mode, dtype = sc.run["numerics"], sc.model["dtype"]
    if sc.run["program"] == "gpt":
        plan = plan_of(sc, mesh)
        cfg = plan.data
        coords = [mesh.coords(r) for r in range(mesh.world_size)]
        alike = plan.alike(mesh.sizes["tp"]) if fold and mode == "meta" else ()
        result = simulate(composed, plan, mesh=mesh, cluster=spec, mode=mode, cost_dtype=dtype, fold=alike)
        assembled = (lambda: assemble_composed(result.results, coords, plan))
        parameters = cfg.model.parameters
        tokens = cfg.global_batch * cfg.model.seq
        flops = tuple(f * cfg.steps for f in step_flops(cfg.model, tokens))
        if not sc.run["verify"]:
            verdict: dict[str, Any] = {"mode": mode, "status": "not requested (run.verify = false)"}
        elif mode == "meta":
            verdict = {"mode": mode, "status": "not applicable: meta mode carries no numbers"}
        else:
            verdict = _report.verification(mode, reference(cfg, mode), assembled())
    elif sc.run["program"] == "mlp":
        cfg, parameters, model_flops = _mlp(sc, mesh)
        flops, tokens = (model_flops, model_flops), cfg.tokens
        result = simulate(train_mlp, cfg, mesh=mesh, cluster=spec, mode=mode, cost_dtype=dtype)
        if not sc.run["verify"]:
            verdict = {"mode": mode, "status": "not requested (run.verify = false)"}
        elif mode == "meta":
            verdict = {"mode": mode, "status": "not applicable: meta mode carries no numbers"}
        else:
            one = DeviceMesh()
            ref = simulate(train_mlp, cfg, mesh=one, cluster=preset(spec.preset, nodes=1, gpus_per_node=1),
                           mode=mode, cost_dtype=dtype)
            expected = assemble(ref.results, [one.coords(0)])
            got = assemble(result.results, [mesh.coords(r) for r in range(mesh.world_size)])
            verdict = _report.verification(mode, expected, got)
    elif sc.run["program"] == "allreduce":
        elements = sc.model["global_batch"] * sc.model["seq"] * sc.model["hidden"]
        result = simulate(allreduce_decomposed, elements, sc.run["seed"], mesh=mesh, cluster=spec, mode=mode,
                          cost_dtype=dtype)
        parameters, flops, tokens = 0, (0.0, 0.0), 0
        if mode == "meta":
            verdict = {"mode": mode, "status": "not applicable: meta mode carries no numbers"}
        else:
            def limbs(x: Any) -> Any:
                return x.limbs if hasattr(x, "limbs") else x
            expected = {f"rank{r}": limbs(res["all_reduce"]) for r, res in enumerate(result.results)}
            got = {f"rank{r}": limbs(res["reduce_scatter+all_gather"]) for r, res in enumerate(result.results)}
            verdict = _report.verification(mode, expected, got)
            verdict["reference"] = "the all-reduce's result"
    else:
        result = simulate(collectives_demo, sc.run["seed"], mesh=mesh, cluster=spec, mode=mode, cost_dtype=dtype)
        parameters, flops, tokens = 0, (0.0, 0.0), 0
        verdict = {"mode": mode, "status": "not applicable: the collectives program has no single-device form "
                                           "(its results are checked against their definitions by the test suite)"}
    rep = _report.build(sc, result, parameters=parameters, flops=flops, tokens=tokens, verdict=verdict)
    return Outcome(sc, result, rep)
