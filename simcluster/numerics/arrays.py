"""The array namespace: the one seam between the kernel set and the memory that holds the numbers.

The kernel set (ops.py, kernels.py, modes.py, flat.py) and the values that flow through a program
(tensor.py's Partial) never call numpy on data; they call the namespace they were given. This module
is numpy's, on the host, which the emulator uses. The torch backend brings torch's
(gpu_backend/torch_arrays.py: the same functions on tensors on the rank's device), so that the same
kernels run on a GPU with nothing through the host.

A namespace is a plain object with these attributes (the Array API standard's spirit, only what the
kernels use, with dtypes named by their logical names: 'fp32', 'bf16', 'fp16', 'fp64', 'int64',
'bool'):

  add subtract multiply divide maximum minimum   elementwise, broadcasting (numpy's ufuncs)
  where isfinite sqrt exp log tanh               elementwise
  astype(x, dtype, copy=True) const(x, value)    x in a dtype; a scalar in x's dtype
  name(dtype) is_array(x) is_dtype(x) result_type(a, b)
  uniform(seed, stream, shape, offset=, full_shape=, low=, high=)   the counter-based RNG (random.py)
  zeros(shape, dtype) zeros_like(x) asarray(x, dtype=None) broadcast_to(x, shape)
  concat(xs, dim) swapaxes(x, a, b) permute(x, dims) contiguous(x) repeat(x, n, dim)
  take_last(x, index) put_last(x, index, values) one_hot(index, n, dtype)
  matmul(a, b) einsum(spec, a, b) sum(x, axis, dtype) max(x, axis)   (max keeps the axis)
  to_host(x)                                     a numpy array (verification, checkpoints, MoE routing)
  floor trunc abs isnan clip stack ldexp frexp full_like flip_last argmax_last any truth gather_last arange
                                                 exact mode's limbs, slices and transcendentals
  cheap_truth                                    whether truth() is free (on the host) or waits for a device
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from simcluster.numerics import random as _random
from simcluster.numerics.dtypes import dtype_name, numpy_dtype


def _np_dtype(dtype: Any) -> Any:
    return numpy_dtype(dtype) if isinstance(dtype, str) else dtype


class NumpyArrays:
    """numpy on the host: the emulator's arrays."""

    add = staticmethod(np.add)
    subtract = staticmethod(np.subtract)
    multiply = staticmethod(np.multiply)
    divide = staticmethod(np.divide)
    maximum = staticmethod(np.maximum)
    minimum = staticmethod(np.minimum)
    where = staticmethod(np.where)
    isfinite = staticmethod(np.isfinite)
    sqrt = staticmethod(np.sqrt)
    exp = staticmethod(np.exp)
    log = staticmethod(np.log)
    tanh = staticmethod(np.tanh)

    @staticmethod
    def astype(x: Any, dtype: Any, copy: bool = True) -> np.ndarray:
        return np.asarray(x).astype(_np_dtype(dtype), copy=copy)

    @staticmethod
    def const(x: Any, value: float) -> Any:
        """`value` rounded once to x's dtype."""
        return x.dtype.type(value)

    @staticmethod
    def name(dtype: Any) -> str:
        return dtype_name(dtype)

    @staticmethod
    def is_array(x: Any) -> bool:
        return isinstance(x, np.ndarray)

    @staticmethod
    def is_dtype(x: Any) -> bool:
        return isinstance(x, (type, np.dtype))

    result_type = staticmethod(np.result_type)
    uniform = staticmethod(_random.uniform)

    @staticmethod
    def zeros(shape: Sequence[int], dtype: Any) -> np.ndarray:
        return np.zeros(tuple(shape), dtype=_np_dtype(dtype))

    @staticmethod
    def zeros_like(x: Any) -> np.ndarray:
        return np.zeros_like(x)

    @staticmethod
    def asarray(x: Any, dtype: Any = None) -> np.ndarray:
        return np.asarray(x) if dtype is None else np.asarray(x, dtype=_np_dtype(dtype))

    broadcast_to = staticmethod(np.broadcast_to)

    @staticmethod
    def concat(xs: Sequence[Any], dim: int) -> np.ndarray:
        return np.concatenate(xs, axis=dim)

    swapaxes = staticmethod(np.swapaxes)

    @staticmethod
    def permute(x: Any, dims: Sequence[int]) -> np.ndarray:
        return x.transpose(tuple(dims))

    contiguous = staticmethod(np.ascontiguousarray)

    @staticmethod
    def repeat(x: Any, n: int, dim: int) -> np.ndarray:
        return np.repeat(x, n, axis=dim)

    @staticmethod
    def take_last(x: Any, index: Any) -> np.ndarray:
        return np.take_along_axis(x, index[..., None], axis=-1)[..., 0]

    @staticmethod
    def put_last(x: Any, index: Any, values: Any) -> np.ndarray:
        """A copy of x with x[..., index] = values (index and values shaped like x without its last axis)."""
        out = np.array(x)
        np.put_along_axis(out, index[..., None], values[..., None], axis=-1)
        return out

    @staticmethod
    def one_hot(index: Any, n: int, dtype: Any) -> np.ndarray:
        out = np.zeros(tuple(index.shape) + (n,), dtype=_np_dtype(dtype))
        np.put_along_axis(out, index[..., None], 1, axis=-1)
        return out

    matmul = staticmethod(np.matmul)

    @staticmethod
    def einsum(spec: str, a: Any, b: Any) -> np.ndarray:
        return np.einsum(spec, a, b, optimize=True)

    @staticmethod
    def sum(x: Any, axis: Any, dtype: Any = None) -> Any:
        return np.sum(x, axis=axis, dtype=None if dtype is None else _np_dtype(dtype))

    @staticmethod
    def max(x: Any, axis: int) -> np.ndarray:
        return np.max(x, axis=axis, keepdims=True)

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        return np.asarray(x)

    @staticmethod
    def write(dst: Any, src: Any) -> None:
        """src's values into dst, in place (rounded to dst's dtype as astype rounds)."""
        np.copyto(dst, np.asarray(src).astype(dst.dtype, copy=False))

    # -- what exact mode's limbs and slices need (limbs.py, exact.py, transcendental.py) ------------
    floor = staticmethod(np.floor)
    trunc = staticmethod(np.trunc)
    abs = staticmethod(np.abs)
    isnan = staticmethod(np.isnan)
    clip = staticmethod(np.clip)
    stack = staticmethod(np.stack)

    @staticmethod
    def ldexp(x: Any, e: Any) -> np.ndarray:
        """x * 2**e exactly (e integer-valued: an int or an array of them)."""
        return np.ldexp(x, np.asarray(e).astype(np.int64) if not isinstance(e, int) else e)

    @staticmethod
    def frexp(x: Any) -> tuple[np.ndarray, np.ndarray]:
        m, e = np.frexp(x)
        return m, e.astype(np.int64)

    @staticmethod
    def full_like(x: Any, value: float) -> np.ndarray:
        return np.full_like(x, value)

    @staticmethod
    def flip_last(x: Any) -> np.ndarray:
        return x[..., ::-1]

    @staticmethod
    def argmax_last(x: Any) -> np.ndarray:
        return np.argmax(x, axis=-1)

    @staticmethod
    def any(x: Any, axis: Any = None) -> Any:
        return np.any(x, axis=axis)

    @staticmethod
    def truth(x: Any) -> bool:
        """A 0-d boolean's value on the host (exact mode's data-dependent checks)."""
        return bool(x)

    cheap_truth = True  # truth() waits for nothing: exact mode may check for work left rather than do all of it

    @staticmethod
    def gather_last(x: Any, index: Any) -> np.ndarray:
        """x[..., index[...]] for an index shaped like x without its last dim."""
        return np.take_along_axis(x, index[..., None], -1)[..., 0]

    @staticmethod
    def arange(n: int) -> np.ndarray:
        return np.arange(n)


NUMPY = NumpyArrays()
