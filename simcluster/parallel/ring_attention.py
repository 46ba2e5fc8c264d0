"""Ring attention (Liu et al. 2023) and all-gather-KV context parallelism (Llama 3), exact.

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

allgather: all-gather keys and values, attend locally, reduce-scatter dK and dV in the backward pass.

rsa: ColossalAI's Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training
from System Perspective"), on contiguous sequence chunks: RingQK passes keys around the ring to
build this rank's full rows of QK^T (s/P x s, kept for the backward pass), a plain softmax over
them, RingAV passes values around for the output (in every numerics mode: the exact passes above).
Backward as ColossalAI's code does it: values around the ring again for dP = dO V^T, dV = P^T dO
over the whole sequence all-reduced over the ring's ranks, each keeping its rows; keys around again
for dQ = dS K, dK = dS^T Q all-reduced the same way.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Generator


from simcluster.model import flash
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.positions import Positions, layout


def _positions(model: Any, owner: int) -> Any:
    return layout(model.m.seq, model.P, owner, model.zigzag)


def _every_position(model: Any) -> Any:
    """The positions of the whole sequence in the order the all-gather puts them: rank by rank."""
    return Positions.joined(_positions(model, o) for o in range(model.P))


def _drop(model: Any, x: Any, keep: Any) -> Any:
    """Dropout applied (kept values scaled by 1/(1-p)), as the backward pass uses it."""
    ops = model.ops
    return x if keep is None else ops.scale(ops.zero_where(keep, x), 1.0 / (1.0 - model.m.dropout))


def _kept(model: Any, e: Any, keep: Any) -> Any:
    """The forward pass keeps the weights unscaled; 1/(1-p) is applied once, to the output."""
    return e if keep is None else model.ops.zero_where(keep, e)


def _like(x: Any) -> MetaTensor:
    """What the receiver of a value like x expects: shape, dtype, partial or not."""
    from simcluster.numerics.tensor import signature

    partial, dtype, shape = signature(x)
    return MetaTensor(shape, dtype, partial)


def _rotate(model: Any, x: Any, tag: int) -> tuple[Any, Any]:
    """Send x to the next rank on the ring and receive the previous rank's, both asynchronous."""
    ctx, cp, P, r = model.ctx, model.cp, model.P, model.r
    send = ctx.comm.send(x, dst=cp.ranks[(r + 1) % P], tag=tag, async_op=True)
    recv = ctx.comm.recv(src=cp.ranks[(r - 1) % P], like=_like(x), tag=tag, async_op=True)
    return send, recv


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any,
            ring: bool = True) -> Generator[Any, Any, Any]:
    """Ring attention's forward pass (`ring`), or RSA's RingQK and RingAV (not `ring`)."""
    ops, P, r = model.ops, model.P, model.r
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
                sk, rk = _rotate(model, kv[0], tag + 1)
                sv, rv = _rotate(model, kv[1], tag + 2)
                sends += [sk, sv]
            cols = _positions(model, o)
            with flash.forward(ops, model.m, q, kv[0]):
                keep = model.block_keep(f"attn.{layer}", (b, a, sq, kv[0].shape[2]), step, where, rows, cols)
                block = ops.attention_block(q, kv[0], kv[1], scale, model.allowed(rows, cols), keep,
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
    fused = (lambda *a: flash.forward(ops, model.m, *a)) if ring else (lambda *a: nullcontext())
    for t, o in enumerate(owners):
        if t < P - 1:
            send, recv = _rotate(model, k_cur, tag + 1)
            sends.append(send)
            if ring:
                send_v, recv_v = _rotate(model, v_cur, tag + 2)
                sends.append(send_v)
        with fused(q, k_cur):
            s = ops.attention_scores(q, k_cur, scale, model.allowed(rows, _positions(model, o)))
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
            send, recv = _rotate(model, v_cur, tag + 2)
            sends.append(send)
        if ring:
            v_cur = values[t]
        with merge():
            e = ops.attention_weights(scores[t], row_max)
            keep = model.block_keep(f"attn.{layer}", tuple(e.shape), step, where, rows, _positions(model, o))
            l_parts.append(ops.sum(e, -1, partial=True))
            o_parts.append(ops.einsum("bask,bakd->basd", _kept(model, e, keep), v_cur, partial=True))
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
    ops, P, r, m = model.ops, model.P, model.r, model.m
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
            sk, rk = _rotate(model, kv[0], tag + 1)
            sv, rv = _rotate(model, kv[1], tag + 2)
            sends += [sk, sv]
        with flash.backward(ops, m, core["q"], kv[0]):  # (a block's backward as one fused kernel, with flash)
            cols = _positions(model, o)
            if lse is None:
                probs = ops.attention_probs(ops.attention_weights(core["scores"][t], core["max"]), core["l"])
            else:
                s = ops.attention_scores(core["q"], kv[0], scale, model.allowed(rows, cols))
                probs = ops.attention_weights(s, ops.expand_last(lse))
            keep = model.block_keep(f"attn.{core['layer']}", tuple(probs.shape), core["step"], core["where"], rows,
                                    cols)
            dv_t = ops.einsum("bask,basd->bakd", _drop(model, probs, keep), dout, partial=True)
            dp = _drop(model, ops.einsum("basd,bakd->bask", dout, kv[1]), keep)
            ds = ops.mul(probs, ops.sub(dp, delta))
            dq_parts.append(ops.einsum("bask,bakd->basd", ds, kv[0], partial=True))
            dk_t = ops.einsum("bask,basd->bakd", ds, core["q"], partial=True)
        dk_acc = dk_t if dk_acc is None else ops.add_partial(dk_acc, dk_t)
        dv_acc = dv_t if dv_acc is None else ops.add_partial(dv_acc, dv_t)
        if P == 1:
            break  # the block never leaves home
        # the block's accumulators move on with it; after the last step they go home to the owner
        sa, ra = _rotate(model, dk_acc, tag + 3)
        sb, rb = _rotate(model, dv_acc, tag + 4)
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


def allgather_forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int,
                      where: Any) -> Generator[Any, Any, Any]:
    """Llama 3's context parallelism: every rank gathers all keys and values, attends locally."""
    ops, ctx, cp = model.ops, model.ctx, model.cp
    K, V = yield [ctx.comm.all_gather(x, group=cp, dim=2, async_op=True) for x in (k, v)]  # (b, a, s, d)
    cols = _every_position(model)
    rows = model.positions
    scale, drop_scale = 1.0 / math.sqrt(model.m.head_dim), 1.0 / (1.0 - model.m.dropout)
    if ops.mode is Mode.FAST:  # one block: the output and lse, the scores again in the backward pass
        b, a, sq, _ = q.shape
        with flash.forward(ops, model.m, q, K):
            keep = model.block_keep(f"attn.{layer}", (b, a, sq, K.shape[2]), step, where, rows, cols)
            out, lse = ops.attention_block(q, K, V, scale, model.allowed(rows, cols), keep, drop_scale)
        out = ops.cast(out, q.dtype)
        return out, {"lse": lse, "allowed": (rows, cols), "keep": keep, "q": q, "K": K, "V": V, "out": out}
    with flash.forward(ops, model.m, q, K):
        s = ops.attention_scores(q, K, 1.0 / math.sqrt(model.m.head_dim), model.allowed(rows, cols))
        row_max = ops.max(s, -1)
        e = ops.attention_weights(s, row_max)
        l_sum = ops.sum(e, -1, partial=True)
        keep = model.block_keep(f"attn.{layer}", tuple(e.shape), step, where, rows, cols)
        out = ops.attention_output(ops.einsum("bask,bakd->basd", _kept(model, e, keep), V, partial=True), l_sum,
                                   q.dtype, 1.0 / (1.0 - model.m.dropout))
    return out, {"scores": [s], "max": row_max, "l": l_sum, "keep": keep, "q": q, "K": K, "V": V, "out": out}


