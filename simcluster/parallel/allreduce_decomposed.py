"""All-reduce = reduce-scatter + all-gather: the same bytes, the same result.

Each rank all-reduces a tensor of exact partial sums, then does it again as a reduce-scatter (each
rank ends up with the sum of its 1/n chunk) followed by an all-gather of the chunks. Both give the
same limbs in exact mode; on a ring both cost 2(n-1)/n of the tensor per rank.
"""

from __future__ import annotations

from typing import Any, Generator

from simcluster.numerics.tensor import MetaTensor
from simcluster.program.context import Context


def allreduce_decomposed(ctx: Context, elements: int, seed: int = 0) -> Generator[Any, Any, dict[str, Any]]:
    group = ctx.mesh.world
    n = group.size
    size = -(-elements // n) * n
    if ctx.ops.mode.value == "meta":
        x: Any = MetaTensor((size,), "fp32", partial=True)
    else:
        values = ctx.ops.uniform(seed, "allreduce.x", (size,), offset=(ctx.rank * size,), full_shape=(n * size,))
        x = ctx.ops.partial_of(values)
    with ctx.annotate("compute", "all-reduce"):
        whole = yield ctx.comm.all_reduce(x, group=group)
    with ctx.annotate("compute", "reduce-scatter"):
        mine = yield ctx.comm.reduce_scatter(x, group=group)
    with ctx.annotate("compute", "all-gather"):
        again = yield ctx.comm.all_gather(mine, group=group)
    return {"all_reduce": whole, "reduce_scatter+all_gather": again}
