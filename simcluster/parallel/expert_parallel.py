"""Expert parallelism: a mixture of experts' experts shared out over an ep group, tokens sent to them and back.

Megatron-Core's layout (Shoeybi et al.; its MoE's "alltoall" token dispatcher): the ep group is ep
consecutive data-parallel ranks (mesh.expert_groups); rank q of it holds experts [q E/ep, (q+1) E/ep).
Each rank routes its own tokens (model/moe.py: the rows grouped by expert), then
  plan:  the rows it has for each expert, all-gathered over the group (the receivers' sizes: Megatron
         reads these counts back to the host too);
  there: to each rank, the rows for its experts, and from each, the rows it has for mine; an expert's
         input is the rows every rank sent it, in rank order;
  back:  each expert's outputs returned to the ranks the rows came from, which put them back in the
         order they sent them.
The backward pass sends the output gradients the same way and the input gradients back. Each move is
one uneven all-to-all (torch's all_to_all_single with split sizes; NCCL builds it of a send and a
receive for each peer, grouped); only the rows for other ranks cross a link. Each rank's weight
gradient of an expert sums the rows it computed, from every rank of the group, as one exact partial,
and data parallelism then sums it over the ranks holding the same experts (expert data parallelism,
dp_wrap.py): the single device's bytes.
"""

from __future__ import annotations

from typing import Any, Generator

import numpy as np

from simcluster.model.moe import host_float32
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.context import Context


class Plan:
    """Who sends what: `counts[q][e]` rows rank q of the group has for expert e (host integers)."""

    def __init__(self, counts: list[list[int]], me: int, ep: int) -> None:
        self.counts, self.me, self.ep = counts, me, ep
        self.local = len(counts[0]) // ep  # experts a rank holds

    def mine(self, q: int) -> list[int]:
        """Rows rank q sends me, for each of my experts."""
        return self.counts[q][self.me * self.local:(self.me + 1) * self.local]

    def to(self, q: int) -> int:
        """Rows I send rank q: mine for its experts."""
        return sum(self.counts[self.me][q * self.local:(q + 1) * self.local])


class Exchange:
    """The all-to-all of one MoE layer on one rank of its ep group (model/moe.py calls it)."""

    def __init__(self, ctx: Context, layer: Any) -> None:
        self.ctx, self.layer, self.group = ctx, layer, ctx.mesh.ep
        self.me, self.ep = self.group.rank_of(ctx.rank), self.group.size

    def plan(self, bounds: tuple[int, ...]) -> Generator[Any, Any, Plan]:
        """Every rank's rows per expert (all-gathered: fp32 holds whole counts exactly)."""
        ops, experts = self.ctx.ops, len(bounds) - 1
        mine = [bounds[e + 1] - bounds[e] for e in range(experts)]
        sent = MetaTensor((experts,), "fp32") if ops.mode is Mode.META else ops.from_host(host_float32(mine))
        every = yield self.ctx.comm.all_gather(sent, group=self.group, dim=0)
        if ops.mode is Mode.META:  # (a stated routing: every rank has the same counts)
            return Plan([mine] * self.ep, self.me, self.ep)
        flat = read_counts(ops.xp.to_host(every))
        return Plan([flat[q * experts:(q + 1) * experts] for q in range(self.ep)], self.me, self.ep)

    def there(self, rows: Any, plan: Plan, meanwhile: Any = None) -> Generator[Any, Any, tuple[list[Any], Any]]:
        """My experts' inputs: from each rank the rows it has for them, joined expert by expert; and what
        `meanwhile()` computes while they travel (the all-to-all issued first, waited for after it)."""
        ops, cut, n = self.ctx.ops, self.layer.slice_rows, plan.local
        sizes = [sum(plan.mine(q)) for q in range(self.ep)]
        work = self.ctx.comm.all_to_all_rows(rows, group=self.group, send_rows=[plan.to(q) for q in range(self.ep)],
                                             recv_rows=sizes, async_op=meanwhile is not None)
        early = meanwhile() if meanwhile is not None else None
        got = yield work
        starts = [sum(sizes[:q]) for q in range(self.ep)]  # where each rank's rows begin
        inputs = []
        for e in range(n):
            parts = []
            for q in range(self.ep):
                at = starts[q] + sum(plan.mine(q)[:e])
                parts.append(cut(got, at, at + plan.mine(q)[e]))
            inputs.append(ops.concat(parts, 0))
        return inputs, early

    def back(self, outs: list[Any], plan: Plan) -> Generator[Any, Any, Any]:
        """Each expert's output rows back to the ranks they came from; mine joined in the order I sent them."""
        cut, parts = self.layer.slice_rows, []
        for q in range(self.ep):
            for e, out in enumerate(outs):
                at = sum(plan.mine(p)[e] for p in range(q))
                parts.append(cut(out, at, at + plan.mine(q)[e]))
        return (yield self.ctx.comm.all_to_all_rows(self.ctx.ops.concat(parts, 0), group=self.group,
                                                    send_rows=[sum(plan.mine(q)) for q in range(self.ep)],
                                                    recv_rows=[plan.to(q) for q in range(self.ep)]))


def read_counts(gathered: np.ndarray) -> list[int]:
    """The all-gathered counts, read back on the host."""
    return [int(v) for v in np.asarray(gathered).reshape(-1)]
