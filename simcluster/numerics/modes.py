"""The three modes behind the kernel set's one interface (ops.py): exact (sums as integer limbs,
transcendentals of our own), fast (numpy/BLAS floats) and meta (shapes and costs only)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from simcluster.numerics import exact as _exact
from simcluster.numerics import transcendental as _tr
from simcluster.numerics.ops import Mode, Ops, Record, _broadcast
from simcluster.numerics.tensor import MetaTensor, Partial, dtype_name


class _ExactNum:
    """Exact mode's primitives: sums in limbs, transcendentals from correctly rounded operations."""

    def einsum(self, spec: str, a: np.ndarray, b: np.ndarray, partial: bool = False) -> Any:
        p = Partial(_exact.einsum(spec, a, b), dtype_name(np.result_type(a, b)))
        return p if partial else p.finalize(np.result_type(a, b))

    def sum(self, x: np.ndarray, axis: Any, partial: bool = False) -> Any:
        p = Partial(_exact.sum(x, axis), dtype_name(x.dtype))
        return p if partial else p.finalize(x.dtype)

    def round(self, p: Any, dtype: Any) -> np.ndarray:
        return p.finalize(dtype)

    def exp(self, x: np.ndarray) -> np.ndarray:
        return _tr.exp(x).astype(x.dtype)

    def log(self, x: np.ndarray) -> np.ndarray:
        return _tr.log(x).astype(x.dtype)

    def tanh(self, x: np.ndarray) -> np.ndarray:
        return _tr.tanh(x).astype(x.dtype)


class _FastNum:
    """Fast mode's primitives: numpy in the arrays' own dtype (float64 for checking against torch)."""

    def einsum(self, spec: str, a: np.ndarray, b: np.ndarray, partial: bool = False) -> Any:
        return np.einsum(spec, a, b, optimize=True)

    def sum(self, x: np.ndarray, axis: Any, partial: bool = False) -> Any:
        return np.asarray(np.sum(x, axis=axis), dtype=x.dtype)

    def round(self, p: Any, dtype: Any) -> np.ndarray:
        return np.asarray(p, dtype=dtype)

    def exp(self, x: np.ndarray) -> np.ndarray:
        return np.exp(x)

    def log(self, x: np.ndarray) -> np.ndarray:
        return np.log(x)

    def tanh(self, x: np.ndarray) -> np.ndarray:
        return np.tanh(x)


class ExactOps(Ops):
    """Sums that an algorithm may split are exact (limbs); everything else is correctly rounded."""

    mode = Mode.EXACT
    _num = _ExactNum()

    def _matmul(self, a: np.ndarray, b: np.ndarray, partial: bool, out_shape: tuple[int, ...]) -> Any:
        dtype = np.result_type(a, b)
        p = Partial(_exact.matmul(a, b), dtype_name(dtype))  # the sum over k is exact (numerics/exact.py)
        return p if partial else p.finalize(dtype)

    def _finalize(self, p: Partial, dtype: Any) -> np.ndarray:
        if not isinstance(p, Partial):
            raise TypeError(f"finalize expects a Partial in exact mode, got {type(p).__name__}")
        return p.finalize(dtype)

    def _sum(self, x: np.ndarray, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        p = Partial(_exact.sum(x, axis), dtype_name(x.dtype))
        return p if partial else p.finalize(x.dtype)


class FastOps(Ops):
    """Plain numpy/BLAS float math; a 'partial' is just the unrounded-in-spirit float result."""

    mode = Mode.FAST
    _num = _FastNum()

    def _matmul(self, a: np.ndarray, b: np.ndarray, partial: bool, out_shape: tuple[int, ...]) -> Any:
        dtype = np.result_type(a, b)
        if dtype.itemsize < 4:  # 16-bit storage: accumulate in float32, as tensor cores do
            out = np.matmul(a.astype(np.float32), b.astype(np.float32))
            return out if partial else out.astype(dtype)
        return np.matmul(a, b)

    def _finalize(self, p: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(p, dtype=dtype)

    def _sum(self, x: np.ndarray, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return np.asarray(np.sum(x, axis=axis), dtype=x.dtype)


class MetaOps(Ops):
    """Shapes and costs only."""

    mode = Mode.META
    _num: Any = None

    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return MetaTensor(out_shape, getattr(a, "dtype", "fp32"), partial)

    def _finalize(self, p: Any, dtype: Any) -> Any:
        return MetaTensor(tuple(p.shape), dtype_name(dtype))

    def _sum(self, x: Any, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return MetaTensor(out_shape, x.dtype, partial)

    def _binary(self, f: Callable, a: Any, b: Any) -> Any:
        return MetaTensor(_broadcast(a.shape, b.shape), getattr(a, "dtype", "fp32"))

    def _unary(self, f: Callable, a: Any) -> Any:
        return MetaTensor(tuple(a.shape), a.dtype)


def make_ops(mode: Mode | str, record: Record | None = None, *, cost_dtype: str = "fp32") -> Ops:
    mode = Mode(mode) if isinstance(mode, str) else mode
    cls = {Mode.EXACT: ExactOps, Mode.FAST: FastOps, Mode.META: MetaOps}[mode]
    return cls(record, cost_dtype=cost_dtype)
