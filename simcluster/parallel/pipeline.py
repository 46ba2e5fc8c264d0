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
(micro-batch, chunk, direction). After the last pass, each stage all-reduces its gradients over dp
(each pipeline replica is a data-parallel rank) and steps AdamW on its own parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generator, Protocol

import numpy as np

from simcluster.model.gpt import GPT, LOSS_SCALE, init_params
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.data_parallel import DPConfig, begin_step, finish_step, hold_model_state
from simcluster.parallel.pipeline_schedules import Pass, PipelineShape, Schedule, build, check
from simcluster.parallel.pipeline_schedules import splits_weight_gradient
from simcluster.program.context import Context


@dataclass(frozen=True)
class PipelineConfig:
    data: DPConfig = field(default_factory=DPConfig)  # model, batch, micro-batches (m), steps, optimizer
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1  # v, model chunks per stage (interleaved)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.data.zero != 0:
            raise ValueError(f"pipeline parallelism runs with DDP around it (zero=0), not ZeRO-{self.data.zero}")

    def shape(self, stages: int) -> PipelineShape:
        return PipelineShape(stages, self.data.micro_batches, self.virtual)

    def check(self, stages: int) -> None:
        """Clear errors for what this pipeline cannot run on `stages` stages."""
        check(self.schedule, self.shape(stages), self.data.model.layers)
        if self.data.model.tied_head and stages > 1:
            raise ValueError("a tied LM head shares the embedding between the first and the last stage; "
                             "set model.tied_head = false for pipeline parallelism")


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

    def forward(self, j: int, g: int, x: Any) -> Any: ...  # returns the activation (None on the last chunk)

    def backward(self, j: int, g: int, dy: Any) -> Any: ...  # returns the input gradient (None on chunk 0)

    def weight(self, j: int, g: int) -> None: ...

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
                y = work.forward(j, g, x)
            if g < chunks - 1:
                deliver(y, ("F", j, g + 1), rank_of(g + 1), act_tag(j, g))
        elif kind == "B":
            dy = (yield from receive(("B", j, g))) if g < chunks - 1 else None
            with ctx.annotate("backward", f"B{j}"):
                dx = work.backward(j, g, dy)
            if g > 0:
                deliver(dx, ("B", j, g - 1), rank_of(g - 1), grad_tag(j, g - 1))
        else:
            with ctx.annotate("weight_grad", f"W{j}"):
                work.weight(j, g)
    if sends:
        yield sends


class GPTStage:
    """The GPT's chunks on one stage: forward, backward and (ZB-H1) deferred weight gradients."""

    def __init__(self, ctx: Context, cfg: PipelineConfig, weights: dict[str, Any], ranges: list[range],
                 step: int, d: int, n: int, split_w: bool) -> None:
        self.ctx, self.cfg, self.ops = ctx, cfg, ctx.ops
        self.model = GPT(ctx.ops, cfg.data.model, memory=ctx.memory)
        self.weights, self.ranges, self.step, self.d, self.n = weights, ranges, step, d, n
        self.split_w = split_w
        self.chunks = len(ranges)
        self.caches: dict[tuple[int, int], Any] = {}
        self.deferred: dict[tuple[int, int], list] = {}
        self.grads: dict[str, Any] = {}
        self.loss_sum: Any = None
        self.scale = LOSS_SCALE[cfg.data.precision]
        data = cfg.data
        b = data.global_batch // (n * data.micro_batches)
        self.shape = (b, data.model.seq, data.model.hidden)
        self.dtype = "fp32" if data.precision == "fp32" else data.precision

    def message(self) -> Any:
        return MetaTensor(self.shape, self.dtype)

    def _add(self, name: str, g: Any) -> None:
        self.grads[name] = g if name not in self.grads else self.ops.add_partial(self.grads[name], g)

    def forward(self, j: int, g: int, x: Any) -> Any:
        model, data = self.model, self.cfg.data
        where, ids, targets = data.micro_batch(self.step, self.d, self.n, j)
        cache: dict[str, Any] = {"where": where, "blocks": {}}
        if g == 0:
            x, cache["embed"] = model.embed_forward(self.weights, ids, self.step, where)
        for i in self.ranges[g]:
            x, c = model.block_forward(self.weights, x, i, self.step, where)
            cache["blocks"][i] = model._stored(c)
            cache.setdefault("held", 0)
            cache["held"] += model.layer_bytes(x)
        if g == self.chunks - 1:
            part, cache["head"] = model.head_forward(self.weights, x, targets)
            self.loss_sum = part if self.loss_sum is None else self.ops.add_partial(self.loss_sum, part)
            x = None
        self.caches[(j, g)] = cache
        self.ctx.memory.hold("activations", f"mb{j}.chunk{g}", self._bytes(cache))
        return x

    def backward(self, j: int, g: int, dy: Any) -> Any:
        model, cache = self.model, self.caches[(j, g)]
        where = cache["where"]
        defer: list | None = [] if self.split_w else None
        grads: dict[str, Any] = {}
        if g == self.chunks - 1:
            dy, head = model.head_backward(self.weights, cache["head"], where, self.scale, defer)
            grads |= head
        for i in reversed(self.ranges[g]):
            dy = model.block_backward(self.weights, dy, cache["blocks"][i], i, self.step, grads, where, defer)
        if g == 0:
            if defer is None:
                grads |= model.embed_backward(cache["embed"], dy)
            else:
                defer.append(("embed", lambda e=cache["embed"], d=dy: model.embed_backward(e, d)))
            dy = None
        for name, value in grads.items():
            self._add(name, value)
        if defer is None:
            self._release(j, g)
        else:
            self.deferred[(j, g)] = defer
        return dy

    def weight(self, j: int, g: int) -> None:
        for name, thunk in self.deferred.pop((j, g)):
            value = thunk()
            for k, v in (value.items() if isinstance(value, dict) else [(name, value)]):
                self._add(k, v)
        self._release(j, g)

    def _release(self, j: int, g: int) -> None:
        del self.caches[(j, g)]
        self.ctx.memory.release("activations", f"mb{j}.chunk{g}")

    def _bytes(self, cache: dict[str, Any]) -> int:
        return cache.get("held", 0) + sum(self.model._bytes(cache[k]) for k in ("embed", "head") if k in cache)


