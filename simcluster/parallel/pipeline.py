"""Pipeline parallelism: the model's layers cut into chunks, run by a schedule (pipeline_schedules.py).

Narayanan et al. 2021 (1F1B, interleaved), Huang et al. 2019 (GPipe), Qi et al. 2024 (ZB-H1, ZB-V),
DeepSeek-AI 2024 (DualPipe). Chunk g holds a contiguous run of blocks (the first chunk of a chain
also the embeddings, the last the final norm, the head and the loss) on the stage the schedule's
placement says (stage g mod p, but for ZB-V and DualPipe). Each stage runs its passes in order:

  F(j, g): receive the activation of micro-batch j from the chunk before g (the first: embed the
           tokens), run the chunk's blocks, send the result to the chunk after (the last: the loss);
  B(j, g): receive the gradient from the chunk after g (the last: from its loss), run the chunk's
           backward, send the input gradient to the chunk before;
  W(j, g): the chunk's weight gradients, deferred from B(j, g) (zero-bubble schedules, DualPipe).

Sends are asynchronous and the receive that the next pass needs is posted one pass ahead, so
transfers run on the point-to-point streams while the stage computes. DualPipe's paired passes (a
forward beside a backward) run `together`: each computes while the other's communication is in
flight. Every message has its own tag
(micro-batch, chunk, direction). What a pass computes is the stage's work (`StageWork`): the GPT's
chunks under any layout (composed.py), or identical timed kernels (`UniformPipeline`, for the
schedules' closed forms); the work also says what of a message goes on the wire (`pack`; with
Megatron's scatter/gather, a tp rank's 1/tp of it) and makes it whole on arrival (`unpack`).
"""

from __future__ import annotations

import functools

from dataclasses import dataclass
from collections import deque
from typing import Any, Callable, Generator, Protocol

from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.pipeline_schedules import Pass, PipelineShape, Placement, Schedule, check, deferred, label
from simcluster.parallel.pipeline_schedules import passes as stage_passes, placement
from simcluster.program.context import Context


@functools.lru_cache(maxsize=64)
def _partition(layers: int, chunks: int, embedding: bool, loss: bool) -> tuple[range, ...]:
    slots = partition_uncached(layers + embedding + loss, chunks)
    return tuple(range(max(r.start - embedding, 0), min(r.stop - embedding, layers)) for r in slots)


def partition(layers: int, chunks: int, embedding: bool = False, loss: bool = False) -> list[range]:
    """Contiguous runs of blocks, as even as possible (the first chunks take one more). With `embedding`
    (`loss`), the embedding (the head with its loss) counts as a block in the split, so the first (last)
    chunk holds one block fewer, none where a chunk is one block's worth: Megatron-LM's
    --account-for-embedding-in-pipeline-split (--account-for-loss-in-pipeline-split), and how Llama 3
    405B balanced its pipeline (126 blocks, 16 stages of 8 chunks: the first chunk only the embedding, the
    last only the head and the loss; Dubey et al. 2024, section 3.3.2). (Made once for every stage.)"""
    return list(_partition(layers, chunks, embedding, loss))


