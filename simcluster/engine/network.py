"""Links shared by concurrent transfers: a fluid model with max-min fair rates.

Each flow crosses a few links (sender's port out, receiver's port in). When flows start or end, the
rates of the flows connected to them through shared links (their component) are recomputed by
progressive filling: the link whose remaining capacity, split among its unfixed flows, is smallest
fixes those flows at that share; repeat. Components that share no link are independent under
max-min fairness, so the rest keep their rates. A flow that starts on idle links is its own
component: it runs at its slowest link at once, until another flow lands on one of its links.
Times are whole nanoseconds: a flow ends at the first nanosecond it is done by.
"""

from __future__ import annotations

import heapq
import math
from typing import Any, Callable, Sequence

import simpy


Prepared = tuple[tuple[tuple[int, ...], float, float, int], ...]  # (links, bytes, rate alone, ns alone)


def _ns(nbytes: float, rate: float) -> int:
    """Whole ns to move `nbytes` at `rate` bytes/ns: the first ns by which it is done (at least 1)."""
    return max(1, math.ceil(nbytes / rate - 1e-9)) if nbytes > 1e-6 else 0


class _Flow:
    __slots__ = ("links", "remaining", "rate", "alone", "since", "transfer", "seq", "version")

    def __init__(self, links: tuple[int, ...], nbytes: float, alone: float, transfer: "_Transfer", seq: int,
                 now: int) -> None:
        self.links = links
        self.remaining = nbytes
        self.rate = 0.0
        self.alone = alone  # its rate when it shares no link: its slowest link's capacity
        self.since = now  # when `remaining` was last brought up to date
        self.transfer = transfer
        self.seq = seq  # creation order: breaks ties between flows ending at the same ns
        self.version = 0


class _Transfer:
    __slots__ = ("pending", "on_done", "arg")

    def __init__(self, pending: int, on_done: Callable[[Any], None], arg: Any) -> None:
        self.pending = pending
        self.on_done = on_done
        self.arg = arg


