"""The scenario's keys, declared once as typed sections (nested frozen dataclasses, as torchtitan's
JobConfig): each key's type (a Literal for a closed set), default, help text and least value. A
section checks its values where it is built and names the key, the value and what would be valid.
From these classes come the loader's checks (scenario.py), `simcluster keys` (SCHEMA), the `--set`
help, and the scenario's JSON Schema (json_schema.py)."""

from __future__ import annotations

import difflib
import functools
import math
import types
import typing
from dataclasses import dataclass, field, fields, make_dataclass
from typing import Any, ClassVar, Literal

from simcluster.topology.presets import COLLECTIVES, PRESETS, ClusterSpec


class ScenarioError(ValueError):
    """A scenario document or override that cannot be used (one line, for the user)."""


@dataclass(frozen=True)
class Key:
    """One key as its section's annotation and field declare it."""

    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None
    renamed: tuple[tuple[Any, Any], ...] = ()  # earlier names of values, still read: (old, new)


def key(default: Any, help: str, *, minimum: float | None = None, renamed: dict[Any, Any] | None = None) -> Any:
    """A section's field: its default, what it means, its least value (numbers), and the earlier names
    of its values that are still read (old name -> name)."""
    return field(default=default, metadata={"help": help, "minimum": minimum, "renamed": renamed or {}})


class Section:
    """A table of a scenario. Building one checks every value (`_check`); a key whose default is None
    may stay unset. `check_value` is the one check of a value, wherever it comes from."""

    section: ClassVar[str]

    def __post_init__(self) -> None:
        for name, k in keys_of(type(self)).items():
            value = getattr(self, name)
            if value is None and k.default is None:
                continue
            object.__setattr__(self, name, check_value(f"{self.section}.{name}", k, value))

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]


PRESET_NAMES = tuple(sorted(PRESETS))


