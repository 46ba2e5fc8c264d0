"""Phase one of a run: execute every rank's program, match its communication, compute the data.

Ranks run as cooperative coroutines in a fixed order: a rank runs until it yields a work that is not
complete, then the next ready rank runs. A call completes, and its members' data is computed, when
every member has issued it; members that were waiting for it become ready again, in group order.
Nothing depends on time here: numbers never depend on timing, so data and time are separate passes.

What comes out, besides each rank's result, is each rank's streams (streams.py): ordered lists of
kernels, waits on other streams, and parts of communication calls. `timing.py` replays them.

Checked here: the k-th calls on a group (or the k-th messages on a send/recv channel) must agree
across ranks (`CollectiveMismatchError`); if no rank can proceed, or a rank ends while others wait
for it, the run stops with a `DeadlockError` naming the ranks, the operations and the groups.
"""

from __future__ import annotations

import inspect
from collections import deque
from functools import partial
from typing import Any, Sequence

from simcluster.engine import collectives
from simcluster.engine.calls import Call, Channel, EmulatedWork
from simcluster.engine.errors import CollectiveMismatchError, DeadlockError, FoldError
from simcluster.engine.fold import Fold
from simcluster.engine.gcpause import gc_paused
from simcluster.engine.streams import COMM, WAIT, RankState, wait_index
from simcluster.numerics.modes import make_ops
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import describe_signature
from simcluster.program.comm import Comm, CommKind, CommOp, ProgramError, Work
from simcluster.program.context import Context, Program
from simcluster.program.mesh import DeviceMesh, ProcessGroup

_SEND, _RECV, _COPY = CommKind.SEND, CommKind.RECV, CommKind.COPY


