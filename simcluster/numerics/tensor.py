"""The three kinds of value that flow through a program, and the data movement collectives need.

- an array: a real tensor (exact and fast modes), numpy's on the emulator, torch's on a device (the
  array namespace, arrays.py, says how to compute with it).
- `Partial`: an unrounded exact sum, held as integer limbs (exact mode). Its `dtype` is the logical
  dtype it will be rounded to; communication and memory are charged in that dtype, never in limbs.
- `MetaTensor`: shape and dtype only (meta mode).

The emulator's collectives are written against the helpers at the bottom (`split`, `concat`, `reduce`,
numpy's), so that one definition of each collective serves all three kinds; programs move data through
`ops`, never through these.
"""

from __future__ import annotations

import math
from enum import Enum
from typing import Any, Sequence

import numpy as np

from simcluster.numerics import limbs as _limbs
from simcluster.numerics.arrays import NUMPY
from simcluster.numerics.dtypes import ITEMSIZE, accumulator_name, dtype_name, numpy_dtype


class Partial:
    """An unrounded sum of logical dtype `dtype`, to be rounded once by `finalize`. Exact mode holds it as
    integer limbs (int64, shape (*shape, LIMBS)): exact, so any order of adding gives the same value.
    Fast mode holds a float accumulator (shape (*shape, 1), `accumulator_name`), as a GPU kernel
    accumulates in fp32 whatever it stores: the same signature, sums in the order they happen; a partial
    retagged to a 16-bit dtype (flat.py: a gradient on its way to a 16-bit all-reduce) holds and sums its
    values in that dtype, as the all-reduce does.
    `xp`: the array namespace that holds the limbs (arrays.py; numpy on the host unless said)."""

    __slots__ = ("limbs", "dtype", "xp")

    def __init__(self, limbs: Any, dtype: str = "fp32", xp: Any = NUMPY) -> None:
        assert limbs.shape[-1] in (1, _limbs.LIMBS), (limbs.dtype, limbs.shape)  # an accumulator, or limbs
        self.limbs = limbs
        self.dtype = dtype_name(dtype)
        self.xp = xp

    @classmethod
    def from_terms(cls, terms: np.ndarray, axis: int, dtype: str = "fp32") -> "Partial":
        return cls(_limbs.sum_terms(terms, axis), dtype)

    @classmethod
    def from_values(cls, values: Any, dtype: str = "fp32", xp: Any = NUMPY) -> "Partial":
        """A partial that holds `values` exactly (a sum of one term each)."""
        return cls(_limbs.normalize(_limbs.from_float64(values, xp), xp), dtype, xp)

    @classmethod
    def accumulating(cls, values: Any, dtype: Any, xp: Any = NUMPY) -> "Partial":
        """Fast mode's partial: `values` held in the accumulator dtype of `dtype`."""
        return cls(xp.astype(values, accumulator_name(dtype), copy=False)[..., None], dtype_name(dtype), xp)

    @property
    def exact(self) -> bool:
        return self.limbs.shape[-1] != 1

    @property
    def shape(self) -> tuple[int, ...]:
        return self.limbs.shape[:-1]

    @property
    def ndim(self) -> int:
        return self.limbs.ndim - 1

    def __add__(self, other: "Partial") -> "Partial":
        if not isinstance(other, Partial) or other.shape != self.shape or other.exact != self.exact:
            raise TypeError(f"can only add a Partial of shape {self.shape} to a Partial, got {describe(other)}")
        if not self.exact:
            return Partial(self.limbs + other.limbs, self.dtype, self.xp)
        return Partial(_limbs.normalize(self.limbs + other.limbs, self.xp), self.dtype, self.xp)

    def finalize(self, dtype: Any = np.float32) -> Any:
        """Round the value once, to `dtype`."""
        if not self.exact:
            return self.xp.astype(self.limbs[..., 0], dtype, copy=False)
        return _limbs.to_float(self.limbs, dtype, self.xp)

    def __repr__(self) -> str:
        return f"Partial(shape={self.shape}, dtype={self.dtype}{'' if self.exact else ', fast'})"


_set = object.__setattr__


INDEX_DTYPES = ("int64", "int32", "bool")  # what a MetaTensor's own operators accept


