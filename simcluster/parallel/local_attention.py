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
    return core_backward(model, dout, core)
    yield  # (a generator, as the others)


def core_backward(model: Any, dout: Any, core: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The core's backward (model.core's, here and in ulysses.py) on the kept key/value heads as the query
    heads see them (the shard's expand_kv), their gradients folded onto the kv heads where the shard takes
    them as they are (fold_kv)."""
    return model.gpt.attention_backward(dout, core | {"k": model.expand_kv(core["k"]), "v": model.expand_kv(core["v"])},
                                        model.fold_kv if model.folds else None)
