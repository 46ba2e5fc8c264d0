"""exp, log, expm1 and tanh from +, -, *, /, floor and ldexp only (numerics rule 3).

numpy's own exp/log may take SIMD or scalar paths that differ in the last bit depending on an
array's length, alignment or stride. These use only correctly rounded IEEE operations, element by
element, so an element gets the same bits wherever it sits. Computed in float64 (errors of a few
float64 ulps), then rounded once to the working dtype by the caller.
"""

from __future__ import annotations

import numpy as np

_LN2_HI = 6.93147180369123816490e-01  # ln 2 split so that n * _LN2_HI is exact for |n| < 2**20
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00


def _taylor_exp_minus_one(r: np.ndarray, terms: int) -> np.ndarray:
    """e**r - 1 for small |r|, by Horner on the Taylor series."""
    acc = np.full_like(r, 1.0 / _factorial(terms))
    for k in range(terms - 1, 0, -1):
        acc = acc * r + 1.0 / _factorial(k)
    return acc * r


def _factorial(k: int) -> float:
    out = 1.0
    for i in range(2, k + 1):
        out *= i
    return out


def exp(x: np.ndarray) -> np.ndarray:
    """e**x in float64; overflow gives inf and underflow 0, as IEEE exp does."""
    x = np.asarray(x, dtype=np.float64)
    big = x > 709.0
    small = x < -745.0
    xc = np.clip(np.where(np.isnan(x), 0.0, x), -745.0, 709.0)
    n = np.floor(xc * _INV_LN2 + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO  # |r| <= ln2/2 (+ a hair)
    p = 1.0 + _taylor_exp_minus_one(r, 17)
    # ldexp in two halves keeps subnormal results exact-to-rounding
    half = np.floor(n / 2)
    out = np.ldexp(np.ldexp(p, half.astype(np.int64)), (n - half).astype(np.int64))
    out = np.where(big, np.inf, np.where(small, 0.0, out))
    return np.where(np.isnan(x), np.nan, out)


def expm1(x: np.ndarray) -> np.ndarray:
    """e**x - 1 in float64, accurate near 0."""
    x = np.asarray(x, dtype=np.float64)
    near = np.abs(x) < 0.5
    small = _taylor_exp_minus_one(np.where(near, x, 0.0), 22)
    return np.where(near, small, exp(x) - 1.0)


def log(x: np.ndarray) -> np.ndarray:
    """Natural log in float64: log(m * 2**e) = e ln2 + 2 atanh((m - 1) / (m + 1))."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(np.where(np.isfinite(x) & (x > 0), x, 1.0))  # x = m * 2**e, m in [0.5, 1)
    low = m < 0.7071067811865476
    m = np.where(low, m * 2.0, m)
    e = np.where(low, e - 1, e).astype(np.float64)
    s = (m - 1.0) / (m + 1.0)  # |s| <= 0.1716
    s2 = s * s
    acc = np.full_like(s, 1.0 / 23.0)
    for k in range(21, 0, -2):
        acc = acc * s2 + 1.0 / k
    out = (e * _LN2_HI + 2.0 * s * acc) + e * _LN2_LO
    out = np.where(x == 0, -np.inf, out)
    out = np.where(x < 0, np.nan, out)
    out = np.where(np.isposinf(x), np.inf, out)
    return np.where(np.isnan(x), np.nan, out)


def tanh(x: np.ndarray) -> np.ndarray:
    """tanh in float64 via expm1 (no cancellation near 0)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), 20.0)  # tanh(20) rounds to 1 in float64
    t = expm1(2.0 * a)
    out = t / (t + 2.0)
    return np.where(x < 0, -out, out)