class MetaTensor:
    """Shape and dtype only; `partial` marks an unrounded sum (charged in `dtype`). Immutable.

    (A plain class with slots, not a dataclass: meta-mode programs at scale make millions.)
    """

    __slots__ = ("shape", "dtype", "partial", "_signature")

    def __init__(self, shape: Sequence[int], dtype: str = "fp32", partial: bool = False) -> None:
        shape = tuple(map(int, shape))
        if shape and min(shape) < 0:
            raise ValueError(f"negative dimension in shape {shape}")
        if dtype.__class__ is not str or dtype not in ITEMSIZE:
            dtype_name(dtype)
        _set(self, "shape", shape)
        _set(self, "dtype", dtype)
        _set(self, "partial", partial)
        _set(self, "_signature", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"MetaTensor is immutable (cannot set {name!r})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"MetaTensor is immutable (cannot delete {name!r})")

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not MetaTensor:
            return NotImplemented
        return (self.shape, self.dtype, self.partial) == (other.shape, other.dtype, other.partial)

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.partial))

    def __repr__(self) -> str:
        return f"MetaTensor(shape={self.shape!r}, dtype={self.dtype!r}, partial={self.partial!r})"

    def __reduce__(self) -> tuple:
        return MetaTensor, (self.shape, self.dtype, self.partial)

    # Index arithmetic that a program does on integer data (a vocabulary shard's targets: targets - first,
    # 0 <= local < rows): the result's shape and dtype, as numpy's would be.
    def _elementwise(self, other: Any, dtype: str | None) -> "MetaTensor":
        if self.dtype not in INDEX_DTYPES or getattr(other, "dtype", "int64") not in INDEX_DTYPES:
            raise TypeError(f"arithmetic on {self.dtype} data goes through ops (a kernel, with its cost); a "
                            f"MetaTensor does only index arithmetic")
        shape = tuple(np.broadcast_shapes(self.shape, tuple(getattr(other, "shape", ()))))
        return MetaTensor(shape, dtype or (self.dtype if self.dtype != "bool" else getattr(other, "dtype", "int64")))

    def __add__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, None)

    def __sub__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, None)

    def __mul__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, None)

    __radd__, __rsub__, __rmul__ = __add__, __sub__, __mul__

    def __ge__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, "bool")

    def __lt__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, "bool")

    def __and__(self, other: Any) -> "MetaTensor":
        return self._elementwise(other, "bool")

    def __getitem__(self, key: Any) -> "MetaTensor":
        """x[..., None] (a new last axis of 1), the one view of index data a program takes."""
        if key == (Ellipsis, None):
            return MetaTensor(self.shape + (1,), self.dtype, self.partial)
        raise TypeError(f"MetaTensor supports x[..., None] only, not [{key!r}]")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def signature(self) -> tuple[bool, str, tuple[int, ...]]:
        """(partial, dtype, shape), made once: a meta program communicates the same tensors often."""
        sig = self._signature
        if sig is None:
            sig = (self.partial, self.dtype, self.shape)
            _set(self, "_signature", sig)
        return sig


class ReduceOp(Enum):
    SUM = "sum"
    MAX = "max"
    MIN = "min"


# --- what collectives need, for every kind of value -------------------------------------------


def shape_of(x: Any) -> tuple[int, ...]:
    return tuple(x.shape)


def logical_dtype(x: Any) -> str:
    if isinstance(x, (Partial, MetaTensor)):
        return x.dtype
    return dtype_name(x.dtype)


def nbytes(x: Any) -> int:
    """Bytes of `x` in its logical dtype (a partial's limbs are not charged)."""
    return math.prod(shape_of(x)) * ITEMSIZE[logical_dtype(x)]


def kind_of(x: Any) -> str:
    if isinstance(x, Partial):
        return "partial"
    if isinstance(x, MetaTensor):
        return "meta-partial" if x.partial else "meta"
    if isinstance(x, np.ndarray) or hasattr(x, "__dlpack__"):  # numpy's, or another namespace's (torch)
        return "array"
    raise TypeError(f"expected an array, a Partial or a MetaTensor, got {type(x).__name__}")


def describe(x: Any) -> str:
    """A short description for error messages: 'fp32(4, 8)', 'partial fp32(4, 8)'."""
    if x is None:
        return "nothing"
    try:
        k = kind_of(x)
    except TypeError:
        return type(x).__name__
    prefix = "partial " if k in ("partial", "meta-partial") else ""
    return f"{prefix}{logical_dtype(x)}{shape_of(x)}"


def is_partial(x: Any) -> bool:
    return isinstance(x, Partial) or (isinstance(x, MetaTensor) and x.partial)


