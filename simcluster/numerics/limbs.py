"""Exact sums as integer limbs (DESIGN.md, numerics rule 1).

A real number in the window is held as LIMBS int64 digits of LIMB_BITS bits:

    value = sum_i limbs[..., i] * 2**(WINDOW_LO + LIMB_BITS * i)

After `normalize`, every limb but the top one lies in [0, 2**LIMB_BITS); the top limb is signed and
absorbs carries, so a normalized sum of terms each below 2**WINDOW_HI in magnitude can grow to
about 2**(WINDOW_HI + 31) before the top limb overflows. Integer addition is associative, so limbs
summed in any order, any split, over any number of ranks, give the same digits.

Bits of a term below 2**WINDOW_LO are dropped by flooring each term on its own: a deterministic
function of the term, so the sum of floored terms is still independent of order.

Written against an array namespace `xp` (arrays.py; numpy's unless said), in int64 and float64
arithmetic only, so that the torch backend keeps limbs on its device and gets the same digits.
"""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np

from simcluster.numerics.arrays import NUMPY
from simcluster.numerics.dtypes import dtype_name

LIMB_BITS = 32
LIMBS = 6
WINDOW_LO = -160  # weight of the lowest limb's unit: 2**-160 (below float32's smallest, 2**-149)
WINDOW_HI = WINDOW_LO + LIMB_BITS * (LIMBS - 1)  # weight of the top limb's unit: 2**0

# The top limb's unit is 2**WINDOW_HI and it is a signed int64. A term (or one exact sum added at
# once) must stay below 2**TERM_LIMIT_EXP, which leaves 2**22 additions of headroom before the top
# limb could overflow: far more than any number of ranks or slices adds up.
TERM_LIMIT_EXP = WINDOW_HI + 40
_RADIX = float(2**LIMB_BITS)
_MASK = 2**LIMB_BITS - 1


def from_float64(x: Any, xp: Any = NUMPY) -> Any:
    """Split float64 terms into limbs exactly (sub-window bits floored). Shape (*x.shape, LIMBS)."""
    x = xp.astype(x, "fp64", copy=False)
    if not xp.truth(xp.isfinite(x).all()):
        host = xp.to_host(x)
        bad = np.argwhere(~np.isfinite(host))[0]
        raise FloatingPointError(f"non-finite term {float(host[tuple(bad)])!r} at index {tuple(int(i) for i in bad)}")
    if math.prod(x.shape) and xp.truth(xp.abs(x).max() >= 2.0**TERM_LIMIT_EXP):
        big = float(xp.to_host(xp.abs(x).max()))
        raise OverflowError(
            f"term of magnitude {big!r} is outside the exact window "
            f"[2**{WINDOW_LO}, 2**{TERM_LIMIT_EXP}); rescale the inputs or widen the window"
        )
    # Scaling by a power of two is exact; floor makes an integer-valued float64.
    v = xp.floor(xp.ldexp(x, -WINDOW_LO))
    digits = []
    for _ in range(LIMBS - 1):
        q = xp.floor(v / _RADIX)
        digits.append(xp.astype(v - q * _RADIX, "int64"))  # exact: the low bits of an exact integer
        v = q
    digits.append(xp.astype(v, "int64"))
    return xp.stack(digits, -1)


def normalize(limbs: Any, xp: Any = NUMPY) -> Any:
    """Propagate carries so that all limbs but the top lie in [0, 2**LIMB_BITS). Returns a new array."""
    if limbs.shape[-1] != LIMBS:
        raise ValueError(f"limbs of shape {tuple(limbs.shape)}: the last dimension holds {LIMBS} digits")
    out = xp.astype(limbs, "int64", copy=True)
    low = out[..., :-1]
    for _ in range(LIMBS - 1):  # every digit's carry at once; after k rounds the k lowest digits are in range
        carry = low >> LIMB_BITS  # arithmetic shift: floor division, also for negatives
        if xp.cheap_truth and not xp.truth(xp.any(carry)):
            break  # (on the host, where looking costs nothing: most sums are done after a round or two)
        low &= _MASK
        out[..., 1:] += carry
    return out


def add_scaled_integers(acc: Any, r: Any, exponent: int, xp: Any = NUMPY) -> None:
    """acc += r * 2**exponent exactly, for integer-valued `r` (|r| < 2**53) and exponent >= WINDOW_LO.

    `acc` holds limbs, not necessarily normalized (carries stay pending until `normalize`).
    """
    e = exponent - WINDOW_LO
    if e < 0:
        raise OverflowError(f"a term of weight 2**{exponent} lies below the exact window 2**{WINDOW_LO}")
    if exponent + 53 > TERM_LIMIT_EXP and math.prod(r.shape):  # |r| < 2**53: only high weights can leave
        big = float(xp.to_host(xp.abs(r).max()))
        if big and math.ldexp(big, exponent) >= 2.0**TERM_LIMIT_EXP:
            raise OverflowError(f"a sum of magnitude {math.ldexp(big, exponent):.4g} is outside the exact window "
                                f"[2**{WINDOW_LO}, 2**{TERM_LIMIT_EXP}); rescale the inputs")
    v = xp.astype(r, "int64")
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


def sum_terms(terms: Any, axis: int, xp: Any = NUMPY) -> Any:
    """Exact sum of float64 terms along `axis`, as normalized limbs of the remaining shape."""
    limbs = from_float64(terms, xp)
    axis = axis % len(terms.shape)
    return normalize(xp.sum(limbs, axis), xp)


BF16 = np.dtype(ml_dtypes.bfloat16)
_PRECISION = {"fp32": 24, "fp16": 11, "bf16": 8}  # significant bits


