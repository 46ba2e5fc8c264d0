"""Communication requests, as a program issues them. Names and semantics follow torch.distributed.

`ctx.comm.all_reduce(x, group=g)` checks its arguments, builds a `CommOp` and hands it to the backend,
which returns a `Work`. The program yields the work to get the result:

    total = yield ctx.comm.all_reduce(partial, group=ctx.mesh.tp)          # wait now
    h = ctx.comm.all_gather(shard, group=ctx.mesh.dp, async_op=True)        # issue, overlap ...
    full = yield h                                                          # ... wait later

A sync request (the default) must be yielded before the rank does anything else; an async one must
be yielded before the program ends. A list of works may be yielded at once (results in order).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Sequence

from simcluster.model.memory import TIERS
from simcluster.numerics.tensor import MetaTensor, ReduceOp, describe, describe_signature, shape_of, signature
from simcluster.program.mesh import ProcessGroup


class ProgramError(RuntimeError):
    """A program used the API wrongly (not a mismatch between ranks: those are SimulationErrors)."""


class CommKind(Enum):
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_GATHER = "all_gather"
    ALL_TO_ALL = "all_to_all"
    BROADCAST = "broadcast"
    REDUCE = "reduce"
    SEND = "send"
    RECV = "recv"
    BARRIER = "barrier"
    COPY = "copy"  # between a rank's memory tiers (gpu, cpu, nvme): ZeRO-Offload and ZeRO-Infinity


COLLECTIVES = frozenset(k for k in CommKind if k not in (CommKind.SEND, CommKind.RECV, CommKind.COPY))


@dataclass(eq=False, slots=True)
class CommOp:
    """One rank's side of a communication. `peer` is the root/src/dst, a global rank.

    `sig` is the (partial, dtype, shape) of the data it moves: the tensor's, or for a recv the
    signature expected. `stream`: the stream it runs on; "" asks the backend for its default (one
    per group, one per peer and direction). Treat an op as immutable once issued; a backend may let
    go of `tensor` once the call has completed.
    """

    kind: CommKind
    rank: int
    group: ProcessGroup | None
    tensor: Any = None
    op: ReduceOp | None = None
    peer: int | None = None
    dim: int = 0
    split_dim: int = 0
    concat_dim: int = 0
    sig: tuple | None = None
    tag: int = 0
    stream: str = ""
    tiers: tuple[str, str] = ("", "")  # a copy's (from, to)
    donate: bool = False  # the program will not read `tensor` again: a backend may reduce into it
    splits: tuple[int, ...] | None = None  # an uneven all_to_all's rows to each member (dim 0), in group order
    gets: tuple[int, ...] | None = None  # and the rows it receives from each

    @property
    def spec(self) -> tuple | None:
        """What a recv expects (its signature)."""
        return self.sig

    def match_key(self) -> tuple:
        """What every rank's op of one collective call must agree on (an uneven all_to_all's members
        send different rows: all but the rows)."""
        if self.splits is not None:
            return (self.kind, "rows", self.sig[0], self.sig[1], self.sig[2][1:])
        return (self.kind, self.op, self.peer, self.dim, self.split_dim, self.concat_dim, self.sig)

    def describe(self) -> str:
        k = self.kind.value
        if self.kind is CommKind.SEND:
            return f"send of {describe_signature(self.sig)} to rank {self.peer}" + (f" (tag {self.tag})" if self.tag else "")
        if self.kind is CommKind.RECV:
            return f"recv of {describe_signature(self.sig)} from rank {self.peer}" + (f" (tag {self.tag})" if self.tag else "")
        if self.kind is CommKind.COPY:
            return f"copy of {describe_signature(self.sig)} from {self.tiers[0]} to {self.tiers[1]}"
        args = []
        if self.op is not None:
            args.append(self.op.value)
        if self.kind in (CommKind.ALL_GATHER, CommKind.REDUCE_SCATTER) and self.dim:
            args.append(f"dim={self.dim}")
        if self.kind is CommKind.ALL_TO_ALL:
            args.append(f"split_dim={self.split_dim}, concat_dim={self.concat_dim}" if self.splits is None else
                        f"rows sent {list(self.splits)}, received {list(self.gets or ())}")
        if self.kind is CommKind.BROADCAST:
            args.append(f"src={self.peer}")
        if self.kind is CommKind.REDUCE:
            args.append(f"dst={self.peer}")
        data = "" if self.sig is None else f" of {describe_signature(self.sig)}"
        return f"{k}({', '.join(args)}){data}"


class Work:
    """A handle on an issued request; yield it to wait. Backends fill in `done` and `value`."""

    __slots__ = ("op", "sync", "done", "value", "waited", "backend")

    def __init__(self, op: CommOp, sync: bool) -> None:
        self.op = op
        self.sync = sync
        self.done = False
        self.value: Any = None
        self.waited = False
        self.backend: Any = None

    def __repr__(self) -> str:
        state = "done" if self.done else "pending"
        return f"<Work {self.op.describe()} on rank {self.op.rank}, {state}>"


Issue = Callable[[CommOp, bool], Work]


def _reduce_op(op: Any) -> ReduceOp:
    return op if op.__class__ is ReduceOp else ReduceOp(op)


def _check_group(group: Any, rank: int, what: str) -> ProcessGroup:
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{what}: group must be a ProcessGroup (e.g. ctx.mesh.tp), got {type(group).__name__}")
    if rank not in group.ranks:
        raise ValueError(f"{what}: rank {rank} is not a member of group {group}")
    return group


def _rows(rows: Sequence[int], group: ProcessGroup, what: str) -> tuple[int, ...]:
    out = tuple(int(r) for r in rows)
    if len(out) != group.size or any(r < 0 for r in out) or any(int(r) != r for r in rows):
        raise ValueError(f"all_to_all_rows: {what} must be {group.size} whole numbers of rows, none negative "
                         f"(one for each member of {group}), got {list(rows)}")
    return out


def _check_dim(tensor: Any, dim: int, what: str, divisor: int | None = None) -> None:
    shape = shape_of(tensor)
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"{what}: dim {dim} out of range for {describe(tensor)}")
    if divisor is not None and shape[dim] % divisor:
        raise ValueError(f"{what}: dim {dim} of {describe(tensor)} has size {shape[dim]}, "
                         f"not divisible by the group size {divisor}")


class Comm:
    """The communication API a program sees; the same for every backend."""

    def __init__(self, issue: Issue, rank: int, world_size: int) -> None:
        self._issue = issue
        self.rank = rank
        self.world_size = world_size
        self.pending_sync: Work | None = None  # a sync request not yet yielded
        # the emulator's, when folded: issue(op, sync) for a call whose data nobody reads, complete at
        # once where this rank is its group's only simulated member (None otherwise; tape.py's replay)
        self.issue_alone: Issue | None = None
        # two passes run together (parallel/pipeline.py's `together`) take turns at each wait, so every rank must
        # wait where its program does: a replayed block (tape.py) then yields a wait whose work is complete too
        self.every_wait = False

    def _unyielded(self) -> ProgramError:
        return ProgramError(
            f"rank {self.rank}: {self.pending_sync.op.describe()} is a synchronous request that was "
            f"never yielded; write `x = yield ctx.comm.{self.pending_sync.op.kind.value}(...)` "
            f"or pass async_op=True")

    def _submit(self, op: CommOp, async_op: bool) -> Work:
        if self.pending_sync is not None and not self.pending_sync.waited:
            raise self._unyielded()
        work = self._issue(op, not async_op)
        self.pending_sync = None if async_op else work
        return work

    def _group_op(self, kind: CommKind, tensor: Any, group: Any, async_op: bool, stream: str | None,
                  op: ReduceOp | None = None, peer: int | None = None, dim: int = 0, split_dim: int = 0,
                  concat_dim: int = 0, donate: bool = False) -> Work:
        # (the commonest path of every program: the checks' usual outcomes are tested inline first)
        g = group if group.__class__ is ProcessGroup and self.rank in group.ranks else \
            _check_group(group, self.rank, kind.value)
        if tensor.__class__ is MetaTensor:
            sig = tensor.signature
        else:
            sig = None if tensor is None else signature(tensor)  # also a type check with a clear message
        if self.pending_sync is not None and not self.pending_sync.waited:
            raise self._unyielded()
        work = self._issue(CommOp(kind, self.rank, g, tensor, op, peer, dim, split_dim, concat_dim, sig, 0,
                                  stream or "", ("", ""), donate), not async_op)
        self.pending_sync = None if async_op else work
        return work

    def all_reduce(self, tensor: Any, *, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM,
                   async_op: bool = False, stream: str | None = None, donate: bool = False) -> Work:
        """Every rank gets the reduction (SUM, MAX, MIN) of all ranks' tensors. `donate`: the program will
        not read `tensor` again (a gradient bucket, a partial sum), so a backend may reduce in place, as
        torch.distributed does, without copying it first."""
        return self._group_op(CommKind.ALL_REDUCE, tensor, group, async_op, stream, op=_reduce_op(op), donate=donate)

    def reduce_scatter(self, tensor: Any, *, group: ProcessGroup, dim: int = 0, op: ReduceOp = ReduceOp.SUM,
                       async_op: bool = False, stream: str | None = None, donate: bool = False) -> Work:
        """Group rank i gets chunk i (along `dim`) of the reduction of all ranks' tensors (`donate`: as in
        all_reduce)."""
        _check_dim(tensor, dim, "reduce_scatter", _check_group(group, self.rank, "reduce_scatter").size)
        return self._group_op(CommKind.REDUCE_SCATTER, tensor, group, async_op, stream, op=_reduce_op(op), dim=dim,
                              donate=donate)

    def all_gather(self, tensor: Any, *, group: ProcessGroup, dim: int = 0,
                   async_op: bool = False, stream: str | None = None) -> Work:
        """Every rank gets all ranks' tensors concatenated along `dim`, in group order."""
        _check_dim(tensor, dim, "all_gather")
        return self._group_op(CommKind.ALL_GATHER, tensor, group, async_op, stream, dim=dim)

    def all_to_all(self, tensor: Any, *, group: ProcessGroup, split_dim: int = 0, concat_dim: int = 0,
                   async_op: bool = False, stream: str | None = None) -> Work:
        """Chunk j (along split_dim) goes to group rank j; received chunks are concatenated along concat_dim."""
        _check_dim(tensor, split_dim, "all_to_all", _check_group(group, self.rank, "all_to_all").size)
        _check_dim(tensor, concat_dim, "all_to_all")
        return self._group_op(CommKind.ALL_TO_ALL, tensor, group, async_op, stream,
                              split_dim=split_dim, concat_dim=concat_dim)

    def all_to_all_rows(self, tensor: Any, *, group: ProcessGroup, send_rows: Sequence[int], recv_rows: Sequence[int],
                        async_op: bool = False, stream: str | None = None) -> Work:
        """An uneven all-to-all along dim 0 (torch's all_to_all_single with split sizes): the first
        send_rows[0] rows go to group rank 0, the next send_rows[1] to group rank 1, ...; what arrives,
        recv_rows[j] rows from group rank j, joined along dim 0 in group order."""
        g = _check_group(group, self.rank, "all_to_all_rows")
        shape = shape_of(tensor)
        sends, recvs = _rows(send_rows, g, "send_rows"), _rows(recv_rows, g, "recv_rows")
        if not shape or sum(sends) != shape[0]:
            raise ValueError(f"all_to_all_rows: send_rows {list(sends)} add up to {sum(sends)} rows, but the "
                             f"tensor is {describe(tensor)}")
        sig = tensor.signature if tensor.__class__ is MetaTensor else signature(tensor)
        return self._submit(CommOp(CommKind.ALL_TO_ALL, self.rank, g, tensor, sig=sig, stream=stream or "",
                                   splits=sends, gets=recvs), async_op)

    def broadcast(self, tensor: Any, *, group: ProcessGroup, src: int,
                  async_op: bool = False, stream: str | None = None) -> Work:
        """Every rank gets rank `src`'s tensor (src is a global rank; all ranks pass a same-shaped tensor)."""
        g = _check_group(group, self.rank, "broadcast")
        if src not in g:
            raise ValueError(f"broadcast: src rank {src} is not in group {g}")
        return self._group_op(CommKind.BROADCAST, tensor, group, async_op, stream, peer=src)

    def reduce(self, tensor: Any, *, group: ProcessGroup, dst: int, op: ReduceOp = ReduceOp.SUM,
               async_op: bool = False, stream: str | None = None) -> Work:
        """Rank `dst` gets the reduction; the others get None."""
        g = _check_group(group, self.rank, "reduce")
        if dst not in g:
            raise ValueError(f"reduce: dst rank {dst} is not in group {g}")
        return self._group_op(CommKind.REDUCE, tensor, group, async_op, stream, op=_reduce_op(op), peer=dst)

    def barrier(self, *, group: ProcessGroup, async_op: bool = False, stream: str | None = None) -> Work:
        return self._group_op(CommKind.BARRIER, None, group, async_op, stream)

    def _check_peer(self, peer: Any, what: str) -> int:
        if type(peer) is not int or not 0 <= peer < self.world_size:  # (not a bool, not a float)
            raise ValueError(f"{what}: peer rank {peer!r} is not in 0..{self.world_size - 1}")
        if peer == self.rank:
            raise ValueError(f"{what}: rank {self.rank} cannot send to or receive from itself")
        return peer

    def send(self, tensor: Any, *, dst: int, tag: int = 0, async_op: bool = False, stream: str | None = None) -> Work:
        """Point to point; a synchronous send waits until the matching recv is posted."""
        dst = self._check_peer(dst, "send")
        return self._submit(CommOp(CommKind.SEND, self.rank, None, tensor, None, dst, 0, 0, 0, signature(tensor), tag,
                                   stream or ""), async_op)

    def recv(self, *, src: int, like: Any, tag: int = 0, async_op: bool = False, stream: str | None = None) -> Work:
        """Receive a value shaped like `like` (any value or MetaTensor of the expected partial/dtype/shape)."""
        src = self._check_peer(src, "recv")
        return self._submit(CommOp(CommKind.RECV, self.rank, None, None, None, src, 0, 0, 0, signature(like), tag,
                                   stream or ""), async_op)

    def copy(self, tensor: Any, *, src: str, dst: str, async_op: bool = False, stream: str | None = None) -> Work:
        """Move a tensor between this rank's memory tiers ("gpu", "cpu", "nvme"): the same values, in
        another place (torch: `x.to("cpu", non_blocking=True)` on a side stream; NVMe through the host,
        as DeepSpeed's async I/O does). It runs on a copy stream per direction by default, over the
        GPU's PCIe link and the node's NVMe drives (topology/cluster.py)."""
        for name, tier in (("src", src), ("dst", dst)):
            if tier not in TIERS:
                raise ValueError(f"copy: {name} {tier!r} is not a memory tier; valid: {', '.join(TIERS)}")
        if src == dst:
            raise ValueError(f"copy: src and dst are both {src!r}; a copy moves a tensor between two tiers")
        return self._submit(CommOp(CommKind.COPY, self.rank, None, tensor, None, None, 0, 0, 0, signature(tensor), 0,
                                   stream or "", (src, dst)), async_op)
