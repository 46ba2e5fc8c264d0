"""Export a trace as PyTorch profiler traces, one file per rank, for Holistic Trace Analysis (HTA).

The layout HTA reads (`hta.common.trace_file`, `trace_parser`): a JSON document per rank with
`distributedInfo` (backend, rank, world size) and `deviceProperties`, and GPU kernels as complete
events of category "kernel" whose `args` give the device and the CUDA stream. Kernels of the compute
stream keep their names and run on stream 7 (the default stream in a profiler trace); communication
runs on one stream per simcluster stream from 13 up, named as NCCL names its kernels
(`ncclDevKernel_AllReduce_Sum_bf16_RING_LL(...)`, `ncclDevKernel_SendRecv(...)`), which is how HTA
tells communication from computation. Timestamps are microseconds with nanosecond fractions, as in
a profiler trace; HTA rounds such timestamps to whole microseconds unless HTA_DISABLE_NS_ROUNDING=1
(set it for kernels of a few microseconds). There are no CPU operators and no ProfilerStep
annotations: the whole run is one span (HTA warns that it found no ProfilerStep).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from simcluster.engine.trace import Trace

COMPUTE_STREAM = 7
FIRST_COMM_STREAM = 13
NCCL_ARGS = "(ncclDevComm*, unsigned long, ncclWork*)"


def nccl_name(kind: str, dtype: str) -> str:
    if kind in ("send", "recv"):
        return "ncclDevKernel_SendRecv" + NCCL_ARGS
    op = "".join(part.capitalize() for part in kind.split("_"))
    reduces = kind in ("all_reduce", "reduce_scatter", "reduce")
    return f"ncclDevKernel_{op}{'_Sum_' + dtype if reduces else ''}_RING_LL" + NCCL_ARGS


def rank_traces(trace: Trace, *, gpus_per_node: int, device: str, memory_bytes: int, dtype: str = "bf16",
                world_size: int | None = None, metadata: dict[str, Any] | None = None) -> dict[int, dict[str, Any]]:
    """One profiler-trace document per rank of the trace (`world_size`: the run's, when the trace holds
    only some of its ranks)."""
    ranks = sorted({r for r, _ in trace.lanes})
    streams: dict[str, int] = {}
    for _, name in trace.lanes:
        if name != "compute" and name not in streams:
            streams[name] = FIRST_COMM_STREAM + len(streams)
    docs: dict[int, dict[str, Any]] = {}
    for rank in ranks:
        local = rank % gpus_per_node
        docs[rank] = {
            "schemaVersion": 1,
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world_size or len(ranks)},
            "deviceProperties": [{"id": local, "name": device, "totalGlobalMem": memory_bytes}],
            "traceName": f"simcluster rank {rank}",
            "displayTimeUnit": "ms",
            "baseTimeNanoseconds": 0,
            "simcluster": metadata or {},
            "traceEvents": [],
        }
    for n, e in enumerate(trace):
        stream = COMPUTE_STREAM if e.stream == "compute" else streams[e.stream]
        args: dict[str, Any] = {"device": e.rank % gpus_per_node, "stream": stream, "correlation": n + 1}
        if e.group:
            args |= {"Collective name": e.kind, "Process Group Name": e.group, "bytes sent": e.bytes}
        docs[e.rank]["traceEvents"].append({
            "ph": "X", "cat": "kernel", "name": nccl_name(e.kind, dtype) if e.group else e.name,
            "pid": e.rank % gpus_per_node, "tid": stream, "ts": e.start / 1000.0, "dur": e.duration / 1000.0,
            "args": args})
    return docs


def write(directory: Path, docs: dict[int, dict[str, Any]]) -> list[Path]:
    """rank-N.json per rank (HTA finds each file's rank in its distributedInfo); an earlier export's
    rank files that this one does not write are removed (HTA would read them as ranks of this run)."""
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("rank-*.json"):
        if old.stem.removeprefix("rank-").isdigit() and int(old.stem.removeprefix("rank-")) not in docs:
            old.unlink()
    paths = []
    for rank, doc in docs.items():
        path = directory / f"rank-{rank}.json"
        path.write_text(json.dumps(doc, separators=(",", ": ")))  # (HTA finds the rank by '"rank": N')
        paths.append(path)
    return paths
