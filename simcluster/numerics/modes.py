"""The three modes behind the kernel set's one interface (ops.py): exact (sums as integer limbs,
transcendentals of our own), fast (numpy/BLAS floats) and meta (shapes and costs only)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from simcluster.numerics import exact as _exact
from simcluster.numerics import kernels as _k
from simcluster.numerics import transcendental as _tr
from simcluster.numerics.arrays import NUMPY
from simcluster.numerics.dtypes import accumulator_name
from simcluster.numerics.ops import Mode, Ops, Record, broadcast_shape
from simcluster.numerics.tensor import MetaTensor, Partial, dtype_name


class ExactNum:
    """Exact mode's primitives: sums in limbs, transcendentals from correctly rounded operations, on the
    array namespace `xp` (numpy here; torch on a device gives the same bits)."""

    def __init__(self, xp: Any = NUMPY) -> None:
        self.xp = xp

    def einsum(self, spec: str, a: Any, b: Any, partial: bool = False) -> Any:
        xp = self.xp
        dtype = xp.name(xp.result_type(a, b))
        p = Partial(_exact.einsum(spec, a, b, xp), dtype, xp)
        return p if partial else p.finalize(dtype)

    def sum(self, x: Any, axis: Any, partial: bool = False) -> Any:
        p = Partial(_exact.sum(x, axis, self.xp), self.xp.name(x.dtype), self.xp)
        return p if partial else p.finalize(x.dtype)

    def round(self, p: Any, dtype: Any) -> Any:
        return p.finalize(dtype)

    def exp(self, x: Any) -> Any:
        return self.xp.astype(_tr.exp(x, self.xp), x.dtype)

    def log(self, x: Any) -> Any:
        return self.xp.astype(_tr.log(x, self.xp), x.dtype)

    def tanh(self, x: Any) -> Any:
        return self.xp.astype(_tr.tanh(x, self.xp), x.dtype)

    def times(self, x: Any, s: Any) -> Any:
        """x * s, s rounded to x's dtype: the correctly rounded product."""
        return x * self.xp.const(x, s)


class FastNum:
    """Fast mode's primitives, as a GPU computes: floats of the array namespace `xp` (numpy here, torch on
    a device), every sum accumulated in float32 (float64 for float64 data, for checking against torch)
    and rounded once to the data's dtype; a partial sum stays in its accumulator (a fast Partial)."""

    def __init__(self, xp: Any = NUMPY) -> None:
        self.xp = xp

    def einsum(self, spec: str, a: Any, b: Any, partial: bool = False) -> Any:
        xp = self.xp
        dtype = xp.name(xp.result_type(a, b))
        acc = accumulator_name(dtype)
        out = xp.einsum(spec, xp.astype(a, acc, copy=False), xp.astype(b, acc, copy=False))
        return Partial.accumulating(out, dtype, xp) if partial else xp.astype(out, dtype, copy=False)

    def sum(self, x: Any, axis: Any, partial: bool = False) -> Any:
        xp = self.xp
        dtype = xp.name(x.dtype)
        out = xp.sum(x, axis, accumulator_name(dtype))
        return Partial.accumulating(out, dtype, xp) if partial else xp.astype(out, dtype, copy=False)

    def round(self, p: Any, dtype: Any) -> Any:
        return p.finalize(dtype) if isinstance(p, Partial) else self.xp.astype(p, dtype, copy=False)

    def exp(self, x: Any) -> Any:
        return self.xp.exp(x)

    def log(self, x: Any) -> Any:
        return self.xp.log(x)

    def tanh(self, x: Any) -> Any:
        return self.xp.tanh(x)

    def times(self, x: Any, s: Any) -> Any:
        """x * s as a GPU kernel with a float scalar computes it (PyTorch's opmath, a dropout kernel's fp32
        scale): 16-bit data widened, times s in fp32, rounded once. (Rounding s to bf16 first made
        1/(1 - 0.1) 1.109375: every dropped activation 0.16 % small.)"""
        xp = self.xp
        low = xp.name(x.dtype)
        if low not in SIXTEEN_BIT:
            return x * xp.const(x, s)
        wide = xp.astype(x, "fp32")
        return xp.astype(wide * xp.const(wide, s), low)


