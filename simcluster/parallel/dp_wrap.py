"""Data parallelism around whatever parameters a rank holds: DDP, or ZeRO stage 1, 2 or 3 (FSDP).

Li et al. 2020 (DDP's gradient buckets); Rajbhandari et al. 2020 (ZeRO). The parameters a rank holds
(a tensor-parallel shard of its pipeline stage's units) are kept per unit (embed, block{i}, head) as
one flat buffer, zero-padded to a multiple of N, the number of ranks it is sharded over; shard rank k
owns chunk k: its fp32 master weights and Adam moments (ZeRO-1), gradients too (ZeRO-2), and weights
too (ZeRO-3). DDP (stage 0) keeps the whole buffer. Gradients are summed over dp, and over cp as well
(cp ranks saw other tokens with the same weights); ZeRO shards over dp x cp (`zero_over = "dp_cp"`,
Megatron's distributed optimizer and torchtitan's FSDP) or over dp alone, after a sum over cp. A mixture of
experts' experts are units of their own (experts{i}, gathered with block{i}), summed and sharded over the
ranks that hold the same experts (expert parallelism: mesh.expert_groups, tp and cp ranks included,
each having routed its own tokens; the dp (x cp x tp) group without it).

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
     the new weights (with `overlap_param_gather`, Megatron's, each unit's gather waited for at its first
     use in the next step; stage 3 gathers them when they are next used). In mixed precision the step
     works on fp32 copies of the owned gradients, held while it runs (a temporary: 4 bytes an owned
     parameter beside ZeRO's 16 of model states), as the real optimizers do: Megatron-LM's fp16
     optimizer (`main_param.grad = model_param.grad.float()`, its 16-bit gradient buffer kept) and
     DeepSpeed's ZeRO (its partition's fp32 gradients; it frees the 16-bit ones first, we do not). With
     `grads_fp32` the gradients are fp32 from the start (summed exactly, rounded once to fp32, reduced
     at 4 bytes a parameter) and the step uses them as they are, as Megatron-LM's bf16 main grads.

Offloaded (ZeRO-Offload, ZeRO-Infinity: `offload_optimizer`, `offload_params`), the master weights and
moments live in the host's memory or on its NVMe: each reduced gradient chunk goes down to the host
(over PCIe, on its own copy stream, as soon as its reduction ends: under the rest of the backward),
the step runs on the host's cores (the "cpu" stream; from and back to NVMe for "nvme"), and the new
16-bit chunks go up again before the all-gather; ZeRO-3's chunks may stay in a host tier between
uses, fetched before each gather. With `delayed_update`, a step's new weights are installed only at
the end of the next step: the host's step runs under the device's next forward and backward.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Generator

import numpy as np

from simcluster.model.gpt import grad_dtype, model_state_bytes, unscale
from simcluster.model.optimizer import AdamState, adam_init, adam_step, clip_coefficient, square_sum
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.program.comm import Work
from simcluster.program.context import Context
from simcluster.topology.cluster import HOST



def _uniform(mask: Any) -> bool | None:
    """True or False where a host mask is all one value (the kernel set needs no copy of it), else None."""
    return True if mask.all() else False if not mask.any() else None

class DPWrap:
    def __init__(self, ctx: Context, data: TrainingConfig, names: dict[str, list[str]],
                 shapes: dict[str, list[tuple[int, ...]]], init: dict[str, Any], *, zero_over: str = "dp_cp",
                 counted_elsewhere: frozenset[str] = frozenset(), twin: Any = None,
                 tied: dict[str, Any] | None = None) -> None:
        ops, mesh = ctx.ops, ctx.mesh
        self.ctx, self.ops, self.data, self.stage = ctx, ops, data, data.zero
        self.units, self.names, self.shapes = list(names), names, shapes
        both = mesh.group("dp", "cp") if mesh.cp.size > 1 else mesh.dp
        self.sum_group = both  # every rank with the same weights and other tokens
        self.twin = twin  # DualPipe: the group of the two copies of these units, each with its own micro-batches
        self.tied = tied or {}  # units two stages hold, each its own part of their gradients: summed over the group
        self.group = (mesh.dp if zero_over == "dp" else both) if self.stage else both
        self.cp_first = mesh.cp if self.stage and zero_over == "dp" and mesh.cp.size > 1 else None
        self.n = self.group.size if self.stage else 1
        self.k = self.group.rank_of(ctx.rank) if self.stage else 0
        # a mixture of experts' units (experts{i}): summed, and sharded, over the ranks holding the same
        # experts (mesh.expert_groups; the dp group where every rank holds them all)
        edp = mesh.edp
        self.experts = experts = {u for u in self.units if u.startswith("experts")}
        self.sums = {u: edp if u in experts else both for u in self.units}
        self.groups = {u: edp if u in experts else self.group for u in self.units}
        self.ns = {u: (edp.size if self.stage else 1) if u in experts else self.n for u in self.units}
        self.ks = {u: (edp.rank_of(ctx.rank) if self.stage else 0) if u in experts else self.k for u in self.units}
        tied = data.model.tied_head and "embed" in names
        self.needs = {u: [u] + (["embed"] if u == "head" and tied else []) for u in self.units}
        for u in experts:  # a block's experts come with it
            self.needs["block" + u.removeprefix("experts")].append(u)
        self.master = {u: ops.chunk(ops.pad(ops.flat([init[k] for k in names[u]]), self.ns[u]), self.ns[u], self.ks[u])
                       for u in self.units}  # fp32
        self.state = adam_init(ops, self.master)
        self.owned = self._owned(counted_elsewhere)
        self.counted = ({u: _uniform(mask) if _uniform(mask) is not None else self.ops.from_host(mask)
                         for u, mask in self.owned.items()}  # where the gradients are; True/False: every element
                        if data.clip_grad and self.owned is not None else None)
        self._new_weights({u: ops.cast(self.master[u], data.precision) for u in self.units})
        if self.stage in (1, 2):  # every rank starts with all the weights
            self.working = {k: ops.cast(v, data.precision) for k, v in init.items()}
        psi = sum(math.prod(s) for u in self.units for s in shapes[u])
        owned = sum(self.master[u].shape[0] for u in self.units)
        self.per = model_state_bytes(1, data.precision, data.grads_fp32)  # bytes per parameter, by category
        self.grad_count = owned if self.stage >= 2 else psi
        self.host = None if data.offload_optimizer == "none" else data.offload_optimizer  # the optimizer's tier
        self.kept = "gpu" if data.offload_params == "none" else data.offload_params  # ZeRO-3's chunks' tier
        self.owned_count = owned
        ctx.memory.hold("parameters", "weights", self.per["parameters"] * (owned if self.stage == 3 else psi),
                        self.kept)
        ctx.memory.hold("optimizer", "adam", self.per["optimizer"] * owned, self.host or "gpu")
        self.writes: list[Any] = []  # ZeRO-3's new chunks on their way to a host tier, not yet waited for
        self.state_writes: list[Any] = []  # the optimizer state on its way to NVMe, not yet waited for
        self.incoming: Any = None  # delayed update: the last step's new chunks, installed after the next step
        self.inflight: dict[str, dict[str, Any]] = {}  # stage 3: gathers issued, by unit
        self.stale: dict[str, Any] = {}  # stages 1, 2: units whose new weights are to be gathered, their chunks
        self.gathering: dict[str, Any] = {}  # stages 1, 2: those gathers issued, not yet waited for
        self.acc: dict[str, Any] = {}  # stages 0, 1: gradients summed over micro-batches
        self.seen: dict[str, int] = {}  # micro-batches whose gradients a unit has had this step
        self.pending: list[tuple[str, Any]] = []  # reductions in flight
        self.deferred: list[tuple[str, Any]] = []  # summed gradients waiting for the end of the backward

    def _owned(self, elsewhere: frozenset[str]) -> dict[str, Any] | None:
        """Which elements of each chunk are this rank's alone: one replica of a chunk has them (`elsewhere`
        names tensors another tp rank has). The global gradient norm counts them, a checkpoint writes them."""
        if self.ops.mode.value == "meta":
            return None
        mesh = self.ctx.mesh
        out = {}
        for u in self.units:
            n = self.ns[u]
            replica = self.ctx.rank != self.sums[u].ranks[0] if self.stage == 0 else (
                self.cp_first is not None and mesh.coord("cp") != 0 and u not in self.experts)
            mask = np.concatenate([np.full(int(np.prod(s)), k not in elsewhere and not replica)
                                   for k, s in zip(self.names[u], self.shapes[u])])
            mask = np.concatenate([mask, np.zeros(-len(mask) % n, bool)])
            out[u] = mask.reshape(n, -1)[self.ks[u]]
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

    def prefetch(self, unit: str) -> Generator[Any, Any, None]:
        """ZeRO-3: start gathering the unit's weights now (once per use); chunks kept in a host tier are
        fetched first, on the copy stream, which the gather then follows."""
        if self.stage != 3 or unit in self.inflight:
            return
        comm, chunks = self.ctx.comm, {x: self.chunks[x] for x in self.needs[unit]}
        if self.kept != "gpu":
            with self.ctx.stream(f"copy:{self.kept}->gpu"):
                if self.writes:  # the last step's chunks are written before they are read
                    yield self.writes
                    self.writes = []
                fetched = yield [comm.copy(c, src=self.kept, dst="gpu", async_op=True) for c in chunks.values()]
                chunks = dict(zip(chunks, fetched))
                self.inflight[unit] = {x: comm.all_gather(c, group=self.groups[x], async_op=True)
                                       for x, c in chunks.items()}
            return
        self.inflight[unit] = {x: comm.all_gather(c, group=self.groups[x], async_op=True) for x, c in chunks.items()}

    def take(self, unit: str, ahead: str | None = None) -> Generator[Any, Any, dict[str, Any]]:
        """The unit's working weights by name; with ZeRO-3 and prefetch, `ahead`'s gather is issued too;
        with ZeRO-1/2 and `overlap_param_gather`, the unit's gather of the last step's new weights waited for."""
        if self.stage < 3:
            waits = [x for x in self.needs[unit] if x in self.gathering or x in self.stale]
            if waits:  # (the unit's, and what it needs: a block's experts, a tied head's embedding)
                yield from self._gathered(waits)
            return self.working
        yield from self.prefetch(unit)
        if ahead is not None and self.data.prefetch:
            yield from self.prefetch(ahead)
        works = self.inflight.pop(unit)
        flats = yield [works[x] for x in self.needs[unit]]
        self.ctx.memory.hold("communication", f"gathered {unit}", sum(f.shape[0] for f in flats) * self.per["parameters"])
        return self._unflat(dict(zip(self.needs[unit], flats)))

    def release(self, unit: str) -> None:
        if self.stage == 3:
            self.ctx.memory.release("communication", f"gathered {unit}")

    # -- gradients ----------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Hold the step's gradients: on the device, and offloaded each rank's reduced chunk on the host
        (stage 1 still sums every micro-batch's whole gradient on the device first). With
        `overlap_param_gather`, the last step's new weights' gathers start now, on every pipeline stage at
        once (after the last step's loss reduction on the same group), each waited for at its unit's first
        `take`: Megatron-Core's forward pre-hooks, with its pipeline schedules' aligned dispatch
        (align_param_gather) where pp > 1."""
        self._dispatch()
        if self.host is None or self.stage == 1:
            self.ctx.memory.hold("gradients", "grads", self.per["gradients"] * self.grad_count)
        if self.host is not None:
            self.ctx.memory.hold("gradients", "grads", self.per["gradients"] * self.owned_count, "cpu")

    def gradients(self, unit: str, grads: dict[str, Any], micro_batches: int) -> Generator[Any, Any, None]:
        """One micro-batch's complete gradients (exact partials) of `unit`, into its flat buffer and, below
        ZeRO-2, added to the micro-batches' before. With `grad_accumulation_fusion` the weight-gradient GEMMs
        write them there, adding to what it holds (Megatron-LM's: no kernels of their own). Without, the sum is
        a kernel each micro-batch after the first (autograd's accumulation), and so is the copy into the buffer
        when it is reduced (DDP's into its bucket after the last micro-batch, FSDP's before each reduce-scatter)."""
        ops, fused = self.ops, self.data.grad_accumulation_fusion
        self.seen[unit] = self.seen.get(unit, 0) + 1
        reduced = self.stage >= 2 or self.seen[unit] == micro_batches
        with ops.fused(None) if fused or not reduced else nullcontext():
            flat = ops.pad(ops.flat([ops.retag(grads[k], grad_dtype(self.data.precision, self.data.grads_fp32))
                                     for k in self.names[unit]]),
                           self.ns[unit])
        if self.stage < 2 and unit in self.acc:
            with ops.fused(None) if fused else nullcontext():
                flat = ops.add_partial(self.acc[unit], flat)
        if self.stage < 2:
            self.acc[unit] = flat
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
            self.pending.append((unit, comm.all_reduce(flat, group=self.groups[unit], async_op=True, donate=True)))
            return
        if self.cp_first is not None and unit not in self.experts:  # ZeRO over dp alone: the cp ranks' sum first
            flat = yield comm.all_reduce(flat, group=self.cp_first)
        work = comm.reduce_scatter(flat, group=self.groups[unit], async_op=True, donate=True)
        if self.host is not None:  # down to the host once reduced (waited on the copy stream, not the compute one)
            with self.ctx.stream("copy:gpu->cpu"):
                part = yield work
                work = comm.copy(part, src="gpu", dst="cpu", async_op=True)
        self.pending.append((unit, work))

    def step(self, step: int) -> Generator[Any, Any, dict[str, Any]]:
        """The optimizer step on the owned chunks; returns their rounded gradients by unit."""
        ops, data, comm = self.ops, self.data, self.ctx.comm
        if self.gathering or self.stale:  # (a unit no pass used this step: the step rewrites its chunks)
            yield from self._gathered([*self.gathering, *self.stale])
        for unit, flat in self.deferred:
            yield from self._reduce(unit, flat)
        self.deferred = []
        if data.delayed_update and self.incoming is not None:  # the last step's weights, for the next step
            yield from self._install(self.incoming)
        with self.ctx.stream(HOST) if self.host else nullcontext():  # on the host's cores, offloaded
            reduced = yield [work for _, work in self.pending]
            total: dict[str, Any] = {}
            for (unit, _), part in zip(self.pending, reduced):
                total[unit] = part if unit not in total else ops.add_partial(total[unit], part)
            self.pending, self.seen = [], {}
            if self.twin is not None:  # both copies sum both halves' gradients, and stay equal
                summed = yield [comm.all_reduce(total[u], group=self.twin, async_op=True) for u in self.units]
                total = dict(zip(self.units, summed))
            for u, group in self.tied.items():  # (a tied head's embedding: the first stage's and the last's)
                total[u] = yield comm.all_reduce(total[u], group=group)
            if self.host == "nvme":
                yield from self._swap_in()
            with self.ctx.annotate("optimizer", f"O{step}"):
                grads = {u: ops.finalize(total[u]) for u in self.units}
                copied = data.precision != "fp32" and not data.grads_fp32  # the step's fp32 gradients (docstring)
                if copied:
                    self.ctx.memory.hold("temporaries", "fp32 grads", 4 * self.owned_count, self.host or "gpu")
                unscaled = unscale(ops, grads, data.precision)
                clip = None
                if data.clip_grad:
                    mine = self._counted(unscaled)
                    squares = yield comm.all_reduce(square_sum(ops, mine), group=self.ctx.mesh.world)
                    clip = clip_coefficient(ops, squares, data.clip_grad)
                free = self._last_weights_free()
                self.master = adam_step(ops, self.master, unscaled, self.state, lr=data.lr,
                                        weight_decay=data.weight_decay, clip=clip, donate=free)
                if copied:
                    self.ctx.memory.release("temporaries", "fp32 grads", self.host or "gpu")
                # the 16-bit working chunks rounded anew into the last step's (a host's are copied to the
                # device, not held)
                into = self.chunks if free and data.precision != "fp32" and not self.host else {}
                chunks: dict[str, Any] = {u: ops.cast(self.master[u], data.precision, out=into.get(u))
                                          for u in self.units}
            if self.host == "nvme":
                self._swap_out()
            here, to = ("cpu" if self.host else "gpu"), (self.kept if self.stage == 3 else "gpu")
            moves = {u: comm.copy(c, src=here, dst=to, async_op=True) for u, c in chunks.items()} if here != to else {}
        if self.host is None or self.stage == 1:
            self.ctx.memory.release("gradients", "grads")
        if self.host is not None:
            self.ctx.memory.release("gradients", "grads", "cpu")
        if data.delayed_update:
            self.incoming = (chunks, moves)
        else:
            yield from self._install((chunks, moves))
        return grads

    def _counted(self, grads: dict[str, Any]) -> list[Any]:
        """The gradients whose squares this rank adds to the global norm: the elements it counts (the rest
        zero). A unit it counts none of is left out, not zeroed and squared: a DDP replica's whole pass
        over its gradients for a sum of zeros, which the other ranks waited for at the norm's all-reduce
        (1.3 s a step of a 2-rank Llama h2048 on this CPU, measured). A rank that counts nothing adds a
        one-element zero. (Meta mode has no masks: every rank squares every gradient, as the counting
        rank does, so that data-parallel replicas run one program and fold.)"""
        if self.counted is None:
            return list(grads.values())
        ops = self.ops
        mine = [g if self.counted[u] is True else ops.where(self.counted[u], g, 0.0)
                for u, g in grads.items() if self.counted[u] is not False]
        if not mine:
            g = next(iter(grads.values()))
            mine = [ops.where(False, ops.chunk(g, g.shape[0], 0), 0.0)]
        return mine

    def _last_weights_free(self) -> bool:
        """Whether this step's optimizer may write its results into the last step's weights: the master
        (in fp32 on the device also the working weights) and the 16-bit working chunks. Nothing reads them
        after the backward, save with a delayed update, whose next step computes with them."""
        return not self.data.delayed_update

    def _install(self, new: tuple[dict[str, Any], dict[str, Work]]) -> Generator[Any, Any, None]:
        """The step's new 16-bit chunks become the working weights: (their values, their copies under way
        to where they are kept). Chunks kept in a host tier are waited for before they are next read."""
        chunks, moves = new
        self.incoming = None
        if self.stage == 3 and self.kept != "gpu":
            self.writes += list(moves.values())
        elif moves:
            chunks = chunks | dict(zip(moves, (yield list(moves.values()))))
        if self.stage in (1, 2):
            self.stale = {u: chunks[u] for u in self.units}
            if not self.data.overlap_param_gather:  # (else gathered under the next forward: `take`)
                yield from self._gathered(self.units)
        self._new_weights(chunks)

    def _dispatch(self) -> None:
        """ZeRO-1/2: the stale units' gathers of their new weights issued, in unit order."""
        for u, chunk in self.stale.items():
            self.gathering[u] = self.ctx.comm.all_gather(chunk, group=self.groups[u], async_op=True)
        self.stale = {}

    def _gathered(self, units: list[str]) -> Generator[Any, Any, None]:
        """ZeRO-1/2: the units' new weights all-gathered and waited for, the working weights theirs (every
        stale unit's gather issued first, in unit order on the dp stream)."""
        self._dispatch()
        flats = yield [self.gathering.pop(u) for u in units]
        self.working = self.working | self._unflat(dict(zip(units, flats)))

    def _swap_in(self) -> Generator[Any, Any, None]:
        """ZeRO-Infinity: the owned master weights and moments from NVMe to the host (after the last
        step's writes), held in a host buffer for the step."""
        comm, units = self.ctx.comm, self.units
        if self.state_writes:
            yield self.state_writes
            self.state_writes = []
        self.ctx.memory.hold("optimizer", "swapped in", self.per["optimizer"] * self.owned_count, "cpu")
        states = [self.master, self.state.m, self.state.v]
        read = yield [comm.copy(d[u], src="nvme", dst="cpu", async_op=True) for d in states for u in units]
        for i, d in enumerate(states):
            d.update(zip(units, read[i * len(units):(i + 1) * len(units)]))

    def _swap_out(self) -> None:
        """The updated master weights and moments back to NVMe (waited for before the next read)."""
        comm = self.ctx.comm
        self.state_writes += [comm.copy(d[u], src="cpu", dst="nvme", async_op=True)
                              for d in (self.master, self.state.m, self.state.v) for u in self.units]
        self.ctx.memory.release("optimizer", "swapped in", "cpu")

    def finish(self) -> Generator[Any, Any, None]:
        """After the last step: a delayed update's weights installed, the weights' gathers and NVMe writes
        waited for."""
        if self.incoming is not None:
            yield from self._install(self.incoming)
        if self.gathering or self.stale:
            yield from self._gathered([*self.gathering, *self.stale])
        if self.writes or self.state_writes:
            yield self.writes + self.state_writes
            self.writes, self.state_writes = [], []

    # -- checkpoints (simcluster/checkpoint/) --------------------------------------------------------
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
            return {u: ops.chunk(ops.pad(ops.flat([tensors[k] for k in self.names[u]]), self.ns[u]), self.ns[u],
                                 self.ks[u]) for u in self.units}
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
                "chunk": (self.k, self.n), "chunks": {u: (self.ks[u], self.ns[u]) for u in self.units}}
