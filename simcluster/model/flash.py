"""What attention costs when it runs as one fused kernel (FlashAttention; Dao et al. 2022, Dao 2023).

The numbers are those of the two-pass core (gpt.py); only the cost changes. A fused kernel streams
q, k, v through on-chip tiles: the s x s scores and probabilities never reach memory, so it reads
q, k, v and writes the output and the softmax statistics (one fp32 log-sum-exp per query row); the
backward pass reads those and dO, recomputes the scores (QK^T again: five products instead of
four, 2.5x the forward's FLOPs) and writes dq, dk, dv. A causal kernel skips the tiles above the
diagonal: half the products. Megatron-LM, torchtitan and the Llama 3 runs all use it
(`model.attention_kernel = "flash"`, the default); "unfused" issues every step of the core as its
own kernel, the s x s tensors through memory, as the first Megatron-LM did.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, ContextManager

from simcluster.numerics.tensor import ITEMSIZE

KERNELS = ("flash", "unfused")


def _sizes(q: Any, k: Any) -> tuple[int, int, float]:
    b, a, sq, d = q.shape
    return b * a * sq * d, b * a * k.shape[2] * d, float(b * a * sq * k.shape[2] * d)


def forward(ops: Any, cfg: Any, q: Any, k: Any) -> ContextManager[None]:
    """Around the forward core on q (b, a, sq, d) and k (b, a, sk, d): one fused kernel, or nothing."""
    if cfg.attention_kernel != "flash":
        return nullcontext()
    nq, nk, prod = _sizes(q, k)
    part = 0.5 if cfg.causal else 1.0
    item = ITEMSIZE[cfg.dtype]
    return ops.fused("flash_attention", flops=4.0 * prod * part,
                     nbytes=item * (2 * nq + 2 * nk) + 4 * nq // q.shape[3])


def backward(ops: Any, cfg: Any, q: Any, k: Any) -> ContextManager[None]:
    """Around the backward core: reads q, o, dO, k, v and the statistics, writes dq, dk, dv."""
    if cfg.attention_kernel != "flash":
        return nullcontext()
    nq, nk, prod = _sizes(q, k)
    part = 0.5 if cfg.causal else 1.0
    item = ITEMSIZE[cfg.dtype]
    return ops.fused("flash_attention_backward", flops=10.0 * prod * part,
                     nbytes=item * (4 * nq + 4 * nk) + 8 * nq // q.shape[3])


def statistics_bytes(*, s: int, b: int, a: int) -> int:
    """What the forward keeps for the backward besides q, k, v, o: one fp32 per query row and head."""
    return 4 * math.prod((s, b, a))