def allgather_backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    ops, ctx, cp = model.ops, model.ctx, model.cp
    scale = 1.0 / math.sqrt(model.m.head_dim)
    with flash.backward(ops, model.m, core["q"], core["K"]):
        if "lse" in core:
            s = ops.attention_scores(core["q"], core["K"], scale, model.allowed(*core["allowed"]))
            probs = ops.attention_weights(s, ops.expand_last(core["lse"]))
        else:
            probs = ops.attention_probs(ops.attention_weights(core["scores"][0], core["max"]), core["l"])
        delta = ops.expand_last(ops.sum(ops.mul(dout, core["out"]), -1))
        dV = ops.einsum("bask,basd->bakd", _drop(model, probs, core["keep"]), dout, partial=True)
        ds = ops.mul(probs, ops.sub(_drop(model, ops.einsum("basd,bakd->bask", dout, core["V"]), core["keep"]), delta))
        dq = ops.scale(ops.einsum("bask,bakd->basd", ds, core["K"]), scale)
        dK = ops.einsum("bask,basd->bakd", ds, core["q"], partial=True)
    dk, dv = yield [ctx.comm.reduce_scatter(x, group=cp, dim=2, async_op=True) for x in (dK, dV)]
    return dq, ops.scale(ops.finalize(dk), scale), ops.finalize(dv)


