"""ColossalAI's Ring Self-Attention (Li et al. 2021, "Sequence Parallelism: Long Sequence Training
from System Perspective"), on contiguous sequence chunks: RingQK passes keys around the ring to
build this rank's full rows of QK^T (s/P x s, kept for the backward pass), a plain softmax over
them, RingAV passes values around for the output (in every numerics mode: ring_attention.py's exact two passes).
Backward as ColossalAI's code does it: values around the ring again for dP = dO V^T, dV = P^T dO
over the whole sequence all-reduced over the ring's ranks, each keeping its rows; keys around again
for dQ = dS K, dK = dS^T Q all-reduced the same way.
"""

from __future__ import annotations

import math
from typing import Any, Generator

from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel import ring_attention
from simcluster.parallel.cp_blocks import drop, positions_of, rotate


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any) -> Generator[Any, Any, Any]:
    """RingQK then RingAV: the two passes of `forward` in every mode (the score rows are materialised)."""
    return (yield from ring_attention.forward(model, q, k, v, layer, step, where, ring=False))


def _own_rows(ops: Any, full: Any, P: int, r: int) -> Any:
    """This rank's contiguous block of the sequence axis (2) of a rounded full-sequence tensor."""
    n = full.shape[2] // P
    if isinstance(full, MetaTensor):
        return MetaTensor(full.shape[:2] + (n,) + full.shape[3:], full.dtype)
    return full[:, :, r * n:(r + 1) * n]


def backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    ops, ctx, cp, P, r, ex = model.ops, model.ctx, model.cp, model.P, model.r, model.expand_kv
    fold = model.fold_kv  # (grouped-query attention's heads as they are: ring_attention.py)
    scale = 1.0 / math.sqrt(model.m.head_dim)
    rows, owners = model.positions, [(r - t) % P for t in range(P)]
    delta = ops.expand_last(ops.sum(ops.mul(dout, core["out"]), -1))
    probs, keeps = [], []
    for t, o in enumerate(owners):
        probs.append(ops.attention_probs(ops.attention_weights(core["scores"][t], core["max"]), core["l"]))
        keeps.append(model.block_keep(f"attn.{core['layer']}", tuple(probs[t].shape), core["step"], core["where"],
                                      rows, positions_of(model, o)))
    order = sorted(range(P), key=lambda t: owners[t])  # the blocks in sequence order
    dropped = ops.concat([drop(model, probs[t], keeps[t]) for t in order], -1)  # (b, a, s/P, s)
    dv_all = ctx.comm.all_reduce(fold(ops.einsum("bask,basd->bakd", dropped, dout, partial=True)), group=cp,
                                 async_op=True)
    tag, sends = (1 << 20) + 8, []
    v_cur, ds = core["v"], [None] * P
    for t, o in enumerate(owners):  # RingQK on (dO, V): the score gradients, block by block
        if t < P - 1:
            send, recv = rotate(model, v_cur, tag + 1)
            sends.append(send)
        dp = drop(model, ops.einsum("basd,bakd->bask", dout, ex(v_cur)), keeps[t])
        ds[t] = ops.mul(probs[t], ops.sub(dp, delta))
        if t < P - 1:
            v_cur = yield recv
    full_ds = ops.concat([ds[t] for t in order], -1)
    dk_all = ctx.comm.all_reduce(fold(ops.einsum("bask,basd->bakd", full_ds, core["q"], partial=True)), group=cp,
                                 async_op=True)
    k_cur, dq = core["k"], None
    for t, o in enumerate(owners):  # RingAV on (dS, K): the query gradient
        if t < P - 1:
            send, recv = rotate(model, k_cur, tag + 2)
            sends.append(send)
        part = ops.einsum("bask,bakd->basd", ds[t], ex(k_cur), partial=True)
        dq = part if dq is None else ops.add_partial(dq, part)
        if t < P - 1:
            k_cur = yield recv
    dk, dv = yield [dk_all, dv_all]
    if sends:
        yield sends
    dk, dv = _own_rows(ops, ops.finalize(dk), P, r), _own_rows(ops, ops.finalize(dv), P, r)
    return ops.scale(ops.finalize(dq), scale), ops.scale(dk, scale), dv
