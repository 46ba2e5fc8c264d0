"""What the interpreter matches communication into, and the timed replay times: a channel (a
process group, a (src, dst, tag) message channel or a rank's copies between memory tiers), each
call on it, and each member's work on its stream."""

from __future__ import annotations

from typing import Any

from simcluster.engine.fold import Fold
from simcluster.engine.streams import Stream
from simcluster.program.comm import CommKind, CommOp, Work
from simcluster.program.mesh import ProcessGroup

_COPY = CommKind.COPY


class Channel:
    """Where calls are matched: a process group (the k-th call of each member is one call), or a
    (src, dst, tag) message channel (the k-th send and the k-th recv are one message)."""

    __slots__ = ("kind", "group", "members", "live", "position", "issued", "open", "where", "streams", "routes",
                 "stream_of", "mixed")

    def __init__(self, kind: CommKind | None, group: ProcessGroup | None, members: tuple[int, ...],
                 where: str, streams: tuple[str, ...], fold: Fold | None) -> None:
        self.kind = kind  # SEND for a message channel, None for a group
        self.group = group
        self.members = members
        # members that run: all, unless folded
        self.live = len(members) if fold is None else sum(fold.is_rep[r] for r in members)
        self.position = {r: i for i, r in enumerate(members)}
        self.issued = [0] * len(members)  # calls issued so far, per member
        self.open: dict[int, Call] = {}  # by sequence number
        self.where = where
        self.streams = streams  # default stream, per member
        self.routes: dict[tuple, Any] = {}  # the timed replay's routes, by call shape
        self.stream_of: list[Stream | None] = [None] * len(members)  # the stream each member issues on
        self.mixed = False  # whether a member issued calls on more than one stream (they may overlap)


class Call:
    """One collective call on a group, or one message on a (src, dst, tag) channel."""

    __slots__ = ("kind", "channel", "seq", "members", "live", "ops", "works", "count", "key",
                 "arrived", "start", "end", "done", "sent", "steps", "phase")

    def __init__(self, kind: CommKind, channel: Channel, seq: int) -> None:
        self.kind = kind  # SEND for a message (members: sender, receiver)
        self.channel = channel
        self.seq = seq
        self.members = channel.members
        self.live = channel.live
        n = len(self.members)
        self.ops: list[CommOp | None] = [None] * n  # in member order
        self.works: list[Work | None] = [None] * n
        self.count = 0  # members that have issued it (it is complete at `live`)
        self.key: Any = None  # what every member must agree on
        # filled by the timed replay
        self.arrived = 0
        self.start = 0
        self.end = 0
        self.done: Any = None  # the streams waiting for its end
        self.sent: list[int] = []  # bytes each member sends
        self.steps: list[tuple[int, list]] = []  # its phases: (latency, flows) each
        self.phase = 0  # the next phase

    @property
    def is_message(self) -> bool:
        return self.kind is CommKind.SEND

    @property
    def group(self) -> ProcessGroup | None:
        return self.channel.group

    @property
    def where(self) -> str:
        return self.channel.where

    def op_of(self, rank: int) -> CommOp | None:
        return self.ops[self.channel.position[rank]]

    def missing(self) -> list[int]:
        return [m for m, op in zip(self.members, self.ops) if op is None]

    def describe(self, rank: int) -> str:
        op = self.op_of(rank)
        if self.kind is _COPY:
            return f"{op.describe() if op else 'copy'} (copy #{self.seq} from {self.where})"
        if self.is_message:
            return f"{op.describe() if op else 'message'} (message #{self.seq} on {self.where})"
        return f"{op.describe() if op else self.kind.value} on group {self.where} (call #{self.seq} on that group)"


class EmulatedWork(Work):
    """A work with where it runs: item `index` of `stream`, part of `call`."""

    __slots__ = ("stream", "index", "call")

    def __init__(self, op: CommOp, sync: bool, stream: Stream, index: int, call: Call) -> None:
        self.op, self.sync, self.done, self.value, self.waited, self.backend = op, sync, False, None, False, None
        self.stream, self.index, self.call = stream, index, call
