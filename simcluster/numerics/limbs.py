"""Exact sums as integer limbs (DESIGN.md, numerics rule 1).

A real number in the window is held as LIMBS int64 digits of LIMB_BITS bits:

    value = sum_i limbs[..., i] * 2**(WINDOW_LO + LIMB_BITS * i)

After `normalize`, every limb but the top one lies in [0, 2**LIMB_BITS); the top limb is signed and
absorbs carries, so a normalized sum of terms each below 2**WINDOW_HI in magnitude can grow to
about 2**(WINDOW_HI + 31) before the top limb overflows. Integer addition is associative, so limbs
summed in any order, any split, over any number of ranks, give the same digits.

Bits of a term below 2**WINDOW_LO are dropped by flooring each term on its own: a deterministic
function of the term, so the sum of floored terms is still independent of order.
"""

from __future__ import annotations

import numpy as np

LIMB_BITS = 32
LIMBS = 4
WINDOW_LO = -96  # weight of the lowest limb's unit: 2**-96
WINDOW_HI = WINDOW_LO + LIMB_BITS * (LIMBS - 1)  # weight of the top limb's unit: 2**0

# The top limb's unit is 2**WINDOW_HI; a term may use the top limb's low 31 bits as well, so the
# largest accepted term magnitude is 2**(WINDOW_HI + 31).
TERM_LIMIT_EXP = WINDOW_HI + 31
_RADIX = float(2**LIMB_BITS)
_MASK = np.int64(2**LIMB_BITS - 1)


def from_float64(x: np.ndarray) -> np.ndarray:
    """Split float64 terms into limbs exactly (sub-window bits floored). Shape (*x.shape, LIMBS)."""
    x = np.asarray(x, dtype=np.float64)
    if not np.all(np.isfinite(x)):
        bad = np.argwhere(~np.isfinite(x))[0]
        raise FloatingPointError(f"non-finite term {float(x[tuple(bad)])!r} at index {tuple(int(i) for i in bad)}")
    if x.size and np.max(np.abs(x)) >= 2.0**TERM_LIMIT_EXP:
        big = float(np.max(np.abs(x)))
        raise OverflowError(
            f"term of magnitude {big!r} is outside the exact window "
            f"[2**{WINDOW_LO}, 2**{TERM_LIMIT_EXP}); rescale the inputs or widen the window"
        )
    # Scaling by a power of two is exact; floor makes an integer-valued float64.
    v = np.floor(np.ldexp(x, -WINDOW_LO))
    out = np.empty(x.shape + (LIMBS,), dtype=np.int64)
    for i in range(LIMBS - 1):
        q = np.floor(v / _RADIX)
        out[..., i] = (v - q * _RADIX).astype(np.int64)  # exact: the low bits of an exact integer
        v = q
    out[..., LIMBS - 1] = v.astype(np.int64)
    return out


def normalize(limbs: np.ndarray) -> np.ndarray:
    """Propagate carries so that all limbs but the top lie in [0, 2**LIMB_BITS). Returns a new array."""
    out = np.array(limbs, dtype=np.int64, copy=True)
    for i in range(LIMBS - 1):
        carry = out[..., i] >> LIMB_BITS  # arithmetic shift: floor division, also for negatives
        out[..., i] &= _MASK
        out[..., i + 1] += carry
    return out


def sum_terms(terms: np.ndarray, axis: int) -> np.ndarray:
    """Exact sum of float64 terms along `axis`, as normalized limbs of the remaining shape."""
    limbs = from_float64(terms)
    axis = axis % terms.ndim
    return normalize(limbs.sum(axis=axis))


def to_float(limbs: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Round normalized limbs to `dtype`. Deterministic; a function of the exact value only.

    Horner's scheme from the lowest limb in float64 keeps the error below one float64 ulp before
    the final cast. (Correct rounding in every halfway case is left to the numerics issue; what the
    exactness contract needs is a deterministic function of the exact value, which this is.)
    """
    limbs = normalize(limbs)
    # Work on the magnitude: with every limb non-negative, Horner's sum has no cancellation.
    negative = limbs[..., LIMBS - 1] < 0
    mag = normalize(np.where(negative[..., None], -limbs, limbs))
    acc = mag[..., 0].astype(np.float64)
    for i in range(1, LIMBS):
        acc = acc / _RADIX + mag[..., i].astype(np.float64)
    return np.ldexp(np.where(negative, -acc, acc), WINDOW_HI).astype(dtype)
