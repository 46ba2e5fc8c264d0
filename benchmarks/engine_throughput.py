"""Engine throughput: simulated trace events per second of wall time (not a test).

A program of 64 ranks (dp=8 x tp=8 on 8 DGX nodes) in meta mode: per round, a few kernels, an
all-reduce on tp, an async all-gather on dp overlapped with more kernels, and a send/recv ring.
Prints a table: rounds, trace events, seconds for the data pass and the timed replay, events/s.

    python benchmarks/engine_throughput.py [--rounds N]
"""

from __future__ import annotations

import argparse
import time

from simcluster.engine.interpreter import Interpreter
from simcluster.engine.timing import Replay
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.cluster import Cluster
from simcluster.topology.presets import preset


def many_small(ctx, rounds):
    x = MetaTensor((4096,), "bf16")
    n = ctx.world_size
    for i in range(rounds):
        for _ in range(4):
            ctx.ops.kernel("k", flops=2e8, nbytes=1e6)
        yield ctx.comm.all_reduce(x, group=ctx.mesh.tp)
        h = ctx.comm.all_gather(x, group=ctx.mesh.dp, async_op=True)
        for _ in range(4):
            ctx.ops.kernel("k", flops=2e8, nbytes=1e6)
        yield h
        s = ctx.comm.send(x, dst=(ctx.rank + 1) % n, async_op=True)
        r = ctx.comm.recv(src=(ctx.rank - 1) % n, like=x, async_op=True)
        yield [s, r]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200)
    args = p.parse_args()
    mesh = DeviceMesh(dp=8, tp=8)
    cluster = Cluster(preset("dgx-a100", nodes=8, gpus_per_node=8))
    t0 = time.perf_counter()
    interp = Interpreter(mesh, "meta", cost_dtype="bf16")
    interp.run(many_small, args.rounds)
    t1 = time.perf_counter()
    trace = Replay(interp.ranks, interp.calls, cluster, "bf16").run()
    t2 = time.perf_counter()
    n = len(trace)
    print(f"{'ranks':>6} {'rounds':>7} {'events':>9} {'data pass s':>12} {'replay s':>9} {'events/s':>10}")
    print(f"{mesh.world_size:>6} {args.rounds:>7} {n:>9} {t1 - t0:>12.2f} {t2 - t1:>9.2f} {n / (t2 - t0):>10,.0f}")


if __name__ == "__main__":
    main()
