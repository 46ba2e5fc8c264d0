"""Meta mode: a block's work recorded once per shape and replayed for every block like it.

In meta mode a block's forward (or backward) pass on the same shapes issues the same kernels and the
same communication, whichever layer it is and whichever micro-batch: only the labels differ ("F3:block7",
the recomputation's "R7") and the names its gradients go under ("layers.7.mlp.w_fc"). Running the
model's Python for each of them is most of what a large simulation costs (a 3,072-GPU Megatron
layout runs a block about 200,000 times), so a `Tapes` records what a block did the first time — each
kernel with its label, each communication request, each wait, the gradients it produced, what it
returned — and replays that for the next block with the same key, relabelled. Kernels back to back
under one label replay as one stream item (a run), which the timed replay steps over at once when it
keeps no events. The calls, results, trace and report it leaves behind are the same as the Python's
would be (tests/test_tape.py: byte-identical reports and traces, taped and not, for every family).

A recording that does anything a replay would not repeat is not kept: a kernel on another stream
than the block's own, memory held or released, a stream waited for by hand, a label that names
neither the block's call nor its recomputation, a message with a tag (which may name the layer), a
request issued before the block or left unwaited after it, a gradient under another layer's name. Such blocks simply run their Python every time.
"""

from __future__ import annotations

from typing import Any, Callable, Generator

from simcluster.numerics.tensor import MetaTensor
from simcluster.program.comm import CommOp

_KERNEL, _ISSUE, _YIELD, _RUN = 0, 1, 2, 3


def shape_key(x: Any) -> Any:
    """What a block's behaviour in meta mode may depend on in `x`, as a hashable value; None where
    that cannot be told (then nothing is taped)."""
    if x is None or x.__class__ in (int, float, str, bool):
        return x
    if x.__class__ is MetaTensor:
        return x.signature
    if x.__class__ in (tuple, list):
        parts = tuple(shape_key(v) for v in x)
        return None if any(p is None and v is not None for p, v in zip(parts, x)) else (x.__class__.__name__,) + parts
    if x.__class__ is dict:
        parts = tuple((k, shape_key(v)) for k, v in x.items())
        return None if any(p is None and v is not None for (_, p), v in zip(parts, x.values())) else ("dict",) + parts
    return None


class Tape:
    __slots__ = ("events", "result", "grads", "deferred", "labels", "ops")

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.ops: dict[int, CommOp] = {}  # by event: the op its calls issued alone share
        self.result: Any = None
        self.grads: list[tuple[str, Any]] = []  # (name after the layer's prefix, value)
        # the weight gradients the block left for a W pass (zero-bubble schedules, DualPipe): (name after the layer's prefix, thunk). A
        # replay hands the recorded thunks on: in meta mode a weight gradient's kernels are its shapes', and
        # the W pass calls each thunk then (its kernels under the W pass's label)
        self.deferred: list[tuple[str, Any]] = []
        self.labels: set[tuple] = set()  # the recomputation's labels it recorded (the rest: the call's own)


