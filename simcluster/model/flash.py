"""What attention costs when it runs as one fused kernel (FlashAttention; Dao et al. 2022, Dao 2023).

The numbers are those of the two-pass core (gpt.py); only the cost changes. A fused kernel streams
q, k, v through on-chip tiles: the s x s scores and probabilities never reach memory, so it reads
q, k, v and writes the output and the softmax statistics (one fp32 log-sum-exp per query row); the
backward pass reads those and dO, recomputes the scores (QK^T again: five products instead of
four, 2.5x the forward's FLOPs) and writes dq, dk, dv. A causal kernel skips the tiles above the
diagonal: it runs, of each block of query rows, the key blocks up to the diagonal, the diagonal's
whole (masked inside: `causal_share`), about half the products. Megatron-LM, torchtitan and the Llama 3 runs all use it
(`model.attention_kernel = "flash"`, the default); "unfused" issues every step of the core as its
own kernel, the s x s tensors through memory, as the first Megatron-LM did.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from typing import Any, ContextManager

import numpy as np

from simcluster.numerics.tensor import ITEMSIZE

# FlashAttention-2's tiles: blocks of 128 query rows by 128 keys for head dim 128 (Dao 2023, section 3.3:
# block sizes of 64 or 128 a side; its forward kernel's kBlockM = kBlockN = 128 on the A100 and H100)
TILE = 128


@functools.lru_cache(maxsize=256)
def causal_share(sq: int, sk: int, tile: int = TILE) -> float:
    """The share of the sq x sk score products a causal fused kernel runs: for each block of `tile` query
    rows, the key blocks from the first to the one holding its last row's diagonal, that one whole (masked
    inside). Queries are the last sq of the sk positions (FlashAttention's alignment). 1/2 + 1/(2n) for
    sq = sk = n tiles: 0.53 at 2K tokens, 0.504 at 16K."""
    if sq <= 0 or sk <= 0:
        return 1.0
    return causal_share_at(((sk - sq, sq),), ((0, sk),), tile)


@functools.lru_cache(maxsize=256)
def causal_share_at(rows: tuple[tuple[int, int], ...], cols: tuple[tuple[int, int], ...], tile: int = TILE) -> float:
    """causal_share for queries at positions `rows` and keys at `cols` (runs of (start, length); the keys taken in
    position order): for each block of `tile` query rows of each run, the keys at or before its last row, in
    whole tiles. A context-parallel rank's zigzag chunks against the gathered keys run each chunk's causal
    prefix, about half of them (Transformer Engine's all-gather attention: each local chunk against the keys
    before it); ring attention's blocks, half of each (zigzag: one key chunk, or one query chunk, whole)."""
    sq, sk = sum(n for _, n in rows), sum(n for _, n in cols)
    if not sq or not sk:
        return 1.0
    starts, lengths = np.array([s for s, _ in cols]), np.array([n for _, n in cols])
    ran = 0
    for start, n in rows:
        ends = np.minimum(np.arange(tile, n + tile, tile), n)  # each block's last row in the run, + 1
        seen = np.clip(start + ends[:, None] - starts[None, :], 0, lengths[None, :]).sum(1)  # keys at or before it
        ran += int(np.dot(np.diff(np.concatenate([[0], ends])), np.minimum(-(-seen // tile) * tile, sk)))
    return ran / (sq * sk)


def cost(q: tuple[int, ...], k: tuple[int, ...], dtype: str, causal: bool, backward: bool,
         at: tuple[Any, Any] | None = None) -> tuple[float, float]:
    """(FLOPs, bytes) of the fused kernel on q (b, a, sq, d) and k (b, a, sk, d): `products` times q k^T's
    FLOPs (when causal, the blocks it runs: causal_share, or causal_share_at the positions `at`, (rows,
    cols), where a context-parallel rank's are not the sequence's last), moving `moved` tensors of q's size,
    as many of k's, and as many fp32 statistics per query row (forward: 2 products, 2 moved; backward: 5 and 4)."""
    products, moved = (5, 4) if backward else (2, 2)
    b, a, sq, d = q
    nq, nk = b * a * sq * d, b * a * k[2] * d
    share = (causal_share(sq, k[2]) if at is None else causal_share_at(at[0].runs, at[1].runs)) if causal else 1.0
    flops = 2.0 * products * b * a * sq * k[2] * d * share
    return flops, float(ITEMSIZE[dtype] * moved * (nq + nk) + 4 * moved // 2 * nq // d)


def _fused(ops: Any, cfg: Any, name: str, q: Any, k: Any, backward: bool, at: Any = None) -> ContextManager[None]:
    """One kernel, costing what `cost` says."""
    if cfg.attention_kernel != "flash":
        return nullcontext()
    flops, nbytes = cost(tuple(q.shape), tuple(k.shape), cfg.dtype, cfg.causal, backward, at)
    return ops.fused(name, flops=flops, nbytes=nbytes)


def forward(ops: Any, cfg: Any, q: Any, k: Any, at: Any = None) -> ContextManager[None]:
    """Around the forward core on q (b, a, sq, d) and k (b, a, sk, d): one fused kernel, or nothing.
    Two products (QK^T, PV); reads q, k, v, writes the output and the statistics. `at`: the queries' and
    keys' positions (Positions), where they are not the sequence's last and whole (context parallelism)."""
    return _fused(ops, cfg, "flash_attention", q, k, backward=False, at=at)


def merge(ops: Any, cfg: Any, q: Any) -> ContextManager[None]:
    """Around a ring-attention block's share of the output (parallel/ring_attention.py): with flash,
    each block's kernel writes its partial output and log-sum-exp, and one elementwise kernel folds
    them into the running ones (fp32: reads both, writes the running ones back; ring-flash-attention's
    `_update_out_and_lse`). Nothing of the block's scores reaches memory."""
    if cfg.attention_kernel != "flash":
        return nullcontext()
    b, a, sq, d = q.shape
    n = b * a * sq * d
    return ops.fused("flash_merge", flops=4.0 * n, nbytes=4 * 3 * (n + n // d))


def backward(ops: Any, cfg: Any, q: Any, k: Any, at: Any = None) -> ContextManager[None]:
    """Around the backward core: five products (QK^T again, dV, dP, dQ, dK); reads q, o, dO, k, v and
    the statistics, writes dq, dk, dv (counted as four of each size), and the row sums dO.o."""
    return _fused(ops, cfg, "flash_attention_backward", q, k, backward=True, at=at)
