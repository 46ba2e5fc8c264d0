"""The keys a scenario may set, declared once: each one's type, default, valid values and help text
(SCHEMA), and the check of a value where it enters, which names the key, the value and what would be
valid. scenario.py loads documents against it; `simcluster keys` prints it."""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, fields
from typing import Any

from simcluster.topology.presets import COLLECTIVES, PRESETS, ClusterSpec


class ScenarioError(ValueError):
    """A scenario document or override that cannot be used (one line, for the user)."""


@dataclass(frozen=True)
class Key:
    type: type
    default: Any
    help: str
    choices: tuple[Any, ...] | None = None
    minimum: float | None = None


_CLUSTER_FIGURES = {f.name: f for f in fields(ClusterSpec)
                    if f.name not in ("preset", "device", "nodes", "gpus_per_node", "profile", "torus", "collectives")}

SCHEMA: dict[str, dict[str, Key]] = {
    "model": {
        "layers": Key(int, 2, "transformer blocks", minimum=1),
        "hidden": Key(int, 64, "hidden size h", minimum=1),
        "heads": Key(int, 4, "attention heads (must divide hidden)", minimum=1),
        "ffn_hidden": Key(int, 256, "MLP inner size", minimum=1),
        "seq": Key(int, 32, "sequence length s", minimum=1),
        "vocab": Key(int, 128, "vocabulary size", minimum=2),
        "global_batch": Key(int, 8, "sequences per step, over all data-parallel ranks", minimum=1),
        "micro_batch": Key(int, None, "sequences per micro-batch on a rank (default: its whole share, no accumulation)",
                           minimum=1),
        "dtype": Key(str, "bf16", "bf16 or fp16: mixed precision (16-bit weights and gradients, fp32 master and "
                     "Adam; fp16 with a static loss scale of 4096); fp32: everything fp32. Kernels and "
                     "communication are timed in it", choices=("bf16", "fp16", "fp32")),
        "causal": Key(bool, True, "causal attention"),
        "attention_kernel": Key(str, "flash", "what the attention core costs in time and memory: one fused "
                                "FlashAttention kernel, or each step as its own kernel with the s x s scores in memory",
                                choices=("flash", "unfused")),
        "fused_kernels": Key(bool, True, "cost a block's elementwise work as the fused kernels of Megatron-LM "
                             "(bias in the GEMM; bias+GELU; bias+dropout+residual; scale+mask+softmax), "
                             "not one kernel an op as eager PyTorch"),
        "tied_head": Key(bool, None, "LM head tied to the token embedding (default: gpt yes, llama no)"),
        "arch": Key(str, "gpt", "gpt (layer norm, learned positions, GELU MLP, biases) or llama (RMSNorm, rotary "
                    "positions, SwiGLU MLP, grouped-query attention, no biases, untied head)", choices=("gpt", "llama")),
        "kv_heads": Key(int, None, "llama: key/value heads for grouped-query attention (must divide heads; default: "
                        "heads)", minimum=1),
        "dropout": Key(float, 0.0, "dropout probability", minimum=0),
    },
    "cluster": {
        "preset": Key(str, "dgx-a100", "hardware preset", choices=tuple(sorted(PRESETS))),
        "nodes": Key(int, 1, "number of nodes", minimum=1),
        "gpus_per_node": Key(int, 8, "GPUs per node (NVLink/NVSwitch domain)", minimum=1),
        "torus": Key(str, None, "chips along each dimension of a TPU-style torus, like '4x4x4' (their product must be "
                     "cluster.nodes x cluster.gpus_per_node; wrap-around links where every dimension is at least 4): "
                     "links between neighbouring chips instead of NVLink and NICs (default: the preset's; '' for none)"),
        "profile": Key(str, None, "a hardware profile measured by `simcluster calibrate` (a TOML file, relative to "
                       "the scenario's folder or the working directory): its figures replace the preset's, and "
                       "each GEMM is timed at the rate measured for the shape nearest it"),
        "collectives": Key(str, None, "how collectives are timed: 'nccl', NCCL's protocols (LL, LL128, Simple) "
                           "picked by message size with its own latencies; 'alpha-beta', a fixed latency a ring step "
                           "at the links' full rate (default: the preset's, nccl; a profile's measured link: "
                           "alpha-beta)", choices=COLLECTIVES),
        **{name: Key(float if f.type in ("float", float) else int, None, f"override of the preset's {name}", minimum=0)
           for name, f in _CLUSTER_FIGURES.items()},
    },
    "parallel": {
        "dp": Key(int, 8, "data-parallel degree", minimum=1),
        "pp": Key(int, 1, "pipeline-parallel degree", minimum=1),
        "cp": Key(int, 1, "context-parallel degree", minimum=1),
        "tp": Key(int, 1, "tensor-parallel degree", minimum=1),
        "sp": Key(bool, False, "Megatron sequence parallelism with tp > 1 (norms and dropout on sequence shards)"),
        "attention": Key(str, "ulysses", "context parallelism's attention (cp > 1): ulysses (all-to-all by heads), ring "
                         "(keys and values around a ring), allgather (Llama 3), rsa (ColossalAI's ring self-attention: "
                         "keys around the ring for whole score rows, then values)",
                         choices=("ulysses", "ring", "allgather", "rsa")),
        "zero": Key(int, 3, "0: DDP; 1, 2, 3: ZeRO stages (3 = FSDP), around whatever a rank holds",
                    choices=(0, 1, 2, 3)),
        "zero_over": Key(str, "dp_cp", "what ZeRO shards over when cp > 1: dp_cp (the flattened dp x cp group, as "
                         "Megatron's distributed optimizer and torchtitan's FSDP do) or dp (after a sum over cp)",
                         choices=("dp_cp", "dp")),
        "prefetch": Key(bool, True, "ZeRO-3: gather the next unit's weights while this one computes"),
        "overlap_grad_reduce": Key(bool, True, "DDP and ZeRO-1: reduce each unit's gradients as soon as its last "
                                   "micro-batch is done, under the rest of the backward pass (Megatron's "
                                   "--overlap-grad-reduce); false: all of them after the backward, as Megatron-LM "
                                   "did in 2021"),
        "offload_optimizer": Key(str, "none", "ZeRO-Offload (zero >= 1): keep the fp32 master weights and Adam's "
                                 "moments in the host's memory (cpu) or on its NVMe (nvme, ZeRO-Infinity); each "
                                 "rank's reduced gradients go down over PCIe and AdamW runs on the host's cores",
                                 choices=("none", "cpu", "nvme")),
        "offload_params": Key(str, "none", "ZeRO-Infinity (zero = 3): keep the 16-bit weight chunks in the host's "
                              "memory (cpu) or on its NVMe (nvme) between uses, fetched before each gather",
                              choices=("none", "cpu", "nvme")),
        "delayed_update": Key(bool, False, "ZeRO-Offload's one-step delayed parameter update: each step computes "
                              "with the weights from before the last step's update, so the host's optimizer step "
                              "runs under the next forward and backward (compared with its own single-device "
                              "definition)"),
        "recompute": Key(str, "none", "activation recomputation", choices=("none", "selective", "full")),
        "schedule": Key(str, "1f1b", "pipeline schedule (pp > 1)", choices=("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v", "dualpipe")),
        "virtual_stages": Key(int, 1, "model chunks per pipeline stage (interleaved schedule)", minimum=1),
        "scatter_gather": Key(bool, False, "pp > 1 with tp > 1 and no sp: each tp rank sends only its 1/tp of a "
                              "pipeline message and the receiving stage all-gathers the parts over tp, so a "
                              "message crosses the network once, not tp times (Megatron-LM's "
                              "--scatter-gather-tensors-in-pipeline, on by default in 2021)"),
    },
    "run": {
        "program": Key(str, "gpt", "what to run: gpt (the GPT model under the [parallel] layout), mlp (a TP x DP "
                       "two-layer MLP), collectives (every primitive), allreduce (all-reduce against reduce-scatter "
                       "+ all-gather of global_batch x seq x hidden values)",
                       choices=("gpt", "mlp", "collectives", "allreduce")),
        "steps": Key(int, 3, "training steps", minimum=1),
        "numerics": Key(str, "exact", "exact (bit-exact), fast (BLAS) or meta (shapes only)",
                        choices=("exact", "fast", "meta")),
        "verify": Key(bool, True, "compare every output with a single-device run"),
        "seed": Key(int, 0, "seed of weights and data", minimum=0),
        "lr": Key(float, 1e-3, "learning rate (AdamW for gpt, SGD for mlp)", minimum=0),
        "weight_decay": Key(float, None, "AdamW's decoupled weight decay, torch semantics (default: 0.01 for gpt as "
                            "Megatron-LM, 0.1 for llama as Llama 3)", minimum=0),
        "clip_grad": Key(float, 1.0, "clip the gradients to this global norm before the optimizer step "
                         "(torch's clip_grad_norm_; 0: no clipping)", minimum=0),
        "save_checkpoint": Key(str, None, "gpt: write a checkpoint to this folder (--save-checkpoint; each rank "
                               "its own shards and a manifest, docs/checkpoint.md)"),
        "save_at_step": Key(int, None, "save the checkpoint after this many steps (--at-step; default: run.steps)",
                            minimum=0),
        "resume": Key(str, None, "gpt: start from this checkpoint folder, under any layout (--resume): its newest "
                      "complete checkpoint, or the one a step folder holds; the steps after it are byte-identical "
                      "to the uninterrupted run's"),
        "keep_checkpoints": Key(int, 2, "how many complete checkpoints a save into run.save_checkpoint keeps (the "
                                "oldest are deleted only once the new one is complete)", minimum=1),
    },
    "faults": {
        "straggler_rank": Key(int, None, "a rank whose kernels run slow (a throttled GPU)", minimum=0),
        "straggler_factor": Key(float, 2.0, "how many times as long the straggler's kernels take", minimum=1),
        "straggler_from_us": Key(float, 0.0, "when the straggler slows down, in simulated microseconds", minimum=0),
        "degraded_rank": Key(int, None, "a rank whose link runs at a fraction of its bandwidth", minimum=0),
        "degraded_link": Key(str, "nic", "which of its links: nic (between nodes) or nvlink (inside the node)",
                             choices=("nic", "nvlink")),
        "degraded_factor": Key(float, 0.25, "the fraction of its bandwidth the degraded link keeps (0 to 1]",
                               minimum=0),
        "failed_rank": Key(int, None, "a rank that fails: its peers' collectives never finish, and their "
                           "watchdogs report them", minimum=0),
        "failed_at_us": Key(float, 0.0, "when the rank fails, in simulated microseconds", minimum=0),
        "watchdog_s": Key(float, 600.0, "how long a rank waits on a collective before its watchdog reports it "
                          "(torch.distributed's default NCCL timeout: 10 minutes)", minimum=0),
    },
    "goodput": {
        "interruptions_per_gpu_hour": Key(float, None, "job interruptions per GPU-hour (Llama 3: 419 unexpected in "
                                          "54 days on 16,384 H100s, 1.97e-5); set it to get the goodput report",
                                          minimum=0),
        "storage_gbyte_per_s": Key(float, 2000.0, "checkpoint write bandwidth of the whole job, GB/s (Llama 3's "
                                   "Tectonic: 2 TB/s sustained)", minimum=0),
        "restart_s": Key(float, 600.0, "seconds from an interruption to training again: rescheduling, loading the "
                         "checkpoint, warm-up (an assumption; the Llama 3 paper gives none)", minimum=0),
        "checkpoint_every_steps": Key(int, None, "steps between checkpoints (default: the interval that "
                                      "maximises goodput)", minimum=1),
        "step_time_s": Key(float, None, "the step time to account with, e.g. a measured one (default: the "
                           "simulated step)", minimum=0),
    },
    "target": {
        "b_noise_tokens": Key(float, None, "the gradient noise scale B_noise in tokens (McCandlish et al. 2018; Kaplan "
                              "et al. 2020: about 2e8 / L^4.8 at a loss of L nats); with e_min_tokens, the report "
                              "adds the steps, wall time and GPU-hours to that loss", minimum=0),
        "e_min_tokens": Key(float, None, "the fewest tokens that reach the target loss (with a tiny batch)",
                            minimum=0),
    },
}
TOP_LEVEL = {"name": Key(str, "default", "scenario name"), "description": Key(str, "", "what the scenario shows")}


def all_keys() -> list[str]:
    return list(TOP_LEVEL) + [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]


def _suggest(name: str) -> str:
    close = difflib.get_close_matches(name, all_keys(), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


LARGEST_INT = 2**53  # the largest integer a scenario may give: floats (the cost model's) hold every integer to it


def _check(where: str, key: Key, value: Any) -> Any:
    want = key.type
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