class Network:
    def __init__(self, env: simpy.Environment, capacity: Sequence[float]) -> None:
        self.env = env
        self.capacity = capacity  # bytes per ns, by link id
        self.on_link: dict[int, list[_Flow]] = {}
        self.ends: list[tuple[int, int, int, _Flow]] = []  # (end ns, seq, version, flow), lazily invalidated
        self.wake_at: int | None = None
        self.seq = 0
        self.dirty: list[int] = []  # links of flows started at this instant, not yet given rates
        self.dirty_at: int | None = None

    def prepare(self, flows: Sequence[tuple[tuple[int, ...], float]]) -> Prepared:
        """Flows (links, bytes) as `transfer` takes them: with each one's rate and time when alone,
        and without the empty ones. Worth keeping: a call's flows are prepared once."""
        out = []
        for links, b in flows:
            if b > 0:
                rate = float(min(self.capacity[link] for link in links))
                out.append((links, b, rate, _ns(b, rate)))
        return tuple(out)

    def transfer(self, flows: Prepared, on_done: Callable[[Any], None], arg: Any = None) -> None:
        """Start prepared flows now; call `on_done(arg)` when all have arrived.

        A flow that finds all its links idle runs at its slowest link at once (what max-min gives a
        flow that shares nothing); one that shares a link is given its rate with the others started
        at this instant, by one refill after them. A later start that lands on an idle-started
        flow's link marks it for that refill too, so every rate is max-min over all of them.
        """
        if not flows:
            on_done(arg)
            return
        t = _Transfer(len(flows), on_done, arg)
        now = self.env.now
        on_link, dirty, seq, ends = self.on_link, self.dirty, self.seq, self.ends
        alone = False
        for links, b, rate, ns in flows:
            f = _Flow(links, b, rate, t, seq, now)
            seq += 1
            shared = False
            for link in links:
                sharing = on_link.get(link)
                if sharing is None:
                    on_link[link] = [f]
                else:
                    sharing.append(f)
                    shared = True
            if shared:
                dirty += links
            else:
                f.rate = rate
                f.version = 1
                heapq.heappush(ends, (now + ns, f.seq, 1, f))
                alone = True
        self.seq = seq
        if dirty and self.dirty_at != now:  # the first shared start at this instant: refill once, after the others
            self.dirty_at = now
            self.env.timeout(0).callbacks.append(self._refill_dirty)
        if alone:
            self._schedule()

    def _refill_dirty(self, _event: Any) -> None:
        touched, self.dirty, self.dirty_at = self.dirty, [], None
        self._refill([link for link in touched if link in self.on_link])

    def _component(self, links: list[int]) -> tuple[set[int], list[_Flow]]:
        """The links and flows connected to `links` (in discovery order: the filling below depends
        only on link ids and on each link's flow order, never on this order)."""
        on_link = self.on_link
        seen_links = set(links)
        stack = list(seen_links)
        seen: set[int] = set()
        flows: list[_Flow] = []
        while stack:
            for f in on_link.get(stack.pop(), ()):
                if f.seq not in seen:
                    seen.add(f.seq)
                    flows.append(f)
                    for other in f.links:
                        if other not in seen_links:
                            seen_links.add(other)
                            stack.append(other)
        return seen_links, flows

    def _refill(self, touched: list[int]) -> None:
        """Recompute the rates of the flows connected to `touched` links and reschedule their ends."""
        now = self.env.now
        links, flows = self._component(touched)
        for f in flows:
            f.remaining -= f.rate * (now - f.since)
            f.since = now
            f.rate = -1.0
        on_link = self.on_link
        if all(len(on_link[link]) == 1 for link in links):
            # No link is shared: each flow runs at its slowest link (what the filling below gives).
            for f in flows:
                f.rate = f.alone
            self._reschedule(flows, now)
            return
        # Progressive filling in rounds: every link whose fair share is the smallest fixes its flows
        # at that share, then each link gives up (flows fixed on it) x share in one subtraction. A
        # link's capacity thus sees the same operations whatever order links and flows come in, so
        # links that are images of each other under a symmetry of the cluster (folded replicas,
        # engine/fold.py) get bit-equal rates.
        cap = {link: float(self.capacity[link]) for link in links}
        count = {link: len(on_link[link]) for link in links}
        while count:
            share = min(cap[link] / n for link, n in count.items())
            fixed: dict[int, int] = {}
            for link in [link for link, n in count.items() if cap[link] / n == share]:
                for f in on_link[link]:
                    if f.rate < 0:
                        f.rate = share
                        for other in f.links:
                            fixed[other] = fixed.get(other, 0) + 1
            for link, k in fixed.items():
                left = count[link] - k
                if left:
                    cap[link] -= k * share
                    count[link] = left
                else:
                    del count[link]
        self._reschedule(flows, now)

    def _reschedule(self, flows: list[_Flow], now: int) -> None:
        for f in flows:
            f.version += 1
            heapq.heappush(self.ends, (now + _ns(f.remaining, f.rate), f.seq, f.version, f))
        self._schedule()

    def _schedule(self) -> None:
        ends = self.ends
        while ends and ends[0][2] != ends[0][3].version:
            heapq.heappop(ends)
        if not ends:
            return
        at = ends[0][0]
        if self.wake_at is not None and self.wake_at <= at:
            return  # a wake-up at or before `at` is already pending
        self.wake_at = at
        self.env.timeout(at - self.env.now).callbacks.append(self._wake)

    def _wake(self, _event: Any) -> None:
        now = self.env.now
        if self.wake_at != now:
            return  # superseded by an earlier wake-up, which rescheduled
        self.wake_at = None
        ends, on_link = self.ends, self.on_link
        touched: list[int] = []  # links that other flows still cross: theirs may speed up
        finished: list[_Transfer] = []
        while ends and ends[0][0] <= now:
            _, _, version, f = heapq.heappop(ends)
            if version != f.version:
                continue  # rescheduled since
            f.version += 1  # no longer scheduled
            for link in f.links:
                sharing = on_link[link]
                if len(sharing) == 1:
                    del on_link[link]
                else:
                    sharing.remove(f)
                    touched.append(link)
            t = f.transfer
            t.pending -= 1
            if not t.pending:
                finished.append(t)
        still = [link for link in touched if link in on_link] if touched else touched
        if still:
            self._refill(still)
        else:
            self._schedule()
        for t in finished:
            t.on_done(t.arg)
