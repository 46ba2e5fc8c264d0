"""What DDP and the ZeRO stages share: the run's configuration, the batch split, flat units.

The global batch of a step is split over data-parallel ranks, then into micro-batches on each rank:
rank d's micro-batch j holds sequences [d*B/N + j*b, d*B/N + (j+1)*b) of the global batch B, b =
B/(N*m). Every forward pass is told where its sequences sit (`Slice`), so the loss is normalised by the
global token count and dropout masks are those of the whole batch: the ranks' partial gradients,
summed in any order, are exactly the single-device gradient.

Parameters, gradients and optimizer state are kept per unit (embed, block0.., head), each unit a flat
buffer zero-padded to a multiple of N so that ZeRO can shard it evenly (rank d owns chunk d).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simcluster.model.gpt import PRECISIONS, AdamState, GPTConfig, Slice, adam_step, batch, grad_dtype, unit_names
from simcluster.model.gpt import adam_init, model_state_bytes, units, unscale, working_copy


@dataclass(frozen=True)
class DPConfig:
    model: GPTConfig = field(default_factory=GPTConfig)
    global_batch: int = 4  # sequences per step, over all data-parallel ranks
    micro_batches: int = 1  # per rank and step (gradient accumulation)
    steps: int = 3
    lr: float = 1e-3
    precision: str = "fp32"  # "fp32"; "bf16" or "fp16": 16-bit weights and gradients, fp32 master and moments
    zero: int = 0  # 0: DDP; 1, 2, 3: ZeRO stages
    prefetch: bool = True  # ZeRO-3: gather the next unit while this one computes

    def __post_init__(self) -> None:
        for name in ("global_batch", "micro_batches", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r} is not valid; valid: {', '.join(PRECISIONS)}")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero stage {self.zero!r} does not exist; valid stages: 0 (DDP), 1, 2, 3")

    def check(self, dp: int) -> None:
        if self.global_batch % (dp * self.micro_batches):
            valid = [n for n in range(1, self.global_batch + 1) if self.global_batch % (n * self.micro_batches) == 0]
            raise ValueError(f"global batch {self.global_batch} must be divisible by dp={dp} x micro-batches="
                             f"{self.micro_batches}; dp degrees that divide it: {', '.join(map(str, valid))}")

    def micro_batch(self, step: int, rank: int, dp: int, j: int) -> tuple[Slice, np.ndarray, np.ndarray]:
        """(where, ids, targets) of rank `rank`'s micro-batch j at `step`."""
        b = self.global_batch // (dp * self.micro_batches)
        offset = rank * (self.global_batch // dp) + j * b
        ids, targets = batch(self.model, self.model.seed, step, b, first=offset)
        return Slice(offset, self.global_batch), ids, targets


def unit_shapes(cfg: GPTConfig, unit: str) -> list[tuple[int, ...]]:
    shapes = cfg.parameter_shapes()
    return [shapes[n] for n in unit_names(cfg, unit)]


def unit_size(cfg: GPTConfig, unit: str) -> int:
    return sum(math.prod(s) for s in unit_shapes(cfg, unit))


def padded(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]], cfg: DPConfig) -> dict[str, Any]:
    """The single-device view of a run: full tensors by name, from full replicas or per-unit shards.

    Every data-parallel replica must agree: a replica that differs is reported as its own output.
    """
    dp = max(c["dp"] for c in coords) + 1
    by_dp = {c["dp"]: r for r, c in zip(results, coords)}
    out: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(by_dp[0]["loss"])}
    for kind in ("params", "grads", "adam_m", "adam_v"):
        for d in range(dp):
            full = _full(by_dp[d][kind], by_dp, kind, cfg, dp)
            for name, value in full.items():
                key = f"{kind}.{name}"
                if d == 0:
                    out[key] = value
                elif np.asarray(value).tobytes() != np.asarray(out[key]).tobytes():
                    out[f"{key}@dp{d}"] = value
            if "sharded" in by_dp[0] and by_dp[0]["sharded"].get(kind):
                break  # shards: one assembly from all ranks
    return out


