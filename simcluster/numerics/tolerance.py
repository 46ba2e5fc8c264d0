"""How far a fast-mode run may fall from another fast-mode run of the same training, and why.

Exact mode needs no tolerance: every layout gives the single-device bytes. Fast mode computes as a GPU
does (numerics/modes.py: 16-bit or fp32 storage, every sum accumulated in fp32), and a distributed run
does the same operations as one device except for the ORDER of the sums it splits (partial sums over
shards, all-reduces, micro-batch accumulation). What may differ, then, is rounding; the bound below
is derived from the unit roundoff and the reduction lengths, not fitted. (One sum is in storage: the
16-bit gradients' all-reduce over data-parallel ranks, as NCCL's; its roundings are the storage
rounding of its rounding point, a few times over, well inside the bound's six deviations.)

Unit roundoffs: storage u_s = 2^-8 (bf16), 2^-11 (fp16), 2^-24 (fp32); accumulation u_a = 2^-24.

1. One reduction point. A sum of n terms accumulated in either order lies within about sqrt(n) u_a
   (relative, for sums that do not cancel badly) of the exact sum, in the probabilistic sense of Higham
   & Mary (2019, "A new approach to probabilistic rounding error analysis": |error| <= lambda sqrt(n) u
   with probability >= 1 - 2 exp(-lambda^2 / 2)). Rounding the sum to storage adds at most u_s. So each
   run's value at a rounding point carries a relative error delta = u_s + sqrt(n) u_a, with n the
   longest reduction in the model (the hidden and FFN widths, the sequence, the vocabulary, and the
   tokens of a step, over which weight gradients are summed).
2. Propagation. The errors made at the R rounding points between the inputs and a tensor enter it
   to first order with factors of order one (layer norms renormalise, residual streams add); treated as
   independent, zero-mean and at most delta each (standard deviation delta / sqrt(3) for
   round-to-nearest), they add in quadrature: each run's error has standard deviation
   delta sqrt(R / 3), and the difference of two runs delta sqrt(2R / 3).
3. The bound. lambda = 6 standard deviations (the chance that a correct run exceeds it is below 1e-8
   per tensor in this model): eps(R) = 6 delta sqrt(2R / 3), per tensor, by relative norm error
   ||a - b|| / ||b||.

R counts rounding points per block: about 15 on the forward path (two per norm, one per GEMM, three in
the softmax, one per residual add, the activation) and 30 more backward; the embedding and the
head add 6. The loss of step k follows k - 1 whole steps before its forward (their updates move the
weights it uses); the first step's gradients follow one forward and one backward. Later gradients,
the weights and Adam's moments are not compared: Adam divides by the root of the second moment, which
turns float noise on a gradient whose true value is zero (the key bias's, whose effect softmax cancels)
into an update of size lr; that noise is real but says nothing about the program's correctness.

A broken program (a swapped shard, a missing all-reduce, a wrong merge) changes a gradient by a
relative amount of order one, far above eps for every dtype: tests/test_fast_mode.py shows both sides.
"""

from __future__ import annotations

import math
import re
from typing import Callable

UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -24, "fp64": 2.0 ** -53}
ACCUMULATION = 2.0 ** -24  # fp32 accumulators (fp64 data accumulates in fp64: see delta)
FORWARD_PER_BLOCK, BACKWARD_PER_BLOCK, ENDS = 15, 30, 6
SIGMAS = 6.0


def delta(dtype: str, longest_sum: int) -> float:
    """A rounding point's relative error: storage rounding plus the accumulation's sqrt(n) u."""
    acc = UNIT_ROUNDOFF["fp64"] if dtype == "fp64" else ACCUMULATION
    return UNIT_ROUNDOFF[dtype] + math.sqrt(longest_sum) * acc


def bound(dtype: str, longest_sum: int, rounding_points: int) -> float:
    """eps(R) = 6 delta sqrt(2R/3): the largest relative norm error two correct runs may show."""
    return SIGMAS * delta(dtype, longest_sum) * math.sqrt(2.0 * rounding_points / 3.0)


def training_bounds(dtype: str, layers: int, longest_sum: int) -> Callable[[str], float | None]:
    """The bound for each output of a training run by name (`loss[k]`, `first_grads.NAME`); None for
    the outputs that are not compared (see the module's docstring)."""
    forward = FORWARD_PER_BLOCK * layers + ENDS
    step = forward + BACKWARD_PER_BLOCK * layers + ENDS

    def of(name: str) -> float | None:
        loss = re.fullmatch(r"loss\[(\d+)\]", name)
        if loss:
            return bound(dtype, longest_sum, int(loss.group(1)) * step + forward)
        if name.startswith("first_grads."):
            return bound(dtype, longest_sum, step)
        return None
    return of
