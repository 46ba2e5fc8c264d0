"""Export a trace in the Chrome trace event format (opens in Perfetto and chrome://tracing).

One process per rank, one thread per stream; kernels and communication as complete events ("X",
microseconds); the ranks of one collective call joined by flow arrows ("s"/"f").
"""

from __future__ import annotations

import json
from typing import Any

from simcluster.engine.trace import Trace


def chrome_trace(trace: Trace, *, title: str = "simcluster") -> dict[str, Any]:
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
        x = {"ph": "X", "name": e.name, "cat": e.kind, "pid": e.rank, "tid": tids[(e.rank, e.stream)],
             "ts": e.start / 1000.0, "dur": e.duration / 1000.0}
        if e.group:
            x["args"] = {"group": e.group, "bytes sent": e.bytes}
            calls.setdefault((e.group, e.kind, e.start, e.end), []).append(x)
        events.append(x)
    for flow_id, members in enumerate(calls.values()):
        if len(members) < 2:
            continue
        first = members[0]
        events.append({"ph": "s", "id": flow_id, "name": first["cat"], "cat": "collective", "pid": first["pid"],
                       "tid": first["tid"], "ts": first["ts"]})
        for m in members[1:]:
            events.append({"ph": "f", "bp": "e", "id": flow_id, "name": first["cat"], "cat": "collective",
                           "pid": m["pid"], "tid": m["tid"], "ts": m["ts"]})
    return {"traceEvents": events, "displayTimeUnit": "ns", "otherData": {"title": title}}


def dumps(trace: Trace, **kw: Any) -> str:
    return json.dumps(chrome_trace(trace, **kw), separators=(",", ":"))
