"""Faults injected into the timed replay: a straggler, a degraded link, a failed rank, and the watchdog
that names what a failed rank leaves hanging.

A straggler's kernels that start at or after `from_ns` take `factor` times as long (a GPU throttled by
heat or power, a noisy neighbour). A degraded link carries `factor` times its bandwidth, both
directions of a rank's NIC or NVLink port (a flapping cable, a link trained down). A failed rank
stops at `at_ns`: nothing it would start later runs, so every collective it has not joined never
completes, and its peers wait on it. As PyTorch's NCCL watchdog does, each waiting rank gives up
`watchdog_ns` after its own part of the call began (PyTorch's default timeout for NCCL process groups
is 10 minutes) and reports the call: its kind, the group's sequence number (1-based, as NCCL's
SeqNum), and which members joined and which never did -- what the Flight Recorder dump is read for.
The data pass is untouched: a fault changes when things happen, never what they compute.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

NCCL_TIMEOUT_NS = 600 * 10**9  # torch.distributed's default timeout for NCCL process groups: 10 minutes


@dataclass(frozen=True)
class Faults:
    straggler: tuple[int, float, int] | None = None  # (rank, kernel time factor, from ns)
    degraded: tuple[int, str, float] | None = None  # (rank, "nic" | "nvlink", bandwidth factor)
    failed: tuple[int, int] | None = None  # (rank, at ns)
    watchdog_ns: int = NCCL_TIMEOUT_NS

    def __bool__(self) -> bool:
        return any(x is not None for x in (self.straggler, self.degraded, self.failed))

    def describe(self) -> list[str]:
        out = []
        if self.straggler:
            r, f, t = self.straggler
            out.append(f"rank {r} is a straggler: its kernels take {f:g}x as long from {t / 1e3:g} us")
        if self.degraded:
            r, port, f = self.degraded
            out.append(f"rank {r}'s {port} carries {f:g}x its bandwidth")
        if self.failed:
            r, t = self.failed
            out.append(f"rank {r} fails at {t / 1e3:g} us")
        return out


@dataclass(frozen=True)
class Stuck:
    """One rank's watchdog report: the call it waited on, and when it gave up."""

    rank: int
    call: str  # e.g. "all_reduce on dp group (0, 1, 2, 3)"
    seq: int  # the group's sequence number of the call, 1-based
    joined: tuple[int, ...]
    missing: tuple[int, ...]
    began_ns: int
    timeout_ns: int

    def line(self) -> str:
        return (f"[rank {self.rank}] watchdog caught collective operation timeout: {self.call}, SeqNum={self.seq}, "
                f"ran for {self.timeout_ns / 1e9:g} s before timing out (began at {self.began_ns / 1e3:,.1f} us); "
                f"joined: {_ranks(self.joined)}; never joined: {_ranks(self.missing)}")

    def as_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "call": self.call, "seq": self.seq, "joined": list(self.joined),
                "missing": list(self.missing), "began_ns": self.began_ns, "timed_out_ns": self.began_ns + self.timeout_ns}


@dataclass(frozen=True)
class Hang:
    """What a failed rank left: who failed when, and each waiting rank's watchdog report."""

    rank: int
    at_ns: int
    stuck: tuple[Stuck, ...] = field(default=())

    @property
    def end_ns(self) -> int:
        return max((s.began_ns + s.timeout_ns for s in self.stuck), default=self.at_ns)

    def as_dict(self) -> dict[str, Any]:
        return {"failed_rank": self.rank, "failed_at_ns": self.at_ns, "watchdog": [s.as_dict() for s in self.stuck],
                "ranks_waiting": len(self.stuck), "ends_ns": self.end_ns}


def _ranks(ranks: tuple[int, ...]) -> str:
    if not ranks:
        return "none"
    if len(ranks) > 8:
        return f"{len(ranks)} ranks ({', '.join(map(str, ranks[:6]))}, ...)"
    return ", ".join(map(str, ranks))
