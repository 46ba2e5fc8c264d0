"""Every communication primitive, sync and async, on the mesh's subgroups.

A demonstration and a conformance program: the emulator and torch.distributed must give the same
results for it (byte-identical for integers and exact partials, within float tolerance otherwise).

Phases: 1. reductions (all_reduce sum/max/min, reduce_scatter, reduce) on tp, dp and world;
2. data movement (all_gather, all_to_all, broadcast); 3. a ring of sends and receives;
4. an async all_gather overlapped with a matmul; 5. a barrier.
"""

from __future__ import annotations

import math
from typing import Any, Generator

import numpy as np

from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import ReduceOp
from simcluster.program.context import Context

def collectives_demo(ctx: Context, seed: int = 0) -> Generator[Any, Any, dict[str, Any]]:
    r, n = ctx.rank, ctx.world_size
    ROWS, COLS = math.lcm(4, n), math.lcm(6, n)  # every rank's block: divisible by every group size
    tp, dp, world = ctx.mesh.tp, ctx.mesh.dp, ctx.mesh.world
    x = ctx.ops.uniform(seed, "demo.x", (ROWS, COLS), offset=(ROWS * r, 0), full_shape=(ROWS * n, COLS))  # (ROWS, COLS)
    ints = ctx.ops.from_host(np.arange(ROWS * COLS, dtype=np.int64).reshape(ROWS, COLS) * (r + 1) - 7 * r)  # (ROWS, COLS)
    exact = ctx.ops.partial_of(x) if ctx.ops.mode is Mode.EXACT else x
    out: dict[str, Any] = {}

    # 1. reductions
    out["all_reduce_partial_tp"] = yield ctx.comm.all_reduce(exact, group=tp)
    out["all_reduce_sum_world"] = yield ctx.comm.all_reduce(x, group=world)
    out["all_reduce_max_dp"] = yield ctx.comm.all_reduce(x, group=dp, op=ReduceOp.MAX)
    out["all_reduce_min_int_tp"] = yield ctx.comm.all_reduce(ints, group=tp, op=ReduceOp.MIN)
    out["reduce_scatter_partial_dp"] = yield ctx.comm.reduce_scatter(exact, group=dp, dim=0)
    out["reduce_scatter_int_tp_dim1"] = yield ctx.comm.reduce_scatter(ints, group=tp, dim=1)
    out["reduce_int_world"] = yield ctx.comm.reduce(ints, group=world, dst=world.ranks[-1])

    # 2. data movement
    out["all_gather_tp_dim1"] = yield ctx.comm.all_gather(x, group=tp, dim=1)
    out["all_gather_bf16_world"] = yield ctx.comm.all_gather(ctx.ops.cast(x, "bf16"), group=world)
    out["all_to_all_int_world"] = yield ctx.comm.all_to_all(ints, group=world, split_dim=0, concat_dim=1)
    out["broadcast_dp"] = yield ctx.comm.broadcast(x, group=dp, src=dp.ranks[-1])

    # 3. a ring: send to the next rank, receive from the previous one (async, so nobody blocks)
    if n > 1:
        sent = ctx.comm.send(ints, dst=(r + 1) % n, async_op=True)
        got = ctx.comm.recv(src=(r - 1) % n, like=ints, async_op=True)
        _, out["recv_int_ring"] = yield [sent, got]

    # 4. overlap: the gather runs on the dp stream while the matmul runs on the compute stream
    gathering = ctx.comm.all_gather(x, group=dp, async_op=True)
    out["matmul_local"] = ctx.ops.matmul(x, ctx.ops.transpose(x))
    out["all_gather_dp_async"] = yield gathering

    # 5.
    yield ctx.comm.barrier(group=world)
    return out
