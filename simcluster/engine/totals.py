"""What a report is made of: per-rank sums over a run's trace (busy time per stream, communication per
group and operation, compute time, how much communication runs under compute).

The replay keeps them per lane as it makes each event (engine/timing.py `LaneSums`), so a report does
not walk the events again (for a 3,072-GPU Megatron layout that walk cost a third of the run); a trace
without them (a watchdog drew stalls on it) is summed from its events, to the same figures
(tests/test_steady.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from simcluster.engine.trace import Trace, pass_label
from simcluster.numerics.ops import EINSUM_PARTIAL, GEMM_PARTIAL
from simcluster.topology.cluster import ATTENTION_KERNELS

# A kernel's kind, by its name past its label: what the cluster times it as (topology/cluster.py). GEMMs by
# their shape (every matmul and einsum, an unfused attention's batched products too), the fused attention
# kernels at attention's rate, the rest (elementwise, norms, the loss, the optimizer) by their FLOPs and bytes.
KINDS = ("gemm", "attention", "other")
GEMMS = frozenset(("matmul", GEMM_PARTIAL, "einsum", EINSUM_PARTIAL, "attention_scores"))


def kind_of(name: str) -> int:
    """The index in KINDS of a kernel named `name` (labelled or not)."""
    bare = name.rpartition("/")[2]
    return 0 if bare in GEMMS else 1 if bare.endswith(ATTENTION_KERNELS) else 2


@dataclass
class LaneSums:
    """One lane's sums: busy ns, events, when its last event ends, communication by (group, operation)
    as [calls, bytes, ns], its busy spans ([start, end], back-to-back events joined), and its kernels' ns
    by kind (KINDS)."""

    busy: int = 0
    count: int = 0
    end: int = 0
    comm: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    spans: list[list[int]] = field(default_factory=list)
    kinds: list[int] = field(default_factory=lambda: [0, 0, 0])


@dataclass(frozen=True)
class Totals:
    """The per-rank sums a report is made of."""

    end: int
    events: int
    comm: dict[tuple[str, str], dict[int, tuple[int, int, int]]]  # (group, kind) -> rank -> calls, bytes, ns
    busy: dict[int, dict[str, int]]  # rank -> stream -> ns (ranks in order, streams by first event)
    compute: dict[int, int]  # rank -> compute-stream ns, every rank with a lane
    overlap: dict[int, tuple[int, int]]  # rank -> (ns some communication runs, ns of it under compute)
    kinds: dict[int, tuple[int, int, int]]  # rank -> its compute stream's kernel ns by kind (KINDS)
    first_pass: int | None = None  # when the first forward pass starts (after initialisation; steps.py)
    first_step_end: int | None = None  # when step 0's optimizer ends (None: no optimizer)
    last_step_end: int | None = None  # when the last step's optimizer ends

    @classmethod
    def of(cls, trace: Trace) -> "Totals":
        """The trace's sums: those its replay kept as it went (engine/timing.py), or, for a trace that
        has none (one a watchdog drew on), summed from its events."""
        kept = trace.__dict__.get("totals")
        if kept is not None:
            return kept
        lanes: dict[tuple[int, str], LaneSums] = {lane: LaneSums() for lane in trace.lanes}
        first, optimizers = None, {}  # (the steps' marks, as steps.py reads them off the streams)
        for e in trace:
            if not e.group:  # (a kernel: the first forward? a step's optimizer?)
                label = pass_label(e.name)
                if e.kind == "forward" and (first is None or e.start < first):
                    first = e.start
                if label[:1] == "O" and label[1:].isdigit():
                    optimizers[int(label[1:])] = max(optimizers.get(int(label[1:]), 0), e.end)
            d = e.end - e.start
            lane = lanes[(e.rank, e.stream)]
            lane.busy += d
            lane.count += 1
            lane.end = max(lane.end, e.end)
            if e.group:
                acc = lane.comm.setdefault((e.group, e.kind), [0, 0, 0])
                acc[0] += 1
                acc[1] += e.bytes
                acc[2] += d
            else:
                lane.kinds[kind_of(e.name)] += d
            if d:
                lane.spans.append([e.start, e.end])
        marks = (first, optimizers.get(0), optimizers[max(optimizers)] if optimizers else None)
        return cls.of_lanes(list(lanes), list(lanes.values()), marks)

    @classmethod
    def of_lanes(cls, lanes: list[tuple[int, str]], sums: list["LaneSums"],
                 marks: tuple[int | None, int | None, int | None] = (None, None, None)) -> "Totals":
        """From each lane's sums, lanes in the trace's order (rank, then stream), and the steps' marks
        (steps.py)."""
        comm: dict[tuple[str, str], dict[int, list[int]]] = {}
        busy: dict[int, dict[str, int]] = {}
        ranks = sorted({r for r, _ in lanes})
        compute = {r: 0 for r in ranks}
        kinds = {r: (0, 0, 0) for r in ranks}
        spans: dict[int, tuple[list, list]] = {r: ([], []) for r in ranks}
        for (rank, stream), lane in zip(lanes, sums):
            if not lane.count:
                continue
            busy.setdefault(rank, {})[stream] = lane.busy
            if stream == "compute":
                compute[rank] += lane.busy
                kinds[rank] = tuple(a + b for a, b in zip(kinds[rank], lane.kinds))
            for (where, kind), (calls, nbytes, ns) in lane.comm.items():
                acc = comm.setdefault((where.split("[", 1)[0], kind), {}).setdefault(rank, [0, 0, 0])
                acc[0] += calls
                acc[1] += nbytes
                acc[2] += ns
            spans[rank][0 if stream == "compute" else 1].extend(lane.spans)
        return cls(max((lane.end for lane in sums), default=0), sum(lane.count for lane in sums),
                   {k: {r: tuple(v) for r, v in ranks.items()} for k, ranks in comm.items()}, busy, compute,
                   {r: covered(*spans[r]) for r in spans}, kinds, *marks)

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
        kinds = {r: tuple(more(x, y) for x, y in zip(v, before.kinds.get(r, (0, 0, 0)))) for r, v in self.kinds.items()}
        def mark(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else more(a, b)

        return Totals(more(self.end, before.end), more(self.events, before.events), comm, busy,
                      {r: more(ns, before.compute.get(r, 0)) for r, ns in self.compute.items()}, overlap, kinds,
                      self.first_pass, mark(self.first_step_end, before.first_step_end),
                      mark(self.last_step_end, before.last_step_end))


def union(spans: list) -> np.ndarray:
    """The disjoint intervals covering `spans` ((start, end) pairs, touching ones joined), in order,
    as an (n, 2) array."""
    if isinstance(spans, np.ndarray):
        a = spans
    else:  # (pairs in a list: read as one flat run, much faster than numpy's nested-list path)
        a = np.fromiter(chain.from_iterable(spans), dtype=np.int64, count=2 * len(spans)).reshape(-1, 2)
    if not len(a):
        return a
    a = a[np.lexsort((a[:, 1], a[:, 0]))]
    reach = np.maximum.accumulate(a[:, 1])  # the furthest end so far
    first = np.flatnonzero(np.concatenate(([True], a[1:, 0] > reach[:-1])))  # where a new interval starts
    return np.stack((a[first, 0], reach[np.append(first[1:] - 1, len(a) - 1)]), axis=1)


def covered(compute: list, other: list) -> tuple[int, int]:
    """(ns during which some non-compute stream is busy, ns of those during which compute is busy too):
    communication time and the part of it hidden under computation, as HTA's overlap counts them.
    (The part hidden is |A| + |B| - |A u B| for the two unions A and B.)"""
    def length(x: np.ndarray) -> int:
        return int((x[:, 1] - x[:, 0]).sum())

    a, b = union(compute), union(other)
    return length(b), length(a) + length(b) - length(union(np.concatenate((a, b))))