class Tapes:
    """One rank's tapes, by key. `state` is the emulator's RankState (the rank's streams and labels);
    with any other backend there is nothing to tape and `run` just runs the block."""

    def __init__(self, ctx: Any) -> None:
        self.ops, self.comm, self.state = ctx.ops, ctx.comm, ctx.memory
        self.tapes: dict[Any, Tape | None] = {}  # None: tried, and not tapeable

    @classmethod
    def of(cls, ctx: Any) -> "Tapes | None":
        """A rank's tapes where they can work: meta mode on the emulator (whose RankState is the
        context's memory and streams); else None."""
        state = ctx.memory
        if ctx.ops.mode.value != "meta" or not all(
                hasattr(state, a) for a in ("kernel", "kernels", "streams", "cur", "held", "label")):
            return None
        return cls(ctx)

    def run(self, key: Any, layer: int, block: Callable[[], Generator[Any, Any, Any]],
            grads: dict[str, Any] | None = None, defer: list | None = None) -> Generator[Any, Any, Any]:
        """`block()`'s result, run or replayed. `key` must say everything its work depends on except
        the layer index `layer` and the call's label; None runs it untaped. `defer`: the list the block
        appends its deferred weight gradients to (name, thunk), if it defers them."""
        if key is None:
            return (yield from block())
        tape = self.tapes.get(key, False)
        if tape is False:
            tape, result = yield from self._record(layer, block, grads, defer)
            self.tapes[key] = tape
            return result
        if tape is None:
            return (yield from block())
        return (yield from self._replay(tape, layer, grads, defer))

    # -- recording ---------------------------------------------------------------------------------
    def _record(self, layer: int, block: Callable[[], Generator[Any, Any, Any]], grads: dict[str, Any] | None,
                defer: list | None) -> Generator[Any, Any, tuple[Tape | None, Any]]:
        st, ops, comm = self.state, self.ops, self.comm
        kernel, issue = ops._record, comm._issue
        if kernel != st.kernel:  # inside a fused kernel, or not the emulator: nothing to tape
            return None, (yield from block())
        tape, ok = Tape(), [True]
        own, recompute = st.label, f"R{layer}"
        stream = st.cur
        issued: dict[int, int] = {}  # id(work) -> its index among the block's requests
        works: list[Any] = []
        waited: set[int] = set()

        def label() -> tuple:
            lab = st.label
            if lab == own:
                return lab
            if lab[1] != recompute:
                ok[0] = False
            tape.labels.add(lab)
            return lab

        def on_kernel(name: str, work: Any, nbytes: float) -> None:
            if st.cur is not stream:
                ok[0] = False
            tape.events.append((_KERNEL, label(), name, work, nbytes))
            kernel(name, work, nbytes)

        def on_issue(op: Any, sync: bool) -> Any:
            fields = (op.kind, op.rank, op.group, op.tensor, op.op, op.peer, op.dim, op.split_dim,
                      op.concat_dim, op.sig, op.tag, op.stream, op.tiers, op.donate, op.splits, op.gets)
            if st.cur is not stream or op.tag:  # (a message's tag may name its layer: ring attention's do)
                ok[0] = False
            tape.events.append((_ISSUE, label(), fields, sync))
            work = issue(op, sync)
            issued[id(work)] = len(works)
            works.append(work)
            return work

        before = {k: id(v) for k, v in grads.items()} if grads is not None else {}
        deferred = len(defer) if defer is not None else 0
        held = len(st.held)
        gen = block()
        ops._record, comm._issue = on_kernel, on_issue
        value: Any = None
        try:
            while True:
                mark, events = _items(st), len(tape.events)
                try:
                    y = gen.send(value)
                except StopIteration as stop:
                    result = stop.value
                    break
                finally:
                    # what the block appended to any stream is exactly its kernels and requests
                    if _items(st) - mark != len(tape.events) - events or st.cur is not stream:
                        ok[0] = False
                many = y.__class__ is list
                at = [issued.get(id(w)) for w in (y if many else [y])]
                if None in at:
                    ok[0] = False
                else:
                    waited.update(at)
                tape.events.append((_YIELD, tuple(at) if many else at[0], many))
                if ops._record is not on_kernel:  # a wait inside a fused kernel: leave it be
                    ok[0] = False
                    value = yield y
                    continue
                ops._record, comm._issue = kernel, issue  # the interpreter's own work is not the block's
                try:
                    value = yield y
                finally:
                    ops._record, comm._issue = on_kernel, on_issue
        finally:
            ops._record, comm._issue = kernel, issue
        if len(st.held) != held or len(waited) != len(works) or not ok[0]:
            return None, result
        prefix = f"layers.{layer}."
        if grads is not None:
            for k, v in grads.items():
                if before.get(k) != id(v):
                    if not k.startswith(prefix):
                        return None, result
                    tape.grads.append((k[len(prefix):], v))
        for i in range(deferred, len(defer) if defer is not None else 0):
            k, thunk = defer[i]
            if not k.startswith(prefix):
                return None, result
            defer[i] = (k, _Thunk(self, thunk))
            tape.deferred.append((k[len(prefix):], defer[i][1]))
        tape.result = result
        tape.events = _runs(tape.events)
        return tape, result

    # -- replaying ---------------------------------------------------------------------------------
    def _replay(self, tape: Tape, layer: int, grads: dict[str, Any] | None,
                defer: list | None) -> Generator[Any, Any, Any]:
        st, comm = self.state, self.comm
        own = st.label
        relabel = {lab: (lab[0], f"R{layer}") for lab in tape.labels}
        kernel, kernels, issue = st.kernel, st.kernels, comm._issue
        alone = comm.issue_alone  # (folded: a call of this rank's alone completes at once)
        shared = tape.ops
        works: list[Any] = []
        try:
            for i, event in enumerate(tape.events):
                tag = event[0]
                if tag == _RUN:
                    st.label = relabel.get(event[1], own)
                    kernels(event[2])
                elif tag == _KERNEL:
                    st.label = relabel.get(event[1], own)
                    kernel(event[2], event[3], event[4])
                elif tag == _ISSUE:
                    st.label = relabel.get(event[1], own)
                    sync = event[3]
                    # no one reads a replayed call's data: an op issued alone is shared by every replay
                    op = shared.get(i)
                    work = None if alone is None else alone(op or CommOp(*event[2]), sync)
                    if work is None:
                        work = issue(CommOp(*event[2]), sync)
                    elif op is None:
                        shared[i] = work.op
                    comm.pending_sync = work if sync else None
                    works.append(work)
                else:
                    st.label = own
                    at, many = event[1], event[2]
                    chosen = [works[k] for k in at] if many else [works[at]]
                    if comm.every_wait or not all(w.done for w in chosen):
                        yield chosen if many else chosen[0]
                    else:  # all complete: what yielding them would do, without the round trip
                        st.waited(chosen)
        finally:
            st.label = own
        prefix = f"layers.{layer}."
        if grads is not None:
            for name, value in tape.grads:
                grads[prefix + name] = value
        if tape.deferred:
            if defer is None:
                raise AssertionError("a tape with deferred weight gradients replayed where none are deferred")
            defer.extend((prefix + name, thunk) for name, thunk in tape.deferred)
        return _fresh(tape.result)


