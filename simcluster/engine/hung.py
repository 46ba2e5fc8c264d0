"""A timed replay whose streams did not all finish: after a failed rank, what the waiting ranks'
watchdogs report (engine/faults.py `Hang`); otherwise a cycle of waits, a deadlock."""

from __future__ import annotations

from simcluster.engine.calls import Call
from simcluster.engine.errors import DeadlockError
from simcluster.engine.faults import Faults, Hang, Stuck
from simcluster.engine.streams import COMM, WAIT, Stream
from simcluster.engine.trace import TraceEvent


def watchdog(faults: Faults, streams: list[Stream], lists: list[list[TraceEvent]]) -> Hang:
    """After a rank failed: each call some members joined and never finished, as the waiting ranks'
    watchdogs report it, and the stall drawn on their lanes until the timeout."""
    failed, at = faults.failed
    timeout = faults.watchdog_ns
    waiting: dict[int, list[tuple[Stream, list, Call, int]]] = {}  # call id -> its stuck members
    calls: dict[int, Call] = {}
    for s, events in zip(streams, lists):
        done = next((i for i, e in enumerate(s.end_times) if e is None), len(s.items))
        if s.rank == failed or done == len(s.items) or s.items[done][0] != COMM:
            continue
        _, call, kind, label, position, dep, j, where = s.items[done]
        if dep is not None and dep.end_times[j] is None:
            continue  # never joined: its input waits on work stuck elsewhere
        began = max(s.end_times[done - 1] if done else 0, 0 if dep is None else dep.end_times[j])
        waiting.setdefault(id(call), []).append((s, events, call, began))
        calls[id(call)] = call
    first: dict[int, Stuck] = {}
    for key, members in waiting.items():
        call = calls[key]
        joined = tuple(sorted({s.rank for s, _, _, _ in members}))
        missing = tuple(r for r in call.members if r not in joined)
        op = call.ops[call.channel.position[joined[0]]]
        what = op.describe() if op is not None else call.kind.value
        group = f" on group ({', '.join(map(str, call.members))})" if not call.is_message else ""
        for s, events, _, began in members:
            item = s.items[next(i for i, e in enumerate(s.end_times) if e is None)]
            events.append(TraceEvent(s.rank, s.name, item[2], f"{item[3] or item[2]} (hung: watchdog)", began,
                                     began + timeout, 0, item[7]))
            stuck = Stuck(s.rank, what + group, call.seq + 1, joined, missing, began, timeout)
            if s.rank not in first or began < first[s.rank].began_ns:
                first[s.rank] = stuck
    return Hang(failed, at, tuple(first[r] for r in sorted(first)))


def deadlock(streams: list[Stream]) -> DeadlockError:
    """What a replay that stops short says when no rank failed: each stream's item it cannot pass."""
    lines = ["deadlock in the timed replay (streams wait on each other in a cycle):"]
    for s in streams:
        done = sum(1 for e in s.end_times if e is not None)
        if done < len(s.items):
            item = s.items[done]
            what = "a wait on another stream" if item[0] == WAIT else (
                f"{item[1].describe(s.rank)}" if item[0] == COMM else "a kernel")
            lines.append(f"  rank {s.rank} stream {s.name!r} is stuck at item {done}: {what}")
    return DeadlockError("\n".join(lines))
