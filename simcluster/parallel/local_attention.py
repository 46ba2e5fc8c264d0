"""Attention without context parallelism (cp = 1): every rank holds the whole sequence of its heads, so
nothing is exchanged; the block's own core runs (TransformerShard.core: the scores, softmax, dropout
and output, or one fused kernel), and its backward pass is the single-device model's. The same
interface as the attentions that exchange (ulysses.py, ring_attention.py, allgather_attention.py,
rsa.py): a `forward` and a `backward`, each a generator, here one that yields nothing."""

from __future__ import annotations

from typing import Any, Generator


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any) -> Generator[Any, Any, Any]:
    core = model.core(q, k, v, layer, step, where)
    return core["out"], core | {"q": q, "k": k, "v": v}
    yield  # (a generator, as the others)


def backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    return model.gpt.attention_backward(dout, expanded(model, core), model.kv_fold())
    yield  # (a generator, as the others)


def expanded(model: Any, core: dict[str, Any]) -> dict[str, Any]:
    """What the backward pass takes: the kept key/value heads as the query heads see them (the shard's
    expand_kv; the kept ones are the kv heads, with grouped-query attention's heads as they are)."""
    return core | {"k": model.expand_kv(core["k"]), "v": model.expand_kv(core["v"])}
