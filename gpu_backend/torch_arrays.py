"""The array namespace on torch tensors of one device (simcluster/numerics/arrays.py says what one is).

`TorchArrays` has the same functions numpy's namespace has, on tensors of one device (cuda, cpu, or
`meta` for a run that proves no kernel reads host data), with the counter-based random numbers
(numerics/random.py) ported bit for bit; the kernel sets over it are in torch_ops.py. Here too: the
dtypes by logical name, and a value's way between numpy on the host and a tensor on the device.

Scalars: a constant is a Python float rounded once to the tensor's dtype (on the host, where it is
made), so that `x * c` is one kernel with no host-to-device copy (in exact mode a 0-d device tensor:
see `const`); a clipping coefficient stays a 0-d device tensor (never read back).
"""

from __future__ import annotations

import contextlib
import math
from functools import lru_cache
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from simcluster.numerics import random as _random
from simcluster.numerics.dtypes import dtype_name
from simcluster.numerics.limbs import BF16

TORCH_DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
                "int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
_MASK64 = (1 << 64) - 1


def torch_dtype(dtype: Any) -> torch.dtype:
    """The torch dtype of a logical name, a numpy dtype or a torch dtype."""
    return dtype if isinstance(dtype, torch.dtype) else TORCH_DTYPES[dtype_name(dtype)]


def _signed(value: int) -> int:
    """A uint64 bit pattern as the int64 with the same bits (torch's uint64 arithmetic is partial)."""
    value &= _MASK64
    return value - (1 << 64) if value >> 63 else value


@lru_cache(maxsize=4096)
def _rounded(value: float, dtype: torch.dtype) -> float:
    """`value` rounded once to `dtype`, as a Python float (exact in float64)."""
    return float(torch.tensor(value, dtype=torch.float64).to(dtype)) if dtype.is_floating_point else value