class Interpreter:
    """Runs every rank's program, or with a fold (engine/fold.py) the representatives'."""

    def __init__(self, mesh: DeviceMesh, mode: Mode | str, *, cost_dtype: str = "fp32",
                 fold: Fold | None = None, serial_comm: bool = False) -> None:
        self.mesh = mesh
        # communication on the stream that issues it (a CPU's collectives run on the cores that compute:
        # they take turns, nothing overlaps)
        self.serial_comm = serial_comm
        self.mode = Mode(mode) if isinstance(mode, str) else mode
        self.cost_dtype = cost_dtype
        self.fold = fold
        self.ranks = [RankState(r) for r in (range(mesh.world_size) if fold is None else fold.ranks)]
        self.state = {st.rank: st for st in self.ranks}
        self.groups: dict[ProcessGroup, Channel] = {}
        self.by_id: dict[int, Channel] = {}
        self.kept: list[ProcessGroup] = []
        self.messages: dict[tuple[int, int, int], Channel] = {}
        self.copies: dict[tuple[int, tuple[str, str]], Channel] = {}  # a rank's copies, by (from, to) tier
        self.pair_routes: dict[tuple[int, int], dict] = {}  # the message channels' route caches, by (src, dst)
        self.calls: list[Call] = []
        self.images: dict[int, tuple[int, ...]] = {}  # by id of a folded channel (kept alive in groups/messages)
        self.ready: deque[RankState] = deque()
        # the last message completed between two streams: (its item on each, in (rank, name) order; it)
        self.orders: dict[tuple[int, int], tuple[int, int, Call]] = {}

    # -- running -------------------------------------------------------------------------------
    def run(self, program: Program | Sequence[Program], *args: Any) -> list[Any]:
        """Run `program(ctx, *args)` on every rank (or program[r] on rank r); return the results."""
        programs = list(program) if isinstance(program, (list, tuple)) else [program] * self.mesh.world_size
        if len(programs) != self.mesh.world_size:
            raise ValueError(f"{len(programs)} programs for {self.mesh.world_size} ranks")
        for st in self.ranks:
            prog = programs[st.rank]
            st.comm = Comm(partial(self._issue, st), st.rank, self.mesh.world_size)
            if self.fold is not None:
                st.comm.issue_alone = partial(self._issue_alone, st)
            ops = make_ops(self.mode, st.kernel, cost_dtype=self.cost_dtype)
            ctx = Context(rank=st.rank, mesh=self.mesh.view(st.rank), ops=ops, comm=st.comm, streams=st,
                          memory=st)
            gen = prog(ctx, *args)
            if not inspect.isgenerator(gen):  # a program with no communication at all
                st.finished, st.result = True, gen
                continue
            st.gen = gen
            self.ready.append(st)
        with gc_paused():
            while self.ready:
                self._advance(self.ready.popleft())
        self._check_end()
        return [self.state[r].result if r in self.state else None for r in range(self.mesh.world_size)]

    def release(self) -> None:
        """Let go of the programs, their calls and channels once the replay has consumed the streams:
        a rank's Comm refers back to this interpreter, a cycle that only the cyclic collector would
        otherwise free, after walking every object the run left behind."""
        for st in self.ranks:
            st.comm, st.gen, st.works, st.blocked, st.streams = None, None, [], None, {}
        for table in (self.groups, self.by_id, self.messages, self.copies, self.pair_routes, self.state, self.orders,
                      self.images):
            table.clear()
        self.kept.clear()
        self.calls.clear()

    def _advance(self, st: RankState) -> None:
        send, rank, comm = st.gen.send, st.rank, st.comm
        while True:
            try:
                y = send(st.send_value)
            except StopIteration as stop:
                st.finished, st.result, st.gen = True, stop.value, None
                if comm.pending_sync is not None and not comm.pending_sync.waited:
                    raise ProgramError(f"rank {st.rank} ended without yielding its synchronous "
                                       f"{comm.pending_sync.op.describe()}")
                return
            except (DeadlockError, CollectiveMismatchError, ProgramError, FoldError):
                raise
            except Exception as exc:
                raise ProgramError(f"rank {st.rank}: {type(exc).__name__}: {exc}") from exc
            pending = comm.pending_sync
            free = pending is None or pending.waited
            if type(y) is EmulatedWork and y.op.rank == rank and (free or pending is y):
                # the commonest case (one work, checked in full by _works_of otherwise), unrolled
                y.waited = True
                cur = st.cur
                j = wait_index(cur, y.stream, y.index)
                if j >= 0:
                    cur.items.append((WAIT, y.stream, j))
                st.single = True
                if y.done:
                    st.send_value = y.value
                    continue
                st.blocked = [y]
                return
            if type(y) is list and y and (free or pending in y):
                for w in y:
                    if type(w) is not EmulatedWork or w.op.rank != rank:
                        works, single = self._works_of(st, y)
                        break
                else:
                    works, single = y, False
            else:
                works, single = self._works_of(st, y)
            cur = st.cur
            done = True
            for w in works:
                w.waited = True
                j = wait_index(cur, w.stream, w.index)
                if j >= 0:
                    cur.items.append((WAIT, w.stream, j))
                done = done and w.done
            st.single = single
            if done:
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
            if not isinstance(w, EmulatedWork):
                raise ProgramError(f"rank {st.rank} yielded a work that this emulator did not issue: {w!r}")
        pending = st.comm.pending_sync
        if pending is not None and not pending.waited and not any(w is pending for w in works):
            raise ProgramError(f"rank {st.rank}: synchronous {pending.op.describe()} was not yielded before "
                               f"waiting on something else; yield it at once or pass async_op=True")
        return works, single

    # -- communication -------------------------------------------------------------------------
    def _group_channel(self, group: ProcessGroup) -> Channel:
        ch = self.groups.get(group)
        if ch is None:
            ch = self.groups[group] = Channel(None, group, group.ranks, str(group),
                                              (f"comm:{group.name}",) * group.size, self.fold)
        # Found by identity from now on; the group is kept alive here, so its id stays its own.
        self.by_id[id(group)] = ch
        self.kept.append(group)
        return ch

    def _message_channel(self, src: int, dst: int, tag: int) -> Channel:
        key = (src, dst, tag)
        ch = self.messages.get(key)
        if ch is None:
            where = f"p2p[{src}->{dst}]" + (f" tag {tag}" if tag else "")
            ch = self.messages[key] = Channel(CommKind.SEND, None, (src, dst), where, (f"send->{dst}", f"recv<-{src}"),
                                              self.fold)
            if ch.live == 1:
                if not self.fold.is_rep[src] or self.fold.rep(dst) != src:
                    raise FoldError(f"a message from rank {src} to rank {dst} joins a simulated rank to a folded one")
                # a message to a folded peer stands for the one its sender receives from a folded peer (the
                # image of this one: `Fold.partner`), which the sender issues as this channel's receiver
                ch.live = 2
            # messages between the same two ranks move their bytes over the same links, whatever the tag
            ch.routes = self.pair_routes.setdefault((src, dst), ch.routes)
        return ch

    def _received(self, op: CommOp) -> Channel:
        """The channel of a message `op` receives: from a folded peer, the one its own image of that message
        goes on (from this rank to a folded peer, where this rank stands in for the receiver)."""
        src, dst = op.peer, op.rank
        if self.fold is None or self.fold.is_rep[src]:
            return self._message_channel(src, dst, op.tag)
        to = self.fold.partner(src, dst)
        if to is None:
            raise FoldError(f"a message from rank {src} to rank {dst} joins a simulated rank to a folded one")
        ch = self.messages[(src, dst, op.tag)] = self.messages.get((dst, to, op.tag)) or \
            self._message_channel(dst, to, op.tag)
        return ch

    def _copy_channel(self, rank: int, tiers: tuple[str, str]) -> Channel:
        ch = self.copies[(rank, tiers)] = Channel(_COPY, None, (rank,), f"{tiers[0]}->{tiers[1]}[{rank}]",
                                                  (f"copy:{tiers[0]}->{tiers[1]}",), None)
        return ch

    def _issue(self, st: RankState, op: CommOp, sync: bool) -> Work:
        kind = op.kind
        if kind is _COPY:  # one member: complete as soon as it is issued
            ch, pos = self.copies.get((op.rank, op.tiers)) or self._copy_channel(op.rank, op.tiers), 0
            key = op.sig
        elif kind is _SEND:
            ch, pos = self.messages.get((op.rank, op.peer, op.tag)) or self._message_channel(op.rank, op.peer, op.tag), 0
            key = op.sig
        elif kind is _RECV:
            ch, pos = self.messages.get((op.peer, op.rank, op.tag)) or self._received(op), 1
            key = op.sig
        else:
            ch = self.by_id.get(id(op.group)) or self._group_channel(op.group)
            pos = ch.position[op.rank]
            key = op.match_key()
        seq = ch.issued[pos]
        ch.issued[pos] = seq + 1
        call = ch.open.get(seq)
        if call is None:
            call = ch.open[seq] = Call(ch.kind or kind, ch, seq)
            call.key = key
            self.calls.append(call)
        elif key != call.key:
            self._mismatch(call, op)
        work = self._place(st, ch, pos, op, sync, call)
        works = st.works  # (kept to check that each is waited for; pruned as they are)
        works.append(work)
        if len(works) > st.prune_at:
            st.works = [w for w in works if not w.waited]
            st.prune_at = 2 * len(st.works) + 64
        call.ops[pos] = op
        call.works[pos] = work
        call.count += 1
        if call.count == call.live:
            self._complete(call)
        return work

    def _place(self, st: RankState, ch: Channel, pos: int, op: CommOp, sync: bool, call: Call) -> EmulatedWork:
        """Put member `pos`'s part of `call` on the stream it runs on; its work."""
        if self.serial_comm and op.kind is not _COPY:
            op.stream = st.cur.name
        where = ch.where
        if ch.kind is _SEND and op.rank != ch.members[pos]:  # receiving for a folded peer (`_received`)
            where = f"p2p[{op.peer}->{op.rank}]" + (f" tag {op.tag}" if op.tag else "")
            op.stream = op.stream or f"recv<-{op.peer}"
        if not op.stream:
            op.stream = ch.streams[pos]
        target = st.streams.get(op.stream) or st.stream(op.stream)
        own = ch.stream_of[pos]
        if own is not target:
            if own is None:
                ch.stream_of[pos] = target
            else:
                ch.mixed = True
        cur = st.cur
        # the input is ready when the work issued before it on the current stream is done
        j = wait_index(target, cur, len(cur.items) - 1) if cur.items and target is not cur else -1
        target.items.append((COMM, call, op.kind._value_, st.label[1], pos, cur if j >= 0 else None, j, where))
        return EmulatedWork(op, sync, target, len(target.items) - 1, call)

    def _issue_alone(self, st: RankState, op: CommOp, sync: bool) -> EmulatedWork | None:
        """A collective whose group's only simulated member is this rank (a folded group), issued
        for its time alone: what a taped block's replay issues, whose results nobody reads (the
        replay returns the recorded ones). Complete at once, without matching or computing its
        data; the same call and stream items as `_issue` makes. None where other members run."""
        ch = self.by_id.get(id(op.group))
        if ch is None or ch.live != 1:
            return None
        if id(ch) not in self.images:
            self._images(ch)  # (checks, once, that the group holds its members' representative)
        pos = ch.position[op.rank]
        seq = ch.issued[pos]
        ch.issued[pos] = seq + 1
        call = Call(op.kind, ch, seq)
        self.calls.append(call)
        work = self._place(st, ch, pos, op, sync, call)
        call.ops = [op] * len(ch.members)  # every member's image is this one (`_complete`)
        call.count = 1
        call.works = None
        work.done = True
        return work

    def _mismatch(self, call: Call, op: CommOp) -> None:
        issued = [(r, o) for r, o in zip(call.members, call.ops) if o is not None]
        if call.is_message:
            other = issued[0][1]
            send, recv = (other, op) if other.kind is CommKind.SEND else (op, other)
            raise CollectiveMismatchError(
                f"message #{call.seq} on {call.where}: rank {send.rank} sends {describe_signature(send.sig)} "
                f"but rank {recv.rank} expects {describe_signature(recv.sig)}")
        lines = [f"collective mismatch on group {call.where}, call #{call.seq} on that group:"]
        for r, o in sorted(issued + [(op.rank, op)], key=lambda ro: ro[0]):
            lines.append(f"  rank {r} issued {o.describe()}")
        raise CollectiveMismatchError("\n".join(lines))

    def _complete(self, call: Call) -> None:
        if call.live < len(call.members):  # folded members hold their images' data (meta: shapes)
            images = self._images(call.channel)
            ops = call.ops
            call.ops = [op or ops[i] for op, i in zip(ops, images)]
            if call.ops[0].splits is not None:
                self.fold.even_rows(call.ops[0], call.where)
        if call.kind is _SEND:
            self._check_order(call)
        results = collectives.execute(call.kind, call.ops)
        for op in call.ops:
            op.tensor = None  # the data lives on in the results; a long run keeps no inputs alive
        del call.channel.open[call.seq]
        ranks = self.state
        works, call.works = call.works, None  # (no longer needed: let them go with the program)
        for r, w, value in zip(call.members, works, results):
            if w is None:
                continue  # a folded member
            w.value, w.done = value, True
            st = ranks[r] if self.fold is None else ranks[self.fold.rep(r)]  # (a folded peer's stand-in)
            blocked = st.blocked
            if blocked is not None and (blocked[0] is w if len(blocked) == 1 else all(x.done for x in blocked)):
                st.send_value = value if st.single else [x.value for x in blocked]
                st.blocked = None
                self.ready.append(st)

    def _images(self, ch: Channel) -> tuple[int, ...]:
        """Where in a folded channel each member's representative is (found once a channel)."""
        images = self.images.get(id(ch))
        if images is None:
            at, rep = ch.position, self.fold.rep
            if any(rep(m) not in at for m in ch.members):
                raise FoldError(f"group {ch.where} does not hold the representatives of its folded members")
            images = self.images[id(ch)] = tuple(at[rep(m)] for m in ch.members)
        return images

    def _check_order(self, message: Call) -> None:
        """Two messages between the same two streams must be in the same order on both: each stream
        runs in order, so the timed replay (and a GPU) would have each wait for the other. Matching
        by tag (as the data pass does, and gloo) would hide that; NCCL ignores tags altogether.

        Messages that are consistent complete in order here (each completes when its later side
        is issued), so comparing each with the last one completed between the two streams suffices."""
        (a, b) = sorted(((w.stream, w.index) for w in message.works), key=lambda si: (si[0].rank, si[0].name))
        key = (id(a[0]), id(b[0]))
        last = self.orders.get(key)
        if last is not None and (a[1] > last[0]) != (b[1] > last[1]):
            first, then = (last[2], message) if a[1] > last[0] else (message, last[2])
            raise DeadlockError(
                f"point-to-point messages out of order: rank {a[0].rank} issues {first.describe(a[0].rank)} "
                f"before {then.describe(a[0].rank)} on its stream {a[0].name!r}, but rank {b[0].rank} issues "
                f"them the other way round on its stream {b[0].name!r}; each stream runs in order, so on a GPU "
                f"each would wait for the other (tags do not reorder them: NCCL ignores tags). Issue them in "
                f"the same order on both ranks, or put one on a stream of its own (stream=...)")
        if last is None or a[1] > last[0]:
            self.orders[key] = (a[1], b[1], message)

    # -- the end -------------------------------------------------------------------------------
    def _state_of(self, r: int) -> str:
        st = self.state.get(r)
        if st is None:
            return f"folded onto rank {self.fold.rep(r)}"
        if st.finished:
            return "finished"
        waiting = [w for w in (st.blocked or []) if not w.done]
        return "waiting in " + "; ".join(w.call.describe(r) for w in waiting)

    def _check_end(self) -> None:
        stuck = [st for st in self.ranks if not st.finished]
        if stuck:
            lines = ["deadlock: no rank can proceed"]
            for st in stuck:
                for w in st.blocked or []:
                    if w.done:
                        continue
                    call = w.call
                    lines.append(f"  rank {st.rank} waits in {call.describe(st.rank)}")
                    for m in call.missing():
                        lines.append(f"    rank {m} has not issued it: rank {m} is {self._state_of(m)}")
            raise DeadlockError("\n".join(lines))
        open_calls = [c for c in self.calls if c.count < c.live]
        if open_calls:
            lines = ["a rank ended while others wait:"]
            for call in open_calls:
                missing = call.missing()
                for r in sorted(r for r, op in zip(call.members, call.ops) if op is not None):
                    lines.append(f"  rank {r} issued {call.describe(r)}, but rank(s) "
                                 f"{', '.join(map(str, missing))} finished without issuing it")
            raise DeadlockError("\n".join(lines))
        for st in self.ranks:
            unwaited = [w for w in st.works if not w.waited]
            if unwaited:
                raise ProgramError(f"rank {st.rank} finished without waiting for "
                                   + "; ".join(w.call.describe(st.rank) for w in unwaited)
                                   + " (yield the work before the program ends)")
