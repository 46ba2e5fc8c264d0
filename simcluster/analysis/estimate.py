"""The planner's closed-form estimate of a layout (`simcluster plan`'s first stage): memory per GPU
and step time, from which it chooses what to simulate.

Memory: model states by ZeRO stage (Rajbhandari et al. 2020); activations by Korthikanti et al. 2022,
times the micro-batches a first stage holds: p for 1F1B, p(1 + (p-1)/pv) interleaved (Narayanan et al.
2021); for ZB-H1 and ZB-V, which hold a micro-batch to its W pass, each stage's pieces as often as its
passes hold them, the LM head's cache with the last; or, if more, the optimizer step's fp32 copy of the
gradients it updates, 4 bytes each in mixed precision. Time: the busiest stage's hardware FLOPs (its
layers, the last one's LM head too) at the device's achievable rate, stretched by the pipeline bubble:
(p-1)/m for 1F1B, (p-1)/(mv) interleaved, and with the passes' times taken equal (T_F = T_B = T_W),
(p-1)(T_F + T_B - T_W) / 3m T_F = (p-1)/3m for ZB-H1 and (p-1) T_F/2 / 3m T_F = (p-1)/6m for ZB-V
(Qi et al. 2023; tests/test_pipeline.py checks those bubbles on the simulator), plus the
tensor-parallel collectives on the critical path, the context-parallel exchanges (Ulysses'
all-to-alls, all-gather KV's gathers, the ring's transfers beyond what each block's attention hides),
ZeRO-3's gathers, the gradients' sums and copies where no GEMM accumulates them, and what the
data-parallel gradient reduction leaves exposed after the backward pass.
A mixture of experts: its experts' states an ep-th a rank, sharded by ZeRO over the dp/ep ranks holding
them, its routed activations (activations.moe_activations), and expert parallelism's all-to-all (or
all-gather and reduce-scatter).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.model.activations import MLP_KIND, layer_activations, moe_activations
from simcluster.model.config import Recompute
from simcluster.model.flops import forward_per_token, op_recomputed, step_flops
from simcluster.model.precision import model_state_bytes
from simcluster.numerics.tensor import ITEMSIZE
from simcluster.parallel.pipeline import partition
from simcluster.parallel.pipeline_schedules import deferred, passes as stage_passes, placement
from simcluster.program.comm import CommKind
from simcluster.program.mesh import DeviceMesh
from simcluster.run.job import parallelism_of
from simcluster.topology import nccl

# The pipeline schedules searched, each with its bubble as a share of (p-1)/(mv) (the module docstring)
BUBBLE = {"1f1b": 1, "interleaved": 1, "zb-h1": 3, "zb-v": 6}
DEFERRING = ("zb-h1", "zb-v")  # schedules whose W passes hold a micro-batch's activations after its B


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    cp: int
    dp: int
    zero: int
    micro_batch: int
    recompute: str
    schedule: str
    virtual: int
    sp: int = 1  # sequence parallelism with tp (1: on; 0: off, as Megatron-LM before 2022)
    ep: int = 1  # expert parallelism (a mixture of experts), carved out of dp
    dispatcher: str = "alltoall"  # how ep moves the tokens (parallel.moe_dispatcher)

    def label(self) -> str:
        sched = "" if self.pp == 1 else (f" interleaved v{self.virtual}" if self.schedule == "interleaved" else
                                         " " + self.schedule.upper())
        sp = " no-SP" if self.tp > 1 and not self.sp else ""
        if self.ep > 1:  # (EP where CP would be, the line as long, unless there is cp too)
            ag = " allgather" if self.dispatcher == "allgather" else ""
            return f"TP{self.tp}{sp} PP{self.pp}{sched}{f' CP{self.cp}' if self.cp > 1 else ''} DP{self.dp} EP{self.ep}{ag}"
        return f"TP{self.tp}{sp} PP{self.pp}{sched} CP{self.cp} DP{self.dp}"

    def scenario(self, sc: Scenario) -> Scenario:
        return replace(sc, variants=(), model=replace(sc.model, micro_batch=self.micro_batch),
                       parallel=replace(sc.parallel, tp=self.tp, pp=self.pp, cp=self.cp, dp=self.dp, zero=self.zero,
                                        recompute=self.recompute, schedule=self.schedule,
                                        virtual_stages=self.virtual, sp=self.tp > 1 and bool(self.sp), ep=self.ep,
                                        moe_dispatcher=self.dispatcher,  # (the overlap needs sp where tp > 1)
                                        tp_comm_overlap=sc.parallel.tp_comm_overlap and (self.tp == 1 or bool(self.sp))))


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    memory_bytes: float
    seconds: float


def estimate(sc: Scenario, layout: Layout) -> Estimate | None:
    """The closed-form memory and time of a layout (module docstring); None if the parallelism refuses it."""
    lsc = layout.scenario(sc)
    try:
        parallelism = parallelism_of(lsc, DeviceMesh(dp=layout.dp, pp=layout.pp, cp=layout.cp, tp=layout.tp,
                                                     ep=layout.ep))
    except (ScenarioError, ValueError):
        return None
    spec = lsc.cluster_spec()
    model, data = parallelism.model, parallelism.data
    t, p, c, v, e = layout.tp, layout.pp, layout.cp, layout.virtual, layout.ep
    m = data.micro_batches
    shapes = model.parameter_shapes()
    # a layer's parameters on a rank, an average layer's: a mixture of experts' experts (3-d) an ep-th each
    dense = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.") and len(s) < 3) / model.layers / t
    experts = sum(math.prod(s) for s in shapes.values() if len(s) == 3) / model.layers / e  # (whole on tp ranks)
    edge = model.vocab * model.hidden / t  # the embedding (first stage) or the head (last; one stage: both)
    psi = math.ceil(model.layers / p) * (dense + experts) + edge * (2 if p == 1 and not model.tied_head else 1)
    expert_psi = math.ceil(model.layers / p) * experts
    # what the fullest stage holds: ZB-V's first stage has the embedding and the head (its V's two ends)
    held_psi = psi + (edge if layout.schedule == "zb-v" and p > 1 and not model.tied_head else 0.0)
    n = layout.dp * c  # ZeRO shards over dp x cp (a mixture of experts' experts over the dp/ep holding them)
    spread = c * (t if layout.sp else 1)  # the ranks sharing out a sequence's tokens
    edp = layout.dp * c * t // e  # the ranks holding the same experts (mesh.expert_groups)
    state = model_state_bytes(1, data.precision, data.grads_fp32)

    def sharded(count: float, over: int) -> tuple[float, float]:
        """`count` parameters' model states sharded by ZeRO over `over` ranks, and the optimizer step's fp32
        copy of their gradients (mixed precision: 4 bytes an owned parameter, dp_wrap.py)."""
        shard = {0: (1, 1, 1), 1: (1, 1, over), 2: (1, over, over), 3: (over, over, over)}[layout.zero]
        states = count * (state["parameters"] / shard[0] + state["gradients"] / shard[1] + state["optimizer"] / shard[2])
        return states, 0.0 if data.precision == "fp32" or data.grads_fp32 else 4 * count / shard[2]
    (dense_states, dense_step), (expert_states, expert_step) = (sharded(held_psi - expert_psi, n),
                                                                sharded(expert_psi, edp))
    kept = layer_activations(s=model.seq // c, b=layout.micro_batch, h=model.hidden, a=model.heads, t=t,
                             sp=t > 1 and bool(layout.sp), recompute=layout.recompute, dtype=model.dtype,
                             attention_kernel=model.attention_kernel, kv=model.kv_heads, f=model.ffn_hidden,
                             mlp=MLP_KIND[model.arch], fused=model.fused_kernels, gqa=model.gqa,
                             dropout=model.dropout > 0)
    if model.moe_experts and layout.recompute != "full":
        kept = moe_activations(kept, model, b=layout.micro_batch, parts=spread)
    act = sum(kept.values())
    if layout.schedule in DEFERRING:  # each stage's pieces, as many as its passes hold at once
        place = placement(parallelism.schedule, parallelism.shape(p))
        sizes = [len(r) for r in partition(model.layers, place.pieces, parallelism.embedding_in_split,
                                           parallelism.loss_in_split)]
        # the LM head's cache: its logits' exponentials (b, s/c, V/t; fp32, the cross-entropy's; a fused one's: the
        # logits as they are) and its input before and after the norm
        logit = ITEMSIZE[model.dtype] if model.loss_kernel == "fused" else 4
        head = layout.micro_batch * model.seq / c * (logit * model.vocab / t + 2 * model.hidden * ITEMSIZE[model.dtype])
        held = max(sum(count * (sizes[piece] * act + (head if piece == place.pieces - 1 else 0.0))
                       for piece, count in stage) for stage in _held(parallelism.schedule, parallelism.shape(p)))
    else:
        in_flight = min(m, p)
        if layout.schedule == "interleaved" and p > 1:  # stage 0's warm-up and one more, 1/v of a stage each
            n = parallelism.shape(p).together  # (N = p: p + (p - 1)/v)
            in_flight = min(m * v, 2 * (p - 1) + (v - 1) * n + 1) / v
        held = act * math.ceil(model.layers / p) * in_flight
    # the larger of the backward's activations and the optimizer step's fp32 gradients (dp_wrap.py)
    memory = dense_states + expert_states + max(held, dense_step + expert_step)

    tokens = data.global_batch * model.seq
    hardware = step_flops(replace(model, recompute=layout.recompute), tokens)[1]
    rate = spec.gemm_tflops * 1e12  # the FLOPs are GEMMs', nearly all
    busiest = _busiest(model, parallelism.schedule, parallelism.shape(p), parallelism.embedding_in_split,
                       parallelism.loss_in_split)
    compute = hardware * p * busiest / (spec.world_size * rate) * (1 + (p - 1) / (m * v * BUBBLE[layout.schedule]))
    nvlink = spec.nvlink_bytes_per_ns * 1e9
    if spec.torus:  # a ring along a torus line: its links, both ways where they wrap around (phases.py)
        nvlink = spec.ici_gbyte_per_s * 1e9 * (2 if spec.torus_wraps else 1)
    # forward, backward, and the forward again (the per-op policy: half of it, the norms' all-gathers with
    # sp, wo's all-reduce without)
    passes = {"full": 3.0, "op": 2.5}.get(layout.recompute, 2.0)
    message = layout.micro_batch * model.seq / c * model.hidden * 2  # a layer's activations, 16-bit
    calls = passes * 2 * math.ceil(model.layers / p) * m  # two all-reduces a layer a pass, on the busiest stage
    tp_comm = 0.0 if t == 1 else calls * _call(spec, CommKind.ALL_REDUCE, [(2 * (t - 1), nccl.NVLINK)],
                                               2 * (t - 1) / t * message / nvlink, 1, t, message)
    # the backward's input-gradient reductions (one of each pass's two a layer): under the weight gradients with
    # the async backward, else exposed; the rest, with the overlap, in pieces under the GEMMs (tensor_parallel.py),
    # about one piece of t alone, and those reductions too where each is one GEMM's (the GPT's fused QKV and fc1)
    backward = 0.0 if lsc.parallel.tp_async_backward else 1 / (2 * passes)
    if lsc.parallel.tp_comm_overlap:
        pieces, exposed = (backward, 0.0) if model.arch == "gpt" else (0.0, backward)
        tp_comm *= exposed + (1 - 1 / (2 * passes) + pieces) / t
    else:
        tp_comm *= 1 - 1 / (2 * passes) + backward
    # the data-parallel group (dp x cp, the outermost axes) leaves the node once the mesh does
    across = nvlink if spec.torus or spec.world_size <= spec.gpus_per_node else \
        _rings_rate(spec, nvlink, _per_node(spec.gpus_per_node, t, c, p))
    gathers = 0.0
    if layout.zero == 3:  # every micro-batch's forward and backward gather the stage's weights
        gathers = 2 * m * 2 * psi * (n - 1) / n / across
    # the context-parallel group (stride tp): inside a node while tp x cp fits one, else over k nodes
    nodes = 1 if spec.torus or t * c <= spec.gpus_per_node else t * c // spec.gpus_per_node
    exchange = _context_exchange(lsc.parallel.attention, layout, model, spec, nvlink, nodes) * model.layers / p * m
    # expert parallelism's all-to-all: a rank's routed rows for other ranks' experts, out and back, a
    # forward (twice under full recomputation) and a backward, each MoE layer of the busiest stage (the ep
    # group: dp ranks, a stride of pp cp tp apart, inside a node while ep of them fit one); the all-gather
    # dispatcher's gathers and reduce-scatters move e - 1 peers' tokens instead, whatever k
    if e > 1:
        tokens = layout.micro_batch * model.seq / spread
        rows = tokens * (e - 1) if layout.dispatcher == "allgather" else tokens * model.moe_top_k * (e - 1) / e
        link = nvlink if e * p * c * t <= spec.gpus_per_node else spec.nic_bytes_per_ns * 1e9
        exchange += passes * 2 * rows * model.hidden * 2 / link * math.ceil(model.layers / p) * m
    accumulation = _accumulation(lsc, layout, psi, m) / (spec.hbm_gbyte_per_s * 1e9 * spec.memory_efficiency)
    return Estimate(layout, memory, compute + tp_comm + exchange + gathers + accumulation
                    + _reduction(sc, layout, psi - expert_psi, n, m, across, compute)
                    + _reduction(sc, layout, expert_psi, edp, m, across, compute))


@functools.lru_cache(maxsize=1024)
def _held(schedule: Any, shape: Any) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per stage, (piece, the most micro-batches of it that the stage holds at once), a micro-batch
    held from its F pass to its B pass, or to its W pass where the schedule defers that (zero-bubble
    schedules: the piece's activations wait for the weight gradients, the last piece's LM head too)."""
    place = placement(schedule, shape)
    out = []
    for stage in range(shape.stages):
        mine = stage_passes(schedule, shape, stage)
        split = deferred(mine)
        now: dict[int, int] = {}
        most: dict[int, int] = {}
        for kind, j, g in mine:
            piece = place.piece[g]
            if kind == "F":
                now[piece] = now.get(piece, 0) + 1
                most[piece] = max(most.get(piece, 0), now[piece])
            elif kind == "W" or (j, g) not in split:
                now[piece] -= 1
        out.append(tuple(sorted(most.items())))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def _busiest(model: Any, schedule: Any, shape: Any, embedding: bool = False, loss: bool = False) -> float:
    """The busiest pipeline stage's share of a step's hardware FLOPs (1/p where the layers and the head
    split evenly): its chunks' layers (the first chunks take one more: pipeline.py's partition, with the
    embedding and the loss counted as layers where `embedding`, `loss`) and, on the last chunk's stage,
    the LM head. A pipeline runs at its busiest stage's pace."""
    layers, core, head = forward_per_token(model)
    again = {Recompute.NONE: 0.0, Recompute.SELECTIVE: core, Recompute.FULL: layers + core,
             Recompute.OP: op_recomputed(model)}[model.recompute]
    per_layer = (3 * (layers + core) + again) / model.layers
    place = placement(schedule, shape)
    sizes = [len(r) for r in partition(model.layers, place.pieces, embedding, loss)]
    work = [0.0] * shape.stages
    for g in range(place.chunks):  # (DualPipe holds each piece twice, each copy for half the micro-batches)
        piece = place.piece[g]
        chunk = sizes[piece] * per_layer + (3 * head if piece == place.pieces - 1 else 0.0)
        work[place.stage[g]] += chunk * place.pieces / place.chunks
    return max(work) / sum(work)


