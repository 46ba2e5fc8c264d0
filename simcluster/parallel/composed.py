"""Every parallelism at once: the GPT trained under any (dp, pp, cp, tp) layout, bit-exact.

The axes compose in the order real stacks apply them (torchtitan's parallelize, Megatron-LM's model
provider): the model is cut into pipeline chunks (pipeline.py's `partition`); each chunk's blocks are
TransformerShard blocks, split over tp (and sp) and cp as the parallelism says (transformer_shard.py); data parallelism,
DDP or ZeRO-1/2/3, wraps the parameters the rank then holds (dp_wrap.py). With pp = 1 the pipeline is
one stage whose passes are F(j), B(j) for each micro-batch: plain gradient accumulation.

Per step, on every rank:
  1. the stage's passes (pipeline_schedules.py), each pass running its chunk's units in order
     (backward: in reverse), taking each unit's weights from the data-parallel wrapper (ZeRO-3
     gathers them) and handing it each unit's gradients as soon as a micro-batch has completed them
     (with ZB-H1, after the W pass); with SP, the gradients of weights that tp replicates (norms,
     biases, positions) are first summed over tp, since each tp rank saw only its tokens;
  2. the optimizer step on what the rank owns (dp_wrap.py);
  3. the loss, summed over dp and cp, on the last stage.
`assemble` turns the ranks' results back into one device's tensors, whatever the layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Generator

import numpy as np

from simcluster import checkpoint
from simcluster.model.config import companions
from simcluster.model.gpt import LOSS_SCALE, init_params, unit_names
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.data_parallel import KINDS
from simcluster.parallel.dp_wrap import DPWrap
from simcluster.parallel.llama_shard import LlamaShard
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.pipeline import execute, partition
from simcluster.parallel.pipeline_schedules import Pass, deferred, label, pairs, passes as stage_passes, placement
from simcluster.parallel.tape import Tapes, shape_key
from simcluster.parallel.tensor_parallel import replicas, shard, shard_kind, shard_shape, unshard
from simcluster.parallel.transformer_shard import TransformerShard
from simcluster.program.context import Context


@functools.lru_cache(maxsize=64)
def _units_by_chunk(pieces: tuple[tuple[str, ...], ...], place: Any) -> tuple[tuple[str, ...], ...]:
    return tuple(pieces[place.piece[g]] for g in range(place.chunks))


@functools.lru_cache(maxsize=64)
def chunk_units(layers: int, pieces: int, embedding: bool = False, loss: bool = False) -> tuple[tuple[str, ...], ...]:
    """Each piece's units in forward order (piece 0 embeds, the last has the head; pipeline.partition)."""
    out = [[f"block{i}" for i in r] for r in partition(layers, pieces, embedding, loss)]
    out[0].insert(0, "embed")
    out[-1].append("head")
    return tuple(tuple(units) for units in out)


