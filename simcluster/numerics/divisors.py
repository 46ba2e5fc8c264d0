"""The valid values an error message lists: divisors, found in O(sqrt n) and shortened when many (a
scenario may say seq = 10^12, whose divisors a loop to n would take hours to list)."""

from __future__ import annotations

import math
from typing import Callable, Iterable


LARGEST = 2**20  # the largest divisor listed of an n past LARGEST^2: above any degree (budget.MAX_RANKS is 2^18)


def divisors(n: int, keep: Callable[[int], bool] | None = None) -> list[int]:
    """The divisors of n >= 1 in order (those `keep` accepts); of an n past 2^40, those up to 2^20 only
    (a scenario may give a size of 400 digits, whose square root no loop reaches)."""
    small, large = [], []
    root = math.isqrt(n)
    for d in range(1, min(root, LARGEST) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d and root <= LARGEST:
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