@dataclass(frozen=True)
class ModelSection(Section):
    """[model]: the model and its batch."""

    section: ClassVar[str] = "model"

    layers: int = key(2, "transformer blocks", minimum=1)
    hidden: int = key(64, "hidden size h", minimum=1)
    heads: int = key(4, "attention heads (must divide hidden)", minimum=1)
    ffn_hidden: int = key(256, "MLP inner size", minimum=1)
    seq: int = key(32, "sequence length s", minimum=1)
    vocab: int = key(128, "vocabulary size", minimum=2)
    global_batch: int = key(8, "sequences per step, over all data-parallel ranks", minimum=1)
    micro_batch: int | None = key(
        None, "sequences per micro-batch on a rank (default: its whole share, no accumulation)", minimum=1)
    dtype: Literal["bf16", "fp16", "fp32"] = key(
        "bf16", "bf16 or fp16: mixed precision (16-bit weights and gradients, fp32 master and Adam; fp16 with a "
        "static loss scale of 4096); fp32: everything fp32. Kernels and communication are timed in it")
    causal: bool = key(True, "causal attention")
    attention_kernel: Literal["flash", "unfused"] = key(
        "flash", "the attention core's time and memory: one FlashAttention kernel, or a kernel a step, the s x s in memory")
    fused_kernels: bool = key(
        True, "cost a block's elementwise work as Megatron-LM's fused kernels (bias in the GEMM; bias+GELU; bias+dropout+"
        "residual; scale+mask+softmax; SwiGLU) and torch.compile's (RMSNorm, SwiGLU: a kernel each way); false: as eager "
        "PyTorch launches it, a kernel an op (the Llama's RMSNorm and rotary embedding with fp32 upcasts, model/eager.py)")
    loss_kernel: Literal["unfused", "fused"] = key(
        "unfused", "the cross-entropy: unfused, passes over the logits upcast to fp32 and kept (Megatron-LM's, torch's); "
        "fused, a kernel a pass over the 16-bit logits, which it keeps with a log-sum-exp a row (flash-attn's, LLM "
        "Foundry's; Liger's; Megatron-LM's --cross-entropy-loss-fusion). The same numbers either way")
    tied_head: bool | None = key(None, "LM head tied to the token embedding (default: gpt yes, llama no)")
    arch: Literal["gpt", "llama"] = key(
        "gpt", "gpt (layer norm, learned positions, GELU MLP, biases) or llama (RMSNorm, rotary positions, SwiGLU "
        "MLP, grouped-query attention, no biases, untied head)")
    kv_heads: int | None = key(
        None, "llama: key/value heads for grouped-query attention (must divide heads; default: heads)", minimum=1)
    gqa: Literal["repeat_kv", "native"] = key(
        "repeat_kv", "llama, kv_heads < heads: repeat_kv repeats each key/value head for its query heads before attention "
        "(Llama's reference code, torchtitan's SDPA: context parallelism exchanges the repeats, each one's gradient "
        "rounded, then summed); native takes them as they are (FlashAttention, cuDNN, Transformer Engine; Megatron-LM, "
        "Llama 3): context parallelism exchanges the kv heads only, each one's gradient summed and rounded once")
    dropout: float = key(0.0, "dropout probability", minimum=0)
    moe_experts: int = key(
        0, "a mixture of experts in place of the MLP, this many routed experts (SwiGLU for llama, GELU for gpt; "
        "0: a dense model); "
        "under every parallelism (expert parallelism: parallel.ep; tp with sequence parallelism)", minimum=0)
    moe_top_k: int = key(2, "experts each token is routed to", minimum=1)
    moe_ffn_hidden: int | None = key(None, "an expert's inner size (default: ffn_hidden)", minimum=1)
    moe_first_dense: int = key(0, "dense layers before the first mixture of experts (DeepSeek-V3: 3)", minimum=0)
    moe_aux_coeff: float = key(
        0.0, "the load-balancing loss's coefficient, per sequence (Switch/GShard: 1e-2; DeepSeek-V3: 1e-4)",
        minimum=0)
    moe_capacity_factor: float = key(
        0.0, "tokens an expert takes from a sequence, as a multiple of an even share (GShard, Switch; the rest "
        "are dropped); 0: dropless, as Megatron-Core", minimum=0)
    moe_scores: Literal["softmax", "sigmoid"] = key(
        "softmax", "the router's scores: a softmax over the experts, or a sigmoid each (DeepSeek-V3)")
    moe_normalize: bool = key(False, "divide the chosen scores by their sum (Mixtral, Qwen, DeepSeek)")
    moe_route_scale: float = key(1.0, "the gates' factor (DeepSeek-V3: 2.5)", minimum=0)
    moe_shared_experts: int = key(
        0, "shared experts every token also goes through, each of moe_ffn_hidden (DeepSeek-MoE, DeepSeek-V3: 1)",
        minimum=0)
    moe_shared_overlap: bool = key(
        False, "the shared experts computed while the routed tokens travel to their experts (forward) and their "
        "gradients back (backward), under expert parallelism's all-to-all (Megatron-Core's "
        "moe_shared_expert_overlap); the same numbers either way")
    moe_groups: int = key(
        1, "node-limited routing: the experts in this many equal groups, in order (DeepSeek-V3: 8, one a node)", minimum=1)
    moe_group_limit: int = key(
        0, "node-limited routing: a token's experts from at most this many groups, those whose best "
        "top_k / limit scores sum highest (DeepSeek-V3: 4); 0: any", minimum=0)
    moe_bias_rate: float = key(
        0.0, "DeepSeek-V3's auxiliary-loss-free balancing: each expert's selection bias moves by this much after "
        "each step, towards an even load (DeepSeek-V3: 0.001; 0: no bias)", minimum=0)
    moe_skew: float = key(
        0.0, "meta mode, which has no numbers to route by: experts' shares of the tokens in proportion to "
        "(e + 1)^-skew (0: balanced; 1: Zipf's law)", minimum=0)


