"""Exact sums of products, fast: slices of beta-bit integers, float64 BLAS, integer limbs.

Every float32 operand is first truncated toward zero to a multiple of 2**lo, an absolute grid (the
same for every rank, every shard, every shape), then cut into slices of beta-bit integers:

    x = sum_s X_s * 2**(lo' + s*beta),   X_s integers with |X_s| < 2**beta

where lo' >= lo is where the array's own bits begin (`slices`): a choice of cut, not of value. A
product of two slices summed over k terms is a sum of integers below k * 2**(2*beta) <= 2**53, so
float64 BLAS computes it exactly, in any order. Each such exact integer goes into the limbs at its
weight. What each element contributes depends only on it and the absolute grid, so any split of the
summed dimension, combined in any order, gives the same limbs: this is what makes tensor, sequence and
data parallel sums bit-exact.

Products: operands are truncated to multiples of 2**-80 (PRODUCT_LO) so that every product lands in
the limb window (2**-160). Values below 2**-80 in a matmul operand contribute nothing; that is a
deterministic rule of the kernel, the same in the reference and in every parallel version.
Sums of single values: no truncation (every float32 is a multiple of 2**-149).

Written against an array namespace `xp` (arrays.py; numpy's unless said): the slices' products are
float64 GEMMs on whatever device holds the data, exact there too (integers below 2**53).
"""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np

from simcluster.numerics import limbs as _limbs
from simcluster.numerics.arrays import NUMPY
from simcluster.numerics.dtypes import dtype_name

PRODUCT_LO = -80  # grid bottom for operands of products: 2 * PRODUCT_LO == limbs.WINDOW_LO
SUM_LO = -150  # grid bottom for sums of single float32 values (below float32's smallest subnormal)
assert 2 * PRODUCT_LO >= _limbs.WINDOW_LO and SUM_LO >= _limbs.WINDOW_LO


def _check_finite(x: Any, what: str, xp: Any = NUMPY) -> None:
    if not xp.truth(xp.isfinite(x).all()):
        host = xp.to_host(x)
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(host))[0])
        raise FloatingPointError(f"{what}: non-finite input {float(host[bad])!r} at index {bad}")


