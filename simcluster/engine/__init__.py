"""The SimPy engine: run per-rank programs, check that they fit together, time them on a cluster."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from simcluster.engine.errors import CollectiveMismatchError, DeadlockError, SimulationError
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.interpreter import Interpreter
from simcluster.engine.timing import Replay
from simcluster.engine.trace import Trace, TraceEvent
from simcluster.numerics.ops import Mode
from simcluster.program.comm import ProgramError
from simcluster.program.context import Program
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import ClusterSpec, preset


@dataclass(frozen=True)
class RunResult:
    results: list[Any]  # what each rank's program returned, by rank
    trace: Trace
    mesh: DeviceMesh
    cluster: Cluster

    @property
    def makespan_ns(self) -> int:
        return self.trace.end


def default_cluster(world_size: int, name: str = "dgx-a100") -> ClusterSpec:
    """One node if the world fits in 8 GPUs, else full nodes of 8."""
    per_node = min(world_size, 8)
    if world_size % per_node:
        raise ValueError(f"{world_size} ranks do not fill nodes of 8 GPUs; give a cluster explicitly")
    return preset(name, nodes=world_size // per_node, gpus_per_node=per_node)


def simulate(program: Program | Sequence[Program], *args: Any, mesh: DeviceMesh,
             cluster: ClusterSpec | None = None, mode: Mode | str = Mode.EXACT, cost_dtype: str = "bf16") -> RunResult:
    """Run `program(ctx, *args)` on every rank of `mesh`, then time it on `cluster`."""
    spec = cluster if cluster is not None else default_cluster(mesh.world_size)
    if spec.world_size != mesh.world_size:
        raise ValueError(
            f"the mesh has {mesh.world_size} ranks ({', '.join(f'{a}={n}' for a, n in mesh.sizes.items())}) but the "
            f"cluster has {spec.world_size} GPUs ({spec.nodes} nodes x {spec.gpus_per_node}); they must be equal")
    topo = Cluster(spec)
    with gc_paused():  # (one pause over both passes: the collector then walks their objects once)
        interp = Interpreter(mesh, mode, cost_dtype=cost_dtype)
        results = interp.run(program, *args)
        trace = Replay(interp.ranks, interp.calls, topo, cost_dtype).run()
    return RunResult(results, trace, mesh, topo)


__all__ = ["CollectiveMismatchError", "DeadlockError", "ProgramError", "RunResult", "SimulationError",
           "Trace", "TraceEvent", "default_cluster", "simulate"]
