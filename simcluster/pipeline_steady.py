"""Meta mode at any micro-batch count: a pipeline's steady rounds are simulated twice, not m times.

A pipelined step of m micro-batches (1F1B, interleaved, zero-bubble, DualPipe) is a warm-up, rounds
of the same steady work, and a cool-down. One more micro-batch (for the interleaved schedule one more
group of p, for DualPipe two) puts one more round in the middle: every stage does one more block of
work, and everything after it happens one period P later. So a meta-mode run of m micro-batches a
step simulates m0 and m0 + u (`Micro.counts`). When, on every lane (rank and stream), the second run
is the first with, in each of its S steps, a block of events put in that repeats the block before it
P later, and every later event P later for each block put in before it -- labels and message tags
aside, which name the micro-batch -- (memory events likewise, each block releasing what it holds),
the state that starts the next round is the state that started this one, shifted, and the simulation
is deterministic (as steady.py argues for steps): the run of m is the second with n = (m - m0 - u) / u
more such blocks a step. Its report follows: makespan E2 + nSP; every per-rank sum (busy time,
calls, bytes and time per collective, events, overlap) extended by n times its increment; memory
peaks the second run's. A run of more than 5 steps (steady.py) does this for its 2-step and 3-step
runs.
Byte for byte the report of simulating every micro-batch (tests/test_pipeline_steady.py): Megatron's
1T model (64 stages, 512 micro-batches) costs two runs of 67 and 68.
Where the rounds do not repeat yet (the pipeline's start still shows), the window moves up a round,
at most MOVES times and while the runs cost at most half of m; where they never do, all m are
simulated. ZeRO-2/3 is not tried: its per-micro-batch reduce-scatters fall further behind each round
(DeepSpeed refuses them with a pipeline; Megatron-LM pairs pipelines with ZeRO-1).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from operator import attrgetter
from typing import Any

import numpy as np

from simcluster.engine.trace import Trace

# Where each schedule's rounds first repeat exactly, as measured on GPT layouts of 2 to 8 stages and on
# Megatron's 1T model (1F1B over 64 stages: from m = p + 3): m0 as (a multiple of p, rounds of u more).
START = {"1f1b": (1, 3), "interleaved": (1, 3), "zb-h1": (2, 4), "zb-v": (2, 3), "dualpipe": (2, 3)}
MOVES = 4  # how many times the window may move up a round before the m micro-batches are simulated


@dataclass(frozen=True)
class Micro:
    """The micro-batch counts a run of `m` simulates instead: `first`, then up in steps of `unit`."""

    first: int
    unit: int
    m: int

    @property
    def counts(self) -> tuple[int, int]:
        return self.first, self.first + self.unit

    def more(self, simulated: int) -> int:
        """Blocks a run of `m` has beyond the run of `simulated` micro-batches."""
        return (self.m - simulated) // self.unit

    def affordable(self, counts: list[int]) -> bool:
        """Whether runs of these counts together cost at most half of the whole run."""
        return 2 * sum(counts) <= self.m


def plan(model: dict[str, Any], parallel: dict[str, Any]) -> Micro | None:
    """The counts for a GPT step of this model and layout, or None where simulating all m micro-batches
    costs no more (or the schedule does not settle into rounds: GPipe holds every micro-batch)."""
    p, schedule = parallel["pp"], parallel["schedule"]
    if p < 2 or schedule not in START or not model["micro_batch"] or parallel["zero"] >= 2:
        return None  # (ZeRO-2/3 reduce-scatter every micro-batch: behind a pipeline their backlog grows)
    m = model["global_batch"] // parallel["dp"] // model["micro_batch"]
    unit = p if schedule == "interleaved" else 2 if schedule == "dualpipe" else 1
    stages, rounds = START[schedule]
    micro = Micro(stages * p + rounds * unit, unit, m)
    if not micro.affordable(list(micro.counts)) or (m - micro.first) % unit:
        return None
    return micro


def period(b: Trace, c: Trace, steps: int = 1) -> int | None:
    """P when a run of m + u micro-batches (`c`) is that of m (`b`) with one more round in each of its
    `steps` steps, the same as the round before it, and every later event P later for each round put
    in before it (the module's docstring); None otherwise."""
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
