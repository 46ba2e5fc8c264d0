"""A two-layer MLP trained with Megatron tensor parallelism inside data parallelism.

The smallest training program that uses every part of the engine; the transformer programs of
later issues follow the same shape. Shoeybi et al. 2019: the first weight is split by columns and
the second by rows, so the forward needs one all-reduce (their `g`) and the hidden activation never
leaves its rank. Gradients are summed over data-parallel ranks as exact partials, overlapped with
the rest of the backward pass.

Per step:
  1. forward: a = x W1 (column shard), z = relu(a), y = all_reduce_tp(z W2 (row shard, partial))
  2. loss = sum((y - target)^2) / (tokens * hidden), summed over dp as a partial
  3. backward: dW2 (partial over this rank's tokens) -> async all_reduce over dp; dz, da, dW1 -> async
  4. SGD on this rank's shards once both gradient all-reduces are done

On one rank (dp = tp = 1) the same program is the single-device reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generator

import numpy as np

from simcluster.numerics.divisors import divisors, listed
from simcluster.program.context import Context


@dataclass(frozen=True)
class MLPConfig:
    hidden: int = 64
    ffn_hidden: int = 256
    tokens: int = 128  # per step, over the whole data-parallel group
    steps: int = 3
    lr: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden", "ffn_hidden", "tokens", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")

    @property
    def parameters(self) -> int:
        return 2 * self.hidden * self.ffn_hidden

    def check_mesh(self, dp: int, tp: int) -> None:
        if self.ffn_hidden % tp:
            raise ValueError(f"tp={tp} must divide ffn_hidden={self.ffn_hidden}; valid tp: "
                             f"{listed(divisors(self.ffn_hidden))}")
        if self.tokens % dp:
            raise ValueError(f"dp={dp} must divide the {self.tokens} tokens of a step (global_batch x seq)")


def train_mlp(ctx: Context, cfg: MLPConfig) -> Generator[Any, Any, dict[str, Any]]:
    dp, tp = ctx.mesh.dp, ctx.mesh.tp
    d, t = ctx.mesh.coord("dp"), ctx.mesh.coord("tp")
    cfg.check_mesh(dp.size, tp.size)
    h, F = cfg.hidden, cfg.ffn_hidden
    f, b = F // tp.size, cfg.tokens // dp.size
    scale1, scale2 = 1.0 / math.sqrt(h), 1.0 / math.sqrt(F)
    w1 = ctx.ops.uniform(cfg.seed, "w1", (h, f), offset=(0, t * f), full_shape=(h, F), low=-scale1, high=scale1)
    w2 = ctx.ops.uniform(cfg.seed, "w2", (f, h), offset=(t * f, 0), full_shape=(F, h), low=-scale2, high=scale2)
    inv_n = 1.0 / (cfg.tokens * h)
    losses = []
    for step in range(cfg.steps):
        x = ctx.ops.uniform(cfg.seed + step, "x", (b, h), offset=(d * b, 0), full_shape=(cfg.tokens, h))  # (b, h)
        target = ctx.ops.uniform(cfg.seed + step, "target", (b, h), offset=(d * b, 0), full_shape=(cfg.tokens, h))

        with ctx.annotate("forward", f"F{step}"):
            a = ctx.ops.matmul(x, w1)  # (b, f)
            z = ctx.ops.relu(a)
            y_partial = ctx.ops.matmul(z, w2, partial=True)  # (b, h), summed over this rank's f only
        with ctx.annotate("forward", f"g{step}"):
            y = ctx.ops.finalize((yield ctx.comm.all_reduce(y_partial, group=tp)))  # (b, h)
        with ctx.annotate("forward", f"L{step}"):
            err = ctx.ops.sub(y, target)
            sq_sum = ctx.ops.sum(ctx.ops.mul(err, err), None, partial=True)  # () over this rank's tokens
        with ctx.annotate("forward", f"L{step}"):
            loss = ctx.ops.scale(ctx.ops.finalize((yield ctx.comm.all_reduce(sq_sum, group=dp))), inv_n)

        with ctx.annotate("backward", f"B{step}"):
            dy = ctx.ops.scale(err, 2.0 * inv_n)  # (b, h)
            dw2_partial = ctx.ops.matmul(ctx.ops.transpose(z), dy, partial=True)  # (f, h) over this rank's tokens
        dw2_sum = ctx.comm.all_reduce(dw2_partial, group=dp, async_op=True)
        with ctx.annotate("backward", f"B{step}"):
            dz = ctx.ops.matmul(dy, ctx.ops.transpose(w2))  # (b, f)
            da = ctx.ops.relu_backward(dz, a)
            dw1_partial = ctx.ops.matmul(ctx.ops.transpose(x), da, partial=True)  # (h, f)
        dw1_sum = ctx.comm.all_reduce(dw1_partial, group=dp, async_op=True)
        dw2_total, dw1_total = yield [dw2_sum, dw1_sum]

        with ctx.annotate("optimizer", f"O{step}"):
            dw1, dw2 = ctx.ops.finalize(dw1_total), ctx.ops.finalize(dw2_total)
            w1 = ctx.ops.sub(w1, ctx.ops.scale(dw1, cfg.lr))
            w2 = ctx.ops.sub(w2, ctx.ops.scale(dw2, cfg.lr))
        losses.append(loss)
    return {"loss": losses, "y": y, "w1": w1, "w2": w2, "dw1": dw1, "dw2": dw2}


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]]) -> dict[str, Any]:
    """Full tensors from the ranks' shards: the view a single device would have.

    y is sharded by tokens over dp; w1/dw1 by columns and w2/dw2 by rows over tp. Every dp replica
    must hold the same weights: a replica that differs is reported as its own output.
    """
    dp = max(c["dp"] for c in coords) + 1
    tp = max(c["tp"] for c in coords) + 1
    at = {(c["dp"], c["tp"]): r for r, c in zip(results, coords)}
    full: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(at[0, 0]["loss"])}
    full["y"] = np.concatenate([at[i, 0]["y"] for i in range(dp)], axis=0)
    for name, dim in (("w1", 1), ("dw1", 1), ("w2", 0), ("dw2", 0)):
        full[name] = np.concatenate([at[0, j][name] for j in range(tp)], axis=dim)
        for i in range(1, dp):
            replica = np.concatenate([at[i, j][name] for j in range(tp)], axis=dim)
            if replica.tobytes() != full[name].tobytes():
                full[f"{name}@dp{i}"] = replica
    return full