@dataclass(frozen=True)
class _ClusterKeys(Section):
    """[cluster]: the hardware (the figures a preset gives, each overridable, are added below)."""

    section: ClassVar[str] = "cluster"

    preset: Literal[PRESET_NAMES] = key("dgx-a100", "hardware preset")
    nodes: int = key(1, "number of nodes", minimum=1)
    gpus_per_node: int = key(8, "GPUs per node (NVLink/NVSwitch domain)", minimum=1)
    torus: str | None = key(
        None, "chips along each dimension of a TPU-style torus, like '4x4x4' (their product must be cluster.nodes x"
        " cluster.gpus_per_node; wrap-around links where every dimension is at least 4): links between "
        "neighbouring chips instead of NVLink and NICs (default: the preset's; '' for none)")
    profile: str | None = key(
        None, "a hardware profile measured by `simcluster calibrate` (a TOML file, relative to the scenario's "
        "folder or the working directory): its figures replace the preset's, and each GEMM is timed at the "
        "rate measured for the shape nearest it")
    collectives: Literal[COLLECTIVES] | None = key(
        None, "how collectives are timed: 'nccl', NCCL's protocols (LL, LL128, Simple) picked by message size with "
        "its own latencies; 'alpha-beta', a fixed latency a ring step at the links' full rate (default: the "
        "preset's, nccl; a profile's measured link: alpha-beta)")

    @property
    def figures(self) -> dict[str, Any]:
        """The preset's figures this cluster overrides (and how collectives are timed, if set)."""
        return {n: getattr(self, n) for n in (*CLUSTER_FIGURES, "collectives") if getattr(self, n) is not None}


