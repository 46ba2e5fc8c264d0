"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and its sequence parallelism (Korthikanti et al.
2022): which parameters split how over the tp ranks (the shard table), and the operators a block puts
around its parallel regions, as free functions with the papers' names:
  f   identity forward, all-reduce of the input gradient backward: before a column-parallel layer;
  g   all-reduce of the partial output forward, identity backward: after a row-parallel layer;
with sequence parallelism, g is a reduce-scatter to this rank's tokens and f an all-gather of the
sequence (`gather`). Every sum is of exact partials, rounded once after it (`ops.finalize`), so any tp
degree gives the single device's bytes. The blocks that use them: transformer_shard.py, llama_shard.py."""

from __future__ import annotations

from typing import Any, Generator

import numpy as np

from simcluster.numerics.tensor import MetaTensor
from simcluster.program.context import Context


def g(ctx: Context, partial: Any, group: Any, sp: bool) -> Generator[Any, Any, Any]:
    """g forward (and f backward, on a gradient): sum a partial over the tp group and round it once;
    with sequence parallelism a reduce-scatter to this rank's tokens (the sequence is dim 1)."""
    if group.size == 1:
        return ctx.ops.finalize(partial)
    if sp:
        return ctx.ops.finalize((yield ctx.comm.reduce_scatter(partial, group=group, dim=1, donate=True)))
    return ctx.ops.finalize((yield ctx.comm.all_reduce(partial, group=group, donate=True)))


def gather(ctx: Context, x: Any, group: Any, sp: bool) -> Generator[Any, Any, Any]:
    """Into a tensor-parallel region with sequence parallelism: the whole (cp-local) sequence, (b, s/cp, h),
    from each rank's tokens; without it the input as it is."""
    if not sp:
        return x
    return (yield ctx.comm.all_gather(x, group=group, dim=1))


def tp_sum(ctx: Context, x: Any, group: Any, op: str = "sum") -> Generator[Any, Any, Any]:
    """A value reduced over the tp group as it is (SUM, MAX): the cross-entropy's row maximum, sum of
    exponentials and target logit over the vocabulary's rows."""
    if group.size == 1:
        return x
    return (yield ctx.comm.all_reduce(x, group=group, op=op))


COLS = ("mlp.w_fc", "mlp.b_fc", "attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")  # column parallel
ROWS = ("attn.w_proj", "mlp.w_out", "attn.wo", "mlp.w2")  # row parallel

def shard_kind(name: str, model: Any = None, t: int = 1) -> str:
    """rows, cols, qkv (columns of each of q, k and v), replicated, or cols/n: columns in t/n parts, each
    held by n consecutive tp ranks (llama's key/value heads when tp > kv_heads, as Megatron-LM does)."""
    if model is not None and t > model.kv_heads and name.endswith(("attn.wk", "attn.wv")):
        return f"cols/{t // model.kv_heads}"
    if name == "wte":
        return "rows"
    if name == "head" or name.endswith(COLS):
        return "cols"
    if name.endswith("attn.w_qkv") or name.endswith("attn.b_qkv"):
        return "qkv"
    if name.endswith(ROWS):
        return "rows"
    return "replicated"


def replicas(kind: str) -> int:
    """How many consecutive tp ranks hold each piece."""
    return int(kind[len("cols/"):]) if kind.startswith("cols/") else 1


def shard(x: Any, kind: str, t: int, r: int) -> Any:
    """Rank r's piece of a full tensor x split t ways."""
    if kind.startswith("cols/"):
        return shard(x, "cols", t // replicas(kind), r // replicas(kind))
    if kind == "replicated" or t == 1:
        return x
    if isinstance(x, MetaTensor):
        return MetaTensor(shard_shape(tuple(x.shape), kind, t), x.dtype)
    if kind == "rows":
        n = x.shape[0] // t
        return x[r * n:(r + 1) * n]
    if kind == "cols":
        n = x.shape[-1] // t
        return x[..., r * n:(r + 1) * n]
    lead, third = tuple(x.shape[:-1]), x.shape[-1] // 3  # q, k and v side by side: rank r's part of each
    n = third // t
    return x.reshape(lead + (3, third))[..., r * n:(r + 1) * n].reshape(lead + (3 * n,))


def shard_shape(shape: tuple[int, ...], kind: str, t: int) -> tuple[int, ...]:
    if kind.startswith("cols/"):
        return shard_shape(shape, "cols", t // replicas(kind))
    if kind == "replicated":
        return shape
    out = list(shape)
    out[0 if kind == "rows" else -1] //= t
    return tuple(out)


def unshard(parts: list[Any], kind: str) -> Any:
    """The full tensor from the t pieces, in tp order (replicated: the first)."""
    if kind.startswith("cols/"):
        return unshard(parts[::replicas(kind)], "cols")
    if kind == "replicated":
        return parts[0]
    if kind == "rows":
        return np.concatenate(parts, axis=0)
    if kind == "cols":
        return np.concatenate(parts, axis=-1)
    thirds = [np.split(p, 3, axis=-1) for p in parts]
    return np.concatenate([np.concatenate([t[i] for t in thirds], axis=-1) for i in range(3)], axis=-1)
