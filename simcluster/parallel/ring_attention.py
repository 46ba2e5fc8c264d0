"""Ring attention (Liu et al. 2023), exact.

Each of P ranks holds the queries, keys and values of its own tokens (the zigzag layout for causal
attention: rank r holds chunks r and 2P-1-r of 2P, so that every rank has the same work).

ring, exact mode (two passes, as numerics rule 1 needs the row maximum before any exponential):
  1. keys and values travel once around the ring together (as ring-flash-attention sends them);
     every rank scores its queries against each block as it passes (the next block's send/recv
     runs while this block is scored) and takes the row maximum;
  2. every rank adds sum_k e*v and sum_k e for each block it kept, exactly;
  out = round(sum e*v) / round(sum e), as on one device.
With the model's flash kernel (the default), each block's forward and backward cost one fused
kernel on the block's shapes (model/flash.py) and pass 2 one merge of the block's output, as
ring-flash-attention runs; the numbers are the same.
ring, fast mode: one pass, keys and values travelling together: each block as one flash kernel
(ops.attention_block: the block's output and log-sum-exp, float32), merged into the running pair by
their log-sum-exps (ops.attention_merge), as ring-flash-attention does; the backward pass recomputes
each block's scores from q and k and takes its weights from the merged lse: no score is kept between
the passes. allgather in fast mode: the gathered keys as one block, the same way.
backward: keys and values travel around again; each rank adds its part of the block's dK and dV to
accumulators that travel with the block and arrive, complete, back at its owner.
Grouped-query attention's heads as they are (model.gqa = "native", as Transformer Engine's ring runs
them): the blocks and their accumulators carry the kv heads, each expanded for its query heads where it
is used and each part of its gradient summed over them before it is added.

All-gather attention (Llama 3) is allgather_attention.py; ColossalAI's ring self-attention, rsa.py.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Generator

from simcluster.model import flash
from simcluster.numerics.ops import Mode
from simcluster.parallel.cp_blocks import drop, kept, positions_of, rotate


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any,
            ring: bool = True) -> Generator[Any, Any, Any]:
    """Ring attention's forward pass (`ring`), or RSA's RingQK and RingAV (not `ring`)."""
    ops, P, r, ex = model.ops, model.P, model.r, model.expand_kv
    scale = 1.0 / math.sqrt(model.m.head_dim)
    rows = model.positions
    owners = [(r - t) % P for t in range(P)]
    tag = layer * 16
    scores, sends = [], []
    if ops.mode is Mode.FAST and ring:  # one pass: each block's (out, lse), merged as they come
        out = lse = None
        kv = (k, v)
        b, a, sq, _ = q.shape
        for t, o in enumerate(owners):
            if t < P - 1:
                sk, rk = rotate(model, kv[0], tag + 1)
                sv, rv = rotate(model, kv[1], tag + 2)
                sends += [sk, sv]
            cols = positions_of(model, o)
            ek = ex(kv[0])
            with flash.forward(ops, model.m, q, ek, at=(rows, cols)):
                keep = model.block_keep(f"attn.{layer}", (b, a, sq, ek.shape[2]), step, where, rows, cols)
                block = ops.attention_block(q, ek, ex(kv[1]), scale, model.allowed(rows, cols), keep,
                                            1.0 / (1.0 - model.m.dropout))
            if out is None:
                out, lse = block
            else:
                with flash.merge(ops, model.m, q):
                    out, lse = ops.attention_merge(out, lse, *block)
            if t < P - 1:
                kv = tuple((yield [rk, rv]))
        if sends:
            yield sends
        out = ops.cast(out, q.dtype)
        return out, {"lse": lse, "q": q, "k": k, "v": v, "out": out, "layer": layer, "step": step, "where": where}

    # exact mode, pass 1: keys around the ring, the row maximum. Ring attention's values go round with
    # its keys, as in ring-flash-attention (each block's fused kernel uses both; the merge of pass 2
    # is what such a kernel's output update does); RSA's go round in pass 2 (RingAV).
    k_cur, v_cur = k, v
    maxes, values = [], []
    fused = (lambda *a, **at: flash.forward(ops, model.m, *a, **at)) if ring else (lambda *a, **at: nullcontext())
    for t, o in enumerate(owners):
        if t < P - 1:
            send, recv = rotate(model, k_cur, tag + 1)
            sends.append(send)
            if ring:
                send_v, recv_v = rotate(model, v_cur, tag + 2)
                sends.append(send_v)
        ek = ex(k_cur)
        with fused(q, ek, at=(rows, positions_of(model, o))):
            s = ops.attention_scores(q, ek, scale, model.allowed(rows, positions_of(model, o)))
            scores.append(s)
            maxes.append(ops.max(s, -1))
        values.append(v_cur)
        if t < P - 1:
            if ring:
                k_cur, v_cur = yield [recv, recv_v]
            else:
                k_cur = yield recv
    row_max = ops.max(ops.concat(maxes, -1), -1)  # exact in any order
    # pass 2: exact sums of weights and weighted values (RSA: values around the ring now)
    merge = (lambda: flash.merge(ops, model.m, q)) if ring else nullcontext
    v_cur = v
    l_parts, o_parts = [], []
    for t, o in enumerate(owners):
        if t < P - 1 and not ring:
            send, recv = rotate(model, v_cur, tag + 2)
            sends.append(send)
        if ring:
            v_cur = values[t]
        with merge():
            e = ops.attention_weights(scores[t], row_max)
            keep = model.block_keep(f"attn.{layer}", tuple(e.shape), step, where, rows, positions_of(model, o))
            l_parts.append(ops.sum(e, -1, partial=True))
            o_parts.append(ops.einsum("bask,bakd->basd", kept(model, e, keep), ex(v_cur), partial=True))
        if t < P - 1 and not ring:
            v_cur = yield recv
    if sends:
        yield sends
    l_sum, o_sum = l_parts[0], o_parts[0]
    for a, b in zip(l_parts[1:], o_parts[1:]):
        l_sum, o_sum = ops.add_partial(l_sum, a), ops.add_partial(o_sum, b)
    out = ops.attention_output(o_sum, l_sum, q.dtype, 1.0 / (1.0 - model.m.dropout))
    return out, {"scores": scores, "max": row_max, "l": l_sum, "q": q, "k": k, "v": v, "out": out, "layer": layer,
                 "step": step, "where": where}


def backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    """dq, dk, dv for this rank's tokens: dK and dV accumulate as they travel back to their owners."""
    ops, P, r, m, ex = model.ops, model.P, model.r, model.m, model.expand_kv
    fold = model.fold_kv
    scale = 1.0 / math.sqrt(m.head_dim)
    rows = model.positions
    owners = [(r - t) % P for t in range(P)]
    delta = ops.expand_last(ops.sum(ops.mul(dout, core["out"]), -1))  # (b, a, s, 1): over d, never split
    lse = core.get("lse")  # fast mode: the scores again from q and k, the weights from the merged lse
    kv = (core["k"], core["v"])
    dk_acc = dv_acc = None
    dq_parts, sends = [], []
    tag = 1 << 20
    for t, o in enumerate(owners):
        if t < P - 1:
            sk, rk = rotate(model, kv[0], tag + 1)
            sv, rv = rotate(model, kv[1], tag + 2)
            sends += [sk, sv]
        ek, ev = ex(kv[0]), ex(kv[1])
        cols = positions_of(model, o)
        with flash.backward(ops, m, core["q"], ek, at=(rows, cols)):  # (a block's backward as one fused kernel)
            if lse is None:
                probs = ops.attention_probs(ops.attention_weights(core["scores"][t], core["max"]), core["l"])
            else:
                s = ops.attention_scores(core["q"], ek, scale, model.allowed(rows, cols))
                probs = ops.attention_weights(s, ops.expand_last(lse))
            keep = model.block_keep(f"attn.{core['layer']}", tuple(probs.shape), core["step"], core["where"], rows,
                                    cols)
            dv_t = fold(ops.einsum("bask,basd->bakd", drop(model, probs, keep), dout, partial=True))
            dp = drop(model, ops.einsum("basd,bakd->bask", dout, ev), keep)
            ds = ops.mul(probs, ops.sub(dp, delta))
            dq_parts.append(ops.einsum("bask,bakd->basd", ds, ek, partial=True))
            dk_t = fold(ops.einsum("bask,basd->bakd", ds, core["q"], partial=True))
        dk_acc = dk_t if dk_acc is None else ops.add_partial(dk_acc, dk_t)
        dv_acc = dv_t if dv_acc is None else ops.add_partial(dv_acc, dv_t)
        if P == 1:
            break  # the block never leaves home
        # the block's accumulators move on with it; after the last step they go home to the owner
        sa, ra = rotate(model, dk_acc, tag + 3)
        sb, rb = rotate(model, dv_acc, tag + 4)
        sends += [sa, sb]
        got = yield ([rk, rv, ra, rb] if t < P - 1 else [ra, rb])
        if t < P - 1:
            kv, (dk_acc, dv_acc) = (got[0], got[1]), (got[2], got[3])
        else:
            dk_acc, dv_acc = got
    if sends:
        yield sends
    dq = dq_parts[0]
    for part in dq_parts[1:]:
        dq = ops.add_partial(dq, part)
    return (ops.scale(ops.finalize(dq), scale), ops.scale(ops.finalize(dk_acc), scale), ops.finalize(dv_acc))
