"""All-gather context parallelism (Llama 3): all-gather keys and values, attend locally, reduce-scatter
dK and dV in the backward pass. With grouped-query attention's heads as they are (model.gqa = "native",
as Llama 3 ran it: "the communicated K and V tensors are much smaller than Q tensor due to GQA"), the
kv heads go both ways, the gradients summed over their query heads first. In fast mode the gathered keys are one block (ops.attention_block), as
ring_attention.py's blocks are; in exact mode the two passes on them. Each rank holds its zigzag chunks
(cp_blocks.py)."""

from __future__ import annotations

import math
from typing import Any, Generator

from simcluster.model import flash
from simcluster.numerics.ops import Mode
from simcluster.parallel.cp_blocks import drop, every_position, kept


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int,
                      where: Any) -> Generator[Any, Any, Any]:
    """Llama 3's context parallelism: every rank gathers all keys and values, attends locally."""
    ops, ctx, cp = model.ops, model.ctx, model.cp
    Kh, Vh = yield [ctx.comm.all_gather(x, group=cp, dim=2, async_op=True) for x in (k, v)]  # (b, kv, s, d)
    K, V = model.expand_kv(Kh), model.expand_kv(Vh)  # (b, a, s, d)
    cols = every_position(model)
    rows = model.positions
    scale, drop_scale = 1.0 / math.sqrt(model.m.head_dim), 1.0 / (1.0 - model.m.dropout)
    if ops.mode is Mode.FAST:  # one block: the output and lse, the scores again in the backward pass
        b, a, sq, _ = q.shape
        with flash.forward(ops, model.m, q, K, at=(rows, cols)):
            keep = model.block_keep(f"attn.{layer}", (b, a, sq, K.shape[2]), step, where, rows, cols)
            out, lse = ops.attention_block(q, K, V, scale, model.allowed(rows, cols), keep, drop_scale)
        out = ops.cast(out, q.dtype)
        return out, {"lse": lse, "allowed": (rows, cols), "keep": keep, "q": q, "K": Kh, "V": Vh, "out": out}
    with flash.forward(ops, model.m, q, K, at=(rows, cols)):
        s = ops.attention_scores(q, K, 1.0 / math.sqrt(model.m.head_dim), model.allowed(rows, cols))
        row_max = ops.max(s, -1)
        e = ops.attention_weights(s, row_max)
        l_sum = ops.sum(e, -1, partial=True)
        keep = model.block_keep(f"attn.{layer}", tuple(e.shape), step, where, rows, cols)
        out = ops.attention_output(ops.einsum("bask,bakd->basd", kept(model, e, keep), V, partial=True), l_sum,
                                   q.dtype, 1.0 / (1.0 - model.m.dropout))
    return out, {"scores": [s], "max": row_max, "l": l_sum, "keep": keep, "q": q, "K": Kh, "V": Vh, "out": out}


def backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    ops, ctx, cp = model.ops, model.ctx, model.cp
    scale = 1.0 / math.sqrt(model.m.head_dim)
    K, V = model.expand_kv(core["K"]), model.expand_kv(core["V"])
    fold = model.fold_kv
    with flash.backward(ops, model.m, core["q"], K, at=(model.positions, every_position(model))):
        if "lse" in core:
            s = ops.attention_scores(core["q"], K, scale, model.allowed(*core["allowed"]))
            probs = ops.attention_weights(s, ops.expand_last(core["lse"]))
        else:
            probs = ops.attention_probs(ops.attention_weights(core["scores"][0], core["max"]), core["l"])
        delta = ops.expand_last(ops.sum(ops.mul(dout, core["out"]), -1))
        dV = fold(ops.einsum("bask,basd->bakd", drop(model, probs, core["keep"]), dout, partial=True))
        ds = ops.mul(probs, ops.sub(drop(model, ops.einsum("basd,bakd->bask", dout, V), core["keep"]), delta))
        dq = ops.scale(ops.einsum("bask,bakd->basd", ds, K), scale)
        dK = fold(ops.einsum("bask,basd->bakd", ds, core["q"], partial=True))
    dk, dv = yield [ctx.comm.reduce_scatter(x, group=cp, dim=2, async_op=True) for x in (dK, dV)]
    return dq, ops.scale(ops.finalize(dk), scale), ops.finalize(dv)