@dataclass(frozen=True)
class ParallelSection(Section):
    """[parallel]: the layout of the model on the cluster's ranks."""

    section: ClassVar[str] = "parallel"

    dp: int = key(8, "data-parallel degree", minimum=1)
    ep: int = key(
        1, "expert-parallel degree (a mixture of experts): each run of ep data-parallel ranks shares out the "
        "experts, tokens dispatched to them and back by all-to-all; must divide dp and model.moe_experts", minimum=1)
    moe_dispatcher: Literal["alltoall", "allgather"] = key(
        "alltoall", "how expert parallelism (ep > 1) moves tokens to their experts and back, as Megatron-Core's "
        "token dispatchers: alltoall (each token's routed rows to the ranks holding its experts, by uneven "
        "all-to-all), allgather (the ep group's tokens all-gathered to every rank, the outputs reduce-scattered "
        "back: ep tokens' worth each way, not k routed rows; no counts to wait for)")
    pp: int = key(1, "pipeline-parallel degree", minimum=1)
    cp: int = key(1, "context-parallel degree", minimum=1)
    tp: int = key(1, "tensor-parallel degree", minimum=1)
    sp: bool = key(False, "Megatron sequence parallelism with tp > 1 (norms and dropout on sequence shards)")
    tp_comm_overlap: bool = key(
        False, "with sp: run the sequence-parallel all-gathers and reduce-scatters in pieces under the GEMMs beside them, "
        "as Megatron-LM's --tp-comm-overlap (Transformer Engine's userbuffers) and torchtitan's async tensor parallelism "
        "do: each all-gather into a GEMM in tp pieces, each reduce-scatter out of one GEMM in 4 splits of its columns. "
        "The backward's column-parallel layers are tp_async_backward's: Megatron-LM runs both (--tp-comm-overlap with "
        "its async backward, on by default); torch's async TP is this alone, its pattern matcher fusing a reduce-scatter "
        "of one GEMM's output (the GPT's QKV and fc1 input gradients, in pieces) and not of a sum (the Llama's, of q, k "
        "and v and of w1 and w3), each fused one summing its partials in a kernel of its own. The same numbers either way")
    tp_async_backward: bool = key(
        False, "Megatron-LM's column-parallel backward (its LinearWithGradAccumulationAndAsyncCommunication, on since "
        "2021; Transformer Engine's bulk overlap under --tp-comm-overlap): with sp the layer's input gathered again "
        "under the input-gradient GEMM, that gradient's reduce-scatter under the weight-gradient GEMMs; without sp "
        "its all-reduce under them. false: torchtitan's DTensor order, the gathered input kept from the forward and "
        "the reduction after the weight gradients. The same numbers either way")
    attention: Literal["ulysses", "ring", "allgather", "rsa"] = key(
        "ulysses", "context parallelism's attention (cp > 1): ulysses (all-to-all by heads), ring (keys and values "
        "around a ring), allgather (Llama 3), rsa (ColossalAI's ring self-attention: keys, then values, around it)")
    zero: Literal[0, 1, 2, 3] = key(3, "0: DDP; 1, 2, 3: ZeRO stages (3 = FSDP), around whatever a rank holds")
    zero_over: Literal["dp_cp", "dp"] = key(
        "dp_cp", "what ZeRO shards over when cp > 1: dp_cp (the flattened dp x cp group, as Megatron's distributed "
        "optimizer and torchtitan's FSDP do) or dp (after a sum over cp)")
    prefetch: bool = key(True, "ZeRO-3: gather the next unit's weights while this one computes")
    overlap_grad_reduce: bool = key(
        True, "DDP and ZeRO-1: reduce each unit's gradients as soon as its last micro-batch is done, under the rest"
        " of the backward pass (Megatron's --overlap-grad-reduce); false: all of them after it (Megatron-LM, 2021)")
    overlap_param_gather: bool = key(
        False, "ZeRO-1 and 2: each unit's new weights all-gathered under the next step's forward pass, each waited "
        "for where its unit is first used (Megatron's --overlap-param-gather); false: all of them at the end of "
        "the optimizer step. The same numbers either way")
    grads_fp32: bool = key(
        False, "bf16/fp16 training: gradients summed and kept in fp32 (rounded once to fp32, not 16-bit), reduced "
        "over data parallelism at 4 bytes a parameter, and 4 bytes a parameter held: Megatron-LM's bf16 default "
        "(--accumulate-allreduce-grads-in-fp32) and torchtitan's FSDP2 (mixed_precision_reduce = 'float32'); "
        "false: 16-bit gradients (DeepSpeed's bf16 communication, Megatron's --grad-reduce-in-bf16)")
    grad_accumulation_fusion: bool = key(
        True, "each micro-batch's weight gradients written into the gradient buffer by their GEMMs, adding to what it "
        "holds (Megatron-LM's --gradient-accumulation-fusion, on by default); false: the copy into the buffer and the "
        "sum as kernels of their own, as PyTorch's autograd, DDP and FSDP run them. The same numbers either way")
    offload_optimizer: Literal["none", "cpu", "nvme"] = key(
        "none", "ZeRO-Offload (zero >= 1): keep the fp32 master weights and Adam's moments in the host's memory (cpu)"
        " or on its NVMe (nvme, ZeRO-Infinity); the reduced gradients go down over PCIe, AdamW runs on its cores")
    offload_params: Literal["none", "cpu", "nvme"] = key(
        "none", "ZeRO-Infinity (zero = 3): keep the 16-bit weight chunks in the host's memory (cpu) or on its NVMe "
        "(nvme) between uses, fetched before each gather")
    delayed_update: bool = key(
        False, "ZeRO-Offload's one-step delayed parameter update: each step computes with the weights from before "
        "the last step's update, so the host's optimizer step runs under the next forward and backward (compared "
        "with its own single-device definition)")
    recompute: Literal["none", "selective", "full", "op"] = key(
        "none", "activation recomputation: selective (Megatron's: the attention core), full (each block from its "
        "input), op (torchtitan's per-op policy, Llama: every second matmul of a block and the attention kernel's "
        "outputs kept, the rest recomputed)")
    schedule: Literal["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe"] = key(
        "1f1b", "pipeline schedule (pp > 1)")
    virtual_stages: int = key(1, "model chunks per pipeline stage (interleaved schedule)", minimum=1)
    microbatch_group: int = key(
        0, "interleaved: the micro-batches through a chunk before the next chunk's turn, N in [pp, micro-batches], the "
        "last group what is left (at least pp); 0: pp. Megatron-LM's --microbatch-group-size-per-vp-stage, Llama 3's "
        "N: the micro-batch count need not be a multiple of pp; stage 0 holds (v - 1)(N - pp)/v more", minimum=0)
    embedding_in_split: bool = key(False, "the pipeline split counts the embedding as a layer: the first chunk holds one "
                                   "fewer (Megatron-LM's --account-for-embedding-in-pipeline-split; Llama 3 405B)")
    loss_in_split: bool = key(False, "the pipeline split counts the head and its loss as a layer: the last chunk holds one "
                              "fewer (Megatron-LM's --account-for-loss-in-pipeline-split; Llama 3 405B)")
    dualpipe_overlap: bool = key(
        True, "DualPipe: each paired forward and backward pass (its main step's) run together, each computing while "
        "the other's communication (expert all-to-all, tensor-parallel and pipeline transfers) is in flight, as "
        "DeepSeek-V3 overlaps them; false: one after the other. The same numbers either way")
    scatter_gather: bool = key(
        False, "pp > 1 with tp > 1 and no sp: each tp rank sends only its 1/tp of a pipeline message and the "
        "receiving stage all-gathers the parts over tp, so a message crosses the network once, not tp times "
        "(Megatron-LM's --scatter-gather-tensors-in-pipeline, on by default in 2021)")

    @property
    def degrees(self) -> dict[str, int]:
        """The mesh's axes and their sizes, in the mesh's order."""
        return {"dp": self.dp, "pp": self.pp, "cp": self.cp, "tp": self.tp}

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp


