"""Phase two of a run: replay every rank's streams on the cluster, in integer nanoseconds.

Each stream is a SimPy process with its own clock: kernels advance it without SimPy events (a
stream is in order, so a kernel starts when the previous item ended); a wait takes the later of its
clock and the awaited item's end; a communication item first brings SimPy's clock up to the stream's,
then joins its call. When every member has joined, the call's plan (topology/plans.py) runs on the
shared network, and every member's item ends when the plan ends. Ties are broken by SimPy's insertion
counter, and processes start in (rank, stream) order, so a scenario gives the same trace every run.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterator

import simpy

from simcluster.engine.errors import DeadlockError
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.interpreter import COMM, KERNEL, MEMORY, WAIT, Call, RankState, Stream
from simcluster.engine.network import Network
from simcluster.engine.trace import MemoryEvent, Trace, TraceEvent
from simcluster.numerics.tensor import nbytes as tensor_bytes
from simcluster.program.comm import CommKind
from simcluster.topology.cluster import Cluster
from simcluster.topology.plans import plan, semantic_bytes


class Replay:
    def __init__(self, ranks: list[RankState], calls: list[Call], cluster: Cluster, cost_dtype: str) -> None:
        self.ranks = ranks
        self.calls = calls
        self.cluster = cluster
        self.cost_dtype = cost_dtype
        self.env = simpy.Environment()
        self.network = Network(self.env, cluster.capacity)
        self.events: list[TraceEvent] = []
        self.finished = 0
        self.runnable: deque[Iterator[Any]] = deque()
        self.route_cache: dict[tuple, tuple[list[tuple[int, list]], dict[int, float]]] = {}
        self.memory: list[tuple[int, int, int, str, str, int]] = []  # (rank, ns, seq, category, name, +-bytes)
        self.memory_seq = 0
        self.draining = False

    def run(self) -> Trace:
        lanes: list[tuple[int, str]] = []
        streams: list[Stream] = []
        for st in self.ranks:
            for s in st.streams.values():
                if s.items:
                    s.end_times = [None] * len(s.items)
                    streams.append(s)
                    lanes.append((s.rank, s.name))
        for call in self.calls:
            call.done = []  # the streams waiting for it
            call.where_text = call.where
        lists = []
        with gc_paused():
            for s in streams:
                events: list[TraceEvent] = []
                lists.append(events)
                self._resume(self._stream(s, events))
            self.env.run()
        if self.finished != len(streams):
            self._report_stuck(streams)
        # each stream emits its events in order, so lanes concatenated in order are already sorted
        trace = Trace.from_lanes(lanes, lists)
        trace.memory = tuple(MemoryEvent(r, t, c, n, b) for r, t, _, c, n, b in sorted(self.memory))
        return trace

    def _resume(self, gen: Iterator[Any]) -> None:
        """Make a stream runnable now; run every runnable stream until it waits (FIFO, no recursion).

        A lighter stand-in for simpy.Process: a stream yields the list of streams waiting for what
        it needs (a call's end, another stream's item), and whatever completes that resumes them
        here directly, without one scheduled event per waiter. SimPy keeps the clock and the queue.
        """
        self.runnable.append(gen)
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

    def _stream(self, s: Stream, events: list[TraceEvent]) -> Iterator[Any]:
        kernel_ns = self.cluster.kernel_ns
        dtype, rank, name = self.cost_dtype, s.rank, s.name
        durations: dict[tuple[float, float], int] = {}
        new, event, append, end_times = tuple.__new__, TraceEvent, events.append, s.end_times
        memory = self.memory
        t = 0
        for i, item in enumerate(s.items):
            tag = item[0]
            if tag == KERNEL:
                _, op, kind, flops, nb = item
                d = durations.get((flops, nb))
                if d is None:
                    d = durations[(flops, nb)] = kernel_ns(flops, nb, dtype)
                append(new(event, (rank, name, kind, op, t, t + d, 0, "")))  # TraceEvent, built fast
                t += d
            elif tag == MEMORY:
                memory.append((rank, t, self.memory_seq, item[1], item[2], item[3]))
                self.memory_seq += 1
            elif tag == WAIT:
                dep, j = item[1], item[2]
                end = dep.end_times[j]
                if end is None:
                    yield dep.waiters.setdefault(j, [])
                    end = dep.end_times[j]
                if end > t:
                    t = end
            else:
                assert tag == COMM
                call, op, label = item[1], item[2], item[3]
                # No need to bring SimPy's clock up to ours: the call starts at the latest arrival.
                if t > call.start:
                    call.start = t
                call.arrived += 1
                if call.arrived == len(call.members):
                    self._launch(call)
                if call.done is not None:  # (a call of one member with nothing to move ends at once)
                    yield call.done  # resumed when the call ends
                t = call.end
                kind = op.kind.value
                append(new(event, (rank, name, kind, label or kind, call.start, call.end,
                                   int(round(call.sent.get(rank, 0.0))), call.where_text)))
            end_times[i] = t
            if s.waiters:
                for waiter in s.waiters.pop(i, ()):
                    self._resume(waiter)

    def _routes(self, call: Call) -> tuple[list[tuple[int, list]], dict[int, float]]:
        """The call's phases as (latency to wait, flows over links), and bytes sent per rank.

        Calls of the same kind, members and size move the same bytes: computed once, then shared.
        """
        ops = [call.ops[r] for r in call.members]
        if call.is_message:
            key: tuple = (CommKind.SEND, call.members, tensor_bytes(ops[0].tensor), None)
        else:
            first = ops[0] if call.kind is not CommKind.BROADCAST else next(o for o in ops if o.rank == o.peer)
            size = 0 if first.tensor is None else tensor_bytes(first.tensor)
            key = (call.kind, call.members, semantic_bytes(call.kind, size, len(call.members)), first.peer)
        cached = self.route_cache.get(key)
        if cached is None:
            kind, members, nbytes, peer = key
            steps: list[tuple[int, list]] = []
            sent: dict[int, float] = {}
            for phase in plan(kind, members, nbytes, self.cluster, peer=peer):
                flows = []
                latency = 0
                for src, dst, b in phase.flows:
                    links, lat = self.cluster.route(src, dst)
                    latency = max(latency, lat)
                    flows.append((links, b))
                    sent[src] = sent.get(src, 0.0) + b
                steps.append((phase.steps * latency, flows))
            cached = self.route_cache[key] = (steps, sent)
        return cached

    def _launch(self, call: Call) -> None:
        """Run the call's plan from call.start: a chain of callbacks (no process per call)."""
        env = self.env
        assert call.start >= env.now  # every member's clock is at or ahead of SimPy's
        steps, call.sent = self._routes(call)
        wait = call.start - env.now  # folded into the first phase's latency

        def run(index: int, wait: int) -> None:
            if index == len(steps):
                if wait:
                    env.timeout(wait).callbacks.append(lambda _e: finish())
                else:
                    finish()
                return
            latency, flows = steps[index]
            wait += latency
            if wait:
                env.timeout(wait).callbacks.append(lambda _e: transfer(index))
            else:
                transfer(index)

        def transfer(index: int) -> None:
            self.network.transfer(steps[index][1], lambda: run(index + 1, 0))

        def finish() -> None:
            call.end = env.now
            waiting, call.done = call.done, None
            for gen in waiting:
                self._resume(gen)

        run(0, wait)

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
