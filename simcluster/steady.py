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

from typing import Any

from simcluster.engine.trace import Trace, TraceEvent

SIMULATED = 3  # steps simulated for a longer run (and 2 more to find the period)


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
