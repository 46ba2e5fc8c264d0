"""Exact sums of products, fast: slices on a fixed grid, float64 BLAS, integer limbs.

Every float32 operand is cut into slices of beta-bit integers on an absolute grid of powers of two:

    x = sum_s X_s * 2**(lo + s*beta),   X_s integers with |X_s| < 2**beta

(after truncating x toward zero to a multiple of 2**lo). A product of two slices summed over k terms
is a sum of integers below k * 2**(2*beta) <= 2**53, so float64 BLAS computes it exactly, in any
order. Each such exact integer goes into the limbs at its weight. The grid is absolute (the same for
every rank, every shard, every shape), so any split of the summed dimension, combined in any order,
gives the same limbs: this is what makes tensor, sequence and data parallel sums bit-exact.

Products: operands are truncated to multiples of 2**-80 (PRODUCT_LO) so that every product lands in
the limb window (2**-160). Values below 2**-80 in a matmul operand contribute nothing; that is a
deterministic rule of the kernel, the same in the reference and in every parallel version.
Sums of single values: no truncation (every float32 is a multiple of 2**-149).
"""

from __future__ import annotations

import math
import re

import numpy as np

from simcluster.numerics import limbs as _limbs

PRODUCT_LO = -80  # grid bottom for operands of products: 2 * PRODUCT_LO == limbs.WINDOW_LO
SUM_LO = -150  # grid bottom for sums of single float32 values (below float32's smallest subnormal)
assert 2 * PRODUCT_LO >= _limbs.WINDOW_LO and SUM_LO >= _limbs.WINDOW_LO


def _check_finite(x: np.ndarray, what: str) -> None:
    if not np.all(np.isfinite(x)):
        bad = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise FloatingPointError(f"{what}: non-finite input {float(x[bad])!r} at index {bad}")


def slices(x: np.ndarray, beta: int, lo: int) -> list[tuple[int, np.ndarray]]:
    """[(s, X_s)]: the non-zero slices of x on the grid 2**(lo + s*beta), as integer-valued float64."""
    x64 = np.asarray(x, dtype=np.float64)
    mag = np.trunc(np.ldexp(np.abs(x64), -lo))  # exact: a power-of-two scaling of float32 values
    sign = np.where(x64 < 0, -1.0, 1.0)
    radix = float(2**beta)
    out: list[tuple[int, np.ndarray]] = []
    s = 0
    while True:
        high = np.floor(mag / radix)
        low = mag - high * radix  # exact: the low beta bits of an exact integer
        if low.any():
            out.append((s, sign * low))
        if not high.any():
            return out
        mag = high
        s += 1


def _beta(terms: int, operands: int) -> int:
    """Widest slice such that `terms` products of `operands` slices sum below 2**53."""
    return max(1, (53 - max(1, math.ceil(math.log2(terms + 1)))) // operands)


_SPEC = re.compile(r"^([a-z]+),([a-z]+)->([a-z]*)$")


def einsum(spec: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact `np.einsum(spec, a, b)` for float32 operands, as normalized limbs (shape (*out, LIMBS))."""
    m = _SPEC.match(spec)
    if m is None:
        raise ValueError(f"exact einsum spec {spec!r} must look like 'ik,kj->ij' (letters only, two operands)")
    ia, ib, io = m.groups()
    if len(ia) != a.ndim or len(ib) != b.ndim:
        raise ValueError(f"einsum {spec!r}: operands of shapes {a.shape} and {b.shape} do not fit")
    _check_finite(a, "exact einsum")
    _check_finite(b, "exact einsum")
    size = dict(zip(ia, a.shape))
    for letter, n in zip(ib, b.shape):
        if size.setdefault(letter, n) != n:
            raise ValueError(f"einsum {spec!r}: dimension {letter!r} is {size[letter]} in one operand and {n} in the other")
    out_shape = tuple(size[letter] for letter in io)
    terms = math.prod(size[letter] for letter in size if letter not in io)
    beta = _beta(terms, 2)
    acc = np.zeros(out_shape + (_limbs.LIMBS,), dtype=np.int64)
    b_slices = slices(b, beta, PRODUCT_LO)
    for s, xs in slices(a, beta, PRODUCT_LO):
        for t, ys in b_slices:
            r = np.einsum(spec, xs, ys, optimize=True)  # exact: integers, all partial sums < 2**53
            _limbs.add_scaled_integers(acc, r, 2 * PRODUCT_LO + (s + t) * beta)
    return _limbs.normalize(acc)


def matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Exact a @ b for a (..., m, k) and b (k, n) or (..., k, n), as limbs (..., m, n, LIMBS)."""
    if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul of shapes {a.shape} and {b.shape}: need (..., m, k) @ (..., k, n)")
    _check_finite(a, "exact matmul")
    _check_finite(b, "exact matmul")
    k = a.shape[-1]
    beta = _beta(k, 2)
    out_shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + (a.shape[-2], b.shape[-1])
    acc = np.zeros(out_shape + (_limbs.LIMBS,), dtype=np.int64)
    b_slices = slices(b, beta, PRODUCT_LO)
    for s, xs in slices(a, beta, PRODUCT_LO):
        for t, ys in b_slices:
            _limbs.add_scaled_integers(acc, np.matmul(xs, ys), 2 * PRODUCT_LO + (s + t) * beta)
    return _limbs.normalize(acc)


def sum(x: np.ndarray, axis: int | tuple[int, ...] | None) -> np.ndarray:
    """Exact sum of float32 (or float64 holding float32) values over `axis`, as limbs."""
    x = np.asarray(x)
    _check_finite(x, "exact sum")
    axes = tuple(range(x.ndim)) if axis is None else ((axis,) if isinstance(axis, int) else tuple(axis))
    axes = tuple(a % x.ndim for a in axes) if x.ndim else ()
    terms = math.prod(x.shape[a] for a in axes)
    beta = _beta(terms, 1)
    out_shape = tuple(n for i, n in enumerate(x.shape) if i not in axes)
    acc = np.zeros(out_shape + (_limbs.LIMBS,), dtype=np.int64)
    for s, xs in slices(x, beta, SUM_LO):
        _limbs.add_scaled_integers(acc, np.sum(xs, axis=axes) if axes else xs, SUM_LO + s * beta)
    return _limbs.normalize(acc)
