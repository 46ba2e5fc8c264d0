"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and its sequence parallelism (Korthikanti et al.
2022): which parameters split how over the tp ranks (the shard table), and the operators a block puts
around its parallel regions, as free functions with the papers' names:
  f   identity forward, all-reduce of the input gradient backward: before a column-parallel layer;
  g   all-reduce of the partial output forward, identity backward: after a row-parallel layer;
with sequence parallelism, g is a reduce-scatter to this rank's tokens and f an all-gather of the
sequence (`gather`). Every sum is of exact partials, rounded once after it (`ops.finalize`), so any tp
degree gives the single device's bytes. The blocks that use them: transformer_shard.py, llama_shard.py.

With `overlap` (parallel.tp_comm_overlap: Megatron-LM's --tp-comm-overlap, Transformer Engine's
userbuffers; Wang et al. 2023 describe the same decomposition), the sequence-parallel collectives run
in pieces under the GEMMs beside them, as Transformer Engine's defaults for a block do
(transformer_engine/pytorch/module/base.py, initialize_ub):
  an all-gather into a GEMM (QKV and fc1 forward, the output projections' input gradients), a "ring
      exchange" of tp steps: each rank's tokens passed around the tp ring, each part multiplied while
      the next travels (`gather_matmuls`);
  a reduce-scatter out of a GEMM (the output projections forward), "pipeline" with 4 splits of the
      output's columns: each split's reduce-scatter under the next split's GEMM (`matmul_reduce`);
  a column-parallel layer's backward, "bulk": its input gathered again under the input-gradient GEMM, that
      gradient's reduce-scatter under the weight-gradient GEMMs (`reduce_under`, parallel.tp_async_backward;
      Megatron-LM runs its backward so without Transformer Engine too).
