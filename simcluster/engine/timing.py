"""Phase two of a run: replay every rank's streams on the cluster, in integer nanoseconds.

Each stream is a generator with its own clock, run from a queue (not a SimPy process each: that was
the bottleneck): kernels advance the clock without SimPy events (a stream is in order, so a kernel
starts when the previous item ended); a wait takes the later of its clock and the awaited item's
end; a communication item joins its call at the stream's clock, once the work issued before it
has ended (the stream it waits on joins for it, so that the stream itself sleeps until the call
ends). When every member has joined, the call's phases (topology/phases.py) run on the shared
network, one after another, and every member's item ends when the last one ends. SimPy keeps the
clock and the queue of timed callbacks; ties are broken by insertion order, and streams start in (rank,
stream) order, so a scenario gives the same trace every run. A replay consumes its input.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterator

import simpy

from simcluster.engine.calls import Call
from simcluster.engine.faults import Faults, Hang
from simcluster.engine.fold import Fold
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.hung import deadlock, watchdog
from simcluster.engine.network import Network
from simcluster.engine.routes import routes
from simcluster.engine.steps import marks
from simcluster.engine.streams import COMM, KERNEL, KERNELS, MEMORY, WAIT, RankState, Stream
from simcluster.engine.totals import LaneSums, Totals, kind_of
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.topology.cluster import HOST, NIC_IN, NIC_OUT, NVLINK_IN, NVLINK_OUT, Cluster


class _Shared(Exception):
    """A call ended at once (`Replay._claim`) would have shared a link with another transfer."""


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
                    raise deadlock(streams)
                self.hang = watchdog(self.faults, streams, lists)
            # where the steps begin and end, read before the items go (a hung run's trace is summed instead)
            steps = marks(streams) if self.hang is None else (None, None, None)
            # A replay runs once: let its input go now, by reference counting, rather than have
            # the collector walk it when the pause ends and free it later.
            for s in streams:
                s.items, s.end_times, s.waiters = [], [], []
            self.calls.clear()
        # each stream emits its events in order, so lanes concatenated in order are already sorted
        trace = Trace.from_lanes(lanes, lists)
        trace.memory = tuple(MemoryEvent(r, t, c, n, b) for r, t, _, _, c, n, b in sorted(self.memory))
        if self.hang is None:  # (the watchdog draws stalls the sums have not seen)
            trace.totals = Totals.of_lanes(lanes, sums, steps)
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
        named = name != HOST and self.cluster.named_rates  # (a profile's rates by kernel: keyed by name too)
        durations: dict[tuple, int] = {}
        runs: dict[int, tuple[int, int, int, int]] = {}  # a run of kernels' total and its ns by kind, by the run's id
        kind_by_name: dict[str, int] = {}
        kinds = sums.kinds
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
                        key = (item[1], item[3], item[4]) if named else (item[3], item[4])
                        n, total = 1, durations.get(key)
                        if total is None:
                            total = durations[key] = kernel_ns(item[3], item[4], dtype, item[1])
                        which = kind_by_name.get(item[1])
                        if which is None:
                            which = kind_by_name[item[1]] = kind_of(item[1])
                        kinds[which] += total
                    else:
                        run = item[3]  # (the tape's: one object, alive while items hold it, so its id is its own)
                        n, sums_of_run = len(run), runs.get(id(run))
                        if sums_of_run is None:
                            by_kind = [0, 0, 0]
                            for op, flops, nb in run:
                                by_kind[kind_of(op)] += kernel_ns(flops, nb, dtype, op)
                            sums_of_run = runs[id(run)] = (sum(by_kind), *by_kind)
                        total = sums_of_run[0]
                        kinds[0] += sums_of_run[1]
                        kinds[1] += sums_of_run[2]
                        kinds[2] += sums_of_run[3]
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
                    key = (op, flops, nb) if named else (flops, nb)
                    d = durations.get(key)
                    if d is None:
                        d = durations[key] = kernel_ns(flops, nb, dtype, op)
                    if slow is not None and t >= slow[1]:
                        d = math.ceil(d * slow[0])
                    which = kind_by_name.get(op)
                    if which is None:
                        which = kind_by_name[op] = kind_of(op)
                    kinds[which] += d
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

    def _launch(self, call: Call) -> None:
        """Run the call's phases from call.start: phase after phase, each after its latency. A call that
        finds its links idle (`_claim`) ends at once, at the time its phases take there: its members go
        on from then without waiting for SimPy's clock (as they do after a kernel)."""
        assert call.start >= self.env.now  # every member's clock is at or ahead of SimPy's
        call.steps, call.sent, alone, links = routes(call, self.cluster, self.network, self.fold)
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
