"""Goodput: the fraction of wall time a long job trains, given how often it is interrupted, what a
checkpoint costs, how long a restart takes, and the simulated step time; and the checkpoint interval
that maximises it.

Interruptions arrive at random, at a constant rate for the whole job (a Poisson process: `rate` per
GPU-hour times the GPUs; MTBF M = 1 / that). The job trains τ seconds, writes a checkpoint (C
seconds), and repeats; an interruption loses the work since the last checkpoint and costs a restart
(R seconds, during which another interruption can strike). The expected wall time of one segment of
τ + C is then exactly (Daly 2006, "A higher order estimate of the optimum checkpoint interval for
restart dumps", eq. 6 with failures during restart):

    E[T] = M · e^(R/M) · (e^((τ+C)/M) − 1)

and the goodput is τ / E[T]. Its maximum over τ is found numerically (the function is unimodal in
τ); Young's first-order optimum √(2 C M) (1974) and Daly's higher-order one
√(2 C M) · (1 + √(C/2M)/3 + (C/2M)/9) − C are reported beside it (tests/test_faults.py checks that the
numerical optimum approaches them as C/M shrinks). A checkpoint holds what docs/checkpoint.md
describes: fp32 master weights and two Adam moments, and the 16-bit working copy in mixed precision.
"""

from __future__ import annotations

import math
from typing import Any

from simcluster.config.schema import GoodputSection

BYTES_PER_PARAMETER = {"fp32": 12, "bf16": 14, "fp16": 14}  # master + adam_m + adam_v (+ working copy)


def segment_goodput(tau: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """The fraction of wall time that trains, checkpointing after every τ seconds of training."""
    if tau <= 0:
        return 0.0
    try:
        expected = mtbf_s * math.exp(restart_s / mtbf_s) * math.expm1((tau + checkpoint_s) / mtbf_s)
    except OverflowError:  # interruptions far more often than a segment lasts: nothing trains
        return 0.0
    return tau / expected


def best_tau(checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """The τ that maximises segment_goodput: golden-section search on log τ (unimodal)."""
    lo, hi = math.log(1e-6 * mtbf_s), math.log(50.0 * mtbf_s)
    ratio = (math.sqrt(5) - 1) / 2
    f = lambda x: segment_goodput(math.exp(x), checkpoint_s, restart_s, mtbf_s)  # noqa: E731
    a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
    fa, fb = f(a), f(b)
    for _ in range(200):
        if fa < fb:
            lo, a, fa = a, b, fb
            b = lo + ratio * (hi - lo)
            fb = f(b)
        else:
            hi, b, fb = b, a, fa
            a = hi - ratio * (hi - lo)
            fa = f(a)
    return math.exp((lo + hi) / 2)


def young(checkpoint_s: float, mtbf_s: float) -> float:
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def daly(checkpoint_s: float, mtbf_s: float) -> float:
    x = checkpoint_s / (2 * mtbf_s)
    return young(checkpoint_s, mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s if x < 1 else mtbf_s


def account(g: GoodputSection, *, step_s: float, gpus: int, parameters: int, dtype: str) -> dict[str, Any]:
    """The report's `goodput` section from the scenario's [goodput] values."""
    rate = g.interruptions_per_gpu_hour
    step_s = g.step_time_s or step_s
    mtbf = 3600.0 / (rate * gpus) if rate else math.inf
    size = parameters * BYTES_PER_PARAMETER[dtype]
    c = size / (g.storage_gbyte_per_s * 1e9) if g.storage_gbyte_per_s else math.inf
    r = g.restart_s
    out: dict[str, Any] = {"gpus": gpus, "interruptions_per_gpu_hour": rate, "mtbf_s": mtbf, "step_s": step_s,
                           "checkpoint_bytes": size, "checkpoint_s": c, "restart_s": r}
    if not math.isfinite(mtbf) or not math.isfinite(c) or step_s <= 0:
        return out | {"goodput": None, "why": "no interruptions, no storage bandwidth or no step time"}
    tau = best_tau(c, r, mtbf)
    k_best = max(1, min((max(1, math.floor(tau / step_s)), math.ceil(tau / step_s)),
                        key=lambda k: -segment_goodput(k * step_s, c, r, mtbf)))
    k = g.checkpoint_every_steps or k_best
    return out | {
        "checkpoint_every_steps": k, "goodput": segment_goodput(k * step_s, c, r, mtbf),
        "best_every_steps": k_best, "best_goodput": segment_goodput(k_best * step_s, c, r, mtbf),
        "best_interval_s": tau, "young_interval_s": young(c, mtbf), "daly_interval_s": daly(c, mtbf),
        "interruptions_per_day": 86400.0 / mtbf,
    }