torch's async TP (torchtitan's enable_async_tensor_parallel: torch/_inductor/fx_passes/micro_pipeline_tp.py)
runs the first two and not the third: its pattern matcher fuses a reduce-scatter of one GEMM's output
wherever it is, so a column-parallel layer's input gradient that is one GEMM's (the GPT's fused QKV and
fc1) runs as the second, and one that sums two or three (the Llama's q, k and v; w1 and w3) not at all
(`reduce_under` with `pieces`, without its `overlap`); and each of its fused reduce-scatters ends in a
summing kernel on the compute stream (`matmul_reduce`'s `local_sum`), where Transformer Engine's sum
inside its communication kernels.
The pieces land in place in one buffer (no copy kernel), and each GEMM's rows or columns are the
whole GEMM's, so the numbers are the same bytes as without the overlap."""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, Callable, Generator

import numpy as np

from simcluster.numerics.tensor import ITEMSIZE, MetaTensor
from simcluster.parallel.cp_blocks import like
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


RS_SPLITS = 4  # Transformer Engine's "pipeline" overlap: num_splits = 4 by default (module/base.py)


def gather_matmuls(ctx: Context, x: Any, weights: list[Any], group: Any, sp: bool, overlap: bool,
                   then: Callable[[Any], None] | None = None) -> Generator[Any, Any, tuple[Any, list[Any]]]:
    """`gather` of this rank's tokens x (b, tokens, h), and the gathered input times each of `weights`:
    (gathered, products). `then(gathered)` runs before the products without the overlap (a weight
    gradient that reads the gathered input), after them with it. With `overlap`, a ring exchange of tp
    steps: each rank multiplies the part it holds (its own first) while passing it to the next rank and
    receiving the previous rank's."""
    ops = ctx.ops
    if not overlap:
        full = yield from gather(ctx, x, group, sp)
        if then is not None:
            then(full)
        return full, [ops.matmul(full, w) for w in weights]
    t, r = group.size, group.rank_of(ctx.rank)
    parts: list[Any] = [None] * t
    products: list[Any] = [None] * t
    sends = []
    for step in range(t):
        owner = held(r, step, t)
        parts[owner] = x
        if step < t - 1:
            # (untagged, so that a taped block replays them: parallel/tape.py)
            sends.append(ctx.comm.send(x, dst=group.ranks[(r + 1) % t], async_op=True))
            recv = ctx.comm.recv(src=group.ranks[(r - 1) % t], like=like(x), async_op=True)
        products[owner] = [ops.matmul(x, w) for w in weights]
        if step < t - 1:
            x = yield recv
    yield sends
    with ops.fused(None):  # (the parts land in place in one buffer)
        full = ops.concat(parts, 1)
    if then is not None:
        then(full)
    with ops.fused(None):
        return full, [ops.concat([p[j] for p in products], 1) for j in range(len(weights))]


def held(r: int, step: int, t: int) -> int:
    """Whose tokens tp rank r holds at `step` of the ring exchange: its own, then each previous rank's."""
    return (r - step) % t


def matmul_reduce(ctx: Context, x: Any, w: Any, group: Any, sp: bool, overlap: bool,
                  local_sum: bool = False) -> Generator[Any, Any, Any]:
    """A row-parallel layer and its g: x @ w's partial sums reduced over the group (`g`). With `overlap`,
    w's output columns in RS_SPLITS pieces, each piece's reduce-scatter under the next piece's GEMM.
    `local_sum` (torch's async TP): the reduction is a kernel of its own on the compute stream, as torch's
    fused matmul-reduce-scatter runs it (torch/distributed/_symmetric_memory, _fused_matmul_reduce_scatter_impl:
    each rank's partial rows pushed to it, then the group's partials summed by one torch.sum); it reads the
    group's partials of this rank's output and writes the output. Transformer Engine's "pipeline" reduce-
    scatter sums inside its communication kernels (userbuffers), so it has none."""
    ops = ctx.ops
    if not overlap:
        return (yield from g(ctx, ops.matmul(x, w, partial=True), group, sp))
    works = [ctx.comm.reduce_scatter(ops.matmul(x, piece, partial=True), group=group, dim=1, donate=True,
                                     async_op=True)
             for piece in ops.split(w, math.gcd(RS_SPLITS, w.shape[-1]), -1)]
    done = yield works
    moved = (group.size + 1) * sum(math.prod(p.shape) for p in done) * ITEMSIZE[ops.cost_dtype]
    with ops.fused("reduce_scatter_sum", nbytes=moved) if local_sum else nullcontext():
        pieces = [ops.finalize(p) for p in done]
    with ops.fused(None):
        return ops.concat(pieces, -1)


def reduce_under(ctx: Context, partial: Callable[[], Any], then: Callable[[Any], None], group: Any, sp: bool,
                 overlap: bool, mine: Any, kept: Any, pieces: bool = False,
                 gemm: tuple[Any, Any] | None = None) -> Generator[Any, Any, Any]:
    """f backward of a column-parallel layer: its input gradient's partial sums (`partial()`) reduced over
    the group, and `then(input)`, its weight gradients from the layer's whole input. Without `overlap`,
    `then(kept)` (the gathered input the forward kept) first, then the GEMM and its reduction, as
    torchtitan's DTensor runs them; with `pieces` (torch's async TP) and `gemm`, (x, w) where the gradient is
    one GEMM's x @ w, that GEMM and its reduce-scatter as `matmul_reduce`'s pieces. With `overlap`, as
    Megatron-LM's column-parallel backward does (layers.py, LinearWithGradAccumulationAndAsyncCommunication;
    Transformer Engine's "bulk" overlaps are the same): with sequence parallelism the input gathered again
    from this rank's tokens `mine` under the GEMM, then the reduce-scatter under the weight gradients;
    without it the all-reduce under them."""
    if not overlap or group.size == 1:
        then(kept)
        if pieces and gemm is not None and group.size > 1:
            return (yield from matmul_reduce(ctx, *gemm, group, sp, True, local_sum=True))
        return (yield from g(ctx, partial(), group, sp))
    gathering = ctx.comm.all_gather(mine, group=group, dim=1, async_op=True) if sp else None
    p = partial()
    whole = (yield gathering) if sp else kept
    work = ctx.comm.reduce_scatter(p, group=group, dim=1, donate=True, async_op=True) if sp else \
        ctx.comm.all_reduce(p, group=group, donate=True, async_op=True)
    then(whole)
    return ctx.ops.finalize((yield work))


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
