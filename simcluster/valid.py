"""The valid values an error message lists: divisors, found in O(sqrt n) and shortened when many (a
scenario may say seq = 10^12, whose divisors a loop to n would take hours to list)."""

from __future__ import annotations

import math
from typing import Callable, Iterable


def divisors(n: int, keep: Callable[[int], bool] | None = None) -> list[int]:
    """The divisors of n >= 1 in order (those `keep` accepts)."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    out = small + large[::-1]
    return [d for d in out if keep(d)] if keep is not None else out


def listed(values: Iterable[int], most: int = 16) -> str:
    """'1, 2, 4' -- or the first and last few of a long list, with how many lie between."""
    values = list(values)
    if len(values) <= most:
        return ", ".join(map(str, values))
    half = most // 2
    return (", ".join(map(str, values[:half])) + f", ... ({len(values) - 2 * half} more), "
            + ", ".join(map(str, values[-half:])))