def _full(mine: dict[str, Any], by_dp: dict[int, dict[str, Any]], kind: str, cfg: DPConfig, dp: int) -> dict[str, Any]:
    if not by_dp[0].get("sharded", {}).get(kind):
        return mine
    out: dict[str, Any] = {}
    for unit in units(cfg.model):
        flat = np.concatenate([by_dp[d][kind][unit] for d in range(dp)])
        at = 0
        for name, shape in zip(unit_names(cfg.model, unit), unit_shapes(cfg.model, unit)):
            n = math.prod(shape)
            out[name] = flat[at:at + n].reshape(shape)
            at += n
    return out


@functools.lru_cache(maxsize=8)
def reference(cfg: DPConfig, mode: str = "exact") -> dict[str, Any]:
    """The single-device run that every data-parallel run must equal (cached: the configuration is
    immutable, and every variant of a comparison shares it). Do not modify what it returns."""
    from simcluster.model.gpt import train
    from simcluster.numerics.ops import make_ops

    out = train(make_ops(mode), cfg.model, steps=cfg.steps, batch_size=cfg.global_batch, lr=cfg.lr,
                precision=cfg.precision)
    flat: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(out["loss"])}
    for kind in ("params", "grads", "adam_m", "adam_v"):
        for name, value in out[kind].items():
            flat[f"{kind}.{name}"] = value
    return flat


def hold_model_state(ctx: Any, master: dict[str, Any], parameters: int, precision: str) -> tuple[AdamState, dict[str, int]]:
    """The start of training: Adam state for `master`, and this rank's weight and optimizer memory
    held for the run (`parameters`: how many this rank keeps). Returns (state, bytes by category)."""
    state = adam_init(ctx.ops, master)
    sizes = model_state_bytes(parameters, precision)
    ctx.memory.hold("parameters", "weights", sizes["parameters"])
    ctx.memory.hold("optimizer", "adam", sizes["optimizer"])
    return state, sizes


def begin_step(ctx: Any, master: dict[str, Any], sizes: dict[str, int], precision: str) -> dict[str, Any]:
    """The start of a step: the working copy of the weights, then the step's gradient memory held."""
    weights = working_copy(ctx.ops, master, precision)
    ctx.memory.hold("gradients", "grads", sizes["gradients"])
    return weights


def finish_step(ctx: Any, master: dict[str, Any], partials: dict[str, Any], state: AdamState, cfg: DPConfig,
                group: Any, step: int, loss_sum: Any) -> Any:
    """The end of a training step: sum this rank's gradient partials over `group` in one flat
    all-reduce (in the gradient dtype), round each once, step AdamW on the fp32 master weights, free
    the gradients, and sum the loss over `group` (when this rank has one: a pipeline's last stage).
    Returns (new master, rounded gradients, mean loss or None)."""
    ops = ctx.ops
    names = list(master)
    flat = ops.flat([ops.retag(partials[k], grad_dtype(cfg.precision)) for k in names])
    reduced = yield ctx.comm.all_reduce(flat, group=group)
    with ctx.annotate("optimizer", f"O{step}"):
        shapes = [tuple(master[k].shape) for k in names]
        grads = {k: ops.finalize(g) for k, g in zip(names, ops.unflat(reduced, shapes))}
        master = adam_step(ops, master, unscale(ops, grads, cfg.precision), state, lr=cfg.lr)
    ctx.memory.release("gradients", "grads")
    if loss_sum is None:
        return master, grads, None
    with ctx.annotate("forward", "loss"):
        total = yield ctx.comm.all_reduce(loss_sum, group=group)
    return master, grads, ops.scale(ops.finalize(total), 1.0 / (cfg.global_batch * cfg.model.seq))
