"""ZeRO stages 1, 2 and 3 (FSDP): optimizer state, then gradients, then parameters sharded over dp.

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models" (SC 2020).
Each unit (embed, block0 .. block{L-1}, head) is one flat buffer, zero-padded to a multiple of N;
rank d owns chunk d of every unit: its fp32 master weights, Adam moments and, from stage 2, gradients.

Per step:
  1. forward, unit by unit. Stage 3 all-gathers each unit's weights just before it computes and frees
     them after; with prefetch, the next unit's all-gather is issued before this unit computes, so it
     runs on the dp stream during this unit's compute.
  2. backward, unit by unit in reverse (stage 3 gathers again, with the same prefetch). As each unit's
     gradients are complete they are reduce-scattered over dp: stage 1 once per step (after the last
     micro-batch), stages 2 and 3 every micro-batch, so no rank ever holds a full gradient.
  3. AdamW on the owned chunk (fp32 master), then stages 1 and 2 all-gather the updated weights;
     stage 3 keeps only its chunk until the next forward pass gathers it.
"""

from __future__ import annotations

from typing import Any, Generator

from simcluster.model.gpt import GPT, LOSS_SCALE, adam_init, adam_step, grad_dtype, init_params, model_state_bytes
from simcluster.model.gpt import unit_names, units, unscale, working_copy
from simcluster.parallel.data_parallel import DPConfig, unit_shapes
from simcluster.program.context import Context