def partition_uncached(layers: int, chunks: int) -> list[range]:
    base, extra = divmod(layers, chunks)
    out, start = [], 0
    for c in range(chunks):
        size = base + (1 if c < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


class StageWork(Protocol):
    """What a stage computes for its chunks; the executor does the communication."""

    def forward(self, j: int, g: int, x: Any) -> Generator[Any, Any, Any]: ...  # the activation (None: last chunk)

    def backward(self, j: int, g: int, dy: Any) -> Generator[Any, Any, Any]: ...  # the input gradient (None: first)

    def weight(self, j: int, g: int) -> Generator[Any, Any, None]: ...

    def message(self) -> Any: ...  # what an activation or gradient message looks like on the wire (for recv)

    def pack(self, value: Any) -> Any: ...  # what of an activation or gradient goes on the wire

    def unpack(self, message: Any) -> Generator[Any, Any, Any]: ...  # the activation or gradient again


def execute(ctx: Context, passes: list[Pass], work: StageWork, place: Placement, stages: Any,
            passes_of: Callable[[int], list[Pass]], pairs: frozenset[int] = frozenset()) -> Generator[Any, Any, None]:
    """Run one stage's passes: the pipeline's communication around the stage's work. `passes_of(q)`
    gives stage q's passes: receives from q are posted in the order q sends (NCCL matches a pair's
    messages in order, not by tag), each at the latest one pass before it is needed. Pass i runs
    `together` with pass i + 1 where `pairs` holds i (DualPipe's, pipeline_schedules.pairs)."""
    chunks, here = place.chunks, stages.rank_of(ctx.rank)
    rank_of = lambda g: stages.ranks[place.stage[g]]  # noqa: E731
    act_tag = lambda j, g: 2 * (j * chunks + g)  # noqa: E731  activation of chunk g, micro-batch j
    grad_tag = lambda j, g: 2 * (j * chunks + g) + 1  # noqa: E731  gradient into chunk g
    prev, after = place.prev, place.next
    posted: dict[tuple[str, int, int], Any] = {}
    local: dict[tuple[str, int, int], Any] = {}  # neighbouring chunks on this same stage
    sends: list[Any] = []
    queues: dict[int, deque[tuple[str, int, int]]] = {}  # by stage: what it sends here, in its order

    def sent_here(q: int) -> deque[tuple[str, int, int]]:
        if q not in queues:
            queues[q] = deque()
            for kind, j, g in passes_of(q):
                to = after(g) if kind == "F" else prev(g) if kind == "B" else None
                if to is not None and place.stage[to] == here:
                    queues[q].append((kind, j, to))
        return queues[q]

    def post(op: Pass) -> None:
        kind, j, g = op
        src = prev(g) if kind == "F" else after(g) if kind == "B" else None
        if src is None or place.stage[src] == here:
            return
        queue = sent_here(place.stage[src])
        while (kind, j, g) not in posted:
            # (a message its sender never sends is posted all the same: the run reports the deadlock)
            k, i, c = queue.popleft() if queue else (kind, j, g)
            source = prev(c) if k == "F" else after(c)
            posted[(k, i, c)] = ctx.comm.recv(src=rank_of(source), like=work.message(), async_op=True,
                                              tag=act_tag(i, source) if k == "F" else grad_tag(i, c))

    def receive(key: tuple[str, int, int]) -> Generator[Any, Any, Any]:
        if key in local:
            return local.pop(key)
        return (yield from work.unpack((yield posted.pop(key))))

    def deliver(value: Any, key: tuple[str, int, int], dst: int, tag: int) -> None:
        if dst == ctx.rank:
            local[key] = value
        else:
            sends.append(ctx.comm.send(work.pack(value), dst=dst, tag=tag, async_op=True))

    several = len({g for _, _, g in passes}) > 1  # chunks on this stage: name each pass's (F3.5)

    def run(kind: str, j: int, g: int) -> Generator[Any, Any, tuple | None]:
        """One pass; the message it sends on (deliver's arguments), if any."""
        before, then = prev(g), after(g)
        if kind == "F":
            x = (yield from receive(("F", j, g))) if before is not None else None
            with ctx.annotate("forward", label("F", j, g, several)):
                y = yield from work.forward(j, g, x)
            return (y, ("F", j, then), rank_of(then), act_tag(j, g)) if then is not None else None
        if kind == "B":
            dy = (yield from receive(("B", j, g))) if then is not None else None
            with ctx.annotate("backward", label("B", j, g, several)):
                dx = yield from work.backward(j, g, dy)
            return (dx, ("B", j, before), rank_of(before), grad_tag(j, before)) if before is not None else None
        with ctx.annotate("weight_grad", label("W", j, g, several)):
            yield from work.weight(j, g)
        return None

    if passes:
        post(passes[0])
    i = 0
    while i < len(passes):
        n = 2 if i in pairs else 1
        for ahead in passes[i + 1:i + n + 1]:
            post(ahead)  # the next pass's input arrives while this one computes (a pair's both, first)
        if n == 2:
            messages = yield from together(ctx, run(*passes[i]), run(*passes[i + 1]))
        else:
            messages = [(yield from run(*passes[i]))]
        for message in messages:  # (a pair's after both, in pass order: the order its receivers post them in)
            if message is not None:
                deliver(*message)
        i += n
    if sends:
        yield sends


def together(ctx: Context, first: Generator[Any, Any, Any], second: Generator[Any, Any, Any]) -> Generator[Any, Any, list]:
    """Two passes run as one, as DualPipe runs a forward beside a backward: each computes until it waits for
    communication (the request already issued), then the other computes while that is in flight; the wait
    comes when the other next waits. The turns fall at the programs' own waits, so every rank of a group
    issues its collectives in the same order (a replayed block yields every wait it recorded: comm.every_wait).
    Each pass keeps its own stream and label. Kernels go on one compute stream as they come: what is
    overlapped is one pass's communication with the other's compute, not two passes' kernels. Returns
    what each returned."""
    passes, live = [first, second], [True, True]
    sent: list[Any] = [None, None]
    results: list[Any] = [None, None]
    waits: list[Any] = [None, None]  # what a pass waits for, issued and not yet yielded
    outer = ctx.issuing
    where = [outer, outer]
    every_wait, ctx.comm.every_wait = ctx.comm.every_wait, True
    try:
        turn = 0
        while live[0] or live[1]:
            if not live[turn]:
                turn ^= 1
                continue
            if waits[turn] is not None:
                sent[turn], waits[turn] = (yield waits[turn]), None
            ctx.issuing = where[turn]
            try:
                waits[turn] = passes[turn].send(sent[turn])
            except StopIteration as stop:
                live[turn], results[turn] = False, stop.value
            finally:
                where[turn], ctx.issuing = ctx.issuing, outer
            ctx.comm.pending_sync = None  # (a synchronous request waited for at the pass's next turn)
            turn ^= 1
    finally:
        ctx.comm.every_wait = every_wait
    return results


@dataclass(frozen=True)
class UniformPipeline:
    """A pipeline of identical stages, for the schedules' closed forms and pictures: every stage's
    forward takes t_f ns per micro-batch, its input-gradient backward t_b, its weight gradient t_w
    (a W pass of its own where the schedule defers it, part of B otherwise); a chunk takes its share
    of a stage's layers of that (1/v interleaved, 1/2 ZB-V, all of it for each of DualPipe's copies).
    A micro-batch's activations on a chunk are ACTIVATION bytes times that share, held from its F pass
    to the end of its backward (B, or W where deferred), so memory peaks count micro-batches in flight. Messages carry no bytes, so communication costs only what the cluster's latency says."""

    micro_batches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1
    group: int = 0  # the interleaved schedule's N (PipelineShape.group)
    t_f: int = 1000
    t_b: int = 1000
    t_w: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))


