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


def account(model: Any, mode: str, outputs: dict[str, Any] | None, last_step: int) -> dict[str, Any]:
    """The `experts` entry for a model with experts (ModelConfig), from the run's outputs (exact, fast)
    or the statement (meta)."""
    moe = model.moe
    layers = [i for i in range(model.layers) if model.is_moe(i)]
    counts: dict[int, tuple[list[int], list[int]]] = {}
    if mode == "meta":
        r = stated(1, model.seq, moe, model.moe_skew)
        chosen, computed = r.tally()
        batch = outputs["global_batch"] if outputs else 1
        counts = {i: ([int(n) * batch for n in chosen], [int(n) * batch for n in computed]) for i in layers}
    elif outputs is not None:
        for i in layers:
            key = f"routing[{last_step}].layers.{i}"
            if f"{key}.chosen" in outputs:
                counts[i] = ([int(n) for n in outputs[f"{key}.chosen"]], [int(n) for n in outputs[f"{key}.computed"]])
    rows = []
    for i, (chosen, computed) in sorted(counts.items()):
        mean = sum(chosen) / len(chosen)
        rows.append({"layer": i, "tokens_per_expert": chosen, "computed_per_expert": computed,
                     "dropped": sum(chosen) - sum(computed), "imbalance": max(chosen) / mean if mean else 1.0})
    how = f"stated routing, moe_skew {model.moe_skew:g}" if mode == "meta" else "the run's routing"
    return {"experts": {"routing": how,
                        "step": last_step, "experts": moe.experts, "top_k": moe.top_k, "layers": rows}}
