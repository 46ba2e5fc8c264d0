"""Phase two of a run: replay every rank's streams on the cluster, in integer nanoseconds.

Each stream is a generator with its own clock, run from a queue (not a SimPy process each: that was
the bottleneck): kernels advance the clock without SimPy events (a stream is in order, so a kernel
starts when the previous item ended); a wait takes the later of its clock and the awaited item's
end; a communication item joins its call at the stream's clock, once the work issued before it
has ended (the stream it waits on joins for it, so that the stream itself sleeps until the call
ends). When every member has joined, the call's plan (topology/plans.py) runs on the shared
network, phase after phase, and every member's item ends when the plan ends. SimPy keeps the clock
and the queue of timed callbacks; ties are broken by insertion order, and streams start in (rank,
stream) order, so a scenario gives the same trace every run. A replay consumes its input.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterator

import simpy

from simcluster.engine.errors import DeadlockError
from simcluster.engine.faults import Faults, Hang, Stuck
from simcluster.engine.fold import Fold
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.interpreter import Call
from simcluster.engine.streams import COMM, KERNEL, KERNELS, MEMORY, WAIT, RankState, Stream
from simcluster.engine.network import Network
from simcluster.engine.totals import LaneSums, Totals
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.numerics.tensor import ITEMSIZE
from simcluster.program.comm import CommKind
from simcluster.topology.cluster import HOST, NIC_IN, NIC_OUT, NVLINK_IN, NVLINK_OUT, Cluster
from simcluster.topology.plans import plan, semantic_bytes


class _Shared(Exception):
    """A call ended at once (`Replay._claim`) would have shared a link with another transfer."""


def _timed(steps: list[tuple[int, Any]], sent: list[int]) -> tuple[list[tuple[int, Any]], list[int], int | None,
                                                                 frozenset[int]]:
    """A plan's route: its steps, the bytes each member sends, how long it takes on idle links
    where no two of a phase's flows share a link (each then runs alone at its slowest link's rate,
    and the phase ends with the last; None otherwise), and every link it crosses."""
    alone: int | None = 0
    links: set[int] = set()
    for latency, flows in steps:
        crossed = [link for f in flows for link in f[0]]
        if alone is not None and len(set(crossed)) == len(crossed):
            alone += latency + max((f[3] for f in flows), default=0)
        else:
            alone = None
        links.update(crossed)
    return steps, sent, alone, frozenset(links)


class Replay:
    """Replays `ranks`' streams; with a fold (engine/fold.py), the representatives', standing for all."""

    def __init__(self, ranks: list[RankState], calls: list[Call], cluster: Cluster, cost_dtype: str,
                 fold: Fold | None = None, faults: Faults | None = None, events: bool = True) -> None:
        """`events`: keep every event in the trace (views and exports draw them); without, the trace
        has the sums a report needs and the memory events only."""
        self.ranks = ranks
        self.keep = events or faults is not None  # (a watchdog's stalls are drawn on the events)
        self.fold = fold
        self.calls = calls
        self.cluster = cluster
        self.cost_dtype = cost_dtype
        self.faults = faults or Faults()
        self.capacity = list(cluster.capacity)
        if self.faults.degraded:
            rank, port, factor = self.faults.degraded
            for p in ((NIC_OUT, NIC_IN) if port == "nic" else (NVLINK_OUT, NVLINK_IN)):
                self.capacity[rank * 4 + p] *= factor
        self.hang: Hang | None = None
        self.fast = True  # calls on links of their own end at once (`_claim`); off for a second attempt
        self._reset()

    def _reset(self) -> None:
        """A fresh clock, network and queue: what one attempt at the replay starts from."""
        self.env = simpy.Environment()
        self.network = Network(self.env, self.capacity)
        self.finished = 0
        self.runnable: deque[Iterator[Any]] = deque()
        # (rank, ns, lane, item, category, name, +-bytes): at one ns, a rank's changes in stream order,
        # whatever order the replay reached them in
        self.memory: list[tuple[int, int, int, int, str, str, int]] = []
        self.draining = False
        self.timers: dict[int, list[tuple[Callable[[Call], None], Call]]] = {}
        # links that calls ended at once have claimed: the channel, and when its last such call ends
        self.owner: dict[int, Any] = {}
        self.until: dict[int, int] = {}

    def run(self) -> Trace:
        lanes: list[tuple[int, str]] = []
        streams: list[Stream] = []
        with gc_paused():
            for st in self.ranks:
                for s in st.streams.values():
                    if s.items:
                        streams.append(s)
                        lanes.append((s.rank, s.name))
            try:
                lists, sums = self._attempt(streams)
            except _Shared:  # a call ended at once had company on its links after all: replay it all in full
                self.fast = False
                self._reset()
                lists, sums = self._attempt(streams)
            if self.finished != len(streams):
                if not self.faults.failed:
                    self._report_stuck(streams)
                self.hang = self._watchdog(streams, lists)
            # A replay runs once: let its input go now, by reference counting, rather than have
            # the collector walk it when the pause ends and free it later.
            for s in streams:
                s.items, s.end_times, s.waiters = [], [], []
            self.calls.clear()
        # each stream emits its events in order, so lanes concatenated in order are already sorted
        trace = Trace.from_lanes(lanes, lists)
        trace.memory = tuple(MemoryEvent(r, t, c, n, b) for r, t, _, _, c, n, b in sorted(self.memory))
        if self.hang is None:  # (the watchdog draws stalls the sums have not seen)
            trace.totals = Totals.of_lanes(lanes, sums)
        return trace

    def _attempt(self, streams: list[Stream]) -> tuple[list[list[TraceEvent]], list[LaneSums]]:
        """Replay every stream from the start: each one's events and sums."""
        for s in streams:
            s.end_times = [None] * len(s.items)
            s.waiters = [None] * len(s.items)
        for call in self.calls:
            call.done = []  # the streams waiting for it
            call.arrived = call.start = call.end = 0
        lists: list[list[TraceEvent]] = []
        sums: list[LaneSums] = []
        for s in streams:
            lists.append([])
            sums.append(LaneSums())
            self.runnable.append(self._stream(s, len(sums) - 1, lists[-1], sums[-1]))
            self._drain()
        self.env.run()
        return lists, sums

    def _drain(self) -> None:
        """Run every runnable stream until it waits (FIFO, no recursion).

        A lighter stand-in for simpy.Process: a stream yields the list of streams waiting for what
        it needs (a call's end, another stream's item), and whatever completes that makes them
        runnable here directly, without one scheduled event per waiter. SimPy keeps the clock and
        the queue.
        """
        if self.draining:
            return
        self.draining = True
        runnable = self.runnable
        while runnable:
            g = runnable.popleft()
            try:
                waiting_list = g.send(None)
            except StopIteration:
                self.finished += 1
                continue
            waiting_list.append(g)
        self.draining = False

    def _stream(self, s: Stream, lane: int, events: list[TraceEvent], sums: LaneSums) -> Iterator[Any]:
        """Replays one stream; its events go to `events`, their sums (what a report is made of) to
        `sums` as they happen, so that no report has to walk the events again."""
        dtype, rank, name = self.cost_dtype, s.rank, s.name
        busy = count = last = 0  # (last: when its last event ends)
        spans = sums.spans  # [start, end] of its busy time, runs of back-to-back events joined
        comm = sums.comm
        kernel_ns = self.cluster.host_kernel_ns if name == HOST else self.cluster.kernel_ns
        durations: dict[tuple[float, float], int] = {}
        runs: dict[int, int] = {}  # a run of kernels' total, by the run's id
        new, event, append, end_times = tuple.__new__, TraceEvent, events.append, s.end_times
        memory, runnable, waiters = self.memory, self.runnable, s.waiters
        keep = self.keep
        f = self.faults
        slow = f.straggler[1:] if f.straggler and f.straggler[0] == rank else None  # (factor, from ns)
        dies = f.failed[1] if f.failed and f.failed[0] == rank else None
        at_once = not keep and slow is None and dies is None  # (no event to make, nothing to slow or stop)
        t = 0
        for i, item in enumerate(s.items):
            tag = item[0]
            if dies is not None and t >= dies:
                yield []  # failed: never runs again
            if tag == KERNEL or tag == KERNELS:
                if at_once:  # the sums of a kernel, or of a run, at once
                    if tag == KERNEL:
                        n, total = 1, durations.get((item[3], item[4]))
                        if total is None:
                            total = durations[(item[3], item[4])] = kernel_ns(item[3], item[4], dtype)
                    else:
                        run = item[3]  # (the tape's: one object, alive while items hold it, so its id is its own)
                        n, total = len(run), runs.get(id(run))
                        if total is None:
                            total = runs[id(run)] = sum(kernel_ns(flops, nb, dtype) for _, flops, nb in run)
                    busy += total
                    count += n
                    if total:
                        if spans and spans[-1][1] == t:
                            spans[-1][1] = t + total
                        else:
                            spans.append([t, t + total])
                    t += total
                    last = t
                    run = ()  # (nothing left to do kernel by kernel)
                elif tag == KERNEL:  # (one kernel: a run of one, its name already labelled)
                    label, kind, run = None, item[2], ((item[1], item[3], item[4]),)
                else:
                    _, label, kind, run = item
                for op, flops, nb in run:
                    if dies is not None and t >= dies:
                        yield []  # failed: never runs again
                    d = durations.get((flops, nb))
                    if d is None:
                        d = durations[(flops, nb)] = kernel_ns(flops, nb, dtype)
                    if slow is not None and t >= slow[1]:
                        d = math.ceil(d * slow[0])
                    if label:
                        op = f"{label}/{op}"
                    if dies is not None and t + d > dies:
                        append(new(event, (rank, name, kind, op, t, dies, 0, "")))
                        yield []  # (never resumed: a failed rank's sums are not used, the watchdog's are)
                    if keep:
                        append(new(event, (rank, name, kind, op, t, t + d, 0, "")))  # TraceEvent, built fast
                    busy += d
                    count += 1
                    if d:
                        if spans and spans[-1][1] == t:
                            spans[-1][1] = t + d
                        else:
                            spans.append([t, t + d])
                    t += d
                    last = t
            elif tag == WAIT:
                dep, j = item[1], item[2]
                end = dep.end_times[j]
                if end is None:
                    waiting = dep.waiters[j]
                    if waiting is None:
                        waiting = dep.waiters[j] = []
                    yield waiting
                    end = dep.end_times[j]
                if end > t:
                    t = end
            elif tag == COMM:
                _, call, kind, label, position, dep, j, where = item
                # The input is ready when the work issued before it (item j of dep) is done.
                if dep is not None and dep.end_times[j] is None:
                    # dep joins the call for this stream when it gets there; this stream sleeps
                    # until the call ends, without being woken in between
                    waiting = dep.waiters[j]
                    if waiting is None:
                        waiting = dep.waiters[j] = []
                    waiting.append((call, t))
                    yield call.done
                else:
                    if dep is not None and dep.end_times[j] > t:
                        t = dep.end_times[j]
                    if t > call.start:  # join the call (as _join does)
                        call.start = t
                    call.arrived += 1
                    if call.arrived == call.live:
                        self._launch(call)
                    if call.done is not None:  # (a call of one member with nothing to move ends at once)
                        yield call.done  # runnable again when the call ends
                t = call.end
                sent, began = call.sent[position], call.start
                if keep:
                    append(new(event, (rank, name, kind, label or kind, began, t, sent, where)))
                d = t - began
                busy += d
                count += 1
                if where:
                    acc = comm.get((where, kind))
                    if acc is None:
                        acc = comm[(where, kind)] = [0, 0, 0]
                    acc[0] += 1
                    acc[1] += sent
                    acc[2] += d
                if d:
                    if spans and spans[-1][1] == began:
                        spans[-1][1] = t
                    else:
                        spans.append([began, t])
                if t > last:
                    last = t
            else:
                assert tag == MEMORY
                memory.append((rank, t, lane, i, item[1], item[2], item[3]))
            end_times[i] = t
            waiting = waiters[i]
            if waiting is not None:
                waiters[i] = None
                for w in waiting:
                    if type(w) is tuple:  # a call to join for another stream
                        self._join(w[0], w[1] if w[1] > t else t)
                    else:  # a stream to wake
                        runnable.append(w)
        sums.busy, sums.count, sums.end = busy, count, last

    def _join(self, call: Call, t: int) -> None:
        """A member joins `call` at its clock `t`; the last one launches it."""
        # No need to bring SimPy's clock up to ours: the call starts at the latest arrival.
        if t > call.start:
            call.start = t
        call.arrived += 1
        if call.arrived == call.live:
            self._launch(call)

    def _routes(self, call: Call) -> tuple[list[tuple[int, list]], list[int], int | None, frozenset[int]]:
        """The call's phases as (latency to wait, flows over links), bytes sent per member, how long
        it takes on links it has to itself (None where a phase's flows share a link), and the links.

        Calls of the same kind, group and signature move the same bytes: computed once per
        channel, then shared.
        """
        op = call.ops[0]
        routes = call.channel.routes
        # first by the signature object itself (a taped block's calls share theirs; the entry holds
        # it, so its id is its own while the entry lives), then by its value
        seen = routes.get(id(op.sig))
        if seen is not None and seen[0] is op.sig and seen[1] is call.kind and seen[2] == op.peer:
            return seen[3]
        key = (call.kind._value_, op.sig, op.peer)
        cached = routes.get(key)
        if cached is not None:
            routes[id(op.sig)] = (op.sig, call.kind, op.peer, cached)
            return cached
        if cached is None and call.kind is CommKind.COPY:  # one flow over the rank's PCIe link, or NVMe drives
            size = math.prod(op.sig[2]) * ITEMSIZE[op.sig[1]]
            links = self.cluster.copy_route(op.rank, *op.tiers)
            cached = routes[key] = _timed([(self.cluster.spec.pcie_latency_ns, self.network.prepare([(links, size)]))],
                                          [size])
        if cached is None:
            size = 0 if op.sig is None else math.prod(op.sig[2]) * ITEMSIZE[op.sig[1]]
            nbytes = size if call.is_message else semantic_bytes(call.kind, size, len(call.members))
            steps: list[tuple[int, list]] = []
            sent: dict[int, float] = {}
            phases = plan(call.kind, call.members, nbytes, self.cluster, peer=op.peer)
            fold = self.fold
            if fold is not None and call.live < len(call.members):
                fold.check_plan(call.members, phases, call.where, call.kind.value)
            for phase in phases:
                flows = []
                latency = 0
                for src, dst, b in phase.flows:
                    links, lat = self.cluster.route(src, dst)
                    latency = max(latency, lat)
                    sent[src] = sent.get(src, 0.0) + b
                    if fold is None:
                        flows.append((links, b))
                    elif fold.is_rep[src]:  # of each orbit of flows, the one leaving a representative,
                        rep = fold.rep(dst)  # into the port of its destination's representative
                        flows.append((links if rep == dst else (links[0], links[1] + 4 * (rep - dst)), b))
                steps.append((phase.steps * latency, self.network.prepare(flows)))
            cached = routes[key] = _timed(steps, [int(round(sent.get(r, 0.0))) for r in call.members])
        return cached

    def _launch(self, call: Call) -> None:
        """Run the call's plan from call.start: phase after phase, each after its latency. A call that
        finds its links idle (`_claim`) ends at once, at the time its plan takes there: its members go
        on from then without waiting for SimPy's clock (as they do after a kernel)."""
        assert call.start >= self.env.now  # every member's clock is at or ahead of SimPy's
        call.steps, call.sent, alone, links = self._routes(call)
        ch = call.channel
        if (alone is not None and self.fast and ch.group is not None and not ch.mixed
                and self._claim(call, links, alone)):
            call.end = call.start + alone
            waiting, call.done = call.done, None  # (members' clocks run ahead of SimPy's: wake them now)
            self.runnable.extend(waiting)
            self._drain()
            return
        call.phase = 0
        self._next(call, call.start - self.env.now)  # the wait folds into the first latency

    def _next(self, call: Call, wait: int = 0) -> None:
        """Start the call's next phase after its latency (and `wait` more ns), or end the call."""
        if call.phase == len(call.steps):
            if wait:
                self._at(wait, self._finish, call)
            else:
                self._finish(call)
            return
        wait += call.steps[call.phase][0]
        if wait:
            self._at(wait, self._transfer, call)
        else:
            self._transfer(call)

    def _claim(self, call: Call, links: frozenset[int], alone: int) -> bool:
        """Whether `call` can end at once: none of its links carries a flow now. It then claims them
        until it ends. A call of another channel that claimed one of them until after this one
        starts (its member ran ahead), or a flow that starts on one before the claim ends
        (`_transfer`), would have shared it: the replay starts again without ending calls at once
        (`_Shared`), so that the times are always the network's."""
        on_link, owner, until = self.network.on_link, self.owner, self.until
        ch, start = call.channel, call.start
        for link in links:
            if link in on_link:
                return False
            other = owner.get(link)
            if other is not None and other is not ch and until[link] > start:
                raise _Shared
        end = start + alone
        for link in links:
            owner[link] = ch
            if until.get(link, 0) < end:
                until[link] = end
        return True

    def _transfer(self, call: Call) -> None:
        flows = call.steps[call.phase][1]
        call.phase += 1
        if self.until:
            now, ch, owner, until = self.env.now, call.channel, self.owner, self.until
            for f in flows:
                for link in f[0]:
                    if until.get(link, 0) > now and owner[link] is not ch:
                        raise _Shared
        self.network.transfer(flows, self._next, call)

    def _at(self, delay: int, fn: Callable[[Call], None], call: Call) -> None:
        """Call `fn(call)` in `delay` ns; what falls due at the same ns shares one SimPy event, in order."""
        when = self.env.now + delay
        batch = self.timers.get(when)
        if batch is None:
            batch = self.timers[when] = []
            self.env.timeout(delay).callbacks.append(lambda _e: self._fire(when))
        batch.append((fn, call))

    def _fire(self, when: int) -> None:
        for fn, call in self.timers.pop(when):
            fn(call)

    def _finish(self, call: Call) -> None:
        call.end = self.env.now
        waiting, call.done = call.done, None
        self.runnable.extend(waiting)
        self._drain()

    def _watchdog(self, streams: list[Stream], lists: list[list[TraceEvent]]) -> Hang:
        """After a rank failed: each call some members joined and never finished, as the waiting ranks'
        watchdogs report it, and the stall drawn on their lanes until the timeout."""
        failed, at = self.faults.failed
        timeout = self.faults.watchdog_ns
        waiting: dict[int, list[tuple[Stream, list, Call, int]]] = {}  # call id -> its stuck members
        calls: dict[int, Call] = {}
        for s, events in zip(streams, lists):
            done = next((i for i, e in enumerate(s.end_times) if e is None), len(s.items))
            if s.rank == failed or done == len(s.items) or s.items[done][0] != COMM:
                continue
            _, call, kind, label, position, dep, j, where = s.items[done]
            if dep is not None and dep.end_times[j] is None:
                continue  # never joined: its input waits on work stuck elsewhere
            began = max(s.end_times[done - 1] if done else 0, 0 if dep is None else dep.end_times[j])
            waiting.setdefault(id(call), []).append((s, events, call, began))
            calls[id(call)] = call
        first: dict[int, Stuck] = {}
        for key, members in waiting.items():
            call = calls[key]
            joined = tuple(sorted({s.rank for s, _, _, _ in members}))
            missing = tuple(r for r in call.members if r not in joined)
            op = call.ops[call.channel.position[joined[0]]]
            what = op.describe() if op is not None else call.kind.value
            group = f" on group ({', '.join(map(str, call.members))})" if not call.is_message else ""
            for s, events, _, began in members:
                item = s.items[next(i for i, e in enumerate(s.end_times) if e is None)]
                events.append(TraceEvent(s.rank, s.name, item[2], f"{item[3] or item[2]} (hung: watchdog)", began,
                                         began + timeout, 0, item[7]))
                stuck = Stuck(s.rank, what + group, call.seq + 1, joined, missing, began, timeout)
                if s.rank not in first or began < first[s.rank].began_ns:
                    first[s.rank] = stuck
        return Hang(failed, at, tuple(first[r] for r in sorted(first)))

    def _report_stuck(self, streams: list[Stream]) -> None:
        lines = ["deadlock in the timed replay (streams wait on each other in a cycle):"]
        for s in streams:
            done = sum(1 for e in s.end_times if e is not None)
            if done < len(s.items):
                item = s.items[done]
                what = "a wait on another stream" if item[0] == WAIT else (
                    f"{item[1].describe(s.rank)}" if item[0] == COMM else "a kernel")
                lines.append(f"  rank {s.rank} stream {s.name!r} is stuck at item {done}: {what}")
        raise DeadlockError("\n".join(lines))

