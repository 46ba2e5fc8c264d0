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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simcluster.engine.trace import Trace, TraceEvent

SIMULATED = 3  # steps simulated for a longer run (and 2 more to find the period)


@dataclass(frozen=True)
class Totals:
    """The per-rank sums a report is made of."""

    end: int
    events: int
    comm: dict[tuple[str, str], dict[int, tuple[int, int, int]]]  # (group, kind) -> rank -> calls, bytes, ns
    busy: dict[int, dict[str, int]]  # rank -> stream -> ns (ranks in order, streams by first event)
    compute: dict[int, int]  # rank -> compute-stream ns, every rank with a lane
    overlap: dict[int, tuple[int, int]]  # rank -> (ns some communication runs, ns of it under compute)

    @classmethod
    def of(cls, trace: Trace) -> "Totals":
        comm: dict[tuple[str, str], dict[int, list[int]]] = {}
        busy: dict[int, dict[str, int]] = {}
        ranks = sorted({r for r, _ in trace.lanes})
        compute = {r: 0 for r in ranks}
        spans: dict[int, tuple[list[tuple[int, int]], list[tuple[int, int]]]] = {r: ([], []) for r in ranks}
        for e in trace:
            d = e.end - e.start
            streams = busy.setdefault(e.rank, {})
            streams[e.stream] = streams.get(e.stream, 0) + d
            if e.stream == "compute":
                compute[e.rank] += d
            if e.group:
                acc = comm.setdefault((e.group.split("[", 1)[0], e.kind), {}).setdefault(e.rank, [0, 0, 0])
                acc[0] += 1
                acc[1] += e.bytes
                acc[2] += d
            if d:
                spans[e.rank][0 if e.stream == "compute" else 1].append((e.start, e.end))
        return cls(trace.end, len(trace), {k: {r: tuple(v) for r, v in ranks.items()} for k, ranks in comm.items()},
                   busy, compute, {r: covered(*spans[r]) for r in spans})

    def extended(self, before: "Totals", steps: int) -> "Totals":
        """These totals plus `steps` more of the increment from `before` (one step less)."""
        def more(a: int, b: int) -> int:
            return a + steps * (a - b)

        comm = {k: {r: tuple(more(x, y) for x, y in zip(v, before.comm.get(k, {}).get(r, (0, 0, 0))))
                    for r, v in ranks.items()} for k, ranks in self.comm.items()}
        busy = {r: {s: more(ns, before.busy.get(r, {}).get(s, 0)) for s, ns in streams.items()}
                for r, streams in self.busy.items()}
        overlap = {r: tuple(more(x, y) for x, y in zip(v, before.overlap.get(r, (0, 0))))
                   for r, v in self.overlap.items()}
        return Totals(more(self.end, before.end), more(self.events, before.events), comm, busy,
                      {r: more(ns, before.compute.get(r, 0)) for r, ns in self.compute.items()}, overlap)


def union(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The disjoint intervals covering `spans`, in order."""
    out: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1] = (out[-1][0], end)
        else:
            out.append((start, end))
    return out


def covered(compute: list[tuple[int, int]], other: list[tuple[int, int]]) -> tuple[int, int]:
    """(ns during which some non-compute stream is busy, ns of those during which compute is busy too):
    communication time and the part of it hidden under computation, as HTA's overlap counts them."""
    a, b = union(compute), union(other)
    i = j = hidden = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        hidden += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return sum(end - start for start, end in b), hidden


def period(two: Trace, three: Trace) -> int | None:
    """P when the 3-step trace is the 2-step one plus its last step again, P later (None otherwise)."""
    p = three.end - two.end
    if p <= 0 or two.lanes != three.lanes:
        return None
    a, b = _lanes(two), _lanes(three)
    for lane in two.lanes:
        if not _repeats(a.get(lane, []), b.get(lane, []), p, _shift_event):
            return None
    ma, mb = _by_rank(two.memory), _by_rank(three.memory)
    if set(ma) != set(mb):
        return None
    for rank in ma:
        if not _repeats(ma[rank], mb[rank], p, _shift_memory):
            return None
        added = mb[rank][len(ma[rank]):]
        net: dict[str, int] = {}
        for e in added:
            net[e.category] = net.get(e.category, 0) + e.bytes
        if any(net.values()):  # a step that holds more than it releases: peaks would grow
            return None
    return p


def _repeats(old: list, new: list, p: int, shift: Any) -> bool:
    n = len(old)
    c = len(new) - n
    if c < 0 or c > n or new[:n] != old:
        return False
    return all(shift(x, p) == shift(y, 0) for x, y in zip(old[n - c:], new[n:]))


def _shift_event(e: TraceEvent, p: int) -> TraceEvent:
    return e._replace(name="", start=e.start + p, end=e.end + p)  # (labels name the step: "O2")


def _shift_memory(e: Any, p: int) -> Any:
    return e._replace(name="", at=e.at + p)


def _lanes(trace: Trace) -> dict[tuple[int, str], list[TraceEvent]]:
    out: dict[tuple[int, str], list[TraceEvent]] = {}
    for e in trace:
        out.setdefault((e.rank, e.stream), []).append(e)
    return out


def _by_rank(events: tuple) -> dict[int, list]:
    out: dict[int, list] = {}
    for e in events:
        out.setdefault(e.rank, []).append(e)
    return out
