"""Logical dtypes ('fp32', 'bf16', ...) by name, with their sizes, and their storage in numpy (bf16 through
ml_dtypes) or in torch (named by their string, so that nothing here imports torch)."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

# Logical dtypes by name, with their size in bytes. bf16 arrays use ml_dtypes' numpy dtype.
ITEMSIZE: dict[str, int] = {"fp64": 8, "fp32": 4, "bf16": 2, "fp16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
_NUMPY_NAMES = {
    np.dtype(ml_dtypes.bfloat16): "bf16",
    np.dtype(np.float64): "fp64",
    np.dtype(np.float32): "fp32",
    np.dtype(np.float16): "fp16",
    np.dtype(np.int64): "int64",
    np.dtype(np.int32): "int32",
    np.dtype(np.uint8): "uint8",
    np.dtype(np.bool_): "bool",
}
_NUMPY_OF = {name: dt for dt, name in _NUMPY_NAMES.items()}


_TORCH_NAMES = {"torch.bfloat16": "bf16", "torch.float64": "fp64", "torch.float32": "fp32", "torch.float16": "fp16",
                "torch.int64": "int64", "torch.int32": "int32", "torch.uint8": "uint8", "torch.bool": "bool"}


def dtype_name(dtype: Any) -> str:
    """The logical name ('fp32', 'bf16', ...) of a numpy dtype, a torch dtype or a name."""
    if isinstance(dtype, str):
        if dtype not in ITEMSIZE:
            raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(ITEMSIZE)}")
        return dtype
    if dtype.__class__.__module__ == "torch":
        name = _TORCH_NAMES.get(str(dtype))
        if name is None:
            raise TypeError(f"unsupported dtype {dtype}; valid: {', '.join(_TORCH_NAMES)}")
        return name
    dt = np.dtype(dtype)
    if dt not in _NUMPY_NAMES:
        raise TypeError(f"unsupported dtype {dt}; valid: {', '.join(str(d) for d in _NUMPY_NAMES)}")
    return _NUMPY_NAMES[dt]


def is_fp32(x: Any) -> bool:
    """Whether x, a tensor or a dtype's name, is fp32 (its logical dtype: a partial's, a meta tensor's)."""
    d = x if x.__class__ is str else getattr(x, "dtype", None)
    return d is not None and dtype_name(d) == "fp32"


def numpy_dtype(name: str) -> np.dtype:
    if name not in _NUMPY_OF:
        raise ValueError(f"dtype {name!r} has no numpy storage here; valid: {', '.join(_NUMPY_OF)}")
    return _NUMPY_OF[name]


def accumulator_dtype(dtype: Any) -> type:
    """What fast mode accumulates a sum of `dtype` in: float32 (as tensor cores and cuBLAS do for 16-bit
    inputs), float64 for a float64 sum."""
    return np.float64 if dtype_name(dtype) == "fp64" else np.float32


def accumulator_name(dtype: Any) -> str:
    """`accumulator_dtype` by its logical name, for any array namespace."""
    return "fp64" if dtype_name(dtype) == "fp64" else "fp32"
