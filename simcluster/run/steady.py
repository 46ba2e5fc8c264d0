"""Meta mode at any step count: identical steps are simulated once.

A meta-mode run of N > 5 steps (where this is cheaper) simulates 2 steps and 3 steps. When the third
step repeats the second exactly, one period P later -- every lane's new events are the 2-step run's
last ones shifted by P (labels aside: they name the step), the first two steps are untouched by the
third, and the memory events likewise, netting to zero -- the state that starts step 4 is the state
that started step 3, shifted, and the simulation is deterministic: steps 4..N repeat step 3. The
report of N steps then follows from the two runs: makespan E3 + (N - 3) P; every per-rank sum (busy
time per stream, calls, bytes and time per collective, events) extended by (N - 3) times its step-3
increment; memory peaks those of 3 steps.
Byte for byte the report of simulating N steps (tests/test_steady.py), at the cost of 5 steps.
Where a step does not repeat (a fault from a time, a schedule that carries work across steps), the N
steps are simulated.
The comparison (`grown`: one trace is another with blocks of events put in, each repeating the events
before it, and what follows shifted) serves a pipeline's rounds too (pipeline_steady.py); it reads
each lane as arrays of start, end, bytes and what each event is.
"""

from __future__ import annotations

from itertools import groupby
from operator import attrgetter
from typing import Any

import numpy as np

from simcluster.engine.trace import Trace

SIMULATED = 3  # steps simulated for a longer run (and 2 more to find the period)


def period(two: Trace, three: Trace) -> int | None:
    """P when the 3-step trace is the 2-step one plus its last step again, P later (None otherwise)."""
    return grown(two, three)


def grown(b: Trace, c: Trace, steps: int = 1) -> int | None:
    """P when trace `c` is trace `b` with, on every lane, `steps` blocks of events put in (or none),
    each repeating the events before it P later, and every later event P later for each block before
    it -- labels and message tags aside, which name the step or the micro-batch -- (memory events
    likewise, each block releasing what it holds); None otherwise. A step more: one block, at the end
    (`period`); a micro-batch more in each of `steps` steps: one block a step (pipeline_steady.py)."""
    if (c.end - b.end) % steps:
        return None
    p = (c.end - b.end) // steps
    if p <= 0 or b.lanes != c.lanes:
        return None
    codes: dict[Any, int] = {}
    events = [_Columns.of_events(t, codes) for t in (b, c)]
    memory = [_Columns.of_memory(t, codes) for t in (b, c)]
    if set(events[0].lanes) != set(events[1].lanes) or set(memory[0].lanes) != set(memory[1].lanes):
        return None
    if all(_grows(*events, lane, p, steps) for lane in events[0].lanes) and all(
            _grows(*memory, lane, p, steps, net=True) for lane in memory[0].lanes):
        return p
    return None


class _Columns:
    """Events as arrays, lane after lane: when they start and end, their bytes, and what they are (a
    number for the kind and group, a message's tag aside; a memory event's category)."""

    def __init__(self, lanes: dict[Any, tuple[int, int]], start: np.ndarray, end: np.ndarray,
                 nbytes: np.ndarray, what: np.ndarray) -> None:
        self.lanes, self.start, self.end, self.bytes, self.what = lanes, start, end, nbytes, what

    @classmethod
    def of_events(cls, trace: Trace, codes: dict[Any, int]) -> "_Columns":
        ev = trace.events  # (sorted lane by lane)
        lanes: dict[Any, tuple[int, int]] = {}
        i = 0
        for lane, group in groupby(map(attrgetter("rank", "stream"), ev)):
            n = sum(1 for _ in group)
            lanes[lane] = (i, i + n)
            i += n
        keys = list(map(attrgetter("kind", "group"), ev))
        number = {key: codes.setdefault((key[0], key[1].split(" tag ", 1)[0]), len(codes))
                  for key in dict.fromkeys(keys)}
        what = np.fromiter(map(number.__getitem__, keys), np.int64, len(ev))
        return cls(lanes, *_ints(ev, "start", "end", "bytes"), what)

    @classmethod
    def of_memory(cls, trace: Trace, codes: dict[Any, int]) -> "_Columns":
        by_rank: dict[int, list] = {}
        for e in trace.memory:
            by_rank.setdefault(e.rank, []).append(e)
        ev = [e for rank in sorted(by_rank) for e in by_rank[rank]]
        lanes, i = {}, 0
        for rank in sorted(by_rank):
            lanes[rank] = (i, i + len(by_rank[rank]))
            i += len(by_rank[rank])
        at, nbytes = _ints(ev, "at", "bytes")
        what = np.array([codes.setdefault(("memory", e.category), len(codes)) for e in ev], np.int64)
        return cls(lanes, at, at, nbytes, what)

    def rows(self, lane: Any, lo: int = 0, hi: int | None = None) -> tuple[np.ndarray, ...]:
        """The lane's events lo..hi (indices within the lane), column by column."""
        first, last = self.lanes[lane]
        hi = last - first if hi is None else hi
        s = slice(first + lo, first + hi)
        return self.start[s], self.end[s], self.bytes[s], self.what[s]

    def size(self, lane: Any) -> int:
        first, last = self.lanes[lane]
        return last - first


def _ints(events: list, *fields: str) -> list[np.ndarray]:
    return [np.fromiter(map(attrgetter(f), events), np.int64, len(events)) for f in fields]


def _same(x: tuple[np.ndarray, ...], y: tuple[np.ndarray, ...], p: int = 0) -> bool:
    """Whether events `y` are events `x` P later."""
    return (len(x[0]) == len(y[0]) and np.array_equal(x[0] + p, y[0]) and np.array_equal(x[1] + p, y[1])
            and np.array_equal(x[2], y[2]) and np.array_equal(x[3], y[3]))


def _grows(b: _Columns, c: _Columns, lane: Any, p: int, steps: int, net: bool = False) -> bool:
    """Whether lane `c` is lane `b` with, in each step, a block of events put in that repeats the block
    before it P later, every later event P later for each block before it (a lane with no blocks: its
    events step by step P, 2P, ... later); `net`: memory events, each block releasing what it holds."""
    old, new = b.size(lane), c.size(lane)
    if new < old or (new - old) % steps:
        return False
    n = (new - old) // steps  # events a block
    i = j = shift = 0  # where `b` and `c` are, and how many periods `c` is behind
    moved = False  # (a shift without a block must be followed by a match)
    while True:
        left = old - i
        x, y = b.rows(lane, i, old), c.rows(lane, j, j + left)
        differ = np.zeros(left, bool)
        for u, v, w in zip(x, y, (shift * p, shift * p, 0, 0)):
            differ |= u + w != v
        d = int(np.argmax(differ)) if differ.any() else left
        i, j = i + d, j + d
        if i == old and j == new:
            return shift == steps or n == 0
        if shift == steps or (moved and d == 0):
            return False
        shift, moved = shift + 1, n == 0
        if n:  # a block here, repeating the n events before it
            block = c.rows(lane, j, j + n)
            if j < n or j + n > new or not _same(c.rows(lane, j - n, j), block, p) or (net and _holds(block)):
                return False
            j += n


def _holds(block: tuple[np.ndarray, ...]) -> bool:
    """Whether memory events `block` hold more of some category than they release."""
    held: dict[int, int] = {}
    for what, nbytes in zip(block[3].tolist(), block[2].tolist()):
        held[what] = held.get(what, 0) + nbytes
    return any(held.values())
