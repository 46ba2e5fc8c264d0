"""The kernel set: one interface, three modes (exact, fast, meta).

Every op returns its result at once and reports a kernel (name, FLOPs, bytes moved) to `record`,
which the backend turns into work on the rank's current stream. Bytes are counted in the logical
`cost_dtype` (what a GPU would move), whatever holds the numbers here.

This is the minimal set the engine needs; the numerics issue grows it into the full transformer set.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, Callable

import numpy as np

from simcluster.numerics import exact as _exact
from simcluster.numerics import random as _random
from simcluster.numerics.tensor import ITEMSIZE, MetaTensor, Partial, dtype_name

Record = Callable[[str, float, float], None]


class Mode(Enum):
    EXACT = "exact"
    FAST = "fast"
    META = "meta"


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if len(a) < 2 or len(b) != 2 or a[-1] != b[0]:
        raise ValueError(f"matmul of shapes {a} and {b}: need (..., k) @ (k, n)")
    return a[:-1] + (b[1],)


class Ops:
    """Kernels of one mode. Subclasses supply the numbers; this class supplies shapes and costs."""

    mode: Mode

    def __init__(self, record: Record | None = None, *, cost_dtype: str = "fp32") -> None:
        self._record = record if record is not None else (lambda name, flops, nbytes: None)
        self.cost_dtype = dtype_name(cost_dtype)
        self._item = ITEMSIZE[self.cost_dtype]

    # -- costs ---------------------------------------------------------------------------------
    def kernel(self, name: str, *, flops: float, nbytes: float) -> None:
        """A kernel with no numbers: only its cost (used by timing-only programs)."""
        self._record(name, float(flops), float(nbytes))

    def _elementwise_cost(self, name: str, shape: tuple[int, ...], n_in: int, flops_per: float = 1.0) -> None:
        n = _numel(shape)
        self._record(name, flops_per * n, (n_in + 1) * n * self._item)

    # -- the interface -------------------------------------------------------------------------
    def matmul(self, a: Any, b: Any, *, partial: bool = False) -> Any:
        """a @ b over the last dim of a; with partial=True the sum over k stays unrounded."""
        out_shape = _matmul_shape(tuple(a.shape), tuple(b.shape))
        k = a.shape[-1]
        n_out = _numel(out_shape)
        self._record("matmul", 2.0 * n_out * k, (_numel(tuple(a.shape)) + _numel(tuple(b.shape)) + n_out) * self._item)
        return self._matmul(a, b, partial, out_shape)

    def finalize(self, p: Any, dtype: Any = np.float32) -> Any:
        """Round a partial once to `dtype` (the semantic rounding point)."""
        self._elementwise_cost("finalize", tuple(p.shape), 1)
        return self._finalize(p, dtype)

    def sum(self, x: Any, axis: int | None, *, partial: bool = False) -> Any:
        """Sum over one axis (None: all elements); exact in exact mode (a Partial when partial=True)."""
        shape = tuple(x.shape)
        if axis is None:
            out_shape: tuple[int, ...] = ()
        else:
            if not -len(shape) <= axis < len(shape):
                raise ValueError(f"sum over axis {axis} of a tensor of shape {shape}")
            out_shape = shape[: axis % len(shape)] + shape[axis % len(shape) + 1 :]
        self._record("sum", float(_numel(shape)), (_numel(shape) + _numel(out_shape)) * self._item)
        return self._sum(x, axis, partial, out_shape)

    def add(self, a: Any, b: Any) -> Any:
        self._elementwise_cost("add", tuple(np.broadcast_shapes(a.shape, b.shape)), 2)
        return self._binary(np.add, a, b)

    def sub(self, a: Any, b: Any) -> Any:
        self._elementwise_cost("sub", tuple(np.broadcast_shapes(a.shape, b.shape)), 2)
        return self._binary(np.subtract, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        self._elementwise_cost("mul", tuple(np.broadcast_shapes(a.shape, b.shape)), 2)
        return self._binary(np.multiply, a, b)

    def scale(self, a: Any, s: float) -> Any:
        """a * s with s rounded to float32 first (the same bits in every mode that has numbers)."""
        self._elementwise_cost("scale", tuple(a.shape), 1)
        return self._unary(lambda x: x * np.float32(s), a)

    def relu(self, a: Any) -> Any:
        self._elementwise_cost("relu", tuple(a.shape), 1)
        return self._unary(lambda x: np.maximum(x, np.float32(0)), a)

    def relu_backward(self, grad: Any, pre: Any) -> Any:
        """grad where pre > 0, else 0."""
        self._elementwise_cost("relu_backward", tuple(grad.shape), 2)
        return self._binary(lambda g, p: np.where(p > 0, g, np.float32(0)).astype(g.dtype), grad, pre)

    def transpose(self, a: Any) -> Any:
        """Swap the last two dims (a view: no kernel)."""
        if isinstance(a, MetaTensor):
            return MetaTensor(a.shape[:-2] + (a.shape[-1], a.shape[-2]), a.dtype)
        return np.swapaxes(a, -1, -2)

    def uniform(self, seed: int, name: str, shape: tuple[int, ...], *, offset: tuple[int, ...] | None = None,
                full_shape: tuple[int, ...] | None = None, low: float = -1.0, high: float = 1.0) -> Any:
        """The block at `offset` of a counter-based uniform tensor of `full_shape` (float32)."""
        self._elementwise_cost("uniform", tuple(shape), 0)
        if self.mode is Mode.META:
            return MetaTensor(tuple(shape), "fp32")
        return _random.uniform(seed, name, tuple(shape), offset=offset, full_shape=full_shape, low=low, high=high)

    # -- per-mode numbers ----------------------------------------------------------------------
    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _finalize(self, p: Any, dtype: Any) -> Any:
        raise NotImplementedError

    def _sum(self, x: Any, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        raise NotImplementedError

    def _binary(self, f: Callable, a: Any, b: Any) -> Any:
        return f(a, b)

    def _unary(self, f: Callable, a: Any) -> Any:
        return f(a)


class ExactOps(Ops):
    """Sums that an algorithm may split are exact (limbs); everything else is correctly rounded."""

    mode = Mode.EXACT

    def _matmul(self, a: np.ndarray, b: np.ndarray, partial: bool, out_shape: tuple[int, ...]) -> Any:
        p = Partial(_exact.matmul(a, b), "fp32")  # the sum over k is exact (numerics/exact.py)
        return p if partial else p.finalize(np.float32)

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

    def _matmul(self, a: np.ndarray, b: np.ndarray, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return np.matmul(a, b)

    def _finalize(self, p: np.ndarray, dtype: Any) -> np.ndarray:
        return np.asarray(p, dtype=dtype)

    def _sum(self, x: np.ndarray, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return np.asarray(np.sum(x, axis=axis), dtype=x.dtype)


class MetaOps(Ops):
    """Shapes and costs only."""

    mode = Mode.META

    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return MetaTensor(out_shape, "fp32", partial)

    def _finalize(self, p: Any, dtype: Any) -> Any:
        return MetaTensor(tuple(p.shape), dtype_name(dtype))

    def _sum(self, x: Any, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return MetaTensor(out_shape, x.dtype, partial)

    def _binary(self, f: Callable, a: Any, b: Any) -> Any:
        return MetaTensor(tuple(np.broadcast_shapes(a.shape, b.shape)), getattr(a, "dtype", "fp32"))

    def _unary(self, f: Callable, a: Any) -> Any:
        return MetaTensor(tuple(a.shape), a.dtype)


def make_ops(mode: Mode | str, record: Record | None = None, *, cost_dtype: str = "fp32") -> Ops:
    mode = Mode(mode) if isinstance(mode, str) else mode
    cls = {Mode.EXACT: ExactOps, Mode.FAST: FastOps, Mode.META: MetaOps}[mode]
    return cls(record, cost_dtype=cost_dtype)


__all__ = ["Mode", "Ops", "ExactOps", "FastOps", "MetaOps", "make_ops"]
