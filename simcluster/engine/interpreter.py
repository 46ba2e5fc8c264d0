"""Phase one of a run: execute every rank's program, match its communication, compute the data.

Ranks run as cooperative coroutines in a fixed order: a rank runs until it yields a work that is not
complete, then the next ready rank runs. A call completes, and its members' data is computed, when
every member has issued it; members that were waiting for it become ready again, in group order.
Nothing depends on time here: numbers never depend on timing, so data and time are separate passes.

What comes out, besides each rank's result, is each rank's streams: ordered lists of kernels, waits
on other streams, and parts of communication calls. `timing.py` replays them on the cluster.

Checked here: the k-th calls on a group (or the k-th messages on a send/recv channel) must agree
across ranks (`CollectiveMismatchError`); if no rank can proceed, or a rank ends while others wait
for it, the run stops with a `DeadlockError` naming the ranks, the operations and the groups.
"""

from __future__ import annotations

import inspect
from collections import deque
from typing import Any, Callable, Sequence

from simcluster.engine import collectives
from simcluster.engine.errors import CollectiveMismatchError, DeadlockError
from simcluster.engine.gcpause import gc_paused
from simcluster.numerics.ops import Mode, make_ops
from simcluster.numerics.tensor import describe_signature
from simcluster.program.comm import Comm, CommKind, CommOp, ProgramError, Work
from simcluster.program.context import COMPUTE, Context, Program
from simcluster.program.mesh import DeviceMesh
from simcluster.model.memory import CATEGORIES

KERNEL, WAIT, COMM, MEMORY = 0, 1, 2, 3


class Stream:
    """One rank's stream: items run in order. Kernel: (KERNEL, name, kind, flops, bytes);
    wait: (WAIT, stream, index); communication: (COMM, call, op, label);
    memory: (MEMORY, category, name, +-bytes), taking effect when the stream reaches it."""

    __slots__ = ("rank", "name", "items", "waited_upto", "end_times", "waiters")

    def __init__(self, rank: int, name: str) -> None:
        self.rank = rank
        self.name = name
        self.items: list[tuple] = []
        self.waited_upto: dict[str, int] = {}
        self.end_times: list[int | None] = []
        self.waiters: dict[int, Any] = {}


def _add_wait(waiter: Stream, dep: Stream, index: int) -> None:
    if waiter is dep or waiter.waited_upto.get(dep.name, -1) >= index:
        return
    waiter.items.append((WAIT, dep, index))
    waiter.waited_upto[dep.name] = index


class Call:
    """One collective call on a group, or one message on a (src, dst, tag) channel."""

    __slots__ = ("kind", "group", "channel", "seq", "members", "ops", "works",
                 "arrived", "start", "end", "done", "sent", "where_text")

    def __init__(self, kind: CommKind, group: Any, channel: tuple, seq: int, members: tuple[int, ...]) -> None:
        self.kind = kind  # SEND for a message (members: sender, receiver)
        self.group = group
        self.channel = channel
        self.seq = seq
        self.members = members
        self.ops: dict[int, CommOp] = {}
        self.works: dict[int, Work] = {}
        # filled by the timed replay
        self.arrived = 0
        self.start = 0
        self.end = 0
        self.done: Any = None
        self.sent: dict[int, int] = {}

    @property
    def is_message(self) -> bool:
        return self.kind is CommKind.SEND

    @property
    def where(self) -> str:
        if self.is_message:
            src, dst, tag = self.channel[1:]
            return f"p2p[{src}->{dst}]" + (f" tag {tag}" if tag else "")
        return str(self.group)

    def describe(self, rank: int) -> str:
        op = self.ops.get(rank)
        if self.is_message:
            return f"{op.describe() if op else 'message'} (message #{self.seq} on {self.where})"
        return f"{op.describe() if op else self.kind.value} on group {self.where} (call #{self.seq} on that group)"


