"""The parallelism: how one model is laid out on a (dp, pp, cp, tp) mesh, as data.

A parallelism names, for every mesh axis, what it splits (the torchtitan and Megatron-LM shape):
  tp  the block's linear layers: QKV and the first MLP layer by columns, the output projections by
      rows (Shoeybi et al. 2019), the embedding and LM head by vocabulary rows; with `sp`, the
      activations between those regions by sequence (Korthikanti et al. 2022): the shard table and the
      operators f and g are tensor_parallel.py's;
  cp  the sequence: every rank holds s/cp tokens, attention exchanges keys and values
      (`attention`: ulysses, ring, allgather or rsa; ring and allgather use the zigzag layout when causal);
  pp  the blocks: p*v contiguous chunks, run by `schedule` (pipeline_schedules.py);
  dp  the batch, with DDP or ZeRO-1/2/3 around whatever parameters the rank holds (dp_wrap.py), over
      dp, or over dp x cp (`zero_over`), which is what Megatron's distributed optimizer and
      torchtitan's FSDP (`dp_shard_cp`) do, since cp ranks hold the same weights.

`check` says in one line why a layout is impossible and lists what would be possible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


from simcluster.numerics.divisors import divisors, listed
from simcluster.parallel import expert_parallel
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.pipeline_schedules import PipelineShape, Schedule
from simcluster.parallel.pipeline_schedules import check as check_schedule

ATTENTIONS = ("ulysses", "ring", "allgather", "rsa")
CP_ALIKE = ("ulysses", "allgather")  # attentions whose cp ranks run the same shapes (`alike`; Ulysses: given own kv heads)
ZERO_OVER = ("dp_cp", "dp")
DISPATCHERS = tuple(expert_parallel.DISPATCHERS)  # expert parallelism's token dispatchers, by name


@dataclass(frozen=True)
class Parallelism:
    data: TrainingConfig = field(default_factory=TrainingConfig)  # model, batch, micro-batches, steps, optimizer, ZeRO stage
    sp: bool = False
    tp_comm_overlap: bool = False  # with sp: the tp collectives in pieces under the GEMMs (tensor_parallel.py)
    tp_async_backward: bool = False  # Megatron-LM's column-parallel backward (tensor_parallel.reduce_under)
    attention: str = "ulysses"
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual: int = 1  # model chunks per pipeline stage (interleaved)
    microbatch_group: int = 0  # interleaved: micro-batches through a chunk together (0: pp; pipeline_schedules.py)
    embedding_in_split: bool = False  # the pipeline split counts the embedding as a block (pipeline.partition)
    loss_in_split: bool = False  # ... and the head with its loss
    zero_over: str = "dp_cp"
    # pp > 1 with tp > 1 and no sp: each tp rank sends 1/tp of a pipeline message and the receiving
    # stage all-gathers the parts over tp (Narayanan et al. 2021, section 4.1)
    scatter_gather: bool = False
    checkpoint: Any = None  # checkpoint.Checkpointing: save after a step, or resume (exact and fast modes)
    ep: int = 1  # expert parallelism: experts shared out over runs of ep data-parallel ranks (mesh.expert_groups)
    dispatcher: str = "alltoall"  # how ep sends tokens to their experts: alltoall or allgather (expert_parallel.py)
    dualpipe_overlap: bool = True  # DualPipe's paired forward and backward passes run together (pipeline.together)

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention {self.attention!r} is not valid; valid: {', '.join(ATTENTIONS)}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"dispatcher {self.dispatcher!r} is not valid; valid: {', '.join(DISPATCHERS)}")
        if self.zero_over not in ZERO_OVER:
            raise ValueError(f"zero_over {self.zero_over!r} is not valid; valid: {', '.join(ZERO_OVER)}")

    @property
    def model(self) -> Any:
        return self.data.model

    def zigzag(self, cp: int) -> bool:
        """Ring and all-gather attention balance causal work with the zigzag layout (ColossalAI's RSA
        computes whole score rows on contiguous chunks: nothing to balance)."""
        return cp > 1 and self.attention in ("ring", "allgather") and self.model.causal

    def alike(self, tp: int, cp: int = 1) -> tuple[str, ...]:
        """The mesh axes along which ranks run the same kernels on the same shapes, differing only
        in their data: what a meta-mode simulation may fold (engine/fold.py). dp always; tp unless
        kv heads are replicated over tp ranks (one of each kv head's copies adds its input gradient),
        or something is offloaded to NVMe (a node's ranks share its drives: folding dp keeps whole
        nodes, folding tp would leave a node's tp peers' transfers out); cp where tp folds, with
        Ulysses where each cp rank gets its own kv heads, and with all-gather attention (every cp rank
        attends its two zigzag chunks' queries to all the keys: the same shapes, and in meta mode the
        mask is not built; the ring gives each rank other blocks of the mask at each step, RSA's rings
        are its own); ep with a mixture of experts routed evenly (meta mode's stated routing without
        skew: every expert gets as many rows, so the ep peers run the same shapes)."""
        kv, d = self.model.kv_heads, self.data
        if "nvme" in (d.offload_optimizer, d.offload_params):
            return ("dp",)
        if self.model.arch == "llama" and kv is not None and tp > kv:
            return ("dp",)
        own = self.model.arch != "llama" or kv is None or (kv // tp) % cp == 0
        folds_cp = self.attention in CP_ALIKE and (own or self.attention != "ulysses")
        axes = ("dp", "tp", "cp") if folds_cp else ("dp", "tp")
        return axes + ("ep",) if self.model.moe_experts and not self.model.moe_skew else axes

    def shape(self, pp: int) -> PipelineShape:
        return PipelineShape(pp, self.data.micro_batches, self.virtual, self.microbatch_group)

    def check(self, dp: int, pp: int, cp: int, tp: int) -> None:
        """Clear errors for what this parallelism cannot run on the mesh."""
        m = self.model
        self.data.check(dp)
        for what, size in (("heads", m.heads), ("ffn_hidden", m.ffn_hidden), ("vocab", m.vocab)):
            _divides(f"tensor-parallel degree {tp}", tp, what, size)
        if m.kv_heads % tp and tp % m.kv_heads:
            raise ValueError(f"tensor-parallel degree {tp} must divide kv_heads={m.kv_heads} (each rank its kv heads) "
                             f"or be a multiple of it (each kv head replicated on tp/kv_heads ranks); valid "
                             f"degrees: {listed(divisors(m.heads, lambda d: m.kv_heads % d == 0 or d % m.kv_heads == 0))}")
        zig = self.zigzag(cp)
        if zig and m.seq % (2 * cp):
            valid = divisors(m.seq // 2) if m.seq % 2 == 0 else []
            raise ValueError(f"causal {self.attention} attention uses the zigzag layout: seq={m.seq} must be "
                             f"divisible by 2 x cp = {2 * cp}; valid degrees: {listed(valid)}")
        _divides(f"context-parallel degree {cp}", cp, "seq", m.seq)
        if cp > 1 and self.attention == "ulysses":
            _divides(f"ulysses degree {cp}", cp, "heads" if tp == 1 else "heads/tp", m.heads // tp)
        if m.gqa == "native" and m.kv_heads < m.heads:
            if tp > m.kv_heads:
                raise ValueError(f"model.gqa = 'native' with tp={tp} above kv_heads={m.kv_heads} is not modelled (each "
                                 f"kv head on several tp ranks); set model.gqa = 'repeat_kv' or tp <= {m.kv_heads}")
            if cp > 1 and self.attention == "ulysses":
                _divides(f"ulysses degree {cp} with model.gqa = 'native'", cp, "kv_heads/tp", m.kv_heads // tp)
        if self.sp and tp > 1:
            local = m.seq // cp
            if local % tp:
                valid = divisors(local)
                where = f"seq={m.seq}" if cp == 1 else f"a context-parallel rank's {local} tokens (seq/cp)"
                raise ValueError(f"sequence parallelism: tp={tp} must divide {where}; valid degrees: "
                                 f"{listed(valid)}")
        if self.tp_comm_overlap and tp > 1 and not self.sp:
            raise ValueError("parallel.tp_comm_overlap overlaps the sequence-parallel all-gathers and reduce-scatters "
                             "with the GEMMs beside them: set parallel.sp = true (Megatron-LM refuses "
                             "--tp-comm-overlap without --sequence-parallel)")
        check_schedule(self.schedule, self.shape(pp), m.layers, self.embedding_in_split + self.loss_in_split)
        offloaded = (self.data.offload_optimizer, self.data.offload_params) != ("none", "none")
        if self.schedule is Schedule.DUALPIPE and pp > 1 and offloaded:
            raise ValueError("DualPipe with offloading is not modelled: its two copies of a stage sum their "
                             "gradients on the device before the step; set parallel.offload_optimizer and "
                             "parallel.offload_params to none, or choose another schedule")
        if m.moe_experts and tp > 1 and not self.sp:
            raise ValueError(f"a mixture of experts beside tensor parallelism routes each tp rank's own tokens: "
                             f"tp={tp} needs sequence parallelism (parallel.sp = true)")
        if self.ep > 1:
            if not m.moe_experts or m.moe_experts % self.ep or dp % self.ep:
                raise ValueError(f"expert parallelism ep={self.ep} needs a mixture of experts whose count it divides "
                                 f"(model.moe_experts={m.moe_experts}) and must divide dp={dp}")
        if m.moe_experts and m.moe_first_dense > m.layers:
            raise ValueError(f"model.moe_first_dense={m.moe_first_dense} is more than the model's {m.layers} layers")


def _divides(who: str, degree: int, what: str, size: int) -> None:
    if size % degree:
        valid = divisors(size)
        raise ValueError(f"{who} must divide {what}={size}; valid degrees: {listed(valid)}")
