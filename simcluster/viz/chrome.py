"""Export a trace in the Chrome trace event format (opens in Perfetto and chrome://tracing).

One process per rank, one thread per stream; kernels and communication as complete events ("X",
microseconds); memory per rank and category as counter tracks ("C"); a collective call drawn as
arrows from its first rank to each other rank, a message as an arrow from its send to its receive:
every arrow one start ("s") and one finish ("f") of its own id, in the category of the slices it
joins ("communication": the operation is the slice's name). `otherData` carries the scenario, the mesh and the cluster.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

from simcluster.engine.trace import Trace

P2P = ("send", "recv")
COMM = "communication"


def chrome_trace(trace: Trace, *, title: str = "simcluster", metadata: dict[str, Any] | None = None) -> dict[str, Any]:
    tids: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for rank, stream in trace.lanes:
        tid = tids.setdefault((rank, stream), len([k for k in tids if k[0] == rank]))
        if tid == 0:
            events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "ts": 0,
                           "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "ts": 0, "args": {"name": stream}})
    calls: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for e in trace:
        x = {"ph": "X", "name": e.name, "cat": COMM if e.group else e.kind, "pid": e.rank,
             "tid": tids[(e.rank, e.stream)], "ts": e.start / 1000.0, "dur": e.duration / 1000.0}
        if e.group:
            x["args"] = {"operation": e.kind, "group": e.group, "bytes sent": e.bytes}
            calls.setdefault((e.group, "p2p" if e.kind in P2P else e.kind, e.start, e.end), []).append(x)
        events.append(x)
    for flow_id, (tail, head) in enumerate(arrows(calls.values())):
        for phase, end in (("s", tail), ("f", head)):
            events.append({"ph": phase, "id": flow_id, "name": tail["args"]["operation"], "cat": COMM, "pid": end["pid"],
                           "tid": end["tid"], "ts": end["ts"]} | ({"bp": "e"} if phase == "f" else {}))
    events.extend(counters(trace))
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"title": title} | (metadata or {})}


def arrows(calls: Any) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(tail, head) slices: each message's send to its receive (in order when a channel carries two
    at once); a collective's first rank to each of the others."""
    for members in calls:
        ops = [m["args"]["operation"] for m in members]
        if ops[0] in P2P:
            yield from zip([m for m, op in zip(members, ops) if op == "send"],
                           [m for m, op in zip(members, ops) if op == "recv"])
        else:
            yield from ((members[0], m) for m in members[1:])


def counters(trace: Trace) -> Iterator[dict[str, Any]]:
    """Memory held per rank and category: one counter event per rank and instant it changes."""
    held: dict[int, dict[str, int]] = {}
    i, memory = 0, trace.memory
    while i < len(memory):
        rank, at = memory[i].rank, memory[i].at
        now = held.setdefault(rank, {})
        while i < len(memory) and memory[i].rank == rank and memory[i].at == at:
            now[memory[i].category] = now.get(memory[i].category, 0) + memory[i].bytes
            i += 1
        yield {"ph": "C", "name": "memory (bytes)", "pid": rank, "tid": 0, "ts": at / 1000.0, "args": dict(sorted(now.items()))}


def dumps(trace: Trace, **kw: Any) -> str:
    return json.dumps(chrome_trace(trace, **kw), separators=(",", ":"))
