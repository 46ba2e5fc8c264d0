"""What the attentions that exchange keys and values over cp share (ring_attention.py, allgather_attention.py,
rsa.py): which positions each rank's block covers, dropout on a block, and one step around the ring."""

from __future__ import annotations

from typing import Any

from simcluster.numerics.tensor import MetaTensor, signature
from simcluster.parallel.positions import Positions, layout


def positions_of(model: Any, owner: int) -> Any:
    """The positions cp rank `owner` holds (its zigzag chunks where the attention is causal)."""
    return layout(model.m.seq, model.P, owner, model.zigzag)


def every_position(model: Any) -> Any:
    """The positions of the whole sequence in the order the all-gather puts them: rank by rank."""
    return Positions.joined(positions_of(model, o) for o in range(model.P))


def drop(model: Any, x: Any, keep: Any) -> Any:
    """Dropout applied (kept values scaled by 1/(1-p)), as the backward pass uses it."""
    ops = model.ops
    return x if keep is None else ops.scale(ops.zero_where(keep, x), 1.0 / (1.0 - model.m.dropout))


def kept(model: Any, e: Any, keep: Any) -> Any:
    """The forward pass keeps the weights unscaled; 1/(1-p) is applied once, to the output."""
    return e if keep is None else model.ops.zero_where(keep, e)


def like(x: Any) -> MetaTensor:
    """What the receiver of a value like x expects: shape, dtype, partial or not."""
    partial, dtype, shape = signature(x)
    return MetaTensor(shape, dtype, partial)


def rotate(model: Any, x: Any, tag: int) -> tuple[Any, Any]:
    """Send x to the next rank on the ring and receive the previous rank's, both asynchronous."""
    ctx, cp, P, r = model.ctx, model.cp, model.P, model.r
    send = ctx.comm.send(x, dst=cp.ranks[(r + 1) % P], tag=tag, async_op=True)
    recv = ctx.comm.recv(src=cp.ranks[(r - 1) % P], like=like(x), tag=tag, async_op=True)
    return send, recv