def signature(x: Any) -> tuple[bool, str, tuple[int, ...]]:
    """What must agree across ranks for a collective on `x`: partial or not, dtype, shape."""
    if x.__class__ is MetaTensor:
        return x.signature
    kind_of(x)  # type check
    return (is_partial(x), logical_dtype(x), shape_of(x))


def describe_signature(sig: tuple[bool, str, tuple[int, ...]]) -> str:
    partial, dtype, shape = sig
    return f"{'partial ' if partial else ''}{dtype}{shape}"


def _check_dim(x: Any, dim: int) -> int:
    nd = len(shape_of(x))
    if not -nd <= dim < nd:
        raise ValueError(f"dim {dim} out of range for a tensor of {nd} dims ({describe(x)})")
    return dim % nd


def split(x: Any, parts: int, dim: int) -> list[Any]:
    """Split along `dim` into `parts` equal chunks."""
    dim = _check_dim(x, dim)
    size = shape_of(x)[dim]
    if size % parts:
        raise ValueError(f"dim {dim} of size {size} does not split into {parts} equal parts ({describe(x)})")
    if isinstance(x, MetaTensor):
        shape = list(x.shape)
        shape[dim] = size // parts
        return [MetaTensor(tuple(shape), x.dtype, x.partial) for _ in range(parts)]
    if isinstance(x, Partial):
        return [Partial(np.ascontiguousarray(c), x.dtype) for c in np.split(x.limbs, parts, axis=dim)]
    return [np.ascontiguousarray(c) for c in np.split(x, parts, axis=dim)]


def split_rows(x: Any, rows: Sequence[int]) -> list[Any]:
    """Split along dim 0 into parts of `rows` rows each (they add up to x's first dimension)."""
    if isinstance(x, MetaTensor):
        return [MetaTensor((r,) + tuple(x.shape[1:]), x.dtype, x.partial) for r in rows]
    at = np.cumsum(rows)[:-1]
    if isinstance(x, Partial):
        return [Partial(np.ascontiguousarray(c), x.dtype) for c in np.split(x.limbs, at, axis=0)]
    return [np.ascontiguousarray(c) for c in np.split(x, at, axis=0)]


def concat(xs: Sequence[Any], dim: int) -> Any:
    dim = _check_dim(xs[0], dim)
    first = xs[0]
    if isinstance(first, MetaTensor):
        shape = list(first.shape)
        shape[dim] = sum(x.shape[dim] for x in xs)
        return MetaTensor(tuple(shape), first.dtype, first.partial)
    if isinstance(first, Partial):
        return Partial(np.concatenate([x.limbs for x in xs], axis=dim), first.dtype)
    return np.concatenate(xs, axis=dim)


def reduce(xs: Sequence[Any], op: ReduceOp) -> Any:
    """Reduce equal-shaped values, in the order given.

    Exact partials add exactly (any order gives the same limbs); fast partials' accumulators and arrays
    fold left, in their own dtype, in the order given (the group's rank order: deterministic).
    """
    first = xs[0]
    if isinstance(first, MetaTensor):
        return first
    if isinstance(first, Partial):
        if op is not ReduceOp.SUM:
            raise ValueError(f"a Partial can only be reduced with SUM, not {op.name}")
        if not first.exact:
            acc = np.array(first.limbs, copy=True)
            for x in xs[1:]:
                acc = acc + x.limbs
            return Partial(acc, first.dtype)
        total = np.sum(np.stack([x.limbs for x in xs]), axis=0)
        return Partial(_limbs.normalize(total), first.dtype)
    if op is ReduceOp.SUM:
        out = np.array(xs[0], copy=True)
        for x in xs[1:]:
            out = out + x
        return out
    fold = np.maximum if op is ReduceOp.MAX else np.minimum
    out = np.array(xs[0], copy=True)
    for x in xs[1:]:
        out = fold(out, x)
    return out


def copy(x: Any) -> Any:
    """An independent copy (each rank owns its result)."""
    if isinstance(x, MetaTensor) or x is None:
        return x
    if isinstance(x, Partial):
        return Partial(x.limbs.copy(), x.dtype)
    return np.array(x, copy=True)


def zeros_of(sig: tuple[bool, str, tuple[int, ...]], exact: bool = True) -> Any:
    """A real value of the given signature (a receive buffer); `exact`: a partial's form (Partial)."""
    partial, dtype, shape = sig
    if partial and not exact:
        return Partial.accumulating(np.zeros(shape), dtype)
    if partial:
        return Partial(np.zeros(tuple(shape) + (_limbs.LIMBS,), dtype=np.int64), dtype)
    return np.zeros(shape, dtype=numpy_dtype(dtype))