class Stage:
    """A pipeline stage's work for one step (pipeline.StageWork): its chunks' units on this rank."""

    def __init__(self, ctx: Context, parallelism: Parallelism, model: TransformerShard, dp: DPWrap, units: list[list[str]],
                 step: int, passes: list[Pass], tapes: Tapes | None = None, feeds: bool = False) -> None:
        self.ctx, self.ops, self.parallelism, self.model, self.dp = ctx, ctx.ops, parallelism, model, dp
        self.feeds = feeds  # a tied head here feeds the embedding unit its share of wte's gradient (_Placed.feeds)
        self.units, self.step, self.tapes = units, step, tapes  # units: by chunk
        self.weights: dict[str, Any] = {}  # a unit's weights' shapes, for tape keys
        self.split = deferred(passes)  # (micro-batch, chunk) whose weight gradients wait for a W pass
        self.several = len({g for _, _, g in passes}) > 1  # chunks on this stage (each pass named F3.5)
        # micro-batches through each unit here (all of them, but half for each of DualPipe's copies)
        self.through: dict[str, int] = {}
        for kind, _, g in passes:
            for u in units[g] if kind == "B" else ():
                self.through[u] = self.through.get(u, 0) + 1
        if feeds:  # (the head's micro-batches too: DualPipe's ends run the embedding for the others)
            self.through["embed"] = self.through.get("embed", 0) + self.through["head"]
        data = parallelism.data
        self.d, self.n = ctx.mesh.coord("dp"), ctx.mesh.dp.size
        b = data.global_batch // (self.n * data.micro_batches)
        self.shape = (b, len(model.tokens), data.model.hidden)
        # Megatron-LM's scatter/gather of pipeline messages: without sp every tp rank holds the whole
        # activation, so each sends only its 1/tp of it (over its own NIC) and the receiving stage
        # all-gathers the parts over tp (NVLink): a message crosses the network once, not tp times
        self.scatter = parallelism.scatter_gather and model.t > 1 and not model.sp
        self.scale = LOSS_SCALE[data.precision]
        self.caches: dict[tuple[int, int], dict[str, Any]] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.grads: dict[int, dict[str, Any]] = {}  # by micro-batch: gradients not yet handed over
        self.loss_sum: Any = None

    def key(self, kind: str, u: str, p: dict[str, Any], *inputs: Any) -> Any:
        """What a block's pass depends on besides its layer index (tape.py): its weights' and inputs'
        shapes (a dropout mask's step and micro-batch change its values, which meta mode has not,
        never its shape). None: run it untaped."""
        if self.tapes is None:
            return None
        weights = self.weights.get(u)
        if weights is None:  # (the same shapes for the whole step, whether held or gathered)
            m = self.parallelism.model
            weights = self.weights[u] = shape_key([p[k] for x in [u, *companions(m, u)] for k in unit_names(m, x)])
        if weights is None:
            return None
        return (kind, weights, shape_key(inputs))

    def message(self) -> Any:
        b, s, h = self.shape
        return MetaTensor((b, s, h // self.model.t if self.scatter else h), self.parallelism.data.precision)

    def pack(self, value: Any) -> Any:
        return self.ctx.ops.split(value, self.model.t, 2)[self.model.tr] if self.scatter else value

    def unpack(self, message: Any) -> Generator[Any, Any, Any]:
        if not self.scatter:
            return message
        return (yield self.ctx.comm.all_gather(message, group=self.model.tp, dim=2))

    def forward(self, j: int, g: int, x: Any) -> Generator[Any, Any, Any]:
        model, dp, step = self.model, self.dp, self.step
        units = self.units[g]
        if (units[0] == "embed" or units[-1] == "head") and self.ctx.ops.mode is Mode.META:  # shapes, no tokens
            where, data = self.parallelism.data.where(self.d, self.n, j), self.parallelism.data
            ids = targets = MetaTensor((data.global_batch // (self.n * data.micro_batches), len(model.positions)),
                                       "int64")
        elif units[0] == "embed" or units[-1] == "head":  # (the other stages need no token ids)
            where, ids, targets = self.parallelism.data.micro_batch(step, self.d, self.n, j)
            ids, targets = (self.ctx.ops.from_host(x[:, model.positions]) for x in (ids, targets))  # my cp share
        else:
            where = self.parallelism.data.where(self.d, self.n, j)
        cache: dict[str, Any] = {"where": where}
        for index, u in enumerate(units):
            p = yield from dp.take(u, units[index + 1] if index + 1 < len(units) else None)
            with self.ctx.annotate("forward", f"{label('F', j, g, self.several)}:{u}"):
                if u == "embed":
                    x, cache[u] = yield from model.embed(p, ids, step, where)
                    held = model.gpt.held_bytes(cache[u])
                elif u == "head":
                    part, cache[u] = yield from model.head(p, x, targets)
                    self.loss_sum = part if self.loss_sum is None else self.ops.add_partial(self.loss_sum, part)
                    held, x = model.gpt.held_bytes(cache[u]), None
                else:
                    i = int(u[len("block"):])
                    x, cache[u] = yield from self.run(self.key("F", u, p, x), i,
                                                      lambda: model.block(p, x, i, step, where))
                    held = model.held(x, i)
            dp.release(u)
            self.ctx.memory.hold("activations", f"mb{j}.{u}", held)
        self.caches[(j, g)] = cache
        return x

    def backward(self, j: int, g: int, dy: Any) -> Generator[Any, Any, Any]:
        model, dp, cache = self.model, self.dp, self.caches[(j, g)]
        where = cache["where"]
        defer: list | None = [] if (j, g) in self.split else None
        grads = self.grads.setdefault(j, {})
        units = self.units[g][::-1]
        for index, u in enumerate(units):
            p = yield from dp.take(u, units[index + 1] if index + 1 < len(units) else None)
            with self.ctx.annotate("backward", f"{label('B', j, g, self.several)}:{u}"):
                if u == "head":
                    tokens = where.total * self.parallelism.model.seq
                    dy = yield from model.head_backward(p, cache["head"], tokens, self.scale, grads, defer)
                    if self.feeds:  # the copy's gradients: the head's share of wte (and nothing of wpe)
                        model.copy_gradients(cache["head"], grads)
                elif u == "embed":
                    yield from model.embed_backward(cache["embed"], dy, grads)
                    dy = None
                else:
                    i = int(u[len("block"):])
                    key = self.key("B" if defer is None else "B-W", u, p, dy, cache[u])
                    dy = yield from self.run(key, i, lambda: model.block_backward(p, dy, cache[u], i, self.step, where,
                                                                                  grads, defer), grads, defer)
            dp.release(u)
            if defer is None:
                self.ctx.memory.release("activations", f"mb{j}.{u}")
                yield from self.hand_over(u, j)
        if defer is None:
            del self.caches[(j, g)]
        else:
            self.deferred[(j, g)] = defer
        return dy

    def run(self, key: Any, layer: int, block: Any, grads: dict[str, Any] | None = None,
            defer: list | None = None) -> Generator[Any, Any, Any]:
        if key is None:
            return (yield from block())
        return (yield from self.tapes.run(key, layer, block, grads, defer))

    def weight(self, j: int, g: int) -> Generator[Any, Any, None]:
        """A W pass: the deferred weight gradients, then the chunk's units are complete."""
        grads = self.grads[j]
        for name, thunk in self.deferred.pop((j, g)):
            grads[name] = thunk()
        del self.caches[(j, g)]
        for u in self.units[g][::-1]:
            self.ctx.memory.release("activations", f"mb{j}.{u}")
            yield from self.hand_over(u, j)

    def hand_over(self, unit: str, j: int) -> Generator[Any, Any, None]:
        """Micro-batch j's gradients of `unit` are complete: to the data-parallel wrapper."""
        mine, m = self.grads[j], self.parallelism.model
        grads = {k: mine.pop(k) for k in unit_names(m, unit)}
        names = [k for k in grads if shard_kind(k) == "replicated"] if self.model.sp else []
        if names:  # replicated over tp, but each tp rank saw only its tokens (SP)
            with self.ctx.annotate("backward", f"SP{j}"):
                summed = yield [self.ctx.comm.all_reduce(grads[k], group=self.model.tp, async_op=True) for k in names]
            grads |= dict(zip(names, summed))
        yield from self.dp.gradients(unit, grads, self.through[unit])
        for x in companions(m, unit):  # a block's experts, reduced over the ranks that hold them
            yield from self.dp.gradients(x, {k: mine.pop(k) for k in unit_names(m, x)}, self.through[unit])
        if unit == "head" and self.feeds:
            yield from self.hand_over("embed", j)


def composed(ctx: Context, parallelism: Parallelism) -> Generator[Any, Any, dict[str, Any]]:
    """One rank's training under `parallelism`, in the steps torchtitan's `parallelize_llama` takes: where
    its pipeline stage sits, which shards it holds, its weights (fresh or resumed), the data-parallel
    wrapper around them, then the training steps."""
    mesh = ctx.mesh
    parallelism.check(mesh.dp.size, mesh.pp.size, mesh.cp.size, mesh.tp.size)
    stage = _placed(ctx, parallelism)
    shards = _Shards.of(ctx, parallelism, stage)
    ck = parallelism.checkpoint if ctx.ops.mode is not Mode.META else None  # (a preflight of a run that saves)
    start, init, loaded, biases = _weights(ctx, parallelism, shards, ck)
    dp = _wrapped(ctx, parallelism, stage, shards, init, loaded, start)
    del init, loaded  # (the wrapper's flat copies hold them: kept here too, a GPU held the weights twice)
    return (yield from _train(ctx, parallelism, stage, shards, dp, start, ck, biases))


@dataclass(frozen=True)
class _Placed:
    """Where this rank's pipeline stage sits in the schedule."""
    place: Any  # pipeline_schedules.placement: the chunks and the stages that run them
    passes: Any  # this stage's passes, in order
    neighbours: Callable[[int], Any]  # another stage's passes (what it sends here)
    units: tuple[tuple[str, ...], ...]  # the units of each chunk
    mine: list[str]  # this stage's units, in model order
    twin: Any  # DualPipe: the group of this rank and its mirror; else None
    copies: set[str]  # DualPipe: the units of the reverse chain's copies this stage holds; a tied head's embedding
    tie: Any = None  # a tied head across stages: the first and the last stage (Megatron's embedding group); else None
    feeds: bool = False  # a tied head here runs micro-batches its embedding does not: wte's gradient handed apart
    pairs: frozenset[int] = frozenset()  # DualPipe: passes run together with the next (pipeline_schedules.pairs)


def _placed(ctx: Context, parallelism: Parallelism) -> _Placed:
    mesh, m = ctx.mesh, parallelism.model
    p, s = mesh.pp.size, mesh.coord("pp")
    shape = parallelism.shape(p)
    place = placement(parallelism.schedule, shape)
    neighbours = functools.lru_cache(lambda q: stage_passes(parallelism.schedule, shape, q))
    pieces = chunk_units(m.layers, place.pieces, parallelism.embedding_in_split, parallelism.loss_in_split)
    units = _units_by_chunk(pieces, place)
    mine = [u for c in sorted(place.piece[g] for g in place.on(s)) for u in pieces[c]]  # model order
    dual = place.pieces < place.chunks  # DualPipe: each piece twice, the reverse chain's copy not counted twice
    twin = mesh.mesh.mirror(ctx.rank) if dual else None
    copies = {u for g in place.on(s) if g >= place.pieces for u in units[g]} if dual else set()
    tie = None
    if m.tied_head and not dual and ("embed" in mine) != ("head" in mine):
        tie = mesh.mesh.mirror(ctx.rank)  # the head's stage holds a copy of the embedding, summed with the first's
        if "head" in mine:
            mine, copies = ["embed", *mine], {"embed"}
    feeds = m.tied_head and "head" in mine and (tie is not None or dual)
    return _Placed(place, stage_passes(parallelism.schedule, shape, s), neighbours, units, mine, twin, copies, tie,
                   feeds, pairs(parallelism.schedule, shape, s) if parallelism.dualpipe_overlap else frozenset())


@dataclass(frozen=True)
class _Shards:
    """The parameters this rank holds: their names by unit, and how each is split over tp."""
    names: dict[str, list[str]]  # (a block's experts a unit of their own: config.companions)
    kinds: dict[str, str]  # tensor_parallel.shard_kind
    t: int
    r: int
    ep: int = 1  # experts shared out over ep ranks: this rank holds the e-th ep-th of each expert tensor
    e: int = 0

    @staticmethod
    def of(ctx: Context, parallelism: Parallelism, stage: _Placed) -> _Shards:
        m, t = parallelism.model, ctx.mesh.tp.size
        units = [x for u in stage.mine for x in [u, *companions(m, u)]]
        names = {u: unit_names(m, u) for u in units}
        ep = ctx.mesh.ep
        return _Shards(names, {k: shard_kind(k, m, t) for u in units for k in names[u]}, t, ctx.mesh.coord("tp"),
                       ep.size, ep.rank_of(ctx.rank))

    def split(self, ops: Any, full: dict[str, Any], host: bool) -> dict[str, Any]:
        """This rank's share of each whole tensor (`host`: read from a file, made the kernel set's first)."""
        out = {k: shard(ops.constant(full[k], full[k].dtype) if host else full[k], self.kinds[k], self.t, self.r)
               for k in self.kinds}
        if self.ep > 1:  # its experts of each (E, ...) tensor
            for u, names in self.names.items():
                for k in names if u.startswith("experts") else ():
                    out[k] = ops.split(out[k], self.ep, 0)[self.e]
        return out


def _weights(ctx: Context, parallelism: Parallelism, shards: _Shards,
             ck: Any) -> tuple[int, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The first step, this rank's initial weights, and what a resumed checkpoint holds beside them: the
    optimizer's states, and the experts' selection biases."""
    start, loaded, biases = checkpoint.read(ck.resume, list(shards.kinds)) if ck and ck.resume else (0, {}, {})
    full = loaded.pop("master") if loaded else init_params(ctx.ops, parallelism.model, list(shards.kinds))
    return start, shards.split(ctx.ops, full, bool(loaded)), loaded, biases


def _wrapped(ctx: Context, parallelism: Parallelism, stage: _Placed, shards: _Shards, init: dict[str, Any],
             loaded: dict[str, Any], start: int) -> DPWrap:
    """DDP or ZeRO around the parameters this rank holds (with a resumed optimizer state)."""
    t, r, kinds, names = shards.t, shards.r, shards.kinds, shards.names
    # tensors whose copy on an earlier tp rank counts in the global gradient norm (not the experts': their
    # data-parallel group holds the tp ranks, each with its own chunk)
    experts = {k for u in names if u.startswith("experts") for k in names[u]}
    elsewhere = frozenset(k for k in init if r % (t if kinds[k] == "replicated" else replicas(kinds[k]))
                          and k not in experts)
    elsewhere |= {k for u in stage.copies for x in [u, *companions(parallelism.model, u)] for k in names[x]}
    dp = DPWrap(ctx, parallelism.data, names, {u: [tuple(init[k].shape) for k in names[u]] for u in names},
                init, zero_over=parallelism.zero_over, counted_elsewhere=elsewhere, twin=stage.twin,
                tied={"embed": stage.tie} if stage.tie is not None else {})
    if loaded:
        dp.restore({state: shards.split(ctx.ops, v, True) for state, v in loaded.items()}, start)
    return dp


def _train(ctx: Context, parallelism: Parallelism, stage: _Placed, shards: _Shards, dp: DPWrap, start: int,
           ck: Any, biases: dict[str, Any]) -> Generator[Any, Any, dict[str, Any]]:
    """The steps from `start`: the stage's passes, the optimizer step, the loss; a save where asked."""
    ops, data, m = ctx.ops, parallelism.data, parallelism.model
    model = (LlamaShard if m.arch == "llama" else TransformerShard)(ctx, parallelism)
    tapes = Tapes.of(ctx)  # meta mode on the emulator: each kind of block's Python runs once
    losses: list[Any] = []
    grads: dict[str, Any] = {}
    first: dict[str, Any] = {}
    written = None
    model.restore_biases(biases)  # (a resumed run's: as the checkpoint's steps left them)
    for step in range(start, data.steps):
        if ck and ck.save and ck.at == step:
            written = _save(ctx, ck, m, stage, shards, dp, step, model.biases)
        dp.begin_step()
        work = Stage(ctx, parallelism, model, dp, stage.units, step, stage.passes, tapes, feeds=stage.feeds)
        yield from execute(ctx, stage.passes, work, stage.place, ctx.mesh.pp, stage.neighbours, stage.pairs)
        reduced = yield from dp.step(step)
        if m.moe_bias_rate:  # (the experts' selection bias, DeepSeek-V3's, moves with the step's loads)
            yield from model.balance(step, dp.sum_group, stage.twin)
        first = first or reduced
        grads = reduced if step == data.steps - 1 else {}  # (not held through the next step, as no trainer does)
        del reduced
        if work.loss_sum is not None:  # the last stage
            with ctx.annotate("forward", "loss"):
                total = yield ctx.comm.all_reduce(work.loss_sum, group=dp.sum_group)
                if stage.twin is not None:  # DualPipe: the other end's micro-batches
                    total = yield ctx.comm.all_reduce(total, group=stage.twin)
            losses.append(ops.scale(ops.finalize(total), 1.0 / (data.global_batch * m.seq)))
    yield from dp.finish()
    if ck and ck.save and ck.at == data.steps:
        written = _save(ctx, ck, m, stage, shards, dp, data.steps, model.biases)
    return {"loss": losses, "first_step": start, "checkpoint": written, "routing": model.routing,
            "router_bias": {k: ops.xp.to_host(v) for k, v in model.biases.items()},
            "expert_shard": (ctx.mesh.ep.rank_of(ctx.rank), ctx.mesh.ep.size), **dp.results(grads, first)}


def _save(ctx: Context, ck: Any, m: Any, stage: _Placed, shards: _Shards, dp: DPWrap, step: int,
          biases: dict[str, Any]) -> Any:
    """This rank's file of the checkpoint: the states it owns, copied to the host, which writes the file."""
    shapes, ops, names, kinds, t, r = m.parameter_shapes(), ctx.ops, shards.names, shards.kinds, shards.t, shards.r
    snap = {u: {k: ops.xp.to_host(v) for k, v in states.items()} for u, states in dp.snapshot().items()}

    def piece(u: str, i: int, x: Any) -> Any:  # this rank's piece of a whole tensor (of its indices, here)
        x = shard(x, kinds[names[u][i]], t, r)
        if u.startswith("experts") and shards.ep > 1:  # its experts
            n = x.shape[0] // shards.ep
            x = x[shards.e * n:(shards.e + 1) * n]
        return x
    written = checkpoint.write_rank(ck.staging, ctx.rank, step, [
        dict(zip(("index", "which"), checkpoint.element_index(
            [shapes[k] for k in names[u]], lambda i, x, u=u: piece(u, i, x), dp.ns[u], dp.ks[u])),
             names=names[u], mask=dp.owned[u], states=snap[u]) for u in names])
    if biases:  # (as they are now: the steps saved; every rank that runs a layer holds its bias)
        written = (written or {}) | {"router_bias": {k: [float(v) for v in ops.xp.to_host(b)] for k, b in biases.items()}}
    return written


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]], parallelism: Parallelism) -> dict[str, Any]:
    """The single-device view of any layout: each unit's chunks joined over its shard group, the
    tensor-parallel pieces joined by name. Replicas (the same chunk on several ranks, a replicated
    tensor on every tp rank) must agree: one that differs is reported as its own output."""
    m = parallelism.model
    t = max(c["tp"] for c in coords) + 1
    out: dict[str, Any] = {}
    for rank, (res, c) in enumerate(zip(results, coords)):
        if res["loss"]:  # the stages with a head (the last; ZB-V's first; DualPipe's both ends)
            _agree(out, {f"loss[{res['first_step'] + i}]": v for i, v in enumerate(res["loss"])}, rank)
    out |= router_statistics(results)
    for rank, res in enumerate(results):  # (the selection bias: every rank of a layer has it)
        _agree(out, res.get("router_bias", {}), rank)
    shapes = m.parameter_shapes()
    ep = max(res.get("expert_shard", (0, 1))[1] for res in results)  # (the run's, whatever `parallelism` says)
    for kind in KINDS:
        # (unit, tp rank, ep rank) -> chunk index -> flat; experts: shared out over ep, whole on tp ranks (tp 0)
        pieces: dict[tuple[str, int, int], dict[int, Any]] = {}
        for rank, (res, c) in enumerate(zip(results, coords)):
            for unit, arrays in res["units"].items():
                k, _ = res.get("chunks", {}).get(unit, res["chunk"])
                whole = unit.startswith("experts")  # (their chunks over the tp ranks too: mesh.expert_groups)
                got = pieces.setdefault((unit, 0, res.get("expert_shard", (0, 1))[0]) if whole else (unit, c["tp"], 0), {})
                if k in got and np.asarray(got[k]).tobytes() != np.asarray(arrays[kind]).tobytes():
                    out[f"{kind}.{unit}[chunk {k}]@rank{rank}"] = arrays[kind]
                got.setdefault(k, arrays[kind])
        for unit in sorted({u for u, _, _ in pieces}):
            by_tp, whole = [], unit.startswith("experts")
            for tr in range(1 if whole else t):
                tensors = {}
                for e in range(ep if whole else 1):
                    chunks = pieces[(unit, tr, e)]
                    flat = np.concatenate([np.asarray(chunks[i]).reshape(-1) for i in sorted(chunks)])
                    at = 0
                    for name in unit_names(m, unit):
                        local = shard_shape(shapes[name], "replicated" if whole else shard_kind(name, m, t), t)
                        local = (local[0] // ep,) + local[1:] if whole else local
                        n = math.prod(local)
                        part = flat[at:at + n].reshape(local)
                        tensors[name] = part if e == 0 else np.concatenate([tensors[name], part])  # experts in order
                        at += n
                by_tp.append(tensors)
            for name in unit_names(m, unit):
                parts = [tensors[name] for tensors in by_tp]
                how = "replicated" if whole else shard_kind(name, m, t)
                out[f"{kind}.{name}"] = unshard(parts, how)
                copies = t if how == "replicated" else replicas(how)  # consecutive tp ranks holding one piece
                for tr in range(len(parts)):
                    if tr % copies and parts[tr].tobytes() != parts[tr - tr % copies].tobytes():
                        out[f"{kind}.{name}@tp{tr}"] = parts[tr]
    return out


def router_statistics(results: list[dict[str, Any]]) -> dict[str, Any]:
    """A mixture of experts' token counts by step, layer and expert, summed over the ranks (each counted
    its own tokens: moe_shard.Experts.tally)."""
    out: dict[str, Any] = {}
    for res in results:
        for key, n in res.get("routing", {}).items():
            out[key] = n if key not in out else out[key] + n
    return out


def _agree(out: dict[str, Any], values: dict[str, Any], rank: int) -> None:
    for key, value in values.items():
        if key not in out:
            out[key] = value
        elif np.asarray(value).tobytes() != np.asarray(out[key]).tobytes():
            out[f"{key}@rank{rank}"] = value
