"""Run the composed GPT program under a parallelism on an emulated mesh, and join its results."""

from simcluster.engine import simulate
from simcluster.parallel.composed import assemble, composed
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset


def run_composed(data, *, dp=1, pp=1, cp=1, tp=1, program=composed, mode="exact", cluster=None, **options):
    """(the single-device view of the results, or None in meta mode; the run)."""
    parallelism = Parallelism(data=data, **options)
    mesh = DeviceMesh(dp=dp, pp=pp, cp=cp, tp=tp)
    run = simulate(program, parallelism, mesh=mesh, cluster=cluster or preset("dgx-a100", gpus_per_node=mesh.world_size),
                   mode=mode)
    if mode == "meta":
        return None, run
    return assemble(run.results, [mesh.coords(r) for r in range(mesh.world_size)], parallelism), run
