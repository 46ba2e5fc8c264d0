"""Time to a target loss against batch size: where adding GPUs stops paying.

McCandlish et al. 2018 ("An Empirical Model of Large-Batch Training"): to reach a given loss with
batch B, training takes S = S_min (1 + B_noise / B) optimizer steps and E = E_min (1 + B / B_noise)
examples, where S_min is the fewest steps (an infinite batch), E_min the fewest examples (a tiny
batch), and B_noise = E_min / S_min the gradient noise scale; (S / S_min - 1)(E / E_min - 1) = 1.
Below B_noise a larger batch cuts the steps almost in proportion; above it, hardly at all, while
the examples (and GPU-hours) grow. Here B and E are counted in tokens, as language-model papers do
(Kaplan et al. 2020 fit B_crit(L) ~ 2e8 tokens / L^(1/0.21) for the loss L in nats).

Combined with the simulated step time of a layout at that batch, the wall time to the target is
S x step time, and its GPU-hours S x step time x GPUs: a [compare] over data-parallel degrees (and
the batch that comes with them) draws the curve of wall time against GPUs.
"""

from __future__ import annotations

from typing import Any

from simcluster.config.schema import TargetSection


def steps(batch: float, b_noise: float, s_min: float) -> float:
    """Optimizer steps to the target with batch `batch`."""
    return s_min * (1.0 + b_noise / batch)


def examples(batch: float, b_noise: float, e_min: float) -> float:
    """Examples (tokens) consumed to reach the target with batch `batch`."""
    return e_min * (1.0 + batch / b_noise)


def account(target: TargetSection, *, step_s: float, tokens_per_step: int, gpus: int) -> dict[str, Any]:
    """The report's `target` section from the scenario's [target] values and the simulated step."""
    b_noise, e_min = target.b_noise_tokens, target.e_min_tokens
    s_min = e_min / b_noise
    s = steps(tokens_per_step, b_noise, s_min)
    wall = s * step_s
    return {"batch_tokens": tokens_per_step, "b_noise_tokens": b_noise, "e_min_tokens": e_min, "s_min": s_min,
            "steps": s, "tokens": examples(tokens_per_step, b_noise, e_min), "step_s": step_s, "wall_s": wall,
            "gpus": gpus, "gpu_hours": wall * gpus / 3600.0,
            "time_efficiency": s_min / s, "data_efficiency": b_noise / (b_noise + tokens_per_step)}
