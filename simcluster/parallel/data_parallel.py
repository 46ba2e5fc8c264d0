"""What every layout of a training shares: its configuration (`TrainingConfig`: the model, the batch, the
optimizer, precision and the data-parallel choices), the batch split and the flat units (the single-device
reference run it is checked against is reference.py).

The global batch of a step is split over data-parallel ranks, then into micro-batches on each rank:
rank d's micro-batch j holds sequences [d*B/N + j*b, d*B/N + (j+1)*b) of the global batch B, b =
B/(N*m). Every forward pass is told where its sequences sit (`Slice`), so the loss is normalised by the
global token count and dropout masks are those of the whole batch: the ranks' partial gradients,
summed in any order, are exactly the single-device gradient.

Parameters, gradients and optimizer state are kept per unit (embed, block0.., head), each unit a flat
buffer zero-padded to a multiple of N so that ZeRO can shard it evenly (dp_wrap.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simcluster.model.gpt import PRECISIONS, ModelConfig, Slice, batch, unit_names
from simcluster.numerics.divisors import divisors, listed


OFFLOAD = ("none", "cpu", "nvme")  # where ZeRO-Offload/Infinity keep what they offload


@dataclass(frozen=True)
class TrainingConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    global_batch: int = 4  # sequences per step, over all data-parallel ranks
    micro_batches: int = 1  # per rank and step (gradient accumulation)
    steps: int = 3
    lr: float = 1e-3
    weight_decay: float = 0.0  # AdamW's decoupled decay (torch semantics)
    clip_grad: float | None = None  # clip the gradients to this global norm (torch's clip_grad_norm_)
    precision: str = "fp32"  # "fp32"; "bf16" or "fp16": 16-bit weights and gradients, fp32 master and moments
    # mixed precision's gradients summed and kept in fp32, not 16-bit (Megatron-LM's bf16 default,
    # --accumulate-allreduce-grads-in-fp32; torchtitan's FSDP2 reduce_dtype, mixed_precision_reduce = "float32")
    grads_fp32: bool = False
    # each micro-batch's weight gradients written into the gradient buffer by their GEMMs, adding to it (Megatron-LM's
    # --gradient-accumulation-fusion); False: the copy and the sum as kernels of their own (PyTorch's). Times only
    grad_accumulation_fusion: bool = True
    zero: int = 0  # 0: DDP; 1, 2, 3: ZeRO stages
    prefetch: bool = True  # ZeRO-3: gather the next unit while this one computes
    overlap_grad_reduce: bool = True  # DDP, ZeRO-1: reduce a unit's gradients under the rest of the backward
    overlap_param_gather: bool = False  # ZeRO-1, 2: the new weights gathered under the next forward, unit by unit
    # ZeRO-Offload (Ren et al. 2021) and ZeRO-Infinity (Rajbhandari et al. 2021), as DeepSpeed's
    # offload_optimizer / offload_param: "cpu" or "nvme" keeps the fp32 master and Adam's moments there,
    # each rank's reduced gradients go down to its host and AdamW runs on the host's cores; ZeRO-3's
    # 16-bit weight chunks may live there too between uses. They move bytes, not numbers.
    offload_optimizer: str = "none"
    offload_params: str = "none"
    # ZeRO-Offload's one-step delayed parameter update: step s+1 computes with the weights from before
    # step s's update, so the host's step s runs under the device's step s+1 (gpt.train's definition)
    delayed_update: bool = False

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batches", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not valid; valid: {', '.join(PRECISIONS)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero!r} does not exist; valid stages: 0 (DDP), 1, 2, 3")
        for name in ("offload_optimizer", "offload_params"):
            if getattr(self, name) not in OFFLOAD:
                raise ValueError(f"{name} {getattr(self, name)!r} is not valid; valid: {', '.join(OFFLOAD)}")
        if self.offload_optimizer != "none" and self.zero == 0:
            raise ValueError("offloading the optimizer state moves each rank's shard of it (ZeRO-Offload): it "
                             "needs zero = 1, 2 or 3, not DDP")
        if self.offload_params != "none" and self.zero != 3:
            raise ValueError(f"offloading the parameters keeps ZeRO-3's weight chunks in the host's tiers between "
                             f"uses (ZeRO-Infinity): it needs zero = 3, not {self.zero}")

    def check(self, dp: int) -> None:
        if self.global_batch % (dp * self.micro_batches):
            valid = divisors(self.global_batch, lambda n: self.global_batch % (n * self.micro_batches) == 0)
            raise ValueError(f"global batch {self.global_batch} must be divisible by dp={dp} x micro-batches="
                             f"{self.micro_batches}; dp degrees that divide it: {listed(valid)}")

    def micro_batch(self, step: int, rank: int, dp: int, j: int) -> tuple[Slice, np.ndarray, np.ndarray]:
        """(where, ids, targets) of rank `rank`'s micro-batch j at `step`."""
        where = self.where(rank, dp, j)
        ids, targets = batch(self.model, self.model.seed, step, self.global_batch // (dp * self.micro_batches),
                             first=where.offset)
        return where, ids, targets

    def where(self, rank: int, dp: int, j: int) -> Slice:
        """Which sequences of the step's batch rank `rank`'s micro-batch j is (what a pipeline stage
        without the embedding or the head needs of it: no token ids)."""
        return Slice(rank * (self.global_batch // dp) + j * (self.global_batch // (dp * self.micro_batches)),
                     self.global_batch)


def unit_shapes(cfg: ModelConfig, unit: str) -> list[tuple[int, ...]]:
    shapes = cfg.parameter_shapes()
    return [shapes[n] for n in unit_names(cfg, unit)]


def unit_size(cfg: ModelConfig, unit: str) -> int:
    return sum(math.prod(s) for s in unit_shapes(cfg, unit))


def padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


# What a training run returns per tensor: the weights, the last step's gradients, the first step's
# (where float noise has not yet been amplified by Adam: fast mode compares them) and Adam's moments.
KINDS = ("params", "grads", "first_grads", "adam_m", "adam_v")
