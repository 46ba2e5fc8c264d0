"""DeepSpeed-Ulysses attention (Jacobs et al. 2023): sequence-sharded in, head-sharded inside.

Each of P ranks holds s/P tokens of every sequence with all heads. Around the attention core:
  1. all-to-all q, k, v: (b, a, s/P, d) -> (b, a/P, s, d), split by heads, gathered by sequence;
  2. the ordinary attention core on a/P heads over the whole sequence;
  3. all-to-all the output back: (b, a/P, s, d) -> (b, a, s/P, d).
The backward pass runs the same all-to-alls on the gradients, in reverse. Grouped-query attention's
key/value heads taken as they are (model.gqa = "native") go by kv heads: each rank gets its share of them
with the query heads that share them (a tp rank's kv heads split P ways: parallelism.py checks).
"""

from __future__ import annotations

from typing import Any, Generator

from simcluster.parallel.local_attention import core_backward


def to_heads(ctx: Any, x: Any, group: Any) -> Generator[Any, Any, Any]:
    """(b, a, s/P, d) -> (b, a/P, s, d)."""
    return (yield ctx.comm.all_to_all(x, group=group, split_dim=1, concat_dim=2))


def to_sequence(ctx: Any, x: Any, group: Any) -> Generator[Any, Any, Any]:
    """(b, a/P, s, d) -> (b, a, s/P, d)."""
    return (yield ctx.comm.all_to_all(x, group=group, split_dim=2, concat_dim=1))


def forward(model: Any, q: Any, k: Any, v: Any, layer: int, step: int, where: Any) -> Generator[Any, Any, Any]:
    """The attention output for this rank's tokens, and what backward needs."""
    ctx, group = model.ctx, model.cp
    qh, kh, vh = yield [ctx.comm.all_to_all(t, group=group, split_dim=1, concat_dim=2, async_op=True)
                        for t in (q, k, v)]
    core = model.core(qh, kh, vh, layer, step, where)
    out = yield from to_sequence(ctx, core["out"], group)
    return out, core | {"q": qh, "k": kh, "v": vh}


def backward(model: Any, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
    ctx, group = model.ctx, model.cp
    dout_h = yield from to_heads(ctx, dout, group)
    dq, dk, dv = core_backward(model, dout_h, core)
    return (yield [ctx.comm.all_to_all(t, group=group, split_dim=2, concat_dim=1, async_op=True)
                   for t in (dq, dk, dv)])