@dataclass(frozen=True)
class RunSection(Section):
    """[run]: what runs, how long, in which numerics, and the checkpoints."""

    section: ClassVar[str] = "run"

    program: Literal["transformer", "mlp", "collectives", "allreduce"] = key(
        "transformer", "what to run: transformer (the model.arch model, GPT or Llama, trained under the [parallel] "
        "layout; 'gpt', its earlier name, is read as transformer), mlp (a TP x DP two-layer MLP), collectives "
        "(every primitive), allreduce (all-reduce against reduce-scatter + all-gather of global_batch x seq x "
        "hidden values)", renamed={"gpt": "transformer"})
    steps: int = key(3, "training steps", minimum=1)
    numerics: Literal["exact", "fast", "meta"] = key("exact", "exact (bit-exact), fast (BLAS) or meta (shapes only)")
    verify: bool = key(True, "compare every output with a single-device run")
    seed: int = key(0, "seed of weights and data", minimum=0)
    lr: float = key(1e-3, "learning rate (AdamW for transformer, SGD for mlp)", minimum=0)
    weight_decay: float | None = key(
        None, "AdamW's decoupled weight decay (default 0.01 for gpt, Megatron-LM's; 0.1 for llama, Llama 3's)", minimum=0)
    clip_grad: float = key(
        1.0, "clip the gradients to this global norm before the optimizer step (clip_grad_norm_; 0: none)", minimum=0)
    save_checkpoint: str | None = key(
        None, "transformer: write a checkpoint to this folder (--save-checkpoint; each rank its own shards and a manifest, "
        "docs/checkpoint.md)")
    save_at_step: int | None = key(
        None, "save the checkpoint after this many steps (--at-step; default: run.steps)", minimum=0)
    resume: str | None = key(
        None, "transformer: start from this checkpoint folder, under any layout (--resume): its newest complete checkpoint,"
        " or the one a step folder holds; the steps after it are byte-identical to the uninterrupted run's")
    keep_checkpoints: int = key(
        2, "how many complete checkpoints a save into run.save_checkpoint keeps (the oldest are deleted only "
        "once the new one is complete)", minimum=1)