SIXTEEN_BIT = ("fp16", "bf16")


class Widened:
    """Kernels (numerics/kernels.py) as the fused GPU kernels run them on 16-bit data: inputs widened to
    float32, statistics (norms' mean and rstd, softmax's exponentials and sums) kept in float32, the
    main output rounded once to the data's dtype, partial sums tagged with it. The cross-entropy's
    log-sum-exp stays float32, and with it the loss (Megatron-LM's cross-entropy upcasts the logits);
    so do a flash block's output and log-sum-exp and their merge (ring-flash-attention keeps both in
    float32 until the last block).
    The attention scores are rounded to the data's dtype, as an unfused attention's GEMM writes them
    (FlashAttention keeps them in fp32 on chip: not modelled, as the scores' dtype is what a ring or
    Ulysses program computes its merge in)."""

    STAYS_WIDE = frozenset({"log_sum_exp", "attention_block", "attention_merge"})

    def __init__(self, xp: Any = NUMPY) -> None:
        self.xp = xp

    def __getattr__(self, name: str) -> Callable:
        kernel, xp = getattr(_k, name), self.xp

        def sixteen(a: Any) -> bool:
            return xp.is_array(a) and xp.name(a.dtype) in SIXTEEN_BIT

        def widened(num: Any, *args: Any) -> Any:
            low = next((xp.name(a.dtype) for a in args if sixteen(a)), None)
            if low is None:
                return kernel(num, *args)
            out = kernel(num, *(xp.astype(a, "fp32") if sixteen(a) else "fp32" if xp.is_dtype(a) else a
                                for a in args))
            if name in self.STAYS_WIDE:
                return out
            first, *rest = out if isinstance(out, tuple) else (out,)
            first = xp.astype(first, low)
            rest = [Partial(r.limbs, low, r.xp) if isinstance(r, Partial) else r for r in rest]
            return (first, *rest) if isinstance(out, tuple) else first
        return widened


class ExactOps(Ops):
    """Sums that an algorithm may split are exact (limbs); everything else is correctly rounded."""

    mode = Mode.EXACT
    _num = ExactNum()

    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        xp = self.xp
        dtype = xp.name(xp.result_type(a, b))
        p = Partial(_exact.matmul(a, b, xp), dtype, xp)  # the sum over k is exact (numerics/exact.py)
        return p if partial else p.finalize(dtype)

    def _finalize(self, p: Partial, dtype: Any) -> Any:
        if not isinstance(p, Partial):
            raise TypeError(f"finalize expects a Partial in exact mode, got {type(p).__name__}")
        return p.finalize(dtype)

    def _sum(self, x: Any, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return self._num.sum(x, axis, partial)


class FastOps(Ops):
    """Plain numpy/BLAS float math; a 'partial' is just the unrounded-in-spirit float result."""

    mode = Mode.FAST
    _num = FastNum()
    _kernels = Widened()

    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        xp = self.xp
        dtype = xp.name(xp.result_type(a, b))
        acc = accumulator_name(dtype)  # 16-bit storage accumulates in float32, as tensor cores do
        out = xp.matmul(xp.astype(a, acc, copy=False), xp.astype(b, acc, copy=False))
        return Partial.accumulating(out, dtype, xp) if partial else xp.astype(out, dtype, copy=False)

    def _finalize(self, p: Any, dtype: Any) -> np.ndarray:
        return self._num.round(p, dtype)

    def _sum(self, x: np.ndarray, axis: int | None, partial: bool, out_shape: tuple[int, ...]) -> Any:
        return self._num.sum(x, axis, partial)


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
        return MetaTensor(broadcast_shape(a.shape, b.shape), getattr(a, "dtype", "fp32"))

    def _unary(self, f: Callable, a: Any) -> Any:
        return MetaTensor(tuple(a.shape), a.dtype)


def make_ops(mode: Mode | str, record: Record | None = None, *, cost_dtype: str = "fp32") -> Ops:
    mode = Mode(mode) if isinstance(mode, str) else mode
    cls = {Mode.EXACT: ExactOps, Mode.FAST: FastOps, Mode.META: MetaOps}[mode]
    return cls(record, cost_dtype=cost_dtype)