def zero(ctx: Context, cfg: DPConfig) -> Generator[Any, Any, dict[str, Any]]:
    if cfg.zero not in (1, 2, 3):
        raise ValueError(f"zero() runs stages 1, 2 and 3, not {cfg.zero!r} (stage 0 is ddp())")
    ops, dp = ctx.ops, ctx.mesh.dp
    d, n, stage = ctx.mesh.coord("dp"), dp.size, cfg.zero
    cfg.check(n)
    mcfg = cfg.model
    model = GPT(ops, mcfg, memory=ctx.memory)
    order = units(mcfg)
    names = {u: unit_names(mcfg, u) for u in order}
    shapes = {u: unit_shapes(mcfg, u) for u in order}
    needs = {u: [u] + (["embed"] if u == "head" and mcfg.tied_head else []) for u in order}
    gdt = grad_dtype(cfg.precision)

    init = init_params(ops, mcfg)
    master = {u: ops.chunk(ops.pad(ops.flat([init[k] for k in names[u]]), n), n, d) for u in order}  # fp32
    state = adam_init(ops, master)
    shard = {u: ops.cast(master[u], cfg.precision) for u in order}  # the working weights' chunk
    weights = None if stage == 3 else working_copy(ops, init, cfg.precision)

    psi, owned = mcfg.parameters, sum(master[u].shape[0] for u in order)
    per = {k: v // psi for k, v in model_state_bytes(psi, cfg.precision).items()}  # bytes per parameter
    ctx.memory.hold("parameters", "weights", per["parameters"] * (owned if stage == 3 else psi))
    ctx.memory.hold("optimizer", "adam", per["optimizer"] * owned)

    def unit_params(u: str, flats: list[Any]) -> dict[str, Any]:
        p: dict[str, Any] = {}
        for x, flat in zip(needs[u], flats):
            p |= dict(zip(names[x], ops.unflat(flat, shapes[x])))
        return p

    def gather(u: str) -> dict[str, Any]:
        return {x: ctx.comm.all_gather(shard[x], group=dp, async_op=True) for x in needs[u]}

    class Gathered:
        """Each unit's weights, in `sequence` order: stage 3 all-gathers them (with prefetch, the next
        unit's gather is issued before this one computes); stages 1 and 2 hold them all already."""

        def __init__(self, sequence: list[str]) -> None:
            self.sequence = sequence
            self.inflight = gather(sequence[0]) if stage == 3 else None

        def take(self, i: int) -> Generator[Any, Any, dict[str, Any]]:
            if stage < 3:
                return weights
            u, current = self.sequence[i], self.inflight
            if cfg.prefetch and i + 1 < len(self.sequence):
                self.inflight = gather(self.sequence[i + 1])  # runs on the dp stream while u computes
            flats = yield [current[x] for x in needs[u]]
            ctx.memory.hold("communication", f"gathered {u}", sum(f.shape[0] for f in flats) * per["parameters"])
            return unit_params(u, flats)

        def done(self, i: int) -> None:
            """Unit i has computed: free its gathered weights (and, without prefetch, gather the next)."""
            if stage < 3:
                return
            ctx.memory.release("communication", f"gathered {self.sequence[i]}")
            if not cfg.prefetch and i + 1 < len(self.sequence):
                self.inflight = gather(self.sequence[i + 1])

    losses: list[Any] = []
    for step in range(cfg.steps):
        grad_shard: dict[str, Any] = {}
        stage1_full: dict[str, Any] = {}
        loss_sum = None
        if stage >= 2:
            ctx.memory.hold("gradients", "grad shards", per["gradients"] * owned)
        else:
            ctx.memory.hold("gradients", "grads", per["gradients"] * psi)
        for j in range(cfg.micro_batches):
            where, ids, targets = cfg.micro_batch(step, d, n, j)
            last = j == cfg.micro_batches - 1

            # 1. forward, unit by unit
            caches: dict[str, Any] = {}
            x = None
            forward = Gathered(order)
            for index, u in enumerate(order):
                p = yield from forward.take(index)
                with ctx.annotate("forward", f"F{j}:{u}"):
                    if u == "embed":
                        x, caches[u] = model.embed_forward(p, ids, step, where)
                    elif u == "head":
                        part, caches[u] = model.head_forward(p, x, targets)
                        loss_sum = part if loss_sum is None else ops.add_partial(loss_sum, part)
                    else:
                        i = int(u[len("block"):])
                        x, cache = model.block_forward(p, x, i, step, where)
                        caches[u] = model._stored(cache)
                held = model.layer_bytes(x) if u.startswith("block") else model._bytes(caches[u])
                ctx.memory.hold("activations", f"{u}", held)
                forward.done(index)

            # 2. backward, unit by unit in reverse; gradients leave as soon as a unit is done
            scattering: dict[str, Any] = {}
            dx, head_wte = None, None
            backward = Gathered(order[::-1])
            for index, u in enumerate(order[::-1]):
                p = yield from backward.take(index)
                with ctx.annotate("backward", f"B{j}:{u}"):
                    if u == "head":
                        dx, g = model.head_backward(p, caches[u], where, LOSS_SCALE[cfg.precision])
                        head_wte = g.pop("wte", None)
                    elif u == "embed":
                        g = model.embed_backward(caches[u], dx, head_wte)
                    else:
                        g = {}
                        dx = model.block_backward(p, dx, caches[u], int(u[len("block"):]), step, g, where)
                ctx.memory.release("activations", f"{u}")
                flat = ops.pad(ops.flat([ops.retag(g[k], gdt) for k in names[u]]), n)
                if stage == 1:
                    stage1_full[u] = flat if u not in stage1_full else ops.add_partial(stage1_full[u], flat)
                    if last:
                        scattering[u] = ctx.comm.reduce_scatter(stage1_full[u], group=dp, async_op=True)
                else:
                    scattering[u] = ctx.comm.reduce_scatter(flat, group=dp, async_op=True)
                backward.done(index)
            if stage >= 2 or last:
                for u, part in zip(order, (yield [scattering[u] for u in order])):
                    grad_shard[u] = part if u not in grad_shard else ops.add_partial(grad_shard[u], part)

        # 3. the owned chunk's update, then (stages 1, 2) everyone's weights again
        with ctx.annotate("forward", "loss"):
            total = yield ctx.comm.all_reduce(loss_sum, group=dp)
        with ctx.annotate("optimizer", f"O{step}"):
            g_shard = {u: ops.finalize(grad_shard[u]) for u in order}
            master = adam_step(ops, master, unscale(ops, g_shard, cfg.precision), state, lr=cfg.lr)
            shard = {u: ops.cast(master[u], cfg.precision) for u in order}
        ctx.memory.release("gradients", "grad shards" if stage >= 2 else "grads")
        if stage < 3:
            flats = yield [ctx.comm.all_gather(shard[u], group=dp, async_op=True) for u in order]
            weights = {}
            for u, flat in zip(order, flats):
                weights |= dict(zip(names[u], ops.unflat(flat, shapes[u])))
        losses.append(model.loss(total, where))
    return {"loss": losses, "params": master, "grads": g_shard, "adam_m": state.m, "adam_v": state.v,
            "sharded": {"params": True, "grads": True, "adam_m": True, "adam_v": True}}
