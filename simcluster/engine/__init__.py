"""The emulator's engine: interpret every rank's program (matching their communication into calls and
checking that they fit together), then replay the calls and kernels on the modelled cluster, a
discrete-event simulation whose clock and event queue are SimPy's."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

from simcluster.engine.errors import CollectiveMismatchError, DeadlockError, FoldError, SimulationError
from simcluster.engine.faults import Faults, Hang
from simcluster.engine.fold import Fold, fold_for
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.interpreter import Interpreter
from simcluster.engine.layer import layer_cost
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
    results: list[Any]  # what each rank's program returned, by rank (None for a folded rank)
    trace: Trace  # of the simulated ranks (all of them unless folded: fold.expand gives the rest)
    mesh: DeviceMesh
    cluster: Cluster
    fold: Fold | None = None
    unfolded_because: str = ""  # why a fold that was asked for could not be used
    hang: Hang | None = None  # a failed rank's: what the other ranks waited on (engine/faults.py)
    repeated: tuple[int, int] | None = None  # (steps after the trace's, repeating its last; their period ns)
    # (micro-batches the trace's step has, those the report counts, a round's period ns: pipeline_steady.py)
    micro: tuple[int, int, int] | None = None
    layer: dict[str, Any] | None = None  # rank 0's first transformer layer's passes (engine/layer.py)

    def full_trace(self, ranks: Sequence[int] | None = None) -> Trace:
        """Every rank's trace, or `ranks`' (rebuilt from the simulated ranks' when folded)."""
        if self.fold is not None:
            return self.fold.expand(self.trace, ranks)
        if ranks is None:
            return self.trace
        keep = set(ranks)
        return Trace([e for e in self.trace if e.rank in keep], [lane for lane in self.trace.lanes if lane[0] in keep])

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
             cluster: ClusterSpec | None = None, mode: Mode | str = Mode.EXACT, cost_dtype: str = "bf16",
             fold: tuple[str, ...] = (), faults: Faults | None = None, events: bool = True) -> RunResult:
    """Run `program(ctx, *args)` on every rank of `mesh`, then time it on `cluster`.

    fold: the mesh axes ("dp", "tp") along which the program's ranks differ in nothing but their data;
    one representative of each set of identical ranks then runs for all (engine/fold.py), which gives
    the same trace. Meta mode only (elsewhere the ranks hold different numbers). Where the layout
    has nothing to fold, or the run turns out not to be symmetric, it runs unfolded and says why in
    `unfolded_because`. events: keep every trace event (without, the trace has the report's sums and
    the memory events: what a report needs, not what a timeline draws).
    """
    spec = cluster if cluster is not None else default_cluster(mesh.world_size)
    if spec.world_size != mesh.world_size:
        raise ValueError(
            f"the mesh has {mesh.world_size} ranks ({', '.join(f'{a}={n}' for a, n in mesh.sizes.items())}) but the "
            f"cluster has {spec.world_size} GPUs ({spec.nodes} nodes x {spec.gpus_per_node}); they must be equal")
    topo = Cluster(spec, tp=mesh.sizes["tp"])
    why = ""
    if fold and faults:
        fold, why = (), "faults break the symmetry between ranks (engine/faults.py)"
    if fold and spec.unfoldable:
        fold, why = (), spec.unfoldable
    if fold:
        if Mode(mode) is not Mode.META:
            raise ValueError(f"folding replicas needs meta mode (in {Mode(mode).value} mode they hold different "
                             f"numbers)")
        # Fold along every axis given; where the run is not symmetric along ep (a skewed routing), without
        # it; where not along cp either (fold.py's checks), along dp and tp; where not along tp, dp alone.
        attempts, axes = [fold], fold
        for axis in ("ep", "cp", "tp"):
            if axis in axes and (axis != "tp" or "dp" in fold):
                axes = tuple(a for a in axes if a != axis)
                attempts.append(axes)
        for axes in attempts:
            folding = fold_for(mesh, spec, axes)
            if folding is None:
                why = why or ("nothing to fold: no block of whole replicas and whole nodes smaller than the world, "
                              "no tp group inside a node")
                continue
            try:
                return replace(_simulate(program, args, mesh, topo, mode, cost_dtype, folding, events=events),
                               unfolded_because=why)
            except FoldError as exc:
                why = str(exc)
    result = _simulate(program, args, mesh, topo, mode, cost_dtype, None, faults, events)
    return replace(result, unfolded_because=why) if why else result


def _simulate(program: Program | Sequence[Program], args: tuple, mesh: DeviceMesh, topo: Cluster,
              mode: Mode | str, cost_dtype: str, fold: Fold | None, faults: Faults | None = None,
              events: bool = True) -> RunResult:
    with gc_paused():  # (one pause over both passes: the collector then walks their objects once)
        interp = Interpreter(mesh, mode, cost_dtype=cost_dtype, fold=fold,
                             serial_comm=topo.profile is not None and topo.profile.shares_cores)
        results = interp.run(program, *args)
        layer = layer_cost(interp.state[0].streams, topo, cost_dtype) if 0 in interp.state else None
        replay = Replay(interp.ranks, interp.calls, topo, cost_dtype, fold, faults, events)
        trace = replay.run()
        interp.release()
    return RunResult(results, trace, mesh, topo, fold, hang=replay.hang, layer=layer)


__all__ = ["CollectiveMismatchError", "DeadlockError", "ProgramError", "RunResult", "SimulationError",
           "Trace", "TraceEvent", "default_cluster", "simulate"]
