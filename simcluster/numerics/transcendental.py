"""exp, log, expm1 and tanh from +, -, *, /, floor and ldexp only (numerics rule 3).

numpy's own exp/log may take SIMD or scalar paths that differ in the last bit depending on an
array's length, alignment or stride. These use only correctly rounded IEEE operations, element by
element, so an element gets the same bits wherever it sits. Computed in float64 (errors of a few
float64 ulps), then rounded once to the working dtype by the caller. Written against an array
namespace `xp` (arrays.py; numpy's unless said): torch's correctly rounded +, -, *, / give the same bits.
"""

from __future__ import annotations

from typing import Any

from simcluster.numerics.arrays import NUMPY

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00


def _taylor_exp_minus_one(r: Any, terms: int, xp: Any) -> Any:
    """e**r - 1 for small |r|, by Horner on the Taylor series."""
    acc = xp.full_like(r, 1.0 / _factorial(terms))
    for k in range(terms - 1, 0, -1):
        acc = acc * r + 1.0 / _factorial(k)
    return acc * r


def _factorial(k: int) -> float:
    out = 1.0
    for i in range(2, k + 1):
        out *= i
    return out


def exp(x: Any, xp: Any = NUMPY) -> Any:
    """e**x in float64; overflow gives inf and underflow 0, as IEEE exp does."""
    x = xp.astype(x, "fp64", copy=False)
    big = x > 709.0
    small = x < -745.0
    xc = xp.clip(xp.where(xp.isnan(x), 0.0, x), -745.0, 709.0)
    n = xp.floor(xc * _INV_LN2 + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2/2 (+ a hair)
    p = 1.0 + _taylor_exp_minus_one(r, 17, xp)
    # ldexp in two halves keeps subnormal results exact-to-rounding
    half = xp.floor(n / 2)
    out = xp.ldexp(xp.ldexp(p, half), n - half)
    out = xp.where(big, float("inf"), xp.where(small, 0.0, out))
    return xp.where(xp.isnan(x), float("nan"), out)


def expm1(x: Any, xp: Any = NUMPY) -> Any:
    """e**x - 1 in float64, accurate near 0."""
    x = xp.astype(x, "fp64", copy=False)
    near = xp.abs(x) < 0.5
    small = _taylor_exp_minus_one(xp.where(near, x, 0.0), 22, xp)
    return xp.where(near, small, exp(x, xp) - 1.0)


def log(x: Any, xp: Any = NUMPY) -> Any:
    """Natural log in float64: log(m * 2**e) = e ln2 + 2 atanh((m - 1) / (m + 1))."""
    x = xp.astype(x, "fp64", copy=False)
    m, e = xp.frexp(xp.where(xp.isfinite(x) & (x > 0), x, 1.0))  # x = m * 2**e, m in [0.5, 1)
    low = m < 0.7071067811865476
    m = xp.where(low, m * 2.0, m)
    e = xp.astype(xp.where(low, e - 1, e), "fp64")
    s = (m - 1.0) / (m + 1.0)  # |s| <= 0.1716
    s2 = s * s
    acc = xp.full_like(s, 1.0 / 23.0)
    for k in range(21, 0, -2):
        acc = acc * s2 + 1.0 / k
    out = (e * _LN2_HI + 2.0 * s * acc) + e * _LN2_LO
    out = xp.where(x == 0, float("-inf"), out)
    out = xp.where(x < 0, float("nan"), out)
    out = xp.where(x == float("inf"), float("inf"), out)
    return xp.where(xp.isnan(x), float("nan"), out)


def tanh(x: Any, xp: Any = NUMPY) -> Any:
    """tanh in float64 via expm1 (no cancellation near 0)."""
    x = xp.astype(x, "fp64", copy=False)
    a = xp.minimum(xp.abs(x), 20.0)  # tanh(20) rounds to 1 in float64
    t = expm1(2.0 * a, xp)
    out = t / (t + 2.0)
    return xp.where(x < 0, -out, out)
