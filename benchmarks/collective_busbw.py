"""The all-reduce bus bandwidth the model gives whole DGX nodes, beside what nccl-tests measure.

One all-reduce over every GPU of 1 to 32 nodes (meta mode, NCCL's model: topology/nccl.py, and its rings
across nodes: phases.nccl_ring), its bus bandwidth as nccl-tests report it, 2 (n-1)/n S / t, for 1 GiB
and 8 GiB (nccl-tests' usual largest size). The published figures, by NCCL's maintainers: 24 GB/s a 200
Gb/s HDR NIC (NVIDIA/nccl-tests #119, #252), eight a DGX A100: 192; 46-48 GB/s a 400 Gb/s NDR NIC (#290),
eight a DGX H100: 368-384; 365.84 GB/s measured on four HGX H100 nodes of eight GPU-NIC pairs (#309).
Inside one node (NVLink, a ring: NCCL_ALGO=RING; NVLink SHARP not modelled) about 80 % of NVLink's line
rate: 240 and 360 GB/s (S. Jeaugey, #212: "NCCL can get an effective NVLink bandwidth of 370GB/s").

    python benchmarks/collective_busbw.py
"""

from __future__ import annotations

from simcluster.engine import simulate
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

PUBLISHED = {("dgx-a100", 2): "192 (8 x 24)", ("dgx-a100", 8): "192 (8 x 24)",
             ("dgx-h100", 2): "368-384 (8 x 46-48)", ("dgx-h100", 4): "365.84 measured"}


def busbw(name: str, nodes: int, nbytes: int) -> float:
    """GB/s: an all-reduce of `nbytes` over every GPU of `nodes` nodes of the preset."""
    spec = preset(name, nodes=nodes)
    n = spec.world_size

    def program(ctx):
        yield ctx.comm.all_reduce(MetaTensor((nbytes // 4,), "fp32"), group=ctx.mesh.world)

    trace = simulate(program, mesh=DeviceMesh(dp=n), cluster=spec, mode="meta").trace
    ns = max(e.end for e in trace) - min(e.start for e in trace)
    return 2 * (n - 1) / n * nbytes / ns


def main() -> None:
    print(f"{'preset':<9} {'nodes':>5} {'GPUs':>5} {'1 GiB':>8} {'8 GiB':>8}  nccl-tests (GB/s)")
    for name in ("dgx-a100", "dgx-h100"):
        for nodes in (1, 2, 4, 8, 16, 32):
            one, eight = (busbw(name, nodes, s) for s in (2**30, 8 * 2**30))
            print(f"{name:<9} {nodes:>5} {8 * nodes:>5} {one:>8.1f} {eight:>8.1f}  {PUBLISHED.get((name, nodes), '')}")


if __name__ == "__main__":
    main()
