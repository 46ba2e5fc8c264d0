"""A flight recorder for the collectives of one rank, and the report a watchdog gives when one hangs.

PyTorch's NCCL watchdog aborts a collective that has not finished within the process group's timeout,
and its Flight Recorder keeps, per rank, the last collectives with their sequence numbers (counted per
process group), op, sizes and state; comparing the ranks' records tells which ranks never joined the
call the others are stuck in. This is the same for simcluster programs on torch.distributed:

- every rank counts the collectives it issues per group (`seq`, from 1), remembering each group's last
  call and whether it completed;
- a rank whose wait fails (gloo's timeout, a peer that went away) or that ends its program publishes
  its record in the process group's key-value store, and a failing rank reads its peers' records for a
  short grace period and names, for the call it is stuck in, the ranks that joined it and those that
  did not (with what they did last, or that they left no record: hung in a computation, or dead).

Recording costs a dict update per collective; the store is touched only at the end and on failure.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from simcluster.program.comm import CommKind, CommOp, ProgramError

PREFIX = "simcluster/flight/"


class CollectiveTimeout(ProgramError):
    """A collective that did not finish: the message is the watchdog's report."""


def group_key(op: CommOp) -> str:
    """Where an op's sequence number is counted: its process group, or the pair of a point-to-point op."""
    if op.kind in (CommKind.SEND, CommKind.RECV):
        a, b = sorted((op.rank, op.peer))
        return f"p2p {a}<->{b}"
    if op.kind is CommKind.COPY:
        return f"copy {op.tiers[0]}->{op.tiers[1]} on rank {op.rank}"
    return f"{op.group.name} ({','.join(map(str, op.group.ranks))})"


def members(op: CommOp) -> tuple[int, ...]:
    if op.kind in (CommKind.SEND, CommKind.RECV):
        return tuple(sorted((op.rank, op.peer)))
    if op.kind is CommKind.COPY:
        return (op.rank,)
    return op.group.ranks


@dataclass
class FlightRecorder:
    rank: int
    store: Any = None  # a torch.distributed Store, or None (then peers cannot be asked)
    grace_s: float = 3.0  # how long a failing rank waits for its peers' records
    last: dict[str, dict[str, Any]] = field(default_factory=dict)  # group -> {seq, op, completed}

    def issued(self, op: CommOp) -> int:
        key = group_key(op)
        seq = self.last.get(key, {"seq": 0})["seq"] + 1
        self.last[key] = {"seq": seq, "op": op.describe(), "completed": False}
        return seq

    def completed(self, op: CommOp, seq: int) -> None:
        entry = self.last[group_key(op)]
        if entry["seq"] == seq:
            entry["completed"] = True

    def publish(self, state: str) -> None:
        """Leave this rank's record for its peers: `state` is 'finished' or 'failed'."""
        if self.store is not None:
            try:
                self.store.set(f"{PREFIX}{self.rank}", json.dumps({"state": state, "groups": self.last}))
            except Exception:  # the store's host is gone: nobody is left to read it
                pass

    def _peer(self, r: int) -> dict[str, Any] | None:
        try:
            if self.store.check([f"{PREFIX}{r}"]):
                return json.loads(self.store.get(f"{PREFIX}{r}"))
        except Exception:
            return None
        return None

    def report(self, op: CommOp, seq: int, waited_s: float, cause: BaseException) -> CollectiveTimeout:
        """The watchdog's account of `op` (this rank's call number `seq` on its group) not finishing."""
        self.publish("failed")
        peers = [r for r in members(op) if r != self.rank]
        records: dict[int, dict[str, Any] | None] = {r: None for r in peers}
        deadline = time.monotonic() + (self.grace_s if self.store is not None else 0.0)
        while True:
            for r in peers:
                if records[r] is None:
                    records[r] = self._peer(r) if self.store is not None else None
            if all(v is not None for v in records.values()) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        key = group_key(op)
        joined, missing = [self.rank], []
        for r in peers:
            rec = records[r]
            theirs = (rec or {}).get("groups", {}).get(key)
            if theirs is not None and theirs["seq"] >= seq:
                joined.append(r)
            elif rec is None:
                missing.append(f"rank {r}: no record (hung outside a collective, or dead)")
            else:
                did = f"last call seq {theirs['seq']} {theirs['op']}" if theirs else "no call on this group"
                missing.append(f"rank {r}: {did}, then {'ended its program' if rec['state'] == 'finished' else 'failed'}")
        lines = [f"watchdog: rank {self.rank}: collective seq {seq} on group {key}, {op.describe()}, "
                 f"did not finish (waited {waited_s:.1f} s: {type(cause).__name__}: {str(cause).splitlines()[0][:160]})",
                 f"  joined: ranks {', '.join(map(str, sorted(joined)))}"]
        lines += [f"  did not join: {m}" for m in missing] or ["  every rank joined: the collective itself stalled"]
        return CollectiveTimeout("\n".join(lines))