def slices(x: Any, beta: int, lo: int, xp: Any = NUMPY) -> list[tuple[int, Any]]:
    """[(e, X)]: x's non-zero slices, x == sum X * 2**e (after truncating x toward zero to a multiple
    of 2**lo), each X integer-valued float64 below 2**beta in magnitude, the e's lo' + s*beta.

    lo' is lo raised to the lowest bit that any element can set (by its exponent and its dtype's
    significand) where that lies above lo: no element loses a bit either way, so the slices sum to
    the same value, and values that span fewer bits than beta fit in one slice rather than straddling
    a boundary of the absolute grid. The grid's bottom moves; what each element contributes does not.
    """
    bits = _SIGNIFICAND.get(dtype_name(x.dtype), 53)  # an element's set bits lie in [e - bits, e)
    x64 = xp.astype(x, "fp64", copy=False)
    if not math.prod(x64.shape):
        return []
    mag = xp.abs(x64)
    top, least = (float(v) for v in xp.to_host(xp.stack([mag.max(), xp.where(mag > 0, mag, math.inf).min()], 0)))
    if top == 0.0:
        return []
    lo = max(lo, math.frexp(least)[1] - bits)  # (the least non-zero magnitude has the least exponent)
    n = -(-(math.frexp(top)[1] - lo) // beta)  # slices up to top's leading bit (top < 2**frexp(top)[1])
    if n <= 0:
        return []  # every element truncates to zero
    v = xp.trunc(xp.ldexp(x64, -lo))  # exact: a power-of-two scaling, truncating toward zero only below 2**lo
    radix = float(2**beta)
    lows = []
    for _ in range(n):  # signed: each slice the low beta bits of the magnitude, with the element's sign
        high = xp.trunc(v / radix)
        lows.append(v - high * radix)  # exact: integers
        v = high
    nonzero = [True] if n == 1 else xp.to_host(xp.any(xp.stack(lows, 0).reshape(n, -1), 1))
    return [(lo + s * beta, low) for s, low in enumerate(lows) if nonzero[s]]


def _beta(terms: int, operands: int) -> int:
    """Widest slice such that `terms` products of `operands` slices sum below 2**53."""
    return max(1, (53 - max(1, math.ceil(math.log2(terms + 1)))) // operands)


_SIGNIFICAND = {"fp32": 24, "bf16": 8, "fp16": 11}  # significant bits (IEEE 754; bfloat16's 7 stored + 1)
_SPEC = re.compile(r"^([a-z]+),([a-z]+)->([a-z]*)$")


def einsum(spec: str, a: Any, b: Any, xp: Any = NUMPY) -> Any:
    """Exact `np.einsum(spec, a, b)` for float32 operands, as normalized limbs (shape (*out, LIMBS))."""
    m = _SPEC.match(spec)
    if m is None:
        raise ValueError(f"exact einsum spec {spec!r} must look like 'ik,kj->ij' (letters only, two operands)")
    ia, ib, io = m.groups()
    if len(ia) != len(a.shape) or len(ib) != len(b.shape):
        raise ValueError(f"einsum {spec!r}: operands of shapes {a.shape} and {b.shape} do not fit")
    _check_finite(a, "exact einsum", xp)
    _check_finite(b, "exact einsum", xp)
    size = dict(zip(ia, a.shape))
    for letter, n in zip(ib, b.shape):
        if size.setdefault(letter, n) != n:
            raise ValueError(f"einsum {spec!r}: dimension {letter!r} is {size[letter]} in one operand and {n} in the other")
    out_shape = tuple(size[letter] for letter in io)
    terms = math.prod(size[letter] for letter in size if letter not in io)
    beta = _beta(terms, 2)
    acc = xp.zeros(out_shape + (_limbs.LIMBS,), "int64")
    b_slices = slices(b, beta, PRODUCT_LO, xp)
    for ea, xs in slices(a, beta, PRODUCT_LO, xp):
        for eb, ys in b_slices:
            r = xp.einsum(spec, xs, ys)  # exact: integers, all partial sums < 2**53
            _limbs.add_scaled_integers(acc, r, ea + eb, xp)
    return _limbs.normalize(acc, xp)


def matmul(a: Any, b: Any, xp: Any = NUMPY) -> Any:
    """Exact a @ b for a (..., m, k) and b (k, n) or (..., k, n), as limbs (..., m, n, LIMBS)."""
    if len(a.shape) < 2 or len(b.shape) < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul of shapes {a.shape} and {b.shape}: need (..., m, k) @ (..., k, n)")
    _check_finite(a, "exact matmul", xp)
    _check_finite(b, "exact matmul", xp)
    k = a.shape[-1]
    beta = _beta(k, 2)
    out_shape = tuple(np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2]))) + (a.shape[-2], b.shape[-1])
    acc = xp.zeros(out_shape + (_limbs.LIMBS,), "int64")
    b_slices = slices(b, beta, PRODUCT_LO, xp)
    for ea, xs in slices(a, beta, PRODUCT_LO, xp):
        for eb, ys in b_slices:
            _limbs.add_scaled_integers(acc, xp.matmul(xs, ys), ea + eb, xp)
    return _limbs.normalize(acc, xp)


def sum(x: Any, axis: int | tuple[int, ...] | None, xp: Any = NUMPY) -> Any:
    """Exact sum of float32 (or float64 holding float32) values over `axis`, as limbs."""
    x = xp.asarray(x)
    _check_finite(x, "exact sum", xp)
    ndim = len(x.shape)
    axes = tuple(range(ndim)) if axis is None else ((axis,) if isinstance(axis, int) else tuple(axis))
    axes = tuple(a % ndim for a in axes) if ndim else ()
    terms = math.prod(x.shape[a] for a in axes)
    beta = _beta(terms, 1)
    out_shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    acc = xp.zeros(out_shape + (_limbs.LIMBS,), "int64")
    for e, xs in slices(x, beta, SUM_LO, xp):
        _limbs.add_scaled_integers(acc, xp.sum(xs, axes) if axes else xs, e, xp)
    return _limbs.normalize(acc, xp)