def rsa_forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any) -> Generator[Any, Any, Any]:
    """RingQK then RingAV: the two passes of `forward` in every mode (the score rows are materialised)."""
    return (yield from forward(model, q, k, v, layer, step, where, ring=False))


def _own_rows(ops: Any, full: Any, P: int, r: int) -> Any:
    """This rank's contiguous block of the sequence axis (2) of a rounded full-sequence tensor."""
    n = full.shape[2] // P
    if isinstance(full, MetaTensor):
        return MetaTensor(full.shape[:2] + (n,) + full.shape[3:], full.dtype)
    return full[:, :, r * n:(r + 1) * n]


def rsa_backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    ops, ctx, cp, P, r = model.ops, model.ctx, model.cp, model.P, model.r
    scale = 1.0 / math.sqrt(model.m.head_dim)
    rows, owners = model.positions, [(r - t) % P for t in range(P)]
    delta = ops.expand_last(ops.sum(ops.mul(dout, core["out"]), -1))
    probs, keeps = [], []
    for t, o in enumerate(owners):
        probs.append(ops.attention_probs(ops.attention_weights(core["scores"][t], core["max"]), core["l"]))
        keeps.append(model.block_keep(f"attn.{core['layer']}", tuple(probs[t].shape), core["step"], core["where"],
                                      rows, _positions(model, o)))
    order = sorted(range(P), key=lambda t: owners[t])  # the blocks in sequence order
    dropped = ops.concat([_drop(model, probs[t], keeps[t]) for t in order], -1)  # (b, a, s/P, s)
    dv_all = ctx.comm.all_reduce(ops.einsum("bask,basd->bakd", dropped, dout, partial=True), group=cp, async_op=True)
    tag, sends = (1 << 20) + 8, []
    v_cur, ds = core["v"], [None] * P
    for t, o in enumerate(owners):  # RingQK on (dO, V): the score gradients, block by block
        if t < P - 1:
            send, recv = _rotate(model, v_cur, tag + 1)
            sends.append(send)
        dp = _drop(model, ops.einsum("basd,bakd->bask", dout, v_cur), keeps[t])
        ds[t] = ops.mul(probs[t], ops.sub(dp, delta))
        if t < P - 1:
            v_cur = yield recv
    full_ds = ops.concat([ds[t] for t in order], -1)
    dk_all = ctx.comm.all_reduce(ops.einsum("bask,basd->bakd", full_ds, core["q"], partial=True), group=cp,
                                 async_op=True)
    k_cur, dq = core["k"], None
    for t, o in enumerate(owners):  # RingAV on (dS, K): the query gradient
        if t < P - 1:
            send, recv = _rotate(model, k_cur, tag + 2)
            sends.append(send)
        part = ops.einsum("bask,bakd->basd", ds[t], k_cur, partial=True)
        dq = part if dq is None else ops.add_partial(dq, part)
        if t < P - 1:
            k_cur = yield recv
    dk, dv = yield [dk_all, dv_all]
    if sends:
        yield sends
    dk, dv = _own_rows(ops, ops.finalize(dk), P, r), _own_rows(ops, ops.finalize(dv), P, r)
    return ops.scale(ops.finalize(dq), scale), ops.scale(dk, scale), dv
