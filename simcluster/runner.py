"""Run a scenario: build the mesh and cluster, run its program, verify it, and report."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simcluster import report as _report
from simcluster.engine import RunResult, simulate
from simcluster.parallel.collectives_demo import collectives_demo
from simcluster.parallel.tp_dp_mlp import MLPConfig, assemble, train_mlp
from simcluster.program.mesh import DeviceMesh
from simcluster.scenario import Scenario, ScenarioError
from simcluster.topology.presets import preset


@dataclass(frozen=True)
class Outcome:
    scenario: Scenario
    result: RunResult
    report: dict[str, Any]


def _mlp(sc: Scenario, mesh: DeviceMesh) -> tuple[MLPConfig, int, float]:
    for axis in ("pp", "cp"):
        if sc.parallel[axis] != 1:
            raise ScenarioError(f"run.program = 'mlp' uses dp and tp only; parallel.{axis}={sc.parallel[axis]} "
                                f"needs a program that has that axis")
    m, r = sc.model, sc.run
    try:
        cfg = MLPConfig(hidden=m["hidden"], ffn_hidden=m["ffn_hidden"], tokens=m["global_batch"] * m["seq"],
                        steps=r["steps"], lr=r["lr"], seed=r["seed"])
        cfg.check_mesh(mesh.sizes["dp"], mesh.sizes["tp"])
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    return cfg, cfg.parameters, 6.0 * cfg.parameters * cfg.tokens * cfg.steps


def run_scenario(sc: Scenario) -> Outcome:
    spec = sc.cluster_spec()
    mesh = DeviceMesh(**sc.parallel)
    mode, dtype = sc.run["numerics"], sc.model["dtype"]
    if sc.run["program"] == "mlp":
        cfg, parameters, model_flops = _mlp(sc, mesh)
        result = simulate(train_mlp, cfg, mesh=mesh, cluster=spec, mode=mode, cost_dtype=dtype)
        if not sc.run["verify"]:
            verdict: dict[str, Any] = {"mode": mode, "status": "not requested (run.verify = false)"}
        elif mode == "meta":
            verdict = {"mode": mode, "status": "not applicable: meta mode carries no numbers"}
        else:
            one = DeviceMesh()
            ref = simulate(train_mlp, cfg, mesh=one, cluster=preset(spec.preset, nodes=1, gpus_per_node=1),
                           mode=mode, cost_dtype=dtype)
            expected = assemble(ref.results, [one.coords(0)])
            got = assemble(result.results, [mesh.coords(r) for r in range(mesh.world_size)])
            verdict = _report.verification(mode, expected, got)
    else:
        result = simulate(collectives_demo, sc.run["seed"], mesh=mesh, cluster=spec, mode=mode, cost_dtype=dtype)
        parameters, model_flops = 0, 0.0
        verdict = {"mode": mode, "status": "not applicable: the collectives program has no single-device form "
                                           "(its results are checked against their definitions by the test suite)"}
    rep = _report.build(sc, result, parameters=parameters, model_flops=model_flops, verdict=verdict)
    return Outcome(sc, result, rep)