def stage_parameters(cfg: PipelineConfig, ranges: list[range], chunks_here: list[int]) -> list[str]:
    names = list(cfg.data.model.parameter_shapes())
    last = len(ranges) - 1
    mine = []
    for name in names:
        if name in ("wte", "wpe"):
            owner = 0
        elif name.startswith("lnf.") or name == "head":
            owner = last
        else:
            layer = int(name.split(".")[1])
            owner = next(c for c, r in enumerate(ranges) if layer in r)
        if owner in chunks_here:
            mine.append(name)
    return mine


def pipeline(ctx: Context, cfg: PipelineConfig) -> Generator[Any, Any, dict[str, Any]]:
    ops, pp, dp = ctx.ops, ctx.mesh.pp, ctx.mesh.dp
    s, p = ctx.mesh.coord("pp"), pp.size
    d, n = ctx.mesh.coord("dp"), dp.size
    data, mcfg = cfg.data, cfg.data.model
    data.check(n)
    cfg.check(p)
    shape = cfg.shape(p)
    passes = build(cfg.schedule, shape)[s]
    ranges = partition(mcfg.layers, shape.chunks)
    names = stage_parameters(cfg, ranges, [g for g in range(shape.chunks) if g % p == s])
    full = init_params(ops, mcfg)
    master = {k: full[k] for k in names}
    psi_here = sum(math.prod(mcfg.parameter_shapes()[k]) for k in names)
    state, sizes = hold_model_state(ctx, master, psi_here, data.precision)
    losses: list[Any] = []
    grads: dict[str, Any] = {}
    for step in range(data.steps):
        work = GPTStage(ctx, cfg, begin_step(ctx, master, sizes, data.precision), ranges, step, d, n,
                        splits_weight_gradient(cfg.schedule))
        yield from execute(ctx, passes, work, shape.chunks, pp)
        # data parallelism around the pipeline: this stage's gradients, summed over its replicas
        master, grads, loss = yield from finish_step(ctx, master, work.grads, state, data, dp, step, work.loss_sum)
        if loss is not None:  # the last stage
            losses.append(loss)
    return {"loss": losses, "params": master, "grads": grads, "adam_m": state.m, "adam_v": state.v}


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]]) -> dict[str, Any]:
    """The single-device view: every stage's tensors by name, the loss from the last stage; every
    data-parallel replica of a stage must agree (a differing replica is reported as its own output)."""
    by = {(c["dp"], c["pp"]): r for r, c in zip(results, coords)}
    dp = max(c["dp"] for c in coords) + 1
    pp = max(c["pp"] for c in coords) + 1
    out: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(by[0, pp - 1]["loss"])}
    for kind in ("params", "grads", "adam_m", "adam_v"):
        for s in range(pp):
            for name, value in by[0, s][kind].items():
                out[f"{kind}.{name}"] = value
                for d in range(1, dp):
                    other = by[d, s][kind][name]
                    if np.asarray(other).tobytes() != np.asarray(value).tobytes():
                        out[f"{kind}.{name}@dp{d}"] = other
    return out


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

    def forward(self, j: int, g: int, x: Any) -> Any:
        self._kernel("F", self.cfg.t_f)
        return None if g == self.chunks - 1 else self.message()

    def backward(self, j: int, g: int, dy: Any) -> Any:
        self._kernel("B", self.cfg.t_b if self.split_w else self.cfg.t_b + self.cfg.t_w)
        return None if g == 0 else self.message()

    def weight(self, j: int, g: int) -> None:
        self._kernel("W", self.cfg.t_w)


def uniform_cluster(stages: int, **overrides: Any) -> Any:
    """One node of `stages` GPUs at 1 TFLOP/s, no kernel overhead, no latency: times are exactly t_*."""
    from simcluster.topology.presets import preset

    return preset("dgx-a100", gpus_per_node=stages, peak_tflops=1.0, peak_tflops_fp32=1.0, compute_efficiency=1.0,
                  kernel_overhead_ns=0, nvlink_latency_ns=0, **overrides)


def pipeline_uniform(ctx: Context, cfg: UniformPipeline) -> Generator[Any, Any, None]:
    pp = ctx.mesh.pp
    shape = PipelineShape(pp.size, cfg.micro_batches, cfg.virtual)
    check(cfg.schedule, shape, layers=shape.chunks)
    passes = build(cfg.schedule, shape)[ctx.mesh.coord("pp")]
    work = UniformStage(ctx, cfg, shape.chunks, splits_weight_gradient(cfg.schedule))
    yield from execute(ctx, passes, work, shape.chunks, pp)
