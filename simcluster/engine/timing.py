"""Phase two of a run: replay every rank's streams on the cluster, in integer nanoseconds.

Each stream is a SimPy process with its own clock: kernels advance it without SimPy events (a
stream is in order, so a kernel starts when the previous item ended); a wait takes the later of its
clock and the awaited item's end; a communication item first brings SimPy's clock up to the stream's,
then joins its call. When every member has joined, the call's plan (topology/plans.py) runs on the
shared network, and every member's item ends when the plan ends. Ties are broken by SimPy's insertion
counter, and processes start in (rank, stream) order, so a scenario gives the same trace every run.
"""

from __future__ import annotations

from typing import Any, Iterator

import simpy

from simcluster.engine.errors import DeadlockError
from simcluster.engine.interpreter import COMM, KERNEL, WAIT, Call, RankState, Stream
from simcluster.engine.network import Network
from simcluster.engine.trace import Trace, TraceEvent
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
            call.done = self.env.event()
        for s in streams:
            self.env.process(self._stream(s))
        self.env.run()
        if self.finished != len(streams):
            self._report_stuck(streams)
        return Trace(self.events, lanes)

    def _stream(self, s: Stream) -> Iterator[Any]:
        env, events, kernel_ns = self.env, self.events, self.cluster.kernel_ns
        dtype, rank, name = self.cost_dtype, s.rank, s.name
        t = 0
        for i, item in enumerate(s.items):
            tag = item[0]
            if tag == KERNEL:
                _, op, kind, label, flops, nb = item
                end = t + kernel_ns(flops, nb, dtype)
                events.append(TraceEvent(rank, name, kind, f"{label}/{op}" if label else op, t, end))
                t = end
            elif tag == WAIT:
                dep, j = item[1], item[2]
                end = dep.end_times[j]
                if end is None:
                    ev = dep.waiters.get(j)
                    if ev is None:
                        ev = dep.waiters[j] = env.event()
                    yield ev
                    end = dep.end_times[j]
                if end > t:
                    t = end
            else:
                assert tag == COMM
                call, op, label = item[1], item[2], item[3]
                if t > env.now:
                    yield env.timeout(t - env.now)
                call.arrived += 1
                if call.arrived == len(call.members):
                    env.process(self._run_call(call))
                yield call.done
                t = call.end
                kind = op.kind.value
                events.append(TraceEvent(rank, name, kind, label or kind, call.start, call.end,
                                         int(round(call.sent.get(rank, 0.0))), call.where))
            s.end_times[i] = t
            waiter = s.waiters.pop(i, None)
            if waiter is not None:
                waiter.succeed()
        self.finished += 1

    def _run_call(self, call: Call) -> Iterator[Any]:
        env, cluster = self.env, self.cluster
        call.start = env.now
        ops = [call.ops[r] for r in call.members]
        if call.is_message:
            nbytes = tensor_bytes(ops[0].tensor)
            phases = plan(CommKind.SEND, call.members, nbytes, cluster)
        else:
            first = ops[0] if call.kind is not CommKind.BROADCAST else next(o for o in ops if o.rank == o.peer)
            size = 0 if first.tensor is None else tensor_bytes(first.tensor)
            nbytes = semantic_bytes(call.kind, size, len(call.members))
            phases = plan(call.kind, call.members, nbytes, cluster, peer=first.peer)
        for phase in phases:
            flows = []
            latency = 0
            for src, dst, b in phase.flows:
                links, lat = cluster.route(src, dst)
                latency = max(latency, lat)
                flows.append((links, b))
                call.sent[src] = call.sent.get(src, 0.0) + b
            if phase.steps and latency:
                yield env.timeout(phase.steps * latency)
            if flows:
                yield self.network.transfer(flows)
        call.end = env.now
        call.done.succeed()

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