def host_to_torch(x: np.ndarray, device: torch.device) -> torch.Tensor:
    """A numpy array on `device` (bf16 moves as its bits: torch cannot take ml_dtypes arrays). To a GPU
    through pinned memory, without waiting: a copy from pageable memory makes the host wait for every
    kernel queued before it (torch synchronises the stream), and a step uploads its token ids and masks
    each micro-batch (the pinned block is kept until its copy is done: torch's caching host allocator)."""
    x = np.ascontiguousarray(x)
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) if x.dtype == BF16 else torch.from_numpy(x)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def torch_to_host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (bf16 as ml_dtypes' bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """While a rank's program runs, numpy may not read a tensor (np.asarray(t), np.concatenate of
    tensors, a numpy ufunc on one): on a GPU that is a copy to the host, which torch refuses for a CUDA
    tensor and a program must not need. Refused on every device, so a CPU run fails where a GPU would
    (once, a partial that had lost its namespace was concatenated by numpy: exact mode failed on an
    H100 and passed on every CPU test). torch_to_host's `.cpu().numpy()` is the one way back."""
    def refuse(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"numpy read a {self.device.type} tensor of shape {tuple(self.shape)} while the program "
                        f"ran: a host copy (a GPU refuses it); the program's arrays go through ops")
    before = torch.Tensor.__array__
    torch.Tensor.__array__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.__array__ = before  # type: ignore[method-assign]


class TorchArrays:
    """The array namespace on torch tensors of one device."""

    def __init__(self, device: torch.device | str = "cpu", *, correctly_rounded: bool = False) -> None:
        self.device = torch.device(device)
        self.correctly_rounded = correctly_rounded  # exact mode: every elementwise result IEEE's
        self.cheap_truth = self.device.type == "cpu"  # (truth() on a GPU waits for it: arrays.py)

    # -- elementwise ------------------------------------------------------------------------------
    add = staticmethod(torch.add)
    subtract = staticmethod(torch.sub)
    multiply = staticmethod(torch.mul)
    divide = staticmethod(torch.div)
    isfinite = staticmethod(torch.isfinite)
    exp = staticmethod(torch.exp)
    log = staticmethod(torch.log)
    tanh = staticmethod(torch.tanh)

    def sqrt(self, x: torch.Tensor) -> torch.Tensor:
        """Correctly rounded where asked: torch's fp32 sqrt on the CPU is not, in about 0.7 % of values
        (measured against numpy's); through float64 it is (53 >= 2 x 24 + 2 bits: one honest rounding)."""
        if self.correctly_rounded and x.dtype != torch.float64:
            return torch.sqrt(x.to(torch.float64)).to(x.dtype)
        return torch.sqrt(x)

    @staticmethod
    def maximum(a: Any, b: Any) -> torch.Tensor:
        return torch.clamp_min(a, b) if isinstance(b, (int, float)) else torch.maximum(a, b)

    @staticmethod
    def minimum(a: Any, b: Any) -> torch.Tensor:
        return torch.clamp_max(a, b) if isinstance(b, (int, float)) else torch.minimum(a, b)

    @staticmethod
    def where(cond: Any, a: Any, b: Any) -> torch.Tensor:
        return torch.where(cond, a, b)

    # -- dtypes -------------------------------------------------------------------------------------
    def astype(self, x: Any, dtype: Any, copy: bool = True) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            x = self.asarray(x)
        return x.to(torch_dtype(dtype), copy=copy)

    def const(self, x: Any, value: Any) -> Any:
        """`value` rounded once to x's dtype: a Python float (one kernel, no copy to the device); in exact
        mode a 0-d tensor on x's device, because CUDA divides by a host scalar as a multiplication by its
        reciprocal (ATen's div_true kernel: "may lose one bit of precision"), not correctly rounded."""
        if isinstance(value, torch.Tensor):
            return value.to(x.dtype)
        rounded = _rounded(float(value), x.dtype)
        if self.correctly_rounded:
            return torch.full((), rounded, dtype=x.dtype, device=x.device)
        return rounded

    @staticmethod
    def name(dtype: Any) -> str:
        return dtype_name(dtype)

    @staticmethod
    def is_array(x: Any) -> bool:
        return isinstance(x, torch.Tensor)

    @staticmethod
    def is_dtype(x: Any) -> bool:
        return isinstance(x, (torch.dtype, type, np.dtype))

    @staticmethod
    def result_type(a: Any, b: Any) -> torch.dtype:
        return torch.promote_types(a.dtype, b.dtype)

    # -- making arrays --------------------------------------------------------------------------------
    def zeros(self, shape: Sequence[int], dtype: Any) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self.device)

    @staticmethod
    def zeros_like(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)

    def asarray(self, x: Any, dtype: Any = None) -> torch.Tensor:
        """x on this device: a tensor as it is, host data (numpy, ranges, numbers) copied there once."""
        if isinstance(x, torch.Tensor):
            t = x if x.device == self.device else x.to(self.device)
        elif isinstance(x, np.ndarray):
            t = host_to_torch(x, self.device)
        elif isinstance(x, range):
            t = torch.arange(x.start, x.stop, x.step, dtype=torch.int64, device=self.device)
        else:
            t = torch.as_tensor(np.asarray(x), device=self.device)
        return t if dtype is None else t.to(torch_dtype(dtype))

    @staticmethod
    def broadcast_to(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
        return x.expand(tuple(shape))

    # -- layout -------------------------------------------------------------------------------------
    @staticmethod
    def concat(xs: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
        return torch.cat(list(xs), dim=dim)

    swapaxes = staticmethod(torch.swapaxes)

    @staticmethod
    def permute(x: torch.Tensor, dims: Sequence[int]) -> torch.Tensor:
        return x.permute(tuple(dims))

    @staticmethod
    def contiguous(x: torch.Tensor) -> torch.Tensor:
        return x.contiguous()

    @staticmethod
    def repeat(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
        return torch.repeat_interleave(x, n, dim=dim)

    def take_last(self, x: torch.Tensor, index: Any) -> torch.Tensor:
        return torch.gather(x, -1, self.asarray(index)[..., None])[..., 0]

    def put_last(self, x: torch.Tensor, index: Any, values: torch.Tensor) -> torch.Tensor:
        # (one write to each row: deterministic on a GPU too)
        return x.scatter(-1, self.asarray(index)[..., None], values[..., None])

    def one_hot(self, index: Any, n: int, dtype: Any) -> torch.Tensor:
        return torch.nn.functional.one_hot(self.asarray(index), n).to(torch_dtype(dtype))

    # -- reductions and products ----------------------------------------------------------------------
    matmul = staticmethod(torch.matmul)

    @staticmethod
    def einsum(spec: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum(spec, a, b)

    @staticmethod
    def sum(x: torch.Tensor, axis: Any, dtype: Any = None) -> torch.Tensor:
        dt = None if dtype is None else torch_dtype(dtype)
        return torch.sum(x, dtype=dt) if axis is None else torch.sum(x, dim=axis, dtype=dt)

    @staticmethod
    def max(x: torch.Tensor, axis: int) -> torch.Tensor:
        return torch.amax(x, dim=axis, keepdim=True)

    @staticmethod
    def to_host(x: Any) -> np.ndarray:
        return torch_to_host(x) if isinstance(x, torch.Tensor) else np.asarray(x)

    @staticmethod
    def write(dst: Any, src: Any) -> None:
        dst.copy_(src)  # (a cast as .to() casts: the same kernel)

    # -- exact mode's limbs, slices and transcendentals (numerics/limbs.py, exact.py, transcendental.py) --
    floor = staticmethod(torch.floor)
    trunc = staticmethod(torch.trunc)
    abs = staticmethod(torch.abs)
    isnan = staticmethod(torch.isnan)
    clip = staticmethod(torch.clamp)

    @staticmethod
    def stack(xs: Sequence[torch.Tensor], axis: int) -> torch.Tensor:
        return torch.stack(list(xs), dim=axis)

    @staticmethod
    def ldexp(x: torch.Tensor, e: Any) -> torch.Tensor:
        """x * 2**e, exactly: 2**e made from its bits (torch.ldexp goes through pow, which CUDA does not
        promise exact); e within the normal exponents [-1022, 1023], as every caller's is."""
        if isinstance(e, int):
            return x * math.ldexp(1.0, e)
        return x * ((e.to(torch.int64) + 1023) << 52).view(torch.float64)

    @staticmethod
    def frexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m, e = torch.frexp(x)
        return m, e.to(torch.int64)

    @staticmethod
    def full_like(x: torch.Tensor, value: float) -> torch.Tensor:
        return torch.full_like(x, value)

    @staticmethod
    def flip_last(x: torch.Tensor) -> torch.Tensor:
        return torch.flip(x, [-1])

    @staticmethod
    def argmax_last(x: torch.Tensor) -> torch.Tensor:
        return torch.argmax(x, dim=-1)

    @staticmethod
    def any(x: torch.Tensor, axis: Any = None) -> torch.Tensor:
        return torch.any(x) if axis is None else torch.any(x, dim=axis)

    @staticmethod
    def truth(x: Any) -> bool:
        """A 0-d boolean's value, read back to the host: exact mode's data-dependent steps (a slice that is
        all zeros, a term outside the window) wait for the device here."""
        return bool(x)

    @staticmethod
    def gather_last(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.gather(x, -1, index[..., None])[..., 0]

    def arange(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device)

    # -- the counter-based random numbers (numerics/random.py), bit for bit -------------------------
    @staticmethod
    def _shr(z: torch.Tensor, k: int) -> torch.Tensor:
        """Logical right shift of int64s holding uint64 bits."""
        return (z >> k) & ((1 << (64 - k)) - 1)

    def _mix(self, z: torch.Tensor) -> torch.Tensor:
        z = (z ^ self._shr(z, 30)) * _signed(0xBF58476D1CE4E5B9)
        z = (z ^ self._shr(z, 27)) * _signed(0x94D049BB133111EB)
        return z ^ self._shr(z, 31)

    def uniform(self, seed: int, stream: int | str, shape: tuple[int, ...], *, offset: tuple[int, ...] | None = None,
                full_shape: tuple[int, ...] | None = None, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
        """random.uniform on this device: the same bits (SplitMix64 in wrapping int64 arithmetic)."""
        full_shape = tuple(shape) if full_shape is None else tuple(full_shape)
        offset = (0,) * len(shape) if offset is None else tuple(offset)
        if len(full_shape) != len(shape) or len(offset) != len(shape):
            raise ValueError(f"shape {shape}, offset {offset} and full_shape {full_shape} must have the same rank")
        if isinstance(stream, str):
            stream = _random.stream_id(stream)
        key = int(_random._mix(np.array([(seed & 0xFFFFFFFF) << 32 | (stream & 0xFFFFFFFF)], dtype=np.uint64))[0])
        flat = torch.zeros(tuple(shape), dtype=torch.int64, device=self.device)
        for d, (o, s, n) in enumerate(zip(offset, shape, full_shape)):
            view = [1] * len(shape)
            view[d] = s
            flat = flat * n + torch.arange(o, o + s, dtype=torch.int64, device=self.device).reshape(view)
        flat = flat.reshape(-1)
        out = torch.empty(flat.shape, dtype=torch.float32, device=self.device)
        # on a CPU, a block at a time stays in cache (some twenty passes over each element; 3x faster
        # for a 12.6M-element weight, measured); a GPU takes the whole tensor at once
        block = flat.numel() if self.device.type != "cpu" else 1 << 16
        for at in range(0, flat.numel(), block):
            z = self._mix(flat[at:at + block] * _signed(int(_random._GOLDEN)) + _signed(key))
            u = self._shr(z, 40).to(torch.float64) * 2.0**-24  # [0, 1), 24 bits
            out[at:at + block] = low + (high - low) * u
        return out.reshape(tuple(shape))
