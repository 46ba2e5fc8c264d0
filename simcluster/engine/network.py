"""Links shared by concurrent transfers: a fluid model with max-min fair rates.

Each flow crosses a few links (sender's port out, receiver's port in). Whenever a flow starts or
ends, the rates of all active flows are recomputed by progressive filling (the link whose capacity,
split among its unfixed flows, is smallest fixes those flows at that share; repeat), and the next
completion is scheduled. Times are whole nanoseconds (a flow ends at the first ns it is done by).
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Sequence

import simpy

_EPS = 1e-6  # bytes: what is left of a flow from float rounding when it is done


class _Flow:
    __slots__ = ("links", "remaining", "rate", "transfer")

    def __init__(self, links: tuple[int, ...], nbytes: float, transfer: "_Transfer") -> None:
        self.links = links
        self.remaining = nbytes
        self.rate = 0.0
        self.transfer = transfer


class _Transfer:
    __slots__ = ("pending", "event")

    def __init__(self, pending: int, event: Any) -> None:
        self.pending = pending
        self.event = event


class Network:
    def __init__(self, env: simpy.Environment, capacity: Sequence[float]) -> None:
        self.env = env
        self.capacity = capacity  # bytes per ns, by link id
        self.active: list[_Flow] = []
        self.last = 0
        self.generation = 0

    def transfer(self, flows: Sequence[tuple[tuple[int, ...], float]]) -> Any:
        """Start flows (links, bytes) now; the returned event fires when all have arrived."""
        event = self.env.event()
        live = [(links, b) for links, b in flows if b > _EPS]
        if not live:
            event.succeed()
            return event
        self._advance()
        t = _Transfer(len(live), event)
        self.active.extend(_Flow(links, b, t) for links, b in live)
        self._reschedule()
        return event

    def _advance(self) -> None:
        dt = self.env.now - self.last
        if dt:
            for f in self.active:
                f.remaining -= f.rate * dt
        self.last = self.env.now

    def _rates(self) -> None:
        unfixed: dict[int, list[_Flow]] = {}
        for f in self.active:
            f.rate = -1.0
            for link in f.links:
                unfixed.setdefault(link, []).append(f)
        cap = {link: self.capacity[link] for link in unfixed}
        count = {link: len(fl) for link, fl in unfixed.items()}
        version = dict.fromkeys(unfixed, 0)
        heap = [(cap[link] / count[link], link, 0) for link in unfixed]
        heapq.heapify(heap)  # ties broken by link id: deterministic
        while heap:
            share, link, ver = heapq.heappop(heap)
            if ver != version[link] or count[link] == 0:
                continue  # stale entry, or every flow on this link already has its rate
            for f in unfixed[link]:
                if f.rate >= 0:
                    continue
                f.rate = share
                for other in f.links:
                    cap[other] -= share
                    count[other] -= 1
                    if other != link and count[other]:
                        version[other] += 1
                        heapq.heappush(heap, (cap[other] / count[other], other, version[other]))

    def _reschedule(self) -> None:
        self._rates()
        self.generation += 1
        if not self.active:
            return
        dt = min(max(1, math.ceil(f.remaining / f.rate - 1e-9)) for f in self.active)
        gen = self.generation
        self.env.timeout(dt).callbacks.append(lambda _ev: self._on_timer(gen))

    def _on_timer(self, gen: int) -> None:
        if gen != self.generation:
            return  # superseded by a later change
        self._advance()
        still: list[_Flow] = []
        finished: list[_Transfer] = []
        for f in self.active:
            if f.remaining <= _EPS or f.remaining / f.rate < 1e-9:
                f.transfer.pending -= 1
                if f.transfer.pending == 0:
                    finished.append(f.transfer)
            else:
                still.append(f)
        self.active = still
        self._reschedule()
        for t in finished:
            t.event.succeed()
