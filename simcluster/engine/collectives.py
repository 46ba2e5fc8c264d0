"""What each collective computes, given every member's op (in group order). Backend-neutral data."""

from __future__ import annotations

from typing import Any, Sequence

from simcluster.numerics import tensor as T
from simcluster.program.comm import CommKind, CommOp, ProgramError


def execute(kind: CommKind, ops: Sequence[CommOp]) -> list[Any]:
    """The result each member gets, in the same order as `ops`."""
    n = len(ops)
    xs = [op.tensor for op in ops]
    if kind is CommKind.ALL_REDUCE:
        total = T.reduce(xs, ops[0].op)
        if isinstance(total, T.MetaTensor):  # immutable: one value serves every member
            return [total] * n
        return [T.copy(total) for _ in range(n)]
    if kind is CommKind.REDUCE_SCATTER:
        return T.split(T.reduce(xs, ops[0].op), n, ops[0].dim)
    if kind is CommKind.ALL_GATHER:
        full = T.concat(xs, ops[0].dim)
        if isinstance(full, T.MetaTensor):
            return [full] * n
        return [T.copy(full) for _ in range(n)]
    if kind is CommKind.ALL_TO_ALL and ops[0].splits is not None:  # uneven, along dim 0
        for i, a in enumerate(ops):
            for j, b in enumerate(ops):
                if a.splits[j] != b.gets[i]:
                    raise ProgramError(f"all_to_all_rows: rank {a.rank} sends {a.splits[j]} rows to rank {b.rank}, "
                                       f"which expects {b.gets[i]} from it")
        chunks = [T.split_rows(x, op.splits) for x, op in zip(xs, ops)]
        return [T.concat([chunks[i][j] for i in range(n)], 0) for j in range(n)]
    if kind is CommKind.ALL_TO_ALL:
        chunks = [T.split(x, n, ops[0].split_dim) for x in xs]
        return [T.concat([chunks[i][j] for i in range(n)], ops[0].concat_dim) for j in range(n)]
    if kind is CommKind.BROADCAST:
        src = next(op for op in ops if op.rank == op.peer)
        return [T.copy(src.tensor) for _ in range(n)]
    if kind is CommKind.REDUCE:
        total = T.reduce(xs, ops[0].op)
        return [total if op.rank == op.peer else None for op in ops]
    if kind is CommKind.BARRIER:
        return [None] * n
    if kind is CommKind.COPY:  # the same values in another tier
        return [T.copy(xs[0])]
    if kind is CommKind.SEND:  # ops = (send, recv)
        return [None, T.copy(ops[0].tensor)]
    raise AssertionError(kind)
