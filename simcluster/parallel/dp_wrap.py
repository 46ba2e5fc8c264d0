"""Data parallelism around whatever parameters a rank holds: DDP, or ZeRO stage 1, 2 or 3 (FSDP).

Li et al. 2020 (DDP's gradient buckets); Rajbhandari et al. 2020 (ZeRO). The parameters a rank holds
(a tensor-parallel shard of its pipeline stage's units) are kept per unit (embed, block{i}, head) as
one flat buffer, zero-padded to a multiple of N, the number of ranks it is sharded over; shard rank k
owns chunk k: its fp32 master weights and Adam moments (ZeRO-1), gradients too (ZeRO-2), and weights
too (ZeRO-3). DDP (stage 0) keeps the whole buffer. Gradients are summed over dp, and over cp as well
(cp ranks saw other tokens with the same weights); ZeRO shards over dp x cp (`zero_over = "dp_cp"`,
Megatron's distributed optimizer and torchtitan's FSDP) or over dp alone, after a sum over cp.

Over a step:
  1. `take(unit)`: the unit's working weights. Stage 3 all-gathers them and `prefetch(next)` issues
     the next unit's gather early, so it runs on the dp stream while this one computes.
  2. `gradients(unit, grads)`: one micro-batch's gradients of a unit, complete. Stages 2 and 3
     reduce-scatter them at once; DDP all-reduces, and stage 1 reduce-scatters, the sum after the
     unit's last micro-batch (a bucket per unit, overlapped with the rest of the backward pass; with
     `overlap_grad_reduce` off, all of them when the backward is done, as Megatron-LM did in 2021).
  3. `step()`: wait for the reductions (DualPipe: and sum over the unit's two copies), round each
     gradient once; with clipping, the global norm from
     one exact sum of squares over the world (each gradient element counted by one rank: the owner of
     its chunk, tp rank 0 for what tp replicates); AdamW on the owned chunk; stages 1 and 2 all-gather
     the new weights (stage 3 gathers them when they are next used).
"""

from __future__ import annotations

import math
from typing import Any, Generator

import numpy as np

from simcluster.model.gpt import grad_dtype, model_state_bytes, unscale
from simcluster.model.optimizer import AdamState, adam_init, adam_step, clip_by_norm, square_sum
from simcluster.parallel.data_parallel import DPConfig
from simcluster.program.context import Context