class _Thunk:
    """A deferred weight gradient of a taped backward pass, called in the W pass of every block that
    replays the tape: the first call runs it and keeps its kernels and result, the others replay them
    (meta mode: the same shapes, the same kernels). One that does anything but kernels on the current
    stream runs every time."""

    __slots__ = ("tapes", "thunk", "kernels", "result")

    def __init__(self, tapes: Tapes, thunk: Callable[[], Any]) -> None:
        self.tapes, self.thunk = tapes, thunk
        self.kernels: tuple | None | bool = None  # None: not yet called; False: runs every time
        self.result: Any = None

    def __call__(self) -> Any:
        st, ops, comm = self.tapes.state, self.tapes.ops, self.tapes.comm
        if self.kernels is False or ops._record != st.kernel:  # (inside a fused kernel: its own accounting)
            return self.thunk()
        if self.kernels:
            for k in self.kernels:
                st.kernel(*k)
            return self.result
        kernel, issue, stream, held = ops._record, comm._issue, st.cur, len(st.held)
        recorded: list[tuple[str, Any, float]] = []
        clean = [True]

        def on_kernel(name: str, work: Any, nbytes: float) -> None:
            clean[0] = clean[0] and st.cur is stream
            recorded.append((name, work, nbytes))
            kernel(name, work, nbytes)

        def on_issue(op: Any, sync: bool) -> Any:
            clean[0] = False
            return issue(op, sync)

        ops._record, comm._issue = on_kernel, on_issue
        try:
            result = self.thunk()
        finally:
            ops._record, comm._issue = kernel, issue
        if clean[0] and st.cur is stream and len(st.held) == held and recorded:
            self.kernels, self.result = tuple(recorded), result
        else:
            self.kernels = False
        return result


def _runs(events: list[tuple]) -> list[tuple]:
    """The tape with each stretch of two or more kernels under one label as one run (_RUN, label,
    ((name, flops, bytes), ...)): replayed as one stream item (engine/streams.py `kernels`)."""
    out: list[tuple] = []
    i = 0
    while i < len(events):
        j = i
        while j < len(events) and events[j][0] == _KERNEL and events[j][1] == events[i][1]:
            j += 1
        if j - i >= 2:
            out.append((_RUN, events[i][1], tuple(e[2:] for e in events[i:j])))
            i = j
        else:
            out.append(events[i])
            i += 1
    return out


def _items(st: Any) -> int:
    return sum(len(s.items) for s in st.streams.values())


def _fresh(x: Any) -> Any:
    """The recorded result with new containers (its tensors are immutable and shared)."""
    if x.__class__ is dict:
        return {k: _fresh(v) for k, v in x.items()}
    if x.__class__ in (tuple, list):
        return x.__class__(_fresh(v) for v in x)
    return x
