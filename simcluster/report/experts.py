"""The report's `experts` entry: how a mixture of experts routed the last step's tokens.

Per MoE layer, the tokens that chose each expert (each token counts once for each of its top_k
choices) and those each expert computed (fewer where a capacity dropped some), summed over every
rank; the busiest expert against an even share (`imbalance`: max / mean, 1 when balanced), which is
how much longer its GEMMs run than a balanced routing's would. In exact and fast mode these are the
run's own counts (compared with one device's like any output); meta mode has no numbers to route by,
so they are the stated shares (model.moe_skew), and the entry says so.
"""

from __future__ import annotations

from typing import Any

from simcluster.model.moe import stated


def account(model: Any, last_step: int, counts: dict[str, Any] | None, sequences: int) -> dict[str, Any]:
    """The `experts` entry for a model with experts (ModelConfig): from the run's router statistics
    (composed.router_statistics), or, with none (meta mode), from the statement over `sequences`."""
    moe = model.moe
    layers = [i for i in range(model.layers) if model.is_moe(i)]
    tallied: dict[int, tuple[list[int], list[int]]] = {}
    if counts is None:
        chosen, computed = stated(1, model.seq, moe, model.moe_skew).tally()
        tallied = {i: ([int(n) * sequences for n in chosen], [int(n) * sequences for n in computed]) for i in layers}
    else:
        for i in layers:
            key = f"routing[{last_step}].layers.{i}"
            if f"{key}.chosen" in counts:
                tallied[i] = ([int(n) for n in counts[f"{key}.chosen"]], [int(n) for n in counts[f"{key}.computed"]])
    rows = []
    for i, (chosen, computed) in sorted(tallied.items()):
        mean = sum(chosen) / len(chosen)
        rows.append({"layer": i, "tokens_per_expert": chosen, "computed_per_expert": computed,
                     "dropped": sum(chosen) - sum(computed), "imbalance": max(chosen) / mean if mean else 1.0})
    how = f"stated routing, moe_skew {model.moe_skew:g}" if counts is None else "the run's routing"
    return {"experts": {"routing": how,
                        "step": last_step, "experts": moe.experts, "top_k": moe.top_k, "layers": rows}}
