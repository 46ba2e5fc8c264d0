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

import ml_dtypes
import numpy as np

LIMB_BITS = 32
LIMBS = 6
WINDOW_LO = -160  # weight of the lowest limb's unit: 2**-160 (below float32's smallest, 2**-149)
WINDOW_HI = WINDOW_LO + LIMB_BITS * (LIMBS - 1)  # weight of the top limb's unit: 2**0

# The top limb's unit is 2**WINDOW_HI and it is a signed int64. A term (or one exact sum added at
# once) must stay below 2**TERM_LIMIT_EXP, which leaves 2**22 additions of headroom before the top
# limb could overflow: far more than any number of ranks or slices adds up.
TERM_LIMIT_EXP = WINDOW_HI + 40
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


def add_scaled_integers(acc: np.ndarray, r: np.ndarray, exponent: int) -> None:
    """acc += r * 2**exponent exactly, for integer-valued `r` (|r| < 2**53) and exponent >= WINDOW_LO.

    `acc` holds limbs, not necessarily normalized (carries stay pending until `normalize`).
    """
    e = exponent - WINDOW_LO
    if e < 0:
        raise OverflowError(f"a term of weight 2**{exponent} lies below the exact window 2**{WINDOW_LO}")
    r = np.asarray(r)
    if r.size:
        big = float(np.max(np.abs(r)))
        if big and np.ldexp(big, exponent) >= 2.0**TERM_LIMIT_EXP:
            raise OverflowError(f"a sum of magnitude {np.ldexp(big, exponent):.4g} is outside the exact window "
                                f"[2**{WINDOW_LO}, 2**{TERM_LIMIT_EXP}); rescale the inputs")
    v = r.astype(np.int64)
    i, o = divmod(e, LIMB_BITS)
    top = LIMBS - 1
    if i >= top:  # lands in the signed top limb as a whole (small: checked above)
        acc[..., top] += v << (LIMB_BITS * (i - top) + o)
        return
    acc[..., i] += (v & ((1 << (LIMB_BITS - o)) - 1)) << o
    v = v >> (LIMB_BITS - o)  # arithmetic shift: floor, so negative values carry correctly
    for j in range(i + 1, top):
        acc[..., j] += v & _MASK
        v = v >> LIMB_BITS
    acc[..., top] += v


def sum_terms(terms: np.ndarray, axis: int) -> np.ndarray:
    """Exact sum of float64 terms along `axis`, as normalized limbs of the remaining shape."""
    limbs = from_float64(terms)
    axis = axis % terms.ndim
    return normalize(limbs.sum(axis=axis))


BF16 = np.dtype(ml_dtypes.bfloat16)
_PRECISION = {np.dtype(np.float32): 24, np.dtype(np.float16): 11, BF16: 8}  # significant bits


def _round_to_format(mag: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Correctly rounded (to nearest, ties to even) non-negative value of normalized magnitude limbs.

    The leading bits are kept, every bit below them folded into a sticky bit: a value with two or
    three bits more than the target's precision and the sticky bit last, exact in float32, rounds to
    the target exactly as the exact value would, in one rounding (bf16 goes through float32, where the
    value is still exact).
    """
    precision = _PRECISION[dtype]
    top = LIMBS - 1
    ext = np.concatenate([mag[..., :top], mag[..., top:] & _MASK, mag[..., top:] >> LIMB_BITS], axis=-1)
    ext = ext.astype(np.uint64)  # every digit now below 2**32
    n = ext.shape[-1]
    nonzero = ext != 0
    lead = n - 1 - np.argmax(nonzero[..., ::-1], axis=-1)  # index of the leading digit
    lead = np.where(nonzero.any(axis=-1), lead, 0)
    below = np.maximum(lead - 1, 0)
    hi = np.take_along_axis(ext, lead[..., None], -1)[..., 0]
    lo = np.where(lead > 0, np.take_along_axis(ext, below[..., None], -1)[..., 0], np.uint64(0))
    top64 = (hi << np.uint64(LIMB_BITS)) | lo  # value = top64 * 2**(32*(lead-1)) + rest
    index = np.arange(n)
    sticky = ((ext != 0) & (index < (lead - 1)[..., None])).any(axis=-1)
    bits = np.frexp(top64.astype(np.float64))[1].astype(np.int64)  # bit length, or one more
    shift = np.maximum(bits - (precision + 3), 0).astype(np.uint64)
    kept = top64 >> shift
    sticky |= (top64 & ((np.uint64(1) << shift) - np.uint64(1))) != 0
    m = (kept << np.uint64(1)) | sticky.astype(np.uint64)  # at most precision + 4 bits: exact in float32
    exponent = shift.astype(np.int64) - 1 + LIMB_BITS * (np.where(lead > 0, lead, 1) - 1) + WINDOW_LO
    exponent = np.where(lead > 0, exponent, WINDOW_LO)
    value = np.ldexp(m.astype(np.float64), exponent)
    return value.astype(np.float32).astype(dtype) if dtype == BF16 else value.astype(dtype)


def to_float(limbs: np.ndarray, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Round normalized limbs once to `dtype`: correctly rounded for float32, bfloat16 and float16.

    float64 results (used only by fast mode and diagnostics) come from Horner's scheme on the
    magnitude, within an ulp.
    """
    limbs = normalize(limbs)
    negative = limbs[..., LIMBS - 1] < 0
    mag = normalize(np.where(negative[..., None], -limbs, limbs))  # all digits non-negative
    dt = np.dtype(dtype)
    if dt in _PRECISION:
        out = _round_to_format(mag, dt)
        return np.where(negative, -out, out).astype(dt)
    acc = mag[..., 0].astype(np.float64)
    for i in range(1, LIMBS):
        acc = acc / _RADIX + mag[..., i].astype(np.float64)
    return np.ldexp(np.where(negative, -acc, acc), WINDOW_HI).astype(dt)
