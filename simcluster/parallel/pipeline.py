"""Pipeline parallelism: the model's layers cut into p*v chunks, run by a schedule (pipeline_schedules.py).

Narayanan et al. 2021 (1F1B, interleaved), Huang et al. 2019 (GPipe), Qi et al. 2024 (ZB-H1).
Chunk g holds a contiguous run of blocks (chunk 0 also the embeddings, the last chunk the final norm,
the head and the loss) and lives on stage g mod p. Each stage runs its list of passes in order:

  F(j, g): receive the activation of micro-batch j from chunk g-1 (chunk 0: embed the tokens),
           run the chunk's blocks, send the result to chunk g+1 (the last chunk: the loss);
  B(j, g): receive the gradient from chunk g+1 (the last chunk: from its loss), run the chunk's
           backward, send the input gradient to chunk g-1;
  W(j, g): ZB-H1 only: the chunk's weight gradients, deferred from B(j, g).

Sends are asynchronous and the receive that the next pass needs is posted one pass ahead, so
transfers run on the point-to-point streams while the stage computes. Every message has its own tag
(micro-batch, chunk, direction). What a pass computes is the stage's work (`StageWork`): the GPT's
chunks under any plan (composed.py), or identical timed kernels (`UniformPipeline`, for the
schedules' closed forms).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generator, Protocol

from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.pipeline_schedules import Pass, PipelineShape, Schedule, check, passes as stage_passes
from simcluster.parallel.pipeline_schedules import splits_weight_gradient
from simcluster.program.context import Context


def partition(layers: int, chunks: int) -> list[range]:
    """Contiguous runs of blocks, as even as possible (the first chunks take one more)."""
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

    def backward(self, j: int, g: int, dy: Any) -> Generator[Any, Any, Any]: ...  # the input gradient (None: chunk 0)

    def weight(self, j: int, g: int) -> Generator[Any, Any, None]: ...

    def message(self) -> Any: ...  # what an activation or gradient message looks like (for recv)


def execute(ctx: Context, passes: list[Pass], work: StageWork, chunks: int, stages: Any) -> Generator[Any, Any, None]:
    """Run one stage's passes: the pipeline's communication around the stage's work."""
    rank_of = lambda g: stages.ranks[g % stages.size]  # noqa: E731
    act_tag = lambda j, g: 2 * (j * chunks + g)  # noqa: E731  activation of chunk g, micro-batch j
    grad_tag = lambda j, g: 2 * (j * chunks + g) + 1  # noqa: E731  gradient into chunk g
    posted: dict[tuple[str, int, int], Any] = {}
    local: dict[tuple[str, int, int], Any] = {}  # neighbouring chunks on this same stage (p = 1)
    sends: list[Any] = []

    def post(op: Pass) -> None:
        kind, j, g = op
        if kind == "F" and g > 0 and rank_of(g - 1) != ctx.rank:
            posted[("F", j, g)] = ctx.comm.recv(src=rank_of(g - 1), like=work.message(), tag=act_tag(j, g - 1),
                                                async_op=True)
        elif kind == "B" and g < chunks - 1 and rank_of(g + 1) != ctx.rank:
            posted[("B", j, g)] = ctx.comm.recv(src=rank_of(g + 1), like=work.message(), tag=grad_tag(j, g),
                                                async_op=True)

    def receive(key: tuple[str, int, int]) -> Generator[Any, Any, Any]:
        if key in local:
            return local.pop(key)
        return (yield posted.pop(key))

    def deliver(value: Any, key: tuple[str, int, int], dst: int, tag: int) -> None:
        if dst == ctx.rank:
            local[key] = value
        else:
            sends.append(ctx.comm.send(value, dst=dst, tag=tag, async_op=True))

    if passes:
        post(passes[0])
    for i, (kind, j, g) in enumerate(passes):
        if i + 1 < len(passes):
            post(passes[i + 1])  # the next pass's input arrives while this one computes
        if kind == "F":
            x = (yield from receive(("F", j, g))) if g > 0 else None
            with ctx.annotate("forward", f"F{j}"):
                y = yield from work.forward(j, g, x)
            if g < chunks - 1:
                deliver(y, ("F", j, g + 1), rank_of(g + 1), act_tag(j, g))
        elif kind == "B":
            dy = (yield from receive(("B", j, g))) if g < chunks - 1 else None
            with ctx.annotate("backward", f"B{j}"):
                dx = yield from work.backward(j, g, dy)
            if g > 0:
                deliver(dx, ("B", j, g - 1), rank_of(g - 1), grad_tag(j, g - 1))
        else:
            with ctx.annotate("weight_grad", f"W{j}"):
                yield from work.weight(j, g)
    if sends:
        yield sends


@dataclass(frozen=True)
class UniformPipeline:
    """A pipeline of identical stages, for the schedules' closed forms and pictures: every stage's
    forward takes t_f ns per micro-batch, its input-gradient backward t_b, its weight gradient t_w
    (split into a W pass by ZB-H1, part of B otherwise); with v chunks per stage each takes 1/v of
    that. Messages carry no bytes, so communication costs only what the cluster's latency says."""

    micro_batches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1
    t_f: int = 1000
    t_b: int = 1000
    t_w: int = 1000

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))


class UniformStage:
    def __init__(self, ctx: Context, cfg: UniformPipeline, chunks: int, split_w: bool) -> None:
        self.ops, self.cfg, self.split_w = ctx.ops, cfg, split_w
        self.chunks = chunks
        self.rate = 1.0  # FLOP per ns: the run's cluster is set to 1 TFLOP/s at full efficiency

    def _kernel(self, name: str, ns: int) -> None:
        self.ops.kernel(name, flops=ns / self.cfg.virtual * 1e3, nbytes=0)

    def message(self) -> Any:
        return MetaTensor((0,), "bf16")

    def forward(self, j: int, g: int, x: Any) -> Generator[Any, Any, Any]:
        self._kernel("F", self.cfg.t_f)
        return None if g == self.chunks - 1 else self.message()
        yield  # a generator, like every stage's work

    def backward(self, j: int, g: int, dy: Any) -> Generator[Any, Any, Any]:
        self._kernel("B", self.cfg.t_b if self.split_w else self.cfg.t_b + self.cfg.t_w)
        return None if g == 0 else self.message()
        yield

    def weight(self, j: int, g: int) -> Generator[Any, Any, None]:
        self._kernel("W", self.cfg.t_w)
        return
        yield


def uniform_cluster(stages: int, **overrides: Any) -> Any:
    """One node of `stages` GPUs at 1 TFLOP/s, no kernel overhead, no latency: times are exactly t_*."""
    from simcluster.topology.presets import preset

    return preset("dgx-a100", gpus_per_node=stages, peak_tflops=1.0, peak_tflops_fp32=1.0, compute_efficiency=1.0,
                  kernel_overhead_ns=0, nvlink_latency_ns=0, **overrides)


def pipeline_uniform(ctx: Context, cfg: UniformPipeline) -> Generator[Any, Any, None]:
    pp = ctx.mesh.pp
    shape = PipelineShape(pp.size, cfg.micro_batches, cfg.virtual)
    check(cfg.schedule, shape, layers=shape.chunks)
    passes = stage_passes(cfg.schedule, shape, ctx.mesh.coord("pp"))
    work = UniformStage(ctx, cfg, shape.chunks, splits_weight_gradient(cfg.schedule))
    yield from execute(ctx, passes, work, shape.chunks, pp)