ACTIVATION = 2520  # bytes per micro-batch per stage's layers: whole bytes for a chunk of 1/2 .. 1/10 of them


class UniformStage:
    def __init__(self, ctx: Context, cfg: UniformPipeline, place: Placement, split: set[tuple[int, int]]) -> None:
        self.ops, self.cfg, self.place, self.split = ctx.ops, cfg, place, split
        self.share = ctx.mesh.pp.size / place.pieces  # of a stage's layers, in each chunk
        self.memory = ctx.memory

    def _kernel(self, name: str, ns: int) -> None:
        self.ops.kernel(name, flops=ns * self.share * 1e3, nbytes=0)  # the cluster runs 1 FLOP per ps

    def message(self) -> Any:
        return MetaTensor((0,), "bf16")

    def pack(self, value: Any) -> Any:
        return value

    def unpack(self, message: Any) -> Generator[Any, Any, Any]:
        return message
        yield

    def forward(self, j: int, g: int, x: Any) -> Generator[Any, Any, Any]:
        self._kernel("F", self.cfg.t_f)
        self.memory.hold("activations", f"mb{j}.{g}", round(ACTIVATION * self.share))
        return None if self.place.next(g) is None else self.message()
        yield  # a generator, like every stage's work

    def backward(self, j: int, g: int, dy: Any) -> Generator[Any, Any, Any]:
        self._kernel("B", self.cfg.t_b if (j, g) in self.split else self.cfg.t_b + self.cfg.t_w)
        if (j, g) not in self.split:
            self.memory.release("activations", f"mb{j}.{g}")
        return None if self.place.prev(g) is None else self.message()
        yield

    def weight(self, j: int, g: int) -> Generator[Any, Any, None]:
        self._kernel("W", self.cfg.t_w)
        self.memory.release("activations", f"mb{j}.{g}")
        return
        yield


def uniform_cluster(stages: int, **overrides: Any) -> Any:
    """One node of `stages` GPUs at 1 TFLOP/s, no kernel overhead, no latency: times are exactly t_*."""
    from simcluster.topology.presets import preset

    return preset("dgx-a100", gpus_per_node=stages, peak_tflops=1.0, peak_tflops_fp32=1.0, compute_efficiency=1.0,
                  kernel_overhead_ns=0, nvlink_latency_ns=0, collectives="alpha-beta", **overrides)


def pipeline_uniform(ctx: Context, cfg: UniformPipeline) -> Generator[Any, Any, None]:
    pp = ctx.mesh.pp
    shape = PipelineShape(pp.size, cfg.micro_batches, cfg.virtual, cfg.group)
    place = placement(cfg.schedule, shape)
    check(cfg.schedule, shape, layers=place.pieces)
    passes = stage_passes(cfg.schedule, shape, ctx.mesh.coord("pp"))
    work = UniformStage(ctx, cfg, place, deferred(passes))
    yield from execute(ctx, passes, work, place, pp, lambda q: stage_passes(cfg.schedule, shape, q))