@dataclass(frozen=True)
class FaultsSection(Section):
    """[faults]: injected faults: a straggler, a degraded link, a failed rank."""

    section: ClassVar[str] = "faults"

    straggler_rank: int | None = key(None, "a rank whose kernels run slow (a throttled GPU)", minimum=0)
    straggler_factor: float = key(2.0, "how many times as long the straggler's kernels take", minimum=1)
    straggler_from_us: float = key(0.0, "when the straggler slows down, in simulated microseconds", minimum=0)
    degraded_rank: int | None = key(None, "a rank whose link runs at a fraction of its bandwidth", minimum=0)
    degraded_link: Literal["nic", "nvlink"] = key(
        "nic", "which of its links: nic (between nodes) or nvlink (inside the node)")
    degraded_factor: float = key(0.25, "the fraction of its bandwidth the degraded link keeps (0 to 1]", minimum=0)
    failed_rank: int | None = key(
        None, "a rank that fails: its peers' collectives never finish, and their watchdogs report them", minimum=0)
    failed_at_us: float = key(0.0, "when the rank fails, in simulated microseconds", minimum=0)
    watchdog_s: float = key(
        600.0, "how long a rank waits on a collective before its watchdog reports it (torch.distributed's default "
        "NCCL timeout: 10 minutes)", minimum=0)


@dataclass(frozen=True)
class GoodputSection(Section):
    """[goodput]: the goodput report: interruptions, checkpoint writes and restarts (off unless set)."""

    section: ClassVar[str] = "goodput"

    interruptions_per_gpu_hour: float | None = key(
        None, "job interruptions per GPU-hour (Llama 3: 419 unexpected in 54 days on 16,384 H100s, 1.97e-5); set it"
        " to get the goodput report", minimum=0)
    storage_gbyte_per_s: float = key(
        2000.0, "checkpoint write bandwidth of the whole job, GB/s (Llama 3's Tectonic: 2 TB/s sustained)", minimum=0)
    restart_s: float = key(
        600.0, "seconds from an interruption to training again: rescheduling, loading the checkpoint, warm-up (an "
        "assumption; the Llama 3 paper gives none)", minimum=0)
    checkpoint_every_steps: int | None = key(
        None, "steps between checkpoints (default: the interval that maximises goodput)", minimum=1)
    step_time_s: float | None = key(
        None, "the step time to account with, e.g. a measured one (default: the simulated step)", minimum=0)


@dataclass(frozen=True)
class TargetSection(Section):
    """[target]: the critical-batch report: steps and GPU-hours to a target loss (off unless set)."""

    section: ClassVar[str] = "target"

    b_noise_tokens: float | None = key(
        None, "the gradient noise scale B_noise in tokens (McCandlish et al. 2018; Kaplan et al. 2020: about 2e8 / "
        "L^4.8 at a loss of L nats); with e_min_tokens, the report adds the steps, wall time and GPU-hours to"
        " that loss", minimum=0)
    e_min_tokens: float | None = key(
        None, "the fewest tokens that reach the target loss (with a tiny batch)", minimum=0)


_FIGURE_NAMES = ("preset", "device", "nodes", "gpus_per_node", "profile", "torus", "collectives")
CLUSTER_FIGURES = tuple(f.name for f in fields(ClusterSpec) if f.name not in _FIGURE_NAMES)


UNITS = (("tdp_w", "W: the board's rated power, datasheet; 0 where none is published"),
         ("power_limit_w", "W: a power limit under the TDP, as nvidia-smi -pl sets; the clock falls as "
          "(limit / tdp_w)^0.30 (NVIDIA's H100 SXM and NVL ratings) and every compute-bound kernel with it, HBM and "
          "links unchanged; 0: none"),
         ("attention_efficiency", "a fraction of the peak, 0 to 1, that FlashAttention's fused forward kernel reaches "
          "(its backward 0.82 of that, as FlashAttention-3's H100 figures have cuDNN's): on an H100 cuDNN's 0.64 (what "
          "Transformer Engine runs), FlashAttention-2's 0.33 (torch's SDPA in 2024)"),
         ("sustained_compute", "a fraction, 0 to 1, of the compute-bound rates a long run keeps (topology/presets.py)"),
         ("memory_gbyte", "GiB, 2^30 bytes: an '80GB' card is 80 GiB, which the report also shows as 85.9 GB"),
         ("_gbyte_per_s", "GB/s"), ("_gbit_per_s", "Gbit/s"), ("_ns", "ns"), ("tflops", "TFLOP/s"),
         ("_efficiency", "a fraction of the peak, 0 to 1"), ("_tbyte", "TB"), ("gparam_per_s", "10^9 parameters a second"))


