"""Which positions of a sequence a context-parallel rank holds: its share as runs of positions (contiguous,
or zigzag for causal attention), kept as a few integers whatever the sequence's length. The shards
(transformer_shard.py) and the attentions that exchange the shares (cp_blocks.py) both read them."""

from __future__ import annotations

from typing import Any

import numpy as np


class Positions:
    """Positions of a sequence as runs (start, length), not an array of them: a rank's share of a
    sequence of any length costs a few integers (meta mode at s = 2^31 allocates nothing by tokens);
    `np.asarray` gives the array where numbers need it (a causal mask, the token ids' columns)."""

    __slots__ = ("runs",)

    def __init__(self, runs: Any) -> None:
        self.runs = tuple((int(start), int(n)) for start, n in runs if n > 0)

    @classmethod
    def joined(cls, parts: Any) -> "Positions":
        return cls(run for part in parts for run in part.runs)

    def __len__(self) -> int:
        return sum(n for _, n in self.runs)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in self.runs]) if self.runs \
            else np.zeros(0, np.int64)
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, cut: slice) -> "Positions":
        """Positions a:b of these (a slice with no step), as runs."""
        a, b, step = cut.indices(len(self))
        assert step == 1, cut
        out, at = [], 0
        for start, n in self.runs:
            lo, hi = max(a, at), min(b, at + n)
            if lo < hi:
                out.append((start + lo - at, hi - lo))
            at += n
        return Positions(out)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Positions) and self.runs == other.runs

    def __hash__(self) -> int:
        return hash(self.runs)

    def __repr__(self) -> str:
        return f"Positions({list(self.runs)})"


def layout(seq: int, P: int, r: int, zigzag: bool) -> Positions:
    """The positions of a sequence that cp rank r holds: a contiguous s/P, or with zigzag (for causal
    attention, so that every rank has as much work) chunks r and 2P-1-r of 2P chunks."""
    if not zigzag:
        n = seq // P
        return Positions([(r * n, n)])
    n = seq // (2 * P)
    return Positions([(r * n, n), ((2 * P - 1 - r) * n, n)])


def runs(positions: Any) -> list[tuple[int, int]]:
    """Contiguous runs of positions as (start, length)."""
    found: list[tuple[int, int]] = []
    for start, n in positions.runs:  # (runs that meet are one)
        if found and found[-1][0] + found[-1][1] == start:
            found[-1] = (found[-1][0], found[-1][1] + n)
        else:
            found.append((start, n))
    return found
