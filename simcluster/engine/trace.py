"""The trace: immutable events from which every report and picture is derived."""

from __future__ import annotations

import json
from itertools import chain
from typing import Iterable, Iterator, NamedTuple

from simcluster.model.memory import tier_of

COMPUTE_KINDS = frozenset({"compute", "forward", "backward", "weight_grad", "optimizer", "recompute"})


def pass_label(name: str) -> str:
    """The label a kernel's name starts with: F3 from "F3:block0/matmul", O0 from "O0/adam"."""
    return name.split("/", 1)[0].split(":", 1)[0]


class TraceEvent(NamedTuple):
    """One kernel or one rank's part of a communication.

    kind: for kernels the label kind ("compute", "forward", "backward", ...), for communication the
    operation ("all_reduce", "send", ...). bytes: bytes this rank sent on links (0 for kernels).
    group: the process group ("tp[0, 1]") or the channel ("p2p[0->1]"); "" for kernels.
    """

    rank: int
    stream: str
    kind: str
    name: str
    start: int
    end: int
    bytes: int = 0
    group: str = ""

    @property
    def duration(self) -> int:
        return self.end - self.start

    @property
    def is_comm(self) -> bool:
        return bool(self.group)


class MemoryEvent(NamedTuple):
    """A rank starts (bytes > 0) or stops (bytes < 0) holding a buffer at time `at` (logical dtype)."""

    rank: int
    at: int
    category: str
    name: str
    bytes: int


class Trace:
    """Events sorted by (rank, stream order of first use, start)."""

    def __init__(self, events: Iterable[TraceEvent], streams: Iterable[tuple[int, str]]) -> None:
        self.lanes: tuple[tuple[int, str], ...] = tuple(streams)
        order = {lane: i for i, lane in enumerate(self.lanes)}
        keyed = sorted((e.rank, order[(e.rank, e.stream)], e.start, e.end, i, e) for i, e in enumerate(events))
        self.events: tuple[TraceEvent, ...] = tuple(k[-1] for k in keyed)

    memory: tuple[MemoryEvent, ...] = ()

    def memory_peaks(self) -> dict[int, dict[str, int]]:
        """Per rank: the peak of each category, and "total" (the peak of the sum in device memory), in
        bytes; for what a rank keeps in a host tier (categories "cpu:..." and "nvme:..."), the tier's
        peak as "cpu" or "nvme".

        Events at the same instant are applied in stream order; a release and a hold at the same ns
        are netted before the peak is taken, as an allocator would reuse the memory.
        """
        out: dict[int, dict[str, int]] = {}
        current: dict[int, dict[str, int]] = {}
        held: dict[int, dict[str, int]] = {}  # per rank, what each tier holds now
        tiers = {c: "total" if tier_of(c) == "gpu" else tier_of(c) for c in {e.category for e in self.memory}}
        i, events = 0, self.memory
        while i < len(events):
            j = i
            at = events[i][:2]
            while j < len(events) and events[j][:2] == at:
                j += 1
            rank = events[i].rank
            cur = current.setdefault(rank, {})
            tier_now = held.setdefault(rank, {"total": 0})
            peaks = out.setdefault(rank, {"total": 0})
            touched: dict[str, None] = {}  # (in order: the peaks' keys come in the order first seen)
            for e in events[i:j]:
                c = e.category
                cur[c] = cur.get(c, 0) + e.bytes
                tier_now[tiers[c]] = tier_now.get(tiers[c], 0) + e.bytes
                touched[c] = None
            for c in touched:  # (a peak moves only where the instant changed something)
                peaks[c] = max(peaks.get(c, 0), cur[c])
            for tier in dict.fromkeys(tiers[c] for c in touched):
                peaks[tier] = max(peaks.get(tier, 0), tier_now[tier])
            i = j
        return out

    @classmethod
    def from_lanes(cls, lanes: list[tuple[int, str]], events: list[list[TraceEvent]]) -> "Trace":
        """From per-lane lists already in start order (lanes in rank order)."""
        trace = cls.__new__(cls)
        trace.lanes = tuple(lanes)
        trace.events = tuple(chain.from_iterable(events))
        return trace

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    @property
    def end(self) -> int:
        """When the last event ends (computed once: events never change)."""
        end = self.__dict__.get("_end")
        if end is None:
            totals = self.__dict__.get("totals")  # (a replay's sums: engine/totals.py; all a trace without events has)
            end = self.__dict__["_end"] = totals.end if totals is not None else max((e.end for e in self.events), default=0)
        return end

    def lane(self, rank: int, stream: str) -> list[TraceEvent]:
        return [e for e in self.events if e.rank == rank and e.stream == stream]

    def to_jsonl(self) -> str:
        """One JSON array per event: a byte-stable serialisation for determinism checks and diffs."""
        return "".join(json.dumps(list(e), separators=(",", ":")) + "\n" for e in self.events)