def _figure(name: str) -> tuple[str, Any, Any]:
    typ = {f.name: f.type for f in fields(ClusterSpec)}[name]
    unit = next((f" ({u})" for suffix, u in UNITS if name.endswith(suffix)), "")
    return name, (float if typ in ("float", float) else int) | None, key(None, f"override of the preset's {name}"
                                                                          f"{unit}", minimum=0)


# [cluster]: the keys above and an override of each figure a preset gives (topology/presets.py)
ClusterSection = make_dataclass("ClusterSection", [_figure(n) for n in CLUSTER_FIGURES], bases=(_ClusterKeys,),
                                frozen=True)
ClusterSection.__doc__ = _ClusterKeys.__doc__
ClusterSection.__module__ = __name__

SECTIONS: dict[str, type[Section]] = {c.section: c for c in (ModelSection, ClusterSection, ParallelSection,
                                                              RunSection, FaultsSection, GoodputSection, TargetSection)}


@functools.cache
def keys_of(cls: type) -> dict[str, Key]:
    """A section's keys, read from its annotations and fields."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        want, choices = hints[f.name], None
        if isinstance(want, types.UnionType) or typing.get_origin(want) is typing.Union:  # X | None
            want = next(a for a in typing.get_args(want) if a is not type(None))
        if typing.get_origin(want) is Literal:
            choices = typing.get_args(want)
            want = type(choices[0])
        out[f.name] = Key(want, f.default, f.metadata["help"], choices, f.metadata["minimum"],
                          tuple(f.metadata["renamed"].items()))
    return out


SCHEMA: dict[str, dict[str, Key]] = {name: keys_of(cls) for name, cls in SECTIONS.items()}
TOP_LEVEL = {"name": Key(str, "default", "scenario name"), "description": Key(str, "", "what the scenario shows")}


def all_keys() -> list[str]:
    return list(TOP_LEVEL) + [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]


def suggest(name: str) -> str:
    """' (did you mean ...?)' for a misspelt key or section, or ''."""
    close = difflib.get_close_matches(name, all_keys(), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


LARGEST_INT = 2**53  # the largest integer a scenario may give: floats (the cost model's) hold every integer to it


def check_value(where: str, key: Key, value: Any) -> Any:
    """`value` as the key takes it (an int where a float is wanted as a float, an earlier name as the
    name), or a ScenarioError that names the key, the value and what would be valid."""
    want = key.type
    value = dict(key.renamed).get(value, value) if isinstance(value, str) else value
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ScenarioError(f"{where} = {str(value)[:12]}... ({len(str(value))} digits) is too large for a "
                                f"float") from None
    if want is int and isinstance(value, float) and value.is_integer() and where.startswith("cluster."):
        value = int(value)
    if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
        raise ScenarioError(f"{where} must be {want.__name__}, got {type(value).__name__} {value!r}")
    if want is float and not math.isfinite(value):
        raise ScenarioError(f"{where} must be a finite number, got {value!r}")
    if want is int and abs(value) > LARGEST_INT:
        text = str(value) if len(str(value)) <= 24 else f"{str(value)[:12]}... ({len(str(value))} digits)"
        raise ScenarioError(f"{where} = {text} is too large: integers here are at most 2^53 = {LARGEST_INT:,} (the "
                            f"cost model computes in floats, exact to 2^53)")
    if key.choices is not None and value not in key.choices:
        raise ScenarioError(f"{where} = {value!r} is not valid; valid: {', '.join(map(str, key.choices))}")
    if key.minimum is not None and value < key.minimum:
        raise ScenarioError(f"{where} = {value!r} must be at least {key.minimum:g}")
    return value
