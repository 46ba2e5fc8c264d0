"""Expert parallelism: a mixture of experts' experts shared out over an ep group, tokens sent to them and back.

Two dispatchers (model/moe_dispatch.py says what one does; parallel.moe_dispatcher picks), Megatron-Core's
"alltoall" (AllToAll, below) and "allgather" (AllGather, its docstring). In Megatron-Core's layout
(Shoeybi et al.) the ep group is ep consecutive data-parallel ranks (mesh.expert_groups); rank q of it
holds experts [q E/ep, (q+1) E/ep). With the all-to-all, each rank routes its own tokens (model/moe.py:
the rows grouped by expert), then
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

from simcluster.model.moe import host_float32, route
from simcluster.model.moe_dispatch import Rows
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


class AllToAll(Rows):
    """The all-to-all dispatcher of one MoE layer on one rank of its ep group (model/moe.py calls it)."""

    def __init__(self, ctx: Context, layer: Any) -> None:
        super().__init__(layer)
        self.ctx, self.group = ctx, ctx.mesh.ep
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


class AllGather:
    """Megatron-Core's "allgather" token dispatcher for one MoE layer on one rank of its ep group: every
    rank's tokens, gates and choices all-gathered over the group; my experts' rows taken from them (the
    all-to-all's rows, in its order); their weighted outputs put at their tokens' places among the
    group's, an exact partial, reduce-scattered back: each token gets the exact sum of its slots, from
    whichever ranks ran them. Backward: dy all-gathered, the input gradients reduce-scattered the same
    way, and each gate's gradient, rounded where its expert ran, sent to its token's rank (zero from the
    others: the sum is that one value). A rank moves the group's tokens, not its k routed copies: more
    than the all-to-all's rows once ep exceeds k, but no counts to wait for and no uneven splits."""

    def __init__(self, ctx: Context, layer: Any) -> None:
        self.ctx, self.layer, self.group = ctx, layer, ctx.mesh.ep
        self.me, self.ep = self.group.rank_of(ctx.rank), self.group.size

    def dispatch(self, x: Any, r: Any, gates: Any, meanwhile: Any = None) -> Generator[Any, Any, tuple[list, Any, dict]]:
        ops, comm, layer = self.ctx.ops, self.ctx.comm, self.layer
        (t, _), k = x.shape, gates.shape[1]
        routes = yield from self._routes(r, t, k)
        every_gate = yield comm.all_gather(gates, group=self.group, dim=0)  # (ep T, k)
        work = comm.all_gather(x, group=self.group, dim=0, async_op=meanwhile is not None)  # (ep T, h)
        early = meanwhile() if meanwhile is not None else None
        every = yield work
        n = layer.moe.experts // self.ep
        tokens, slots = [], []  # my experts' rows: their tokens among the group's, their slots among its T k
        for e in range(self.me * n, (self.me + 1) * n):
            tokens.append(self._rows(routes, e, lambda q, rq, lo, hi: q * t + rq.token_of_row[lo:hi]))
            slots.append(self._rows(routes, e, lambda q, rq, lo, hi: q * t * k + rq.slot_of_row[lo:hi]))
        flat = layer._view(every_gate, (self.ep * t * k, 1))
        state = {"tokens": tokens, "slots": slots, "gates": [ops.embedding(s, flat) for s in slots], "t": t}
        return [ops.embedding(tok, every) for tok in tokens], early, state

    def _routes(self, r: Any, t: int, k: int) -> Generator[Any, Any, list[Any]]:
        """Every group rank's routing of its own tokens: its choices all-gathered, -1 where a capacity
        dropped one (fp32 holds expert indices exactly). Meta mode routes as stated: every rank alike."""
        ops = self.ctx.ops
        if ops.mode is Mode.META:
            yield self.ctx.comm.all_gather(MetaTensor((t, k), "fp32"), group=self.group, dim=0)
            return [r] * self.ep
        kept = np.where(np.asarray(r.pos) >= 0, np.asarray(r.choice), -1)
        got = yield self.ctx.comm.all_gather(ops.from_host(host_float32(kept)), group=self.group, dim=0)
        every = np.asarray(ops.xp.to_host(got), dtype=np.int64).reshape(self.ep, t, k)
        moe = self.layer.moe
        return [r if q == self.me else route(np.maximum(every[q], 0), 1, t, moe, every[q] >= 0) for q in range(self.ep)]

    def _rows(self, routes: list[Any], e: int, index: Any) -> Any:
        """Expert e's rows from every rank in rank order, as index(q, its routing, first, end) says each
        (meta mode: their count)."""
        counts = [rq.bounds[e + 1] - rq.bounds[e] for rq in routes]
        if self.ctx.ops.mode is Mode.META:
            return MetaTensor((sum(counts),), "int64")
        return np.concatenate([index(q, rq, rq.bounds[e], rq.bounds[e + 1]) for q, rq in enumerate(routes)])

    def _join(self, parts: list[Any]) -> Any:
        """Index arrays (host) joined end to end (meta mode: their count)."""
        if self.ctx.ops.mode is Mode.META:
            return MetaTensor((sum(p.shape[0] for p in parts),), "int64")
        return np.concatenate(parts)

    def combine(self, outs: list[Any], r: Any, gates: Any, state: dict) -> Generator[Any, Any, Any]:
        ops = self.ctx.ops
        state["outs"] = outs
        weighted = ops.concat([ops.mul(o, g) for o, g in zip(outs, state["gates"])], 0)  # (R, h): as one device's
        placed = ops.embedding_backward(self._join(state["tokens"]), weighted, self.ep * state["t"])
        return ops.finalize((yield self.ctx.comm.reduce_scatter(placed, group=self.group, dim=0, donate=True)))

    def combine_backward(self, dy: Any, r: Any, gates: Any, state: dict,
                         meanwhile: Any = None) -> Generator[Any, Any, tuple[list, Any, Any]]:
        ops, comm, layer = self.ctx.ops, self.ctx.comm, self.layer
        t, k = state["t"], gates.shape[1]
        work = comm.all_gather(dy, group=self.group, dim=0, async_op=meanwhile is not None)  # (ep T, h)
        early = meanwhile() if meanwhile is not None else None
        every = yield work
        d_in, d_gate = [], []
        for tok, g, out in zip(state["tokens"], state["gates"], state["outs"]):
            rows = ops.embedding(tok, every)  # (R_e, h): dy of each row's token
            d_in.append(ops.mul(rows, g))
            d_gate.append(ops.finalize(ops.sum(ops.mul(rows, out), -1, partial=True)))  # (R_e,): as one device's
        joined = ops.concat(d_gate, 0)
        placed = ops.finalize(ops.embedding_backward(self._join(state["slots"]),
                                                     layer._view(joined, (joined.shape[0], 1)), self.ep * t * k))
        mine = yield comm.reduce_scatter(placed, group=self.group, dim=0)  # (T k, 1)
        return d_in, layer._view(mine, (t, k)), early

    def dispatch_backward(self, dx_rows: list[Any], r: Any, state: dict) -> Generator[Any, Any, Any]:
        ops = self.ctx.ops
        placed = ops.embedding_backward(self._join(state["tokens"]), ops.concat(dx_rows, 0), self.ep * state["t"])
        return ops.finalize((yield self.ctx.comm.reduce_scatter(placed, group=self.group, dim=0, donate=True)))


DISPATCHERS = {"alltoall": AllToAll, "allgather": AllGather}  # (parallel.moe_dispatcher)


def read_counts(gathered: np.ndarray) -> list[int]:
    """The all-gathered counts, read back on the host."""
    return [int(v) for v in np.asarray(gathered).reshape(-1)]
