"""A block's mixture of experts on one rank, for either model's shard (transformer_shard.py, llama_shard.py).

The layer (model/moe.py) replaces the block's MLP: each rank routes its own tokens -- with sequence
parallelism a tp rank's, with context parallelism a cp rank's -- through whole experts (no tensor
parallelism inside an expert: Megatron-Core's expert tp of 1), the rows exchanged with the ep group
where experts are shared out (parallel/expert_parallel.py). Around it, per rank: the router's
statistics of each step (tally), DeepSeek-V3's selection bias moved after each step by the loads summed
over every rank that ran the layer (balance), and kept across checkpoints (restore_biases).
"""

from __future__ import annotations

from typing import Any, Generator

import numpy as np

from simcluster.model.moe import MoE, MoELayer, capacity_keep, host_float32, stack
from simcluster.model.precision import LOSS_SCALE
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.expert_parallel import DISPATCHERS
from simcluster.program.context import Context


class Experts:
    """The mixture-of-experts part of a block shard (a base of TransformerShard)."""

    ctx: Context
    ops: Any
    m: Any
    tp: Any

    def init_experts(self, ctx: Context, precision: str, dispatcher: str = "alltoall") -> None:
        # the balance loss's gradient: the mean over the step's sequences of each one's, scaled as the loss is
        self.aux_scale = LOSS_SCALE[precision]
        self.dispatcher = DISPATCHERS[dispatcher]  # expert parallelism's (parallel/expert_parallel.py)
        # the ranks sharing out a sequence's tokens (cp, and tp with sequence parallelism), or None
        spread = tuple(a for a in ("cp", "tp") if ctx.mesh.size(a) > 1)
        self.spread = ctx.mesh.group(*spread) if spread and self.m.moe_experts else None
        self.routing: dict[str, Any] = {}  # the router's statistics by step and layer (tally), this rank's tokens
        self.tallied: dict[int, set[int]] = {}  # the MoE layers counted, by step
        self.bias: dict[int, Any] = {}  # DeepSeek-V3's selection bias by MoE layer (`balance`), once it moved
        self.biases: dict[str, Any] = {}  # the same by output name (a result: every rank that runs a layer has it)

    def experts(self, i: int) -> MoELayer:
        """Block i's mixture of experts (model/moe.py) on this rank: every expert, or with expert parallelism
        this rank's share of them, the tokens dispatched over the ep group (parallel/expert_parallel.py)."""
        layer = MoELayer(self.ops, self.m.moe, f"layers.{i}.moe.", self.m.moe_skew, cfg=self.m)
        if self.ctx.mesh.ep.size > 1:  # this rank holds its share of the experts: tokens go to theirs and back
            layer.dispatcher = self.dispatcher(self.ctx, layer)
        if self.spread is not None:  # a sequence's tokens over cp and tp ranks: the balance loss sums them,
            # and an expert's capacity takes them in the whole sequence's order
            layer.parts, layer.whole, layer.sequences = self.spread.size, self.whole_sequences, self.capacity_kept
        return layer

    def capacity_kept(self, choice: Any, moe: MoE) -> Generator[Any, Any, Any]:
        """Which of this rank's choices (b, s', k) the experts' capacities keep: every choice of the ranks
        holding the rest of its sequences gathered (fp32 holds expert indices exactly), put in position order,
        capacity_keep over the whole sequences as one device runs it, and this rank's part of that taken.
        Meta mode has no choices, only the call."""
        ops = self.ops
        if ops.mode is Mode.META:
            yield self.ctx.comm.all_gather(MetaTensor(tuple(choice.shape), "fp32"), group=self.spread)
            return None
        b, mine, k = choice.shape
        got = yield self.ctx.comm.all_gather(ops.from_host(host_float32(choice)), group=self.spread)
        parts = np.asarray(ops.xp.to_host(got), dtype=np.int64).reshape(self.spread.size, b, mine, k)
        whole = np.empty((b, self.m.seq, k), dtype=np.int64)
        for member, part in zip(self.spread.ranks, parts):
            whole[:, self.token_positions(member)] = part
        keep = capacity_keep(whole.reshape(-1, k), b, self.m.seq, moe).reshape(b, self.m.seq, k)
        return keep[:, self.token_positions(self.ctx.rank)].reshape(b * mine, k)

    def moe_forward(self, p: dict[str, Any], c: Any, i: int, step: int, sequences: int,
                    counted: bool) -> Generator[Any, Any, tuple[Any, dict[str, Any]]]:
        """Block i's experts on this rank's tokens c (b, s', h) of the step's `sequences`: their output and
        what the backward needs; the router's statistics tallied unless `counted` (a recomputation runs
        the block again)."""
        if i in self.bias:  # (the selection's: no gradient)
            p = p | {f"layers.{i}.moe.router.bias": self.bias[i]}
        z, _, routed = yield from self.experts(i).forward(p, c, self.aux_scale / sequences)
        if not counted:
            self.tally(step, i, routed["routing"].tally())
        return z, {"moe": routed}

    def moe_backward(self, p: dict[str, Any], dz: Any, cache: dict[str, Any], i: int,
                     weight_grad: Any) -> Generator[Any, Any, Any]:
        """dz into block i's experts (this rank's tokens): the input gradient; the weights' gradients at
        once, deferred or not (the router's is in the backward)."""
        ops, grads = self.ops, {}
        dc = yield from self.experts(i).backward(p, dz, cache["moe"], grads)
        for name, g in grads.items():
            weight_grad(name, lambda g=g: stack(ops, g) if isinstance(g, list) else g)
        return dc

    def whole_sequences(self, chosen: Any) -> Generator[Any, Any, Any]:
        """A (b, E) count of this rank's tokens, summed over the ranks holding the rest of each sequence
        (fp32 holds the counts exactly); meta mode has no counts, only the call."""
        ops = self.ops
        if ops.mode is Mode.META:
            yield self.ctx.comm.all_reduce(MetaTensor(tuple(np.shape(chosen)), "fp32"), group=self.spread)
            return chosen
        total = yield self.ctx.comm.all_reduce(ops.from_host(host_float32(chosen)), group=self.spread)
        return np.asarray(ops.xp.to_host(total), dtype=np.int64)

    def tally(self, step: int, layer: int, counts: tuple[Any, Any]) -> None:
        """Add a micro-batch's router statistics (tokens that chose each expert, tokens each computed)."""
        self.tallied.setdefault(step, set()).add(layer)
        key = f"routing[{step}].layers.{layer}"
        for name, n in zip(("chosen", "computed"), counts):
            have = self.routing.get(f"{key}.{name}")
            self.routing[f"{key}.{name}"] = n if have is None else have + n

    def balance(self, step: int, group: Any, twin: Any = None) -> Generator[Any, Any, None]:
        """DeepSeek-V3's bias update after a step (bias_step), for the MoE layers this rank ran: their
        loads over every data-parallel rank (all-reduced: fp32 holds the counts exactly), over the tp
        ranks (each routed its own tokens), and under DualPipe over the `twin` that holds the same layers
        for the other direction's micro-batches. Meta mode routes as stated, so its bias moves nothing:
        none is kept there."""
        rate, ops = self.m.moe_bias_rate, self.ops
        if not rate or ops.mode is Mode.META:
            return
        for i in sorted(self.tallied.get(step, ())):
            local = ops.from_host(host_float32(self.routing[f"routing[{step}].layers.{i}.chosen"]))
            loads = yield self.ctx.comm.all_reduce(local, group=group)
            if self.tp.size > 1:
                loads = yield self.ctx.comm.all_reduce(loads, group=self.tp)
            if twin is not None:  # (both hold the same layers: the same calls, in the same order)
                loads = yield self.ctx.comm.all_reduce(loads, group=twin)
            change = ops.constant(bias_step(ops.xp.to_host(loads), rate), "fp32")
            self.bias[i] = change if i not in self.bias else ops.add(self.bias[i], change)
            self.biases[f"router_bias.layers.{i}"] = self.bias[i]

    def restore_biases(self, saved: dict[str, Any]) -> None:
        """The selection biases a checkpoint kept (checkpoint.router_bias), by output name."""
        for name, values in saved.items():
            i = int(name.rsplit(".", 1)[1])
            self.bias[i] = self.ops.constant(values, "fp32")
            self.biases[name] = self.bias[i]


def bias_step(loads: np.ndarray, rate: float) -> np.ndarray:
    """DeepSeek-V3's auxiliary-loss-free balancing (Wang et al. 2024): after each step, each expert's
    selection bias moves by `rate` towards an even load -- up for an expert that took fewer of the
    step's tokens than the mean, down for more -- from the step's loads (E,) over every rank: the
    change, fp32."""
    loads = np.asarray(loads, dtype=np.float64)
    return (rate * np.sign(loads.mean() - loads)).astype(np.float32)