class DPWrap:
    def __init__(self, ctx: Context, data: DPConfig, names: dict[str, list[str]],
                 shapes: dict[str, list[tuple[int, ...]]], init: dict[str, Any], *, zero_over: str = "dp_cp",
                 counted_elsewhere: frozenset[str] = frozenset(), twin: Any = None) -> None:
        ops, mesh = ctx.ops, ctx.mesh
        self.ctx, self.ops, self.data, self.stage = ctx, ops, data, data.zero
        self.units, self.names, self.shapes = list(names), names, shapes
        both = mesh.group("dp", "cp") if mesh.cp.size > 1 else mesh.dp
        self.sum_group = both  # every rank with the same weights and other tokens
        self.twin = twin  # DualPipe: the group of the two copies of these units, each with its own micro-batches
        self.group = (mesh.dp if zero_over == "dp" else both) if self.stage else both
        self.cp_first = mesh.cp if self.stage and zero_over == "dp" and mesh.cp.size > 1 else None
        self.n = self.group.size if self.stage else 1
        self.k = self.group.rank_of(ctx.rank) if self.stage else 0
        tied = data.model.tied_head and "embed" in names
        self.needs = {u: [u] + (["embed"] if u == "head" and tied else []) for u in self.units}
        self.master = {u: ops.chunk(ops.pad(ops.flat([init[k] for k in names[u]]), self.n), self.n, self.k)
                       for u in self.units}  # fp32
        self.state = adam_init(ops, self.master)
        self.owned = self._owned(counted_elsewhere)
        self.counted = self.owned if data.clip_grad else None
        self._new_weights({u: ops.cast(self.master[u], data.precision) for u in self.units})
        if self.stage in (1, 2):  # every rank starts with all the weights
            self.working = {k: ops.cast(v, data.precision) for k, v in init.items()}
        psi = sum(math.prod(s) for u in self.units for s in shapes[u])
        owned = sum(self.master[u].shape[0] for u in self.units)
        self.per = model_state_bytes(1, data.precision)  # bytes per parameter, by category
        self.grad_count = owned if self.stage >= 2 else psi
        ctx.memory.hold("parameters", "weights", self.per["parameters"] * (owned if self.stage == 3 else psi))
        ctx.memory.hold("optimizer", "adam", self.per["optimizer"] * owned)
        self.inflight: dict[str, dict[str, Any]] = {}  # stage 3: gathers issued, by unit
        self.acc: dict[str, Any] = {}  # stages 0, 1: gradients summed over micro-batches
        self.seen: dict[str, int] = {}  # micro-batches whose gradients a unit has had this step
        self.pending: list[tuple[str, Any]] = []  # reductions in flight
        self.deferred: list[tuple[str, Any]] = []  # summed gradients waiting for the end of the backward

    def _owned(self, elsewhere: frozenset[str]) -> dict[str, Any] | None:
        """Which elements of each chunk are this rank's alone: one replica of a chunk has them (`elsewhere`
        names tensors another tp rank has). The global gradient norm counts them, a checkpoint writes them."""
        if self.ops.mode.value == "meta":
            return None
        mesh, n = self.ctx.mesh, self.n
        replica = self.ctx.rank != self.sum_group.ranks[0] if self.stage == 0 else (
            self.cp_first is not None and mesh.coord("cp") != 0)
        out = {}
        for u in self.units:
            mask = np.concatenate([np.full(int(np.prod(s)), k not in elsewhere and not replica)
                                   for k, s in zip(self.names[u], self.shapes[u])])
            mask = np.concatenate([mask, np.zeros(-len(mask) % n, bool)])
            out[u] = mask.reshape(n, -1)[self.k]
        return out

    # -- weights ------------------------------------------------------------------------------------
    def _new_weights(self, chunks: dict[str, Any]) -> None:
        """The working weights from this rank's chunks: all of them (DDP), or kept as chunks (ZeRO-3)."""
        self.chunks = chunks
        if self.stage == 0:
            self.working = self._unflat(chunks)

    def _unflat(self, flats: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for u, flat in flats.items():
            out |= dict(zip(self.names[u], self.ops.unflat(flat, self.shapes[u])))
        return out

    def prefetch(self, unit: str) -> None:
        """ZeRO-3: start gathering the unit's weights now (once per use)."""
        if self.stage == 3 and unit not in self.inflight:
            self.inflight[unit] = {x: self.ctx.comm.all_gather(self.chunks[x], group=self.group, async_op=True)
                                   for x in self.needs[unit]}

    def take(self, unit: str, ahead: str | None = None) -> Generator[Any, Any, dict[str, Any]]:
        """The unit's working weights by name; with ZeRO-3 and prefetch, `ahead`'s gather is issued too."""
        if self.stage < 3:
            return self.working
        self.prefetch(unit)
        if ahead is not None and self.data.prefetch:
            self.prefetch(ahead)
        works = self.inflight.pop(unit)
        flats = yield [works[x] for x in self.needs[unit]]
        self.ctx.memory.hold("communication", f"gathered {unit}", sum(f.shape[0] for f in flats) * self.per["parameters"])
        return self._unflat(dict(zip(self.needs[unit], flats)))

    def release(self, unit: str) -> None:
        if self.stage == 3:
            self.ctx.memory.release("communication", f"gathered {unit}")

    # -- gradients ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        self.ctx.memory.hold("gradients", "grads", self.per["gradients"] * self.grad_count)

    def gradients(self, unit: str, grads: dict[str, Any], micro_batches: int) -> Generator[Any, Any, None]:
        """One micro-batch's complete gradients (exact partials) of `unit`."""
        ops = self.ops
        flat = ops.pad(ops.flat([ops.retag(grads[k], grad_dtype(self.data.precision)) for k in self.names[unit]]),
                       self.n)
        self.seen[unit] = self.seen.get(unit, 0) + 1
        if self.stage < 2:
            self.acc[unit] = flat if unit not in self.acc else ops.add_partial(self.acc[unit], flat)
            if self.seen[unit] < micro_batches:
                return
            flat = self.acc.pop(unit)
        if self.stage < 2 and not self.data.overlap_grad_reduce:
            self.deferred.append((unit, flat))
            return
        yield from self._reduce(unit, flat)

    def _reduce(self, unit: str, flat: Any) -> Generator[Any, Any, None]:
        comm = self.ctx.comm
        if self.stage == 0:
            self.pending.append((unit, comm.all_reduce(flat, group=self.group, async_op=True)))
            return
        if self.cp_first is not None:  # ZeRO over dp alone: the cp ranks' sum first
            flat = yield comm.all_reduce(flat, group=self.cp_first)
        self.pending.append((unit, comm.reduce_scatter(flat, group=self.group, async_op=True)))

    def step(self, step: int) -> Generator[Any, Any, dict[str, Any]]:
        """The optimizer step on the owned chunks; returns their rounded gradients by unit."""
        ops, data = self.ops, self.data
        for unit, flat in self.deferred:
            yield from self._reduce(unit, flat)
        self.deferred = []
        reduced = yield [work for _, work in self.pending]
        total: dict[str, Any] = {}
        for (unit, _), part in zip(self.pending, reduced):
            total[unit] = part if unit not in total else ops.add_partial(total[unit], part)
        self.pending, self.seen = [], {}
        if self.twin is not None:  # both copies sum both halves' gradients, and stay equal
            summed = yield [self.ctx.comm.all_reduce(total[u], group=self.twin, async_op=True) for u in self.units]
            total = dict(zip(self.units, summed))
        with self.ctx.annotate("optimizer", f"O{step}"):
            grads = {u: ops.finalize(total[u]) for u in self.units}
            unscaled = unscale(ops, grads, data.precision)
            if data.clip_grad:
                mine = [g if self.counted is None else ops.where(self.counted[u], g, np.float32(0))
                        for u, g in unscaled.items()]
                squares = yield self.ctx.comm.all_reduce(square_sum(ops, mine), group=self.ctx.mesh.world)
                unscaled = clip_by_norm(ops, unscaled, squares, data.clip_grad)
            self.master = adam_step(ops, self.master, unscaled, self.state, lr=data.lr,
                                    weight_decay=data.weight_decay)
            chunks = {u: ops.cast(self.master[u], data.precision) for u in self.units}
        self.ctx.memory.release("gradients", "grads")
        if self.stage in (1, 2):
            flats = yield [self.ctx.comm.all_gather(chunks[u], group=self.group, async_op=True) for u in self.units]
            self.working = self._unflat(dict(zip(self.units, flats)))
        self._new_weights(chunks)
        return grads

    # -- checkpoints (simcluster/checkpoint.py) --------------------------------------------------------
    def snapshot(self) -> dict[str, dict[str, Any]]:
        """Each unit's chunk of every state a checkpoint keeps: fp32 master, Adam's moments, and in mixed
        precision the 16-bit working copy."""
        mixed = self.data.precision != "fp32"
        return {u: {"master": self.master[u], "adam_m": self.state.m[u], "adam_v": self.state.v[u]}
                | ({"working": self.chunks[u]} if mixed else {}) for u in self.units}

    def restore(self, states: dict[str, dict[str, Any]], step: int) -> None:
        """Continue from a checkpoint: `states` maps adam_m, adam_v (and working) to this rank's tensor
        pieces by name, as `init` gives the master weights; `step`: Adam's steps so far."""
        ops = self.ops

        def chunked(tensors: dict[str, Any]) -> dict[str, Any]:
            return {u: ops.chunk(ops.pad(ops.flat([tensors[k] for k in self.names[u]]), self.n), self.n, self.k)
                    for u in self.units}
        self.state = AdamState(chunked(states["adam_m"]), chunked(states["adam_v"]), step)
        if "working" in states:
            self._new_weights(chunked(states["working"]))
            if self.stage in (1, 2):
                self.working = dict(states["working"])

    def results(self, grads: dict[str, Any], first: dict[str, Any]) -> dict[str, Any]:
        """This rank's chunk of every unit's weights, gradients (the last step's and the first's) and
        Adam moments."""
        return {"units": {u: {"params": self.master[u], "grads": grads[u], "first_grads": first[u],
                              "adam_m": self.state.m[u], "adam_v": self.state.v[u]} for u in self.units},
                "chunk": (self.k, self.n)}
