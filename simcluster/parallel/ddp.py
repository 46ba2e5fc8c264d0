"""DDP: every rank holds the whole model; gradients are all-reduced in buckets during backward.

Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training" (VLDB 2020).
Per step:
  1. forward and backward of each micro-batch, gradients accumulated as exact partials;
  2. on the last micro-batch, each unit's bucket (a transformer block, the embeddings, the head) is
     all-reduced over dp as soon as backward has finished it, on the dp stream, while backward goes on;
  3. wait for the buckets, round the gradients once, AdamW on every rank (the same update everywhere).
"""

from __future__ import annotations

from typing import Any, Generator

from simcluster.model.gpt import GPT, LOSS_SCALE, adam_step, grad_dtype, init_params
from simcluster.model.gpt import unit_names, units, unscale
from simcluster.parallel.data_parallel import DPConfig, begin_step, hold_model_state, unit_shapes
from simcluster.program.context import Context


def _add(ops: Any, acc: Any, x: Any) -> Any:
    return x if acc is None else ops.add_partial(acc, x)


def ddp(ctx: Context, cfg: DPConfig) -> Generator[Any, Any, dict[str, Any]]:
    ops, dp = ctx.ops, ctx.mesh.dp
    d, n = ctx.mesh.coord("dp"), dp.size
    cfg.check(n)
    mcfg = cfg.model
    model = GPT(ops, mcfg, memory=ctx.memory)
    master = init_params(ops, mcfg)
    state, sizes = hold_model_state(ctx, master, mcfg.parameters, cfg.precision)
    gdt = grad_dtype(cfg.precision)
    losses, grads = [], {}
    for step in range(cfg.steps):
        weights = begin_step(ctx, master, sizes, cfg.precision)
        acc: dict[str, Any] = {}
        buckets: dict[str, Any] = {}
        loss_sum = None
        for j in range(cfg.micro_batches):
            where, ids, targets = cfg.micro_batch(step, d, n, j)
            with ctx.annotate("forward", f"F{j}"):
                part, cache = model.forward(weights, ids, targets, step, where)
            loss_sum = _add(ops, loss_sum, part)
            last = j == cfg.micro_batches - 1

            def unit_done(unit: str, g: dict[str, Any], last: bool = last) -> None:
                for k, v in g.items():
                    acc[k] = _add(ops, acc.get(k), v)
                if last:  # this bucket is final: reduce it while backward goes on
                    bucket = ops.flat([ops.retag(acc[k], gdt) for k in unit_names(mcfg, unit)])
                    buckets[unit] = ctx.comm.all_reduce(bucket, group=dp, async_op=True)

            with ctx.annotate("backward", f"B{j}"):
                model.backward(weights, cache, step, unit_done, LOSS_SCALE[cfg.precision])
        with ctx.annotate("forward", "loss"):
            total = yield ctx.comm.all_reduce(loss_sum, group=dp)
        reduced = yield [buckets[u] for u in units(mcfg)]
        with ctx.annotate("optimizer", f"O{step}"):
            grads = {}
            for unit, flat in zip(units(mcfg), reduced):
                for name, g in zip(unit_names(mcfg, unit), ops.unflat(flat, unit_shapes(mcfg, unit))):
                    grads[name] = ops.finalize(g)
            master = adam_step(ops, master, unscale(ops, grads, cfg.precision), state, lr=cfg.lr)
        ctx.memory.release("gradients", "grads")
        losses.append(model.loss(total, where))
    return {"loss": losses, "params": master, "grads": grads, "adam_m": state.m, "adam_v": state.v}