class RankState:
    """A rank's program and its streams (the `Streams` side of its Context)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.gen: Any = None
        self.comm: Comm | None = None
        self.streams: dict[str, Stream] = {}
        self.current = COMPUTE
        self.label: tuple[str | None, str | None] = (None, None)
        self.blocked: list[Work] | None = None
        self.single = True
        self.send_value: Any = None
        self.finished = False
        self.result: Any = None
        self.works: list[Work] = []
        self.held: dict[tuple[str, str], int] = {}
        self.stream(COMPUTE)

    def stream(self, name: str) -> Stream:
        s = self.streams.get(name)
        if s is None:
            s = self.streams[name] = Stream(self.rank, name)
        return s

    def wait_stream(self, name: str) -> None:
        dep = self.streams.get(name)
        if dep is not None and dep.items:
            _add_wait(self.stream(self.current), dep, len(dep.items) - 1)

    # -- memory: ctx.memory -----------------------------------------------------------------------
    @property
    def memory(self) -> "RankState":
        return self

    def hold(self, category: str, name: str, nbytes: int) -> None:
        """From this point of the current stream, the rank holds `nbytes` more of `category`."""
        if category not in CATEGORIES:
            raise ValueError(f"unknown memory category {category!r}; valid: {', '.join(CATEGORIES)}")
        if (category, name) in self.held:
            raise ValueError(f"rank {self.rank} already holds {category} buffer {name!r}")
        self.held[(category, name)] = int(nbytes)
        self.stream(self.current).items.append((MEMORY, category, name, int(nbytes)))

    def release(self, category: str, name: str) -> None:
        nbytes = self.held.pop((category, name), None)
        if nbytes is None:
            raise ValueError(f"rank {self.rank} releases {category} buffer {name!r}, which it does not hold")
        self.stream(self.current).items.append((MEMORY, category, name, -nbytes))

    def kernel(self, name: str, flops: float, nbytes: float) -> None:
        kind, label = self.label
        self.stream(self.current).items.append(
            (KERNEL, f"{label}/{name}" if label else name, kind or COMPUTE, flops, nbytes))


class Interpreter:
    def __init__(self, mesh: DeviceMesh, mode: Mode | str, *, cost_dtype: str = "fp32") -> None:
        self.mesh = mesh
        self.mode = Mode(mode) if isinstance(mode, str) else mode
        self.cost_dtype = cost_dtype
        self.ranks = [RankState(r) for r in range(mesh.world_size)]
        self.calls_issued: dict[tuple, int] = {}
        self.open: dict[tuple, Call] = {}
        self.calls: list[Call] = []
        self.ready: deque[int] = deque()

    # -- running -------------------------------------------------------------------------------
    def run(self, program: Program | Sequence[Program], *args: Any) -> list[Any]:
        """Run `program(ctx, *args)` on every rank (or program[r] on rank r); return the results."""
        programs = list(program) if isinstance(program, (list, tuple)) else [program] * len(self.ranks)
        if len(programs) != len(self.ranks):
            raise ValueError(f"{len(programs)} programs for {len(self.ranks)} ranks")
        for st, prog in zip(self.ranks, programs):
            st.comm = Comm(self._issuer(st), st.rank, self.mesh.world_size)
            ops = make_ops(self.mode, st.kernel, cost_dtype=self.cost_dtype)
            ctx = Context(rank=st.rank, mesh=self.mesh.view(st.rank), ops=ops, comm=st.comm, streams=st,
                          memory=st)
            gen = prog(ctx, *args)
            if not inspect.isgenerator(gen):  # a program with no communication at all
                st.finished, st.result = True, gen
                continue
            st.gen = gen
            self.ready.append(st.rank)
        with gc_paused():
            while self.ready:
                self._advance(self.ranks[self.ready.popleft()])
        self._check_end()
        return [st.result for st in self.ranks]

    def _advance(self, st: RankState) -> None:
        while True:
            try:
                y = st.gen.send(st.send_value)
            except StopIteration as stop:
                st.finished, st.result, st.gen = True, stop.value, None
                if st.comm.pending_sync is not None and not st.comm.pending_sync.waited:
                    raise ProgramError(f"rank {st.rank} ended without yielding its synchronous "
                                       f"{st.comm.pending_sync.op.describe()}")
                return
            except (DeadlockError, CollectiveMismatchError, ProgramError):
                raise
            except Exception as exc:
                raise ProgramError(f"rank {st.rank}: {type(exc).__name__}: {exc}") from exc
            works, single = self._works_of(st, y)
            cur = st.stream(st.current)
            for w in works:
                w.waited = True
                stream, index, _ = w.backend
                _add_wait(cur, stream, index)
            st.single = single
            if all(w.done for w in works):
                st.send_value = works[0].value if single else [w.value for w in works]
                continue
            st.blocked = works
            return

    def _works_of(self, st: RankState, y: Any) -> tuple[list[Work], bool]:
        if isinstance(y, Work):
            works, single = [y], True
        elif isinstance(y, (list, tuple)) and y and all(isinstance(w, Work) for w in y):
            works, single = list(y), False
        else:
            raise ProgramError(f"rank {st.rank} yielded {type(y).__name__} {y!r:.60}; a program yields the "
                               f"Work returned by ctx.comm.* (or a list of them)")
        for w in works:
            if w.op.rank != st.rank:
                raise ProgramError(f"rank {st.rank} yielded a work issued by rank {w.op.rank}")
        pending = st.comm.pending_sync
        if pending is not None and not pending.waited and not any(w is pending for w in works):
            raise ProgramError(f"rank {st.rank}: synchronous {pending.op.describe()} was not yielded before "
                               f"waiting on something else; yield it at once or pass async_op=True")
        return works, single

    # -- communication -------------------------------------------------------------------------
    def _issuer(self, st: RankState) -> Callable[[CommOp, bool], Work]:
        return lambda op, sync: self._issue(st, op, sync)

    def _issue(self, st: RankState, op: CommOp, sync: bool) -> Work:
        work = Work(op, sync)
        st.works.append(work)
        if op.kind is CommKind.SEND:
            channel, members, counter = ("p2p", op.rank, op.peer, op.tag), (op.rank, op.peer), ("send",)
        elif op.kind is CommKind.RECV:
            channel, members, counter = ("p2p", op.peer, op.rank, op.tag), (op.peer, op.rank), ("recv",)
        else:
            channel, members, counter = (op.group.name, op.group.ranks), op.group.ranks, (op.rank,)
        ckey = channel + counter
        seq = self.calls_issued.get(ckey, 0)
        self.calls_issued[ckey] = seq + 1
        call = self.open.get((channel, seq))
        if call is None:
            kind = CommKind.SEND if channel[0] == "p2p" else op.kind
            call = self.open[(channel, seq)] = Call(kind, op.group, channel, seq, members)
            self.calls.append(call)
        self._check_match(call, op)
        call.ops[op.rank] = op
        call.works[op.rank] = work

        cur, target = st.stream(st.current), st.stream(op.stream)
        if cur.items:
            _add_wait(target, cur, len(cur.items) - 1)  # the input is ready when issued work is done
        target.items.append((COMM, call, op, st.label[1]))
        work.backend = (target, len(target.items) - 1, call)
        if len(call.ops) == len(call.members):
            self._complete(call)
        return work

    def _check_match(self, call: Call, op: CommOp) -> None:
        if call.is_message:
            other = next(iter(call.ops.values()), None)
            if other is not None and other.sig != op.sig:
                send, recv = (other, op) if other.kind is CommKind.SEND else (op, other)
                raise CollectiveMismatchError(
                    f"message #{call.seq} on {call.where}: rank {send.rank} sends {describe_signature(send.sig)} "
                    f"but rank {recv.rank} expects {describe_signature(recv.sig)}")
            return
        first = next(iter(call.ops.values()), None)
        if first is not None and first.match_key() != op.match_key():
            lines = [f"collective mismatch on group {call.where}, call #{call.seq} on that group:"]
            for r, o in sorted(list(call.ops.items()) + [(op.rank, op)]):
                lines.append(f"  rank {r} issued {o.describe()}")
            raise CollectiveMismatchError("\n".join(lines))

    def _complete(self, call: Call) -> None:
        ordered = [call.ops[r] for r in call.members]
        results = collectives.execute(call.kind, ordered)
        del self.open[(call.channel, call.seq)]
        for r, value in zip(call.members, results):
            w = call.works[r]
            w.value, w.done = value, True
            st = self.ranks[r]
            if st.blocked is not None and all(x.done for x in st.blocked):
                st.send_value = st.blocked[0].value if st.single else [x.value for x in st.blocked]
                st.blocked = None
                self.ready.append(r)

    # -- the end -------------------------------------------------------------------------------
    def _state_of(self, r: int) -> str:
        st = self.ranks[r]
        if st.finished:
            return "finished"
        waiting = [w for w in (st.blocked or []) if not w.done]
        return "waiting in " + "; ".join(w.backend[2].describe(r) for w in waiting)

    def _check_end(self) -> None:
        stuck = [st for st in self.ranks if not st.finished]
        if stuck:
            lines = ["deadlock: no rank can proceed"]
            for st in stuck:
                for w in st.blocked or []:
                    if w.done:
                        continue
                    call = w.backend[2]
                    missing = [m for m in call.members if m not in call.ops]
                    lines.append(f"  rank {st.rank} waits in {call.describe(st.rank)}")
                    for m in missing:
                        lines.append(f"    rank {m} has not issued it: rank {m} is {self._state_of(m)}")
            raise DeadlockError("\n".join(lines))
        if self.open:
            lines = ["a rank ended while others wait:"]
            for call in self.open.values():
                missing = [m for m in call.members if m not in call.ops]
                for r in sorted(call.ops):
                    lines.append(f"  rank {r} issued {call.describe(r)}, but rank(s) "
                                 f"{', '.join(map(str, missing))} finished without issuing it")
            raise DeadlockError("\n".join(lines))
        for st in self.ranks:
            unwaited = [w for w in st.works if not w.waited]
            if unwaited:
                raise ProgramError(f"rank {st.rank} finished without waiting for "
                                   + "; ".join(w.backend[2].describe(st.rank) for w in unwaited)
                                   + " (yield the work before the program ends)")