def _round_to_format(mag: Any, name: str, xp: Any) -> Any:
    """Correctly rounded (to nearest, ties to even) non-negative value of normalized magnitude limbs.

    The leading bits are kept, every bit below them folded into a sticky bit: a value with two or
    three bits more than the target's precision and the sticky bit last, exact in float32, rounds to
    the target exactly as the exact value would, in one rounding (bf16 goes through float32, where the
    value is still exact). The leading two digits (hi, lo, each below 2**32) stand for their 64-bit
    concatenation without forming it: int64 arithmetic only.
    """
    precision = _PRECISION[name]
    top = LIMBS - 1
    ext = xp.concat([mag[..., :top], mag[..., top:] & _MASK, mag[..., top:] >> LIMB_BITS], -1)  # digits < 2**32
    n = ext.shape[-1]
    nonzero = ext != 0
    lead = (n - 1) - xp.argmax_last(xp.astype(xp.flip_last(nonzero), "int32"))  # index of the leading digit
    # (at least 1: a value in the lowest digit alone is the pair (0, that digit); zero is (0, 0))
    lead = xp.maximum(xp.where(xp.any(nonzero, -1), lead, 0), 1)
    hi = xp.gather_last(ext, lead)
    lo = xp.gather_last(ext, lead - 1)
    sticky = xp.any(nonzero & (xp.arange(n) < (lead - 1)[..., None]), -1)
    # bit length of hi * 2**32 + lo, or one more: its float64 rounding's exponent (both forms round the
    # exact integer once, to nearest)
    bits = xp.frexp(xp.astype(hi, "fp64") * 2.0**LIMB_BITS + xp.astype(lo, "fp64"))[1]
    shift = xp.maximum(bits - (precision + 3), 0)  # in [0, 54]
    wide = shift >= LIMB_BITS  # the kept bits all come from hi
    s_hi = xp.where(wide, shift - LIMB_BITS, 0)
    s_lo = xp.where(wide, 0, shift)
    kept = xp.where(wide, hi >> s_hi, (hi << (LIMB_BITS - s_lo)) | (lo >> s_lo))
    dropped = xp.where(wide, (lo != 0) | ((hi & ((1 << s_hi) - 1)) != 0), (lo & ((1 << s_lo) - 1)) != 0)
    sticky = sticky | dropped
    m = (kept << 1) | xp.astype(sticky, "int64")  # at most precision + 4 bits: exact in float32
    exponent = shift - 1 + LIMB_BITS * (lead - 1) + WINDOW_LO
    value = xp.ldexp(xp.astype(m, "fp64"), exponent)
    return xp.astype(xp.astype(value, "fp32"), name) if name == "bf16" else xp.astype(value, name)


_LEAST_EXP = {"fp32": -149, "fp16": -24, "bf16": -133}  # the least subnormal's exponent: the spacing at the bottom


def _horner(mag: Any, xp: Any) -> Any:
    """Non-negative digits' value in float64: each of the five additions (of non-negative numbers)
    rounds once, so its relative error is below 6 * 2**-53."""
    acc = xp.astype(mag[..., 0], "fp64")
    for i in range(1, LIMBS):
        acc = acc / _RADIX + xp.astype(mag[..., i], "fp64")
    return xp.ldexp(acc, WINDOW_HI)


def _round_via_float64(mag: Any, name: str, xp: Any) -> tuple[Any, Any]:
    """(r, sure): the magnitude's float64 value v rounded to `name`, and where r is certainly the
    correct rounding of the exact value: v lies inside r's interval of round-to-nearest (r less half
    the spacing below it, which halves at a power of two, to r plus half the spacing above) by more
    than 2**-48 v, far beyond v's error. Nearly every element is sure; the rest go the exact way."""
    v = _horner(mag, xp)
    r = xp.astype(v, name)
    r64 = xp.astype(r, "fp64")
    p, least = _PRECISION[name], _LEAST_EXP[name] + _PRECISION[name]  # least: the smallest normal's frexp exponent
    m, e = xp.frexp(r64)  # r64 = m 2**e, m in [0.5, 1); a zero's spacing is the subnormals'
    e = xp.maximum(xp.where(r64 == 0, least, e), least)
    up = xp.ldexp(1.0, e - p)
    down = xp.where((m == 0.5) & (e > least), up / 2, up)
    tol = v * 2.0**-48
    return r, (v - (r64 - down / 2) > tol) & ((r64 + up / 2) - v > tol) & xp.isfinite(r64)


def to_float(limbs: Any, dtype: Any = np.float32, xp: Any = NUMPY) -> Any:
    """Round normalized limbs once to `dtype`: correctly rounded for float32, bfloat16 and float16 --
    through float64 where that is certainly right, else from the digits (_round_to_format).

    float64 results (used only by fast mode and diagnostics) come from Horner's scheme on the
    magnitude, within an ulp.
    """
    limbs = normalize(limbs, xp)
    negative = limbs[..., LIMBS - 1] < 0
    mag = normalize(xp.where(negative[..., None], -limbs, limbs), xp)  # all digits non-negative
    name = dtype_name(dtype)
    if name in _PRECISION:
        out, sure = _round_via_float64(mag, name, xp)
        if not xp.truth(sure.all()):  # ties (a sum of two values often is one), and what lies within 2**-48 of one
            unsure = ~sure
            out[unsure] = _round_to_format(mag[unsure], name, xp)
        return xp.astype(xp.where(negative, -out, out), name)
    acc = _horner(mag, xp)
    return xp.astype(xp.where(negative, -acc, acc), name)