def _context_exchange(attention: str, layout: Layout, model: Any, spec: Any, nvlink: float, nodes: int) -> float:
    """The exposed time of one layer's context-parallel exchanges for one micro-batch (forward, its
    recomputation under full recompute, backward), the cp group spread over `nodes` nodes (its ranks
    talk over NVLink inside one, each over its own NIC between them). With x the bytes of this
    rank's queries (b s/c h/t, 16-bit) and kv of its keys (or values, repeated for the query heads unless
    model.gqa = "native"): Ulysses all-to-alls q, k, v
    and the output each way, (c-1)/c of 2x + 2kv, of which (k-1)/k leaves the node; all-gather KV
    gathers (c-1) kv of keys and of values (hierarchically: (k-1) kv through each NIC, then the rest
    inside the node) and reduce-scatters their gradients back; the ring passes keys and values c-1
    steps (and their gradients' accumulators too in the backward pass) at the slowest hop's rate,
    each hidden under that step's block of attention at the device's GEMM rate and exposed only
    beyond it; RSA's forward passes hide as the ring's, and its backward's passes and two
    whole-sequence all-reduces are exposed."""
    c, t, k = layout.cp, layout.tp, nodes
    if c == 1:
        return 0.0
    nic = spec.nic_bytes_per_ns * 1e9

    def gather(v: float) -> float:  # an all-gather (or reduce-scatter) of c blocks of v bytes
        if k > 1 and c > k and spec.collectives == "nccl":  # NCCL's rings (phases.nccl_ring)
            return (c - 1) * v / _rings_rate(spec, nvlink, c // k)
        # hierarchical over k nodes (topology/phases.py): a ring per local index across the nodes,
        # then one inside each node on the k blocks each member has
        return (k - 1) * v / nic + (c // k - 1) * k * v / nvlink

    b, s, d = layout.micro_batch, model.seq // c, model.head_dim
    x = b * s * model.heads // t * d * 2
    # (grouped-query attention's kv heads travel as they are with model.gqa = "native", repeated otherwise)
    kv = b * s * (max(model.kv_heads // t, 1) if model.gqa == "native" else model.heads // t) * d * 2
    passes = (2 if layout.recompute == "full" else 1) + 1  # forwards and the backward
    link = nccl.NET if k > 1 else nccl.NVLINK
    if attention == "ulysses":  # q, k, v and the output: four all-to-alls a pass
        return passes * sum(_call(spec, CommKind.ALL_TO_ALL, [(1, link)], max((c // k - 1) / c * size / nvlink,
                                                                              (k - 1) / k * size / nic), k, c / k)
                            for size in (x, x, kv, kv))
    if attention == "allgather":  # keys and values, each all-gathered (their gradients reduce-scattered)
        steps = [(k - 1, nccl.NET), (c // k - 1, nccl.NVLINK)] if k > 1 else [(c - 1, nccl.NVLINK)]
        return passes * 2 * _call(spec, CommKind.ALL_GATHER, steps, gather(kv), k, c / k)
    # a block: this rank's queries against one rank's keys, two products (half of them when causal)
    block = 2 * 2 * b * model.heads // t * s * s * d * (0.5 if model.causal else 1.0)
    rate, hop = spec.gemm_tflops * 1e12, nic if k > 1 else nvlink
    forward = (c - 1) * max(0.0, 2 * kv / hop - block / rate)
    if attention == "ring":
        return (passes - 1) * forward + (c - 1) * max(0.0, 4 * kv / hop - 2.5 * block / rate)
    return (passes - 1) * forward + (c - 1) * 2 * kv / hop + 2 * 2 * gather(kv)


def _call(spec: Any, kind: CommKind, steps: list[tuple[int, str]], seconds: float, nodes: int,
          per_node: float, nbytes: float | None = None) -> float:
    """A collective's seconds: its bytes' `seconds` at the links' full rate, and with NCCL's protocols
    (topology/nccl.py) the latency and rate of the one it picks (an all-reduce of `nbytes`: of the
    ring's or the tree's); the textbook model's few us of latency are left out."""
    if spec.collectives != "nccl" or spec.torus:
        return seconds
    return nccl.choose(kind, steps, seconds * 1e9, nodes, per_node, nbytes)[2] / 1e9


def _per_node(gpus: int, t: int, c: int, p: int) -> int:
    """How many of a data-parallel group (dp x cp: a rank of each, the same tp and pp index) one node
    holds where the group spans nodes evenly, else 1 (the mesh's order: dp, pp, cp, tp, tp fastest)."""
    if p * c * t <= gpus and gpus % (p * c * t) == 0:
        return gpus // (p * t)
    if c * t >= gpus and (c * t) % gpus == 0:
        return gpus // t
    return 1


def _rings_rate(spec: Any, nvlink: float, g: int) -> float:
    """Bytes a second at which a ring collective over nodes, g members on each, moves what a member sends:
    with NCCL's model its rings carry 1/g of it over each member's NIC and the rest over NVLink, all at
    once (topology/phases.nccl_ring); the textbook model, and one member a node, over the NIC."""
    nic = spec.nic_bytes_per_ns * 1e9
    if g == 1 or spec.collectives != "nccl":
        return nic
    return 1 / max((g - 1) / g / nvlink, 1 / (g * nic))


def _accumulation(sc: Scenario, layout: Layout, psi: float, m: int) -> float:
    """The bytes a step's memory-bound kernels move for the busiest stage's gradients without
    `grad_accumulation_fusion` (dp_wrap.gradients; with it, the weight-gradient GEMMs add into the buffer): a
    sum each micro-batch after the first, two gradients read and one written, below ZeRO-2, and a copy into
    the flat buffer each time it is reduced (once a step below ZeRO-2, every micro-batch from it)."""
    if sc.parallel.grad_accumulation_fusion:
        return 0.0
    item = model_state_bytes(1, sc.model.dtype, sc.parallel.grads_fp32)["gradients"]  # a gradient's bytes
    sums, copies = (m - 1, 1) if layout.zero < 2 else (0, m)
    return psi * item * (3 * sums + 2 * copies)


def _reduction(sc: Scenario, layout: Layout, psi: float, n: int, m: int, across: float, compute: float) -> float:
    """The exposed time of the step's data-parallel gradient reduction: a ring moves (n-1)/n of the
    stage's gradients a reduce-scatter (ZeRO-2/3: each micro-batch's; DDP, ZeRO-1: their sum; 16-bit, or
    fp32 with `grads_fp32`), DDP's all-reduce as much again, and ZeRO-1/2 all-gather the new 16-bit
    weights (ZeRO-3 gathers weights where they are used). Overlapped (dp_wrap.py), a reduction hides under the backward pass of its
    micro-batch (a share of the compute, passes counted as flops.py does: the backward is twice a
    forward); without `overlap_grad_reduce` (Megatron-LM's 2021 local DDP), all of it comes after. With
    `overlap_param_gather`, ZeRO-1/2's all-gather of the new weights hides under the next step's first
    forward pass."""
    if n == 1:
        return 0.0
    ring = (n - 1) / n * 2 * psi / across  # one reduce-scatter (or all-gather) of the stage's 16-bit weights
    state = model_state_bytes(1, sc.model.dtype, sc.parallel.grads_fp32)
    grads = ring * state["gradients"] / state["parameters"]  # ... of its gradients (fp32 ones: twice the bytes)
    share = (2 / 4, 1 / 4) if layout.recompute == "full" else (2 / 3, 1 / 3)
    backward, forward = (compute / m * x for x in share)  # one micro-batch's
    under_forward = sc.parallel.overlap_param_gather and layout.zero in (1, 2)
    gather = max(0.0, ring - forward) if under_forward else ring  # ZeRO-1/2's all-gather of the new weights
    second = grads if layout.zero == 0 else ring  # DDP's all-reduce gathers the gradients, ZeRO-1 the weights
    if layout.zero >= 2:
        return m * max(0.0, grads - backward) + (gather if layout.zero == 2 else 0.0)
    if not sc.parallel.overlap_grad_reduce:
        return grads + (second if layout.zero == 0 else gather)
    if under_forward:  # (the reduce-scatter under the backward, the gather under the next forward)
        return max(0.0, grads - backward) + gather
    return max(0.0, grads + second - backward)
