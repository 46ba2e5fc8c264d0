"""The trace: immutable events from which every report and picture is derived."""

from __future__ import annotations

import json
from dataclasses import astuple, dataclass
from typing import Iterable, Iterator

COMPUTE_KINDS = frozenset({"compute", "forward", "backward", "weight_grad", "optimizer", "recompute"})


@dataclass(frozen=True, slots=True)
class TraceEvent:
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


class Trace:
    """Events sorted by (rank, stream order of first use, start)."""

    def __init__(self, events: Iterable[TraceEvent], streams: Iterable[tuple[int, str]]) -> None:
        self.lanes: tuple[tuple[int, str], ...] = tuple(streams)
        order = {lane: i for i, lane in enumerate(self.lanes)}
        self.events: tuple[TraceEvent, ...] = tuple(
            sorted(events, key=lambda e: (e.rank, order[(e.rank, e.stream)], e.start, e.end)))

    def __iter__(self) -> Iterator[TraceEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        return len(self.events)

    @property
    def end(self) -> int:
        return max((e.end for e in self.events), default=0)

    def lane(self, rank: int, stream: str) -> list[TraceEvent]:
        return [e for e in self.events if e.rank == rank and e.stream == stream]

    def to_jsonl(self) -> str:
        """One JSON array per event: a byte-stable serialisation for determinism checks and diffs."""
        return "".join(json.dumps(astuple(e), separators=(",", ":")) + "\n" for e in self.events)
