"""The kernel set on torch tensors on the rank's device: fast mode as a GPU runs it, nothing through the host.

`TorchArrays` is the array namespace (simcluster/numerics/arrays.py says what one is) on torch: the
same functions numpy's has, on tensors of one device (cuda, cpu, or `meta` for a run that proves no
kernel reads host data). `TorchFastOps` is simcluster's fast mode (numerics/modes.py) over it: the
same kernels (numerics/kernels.py) written once, matmuls and einsums in cuBLAS with fp32 accumulation
for 16-bit inputs (TF32 off, so fp32 means fp32), 16-bit elementwise kernels widened to fp32 as the
fused GPU kernels run them, a fast Partial as an fp32 device tensor, and the counter-based random
numbers (numerics/random.py) ported so that dropout masks and initial weights are bit-identical.

`TorchExactOps` is exact mode over it: the int64 limbs and sliced float64 GEMMs of numerics/exact.py
on the device, byte-identical to the emulator. Both may use a fused attention (torch's
scaled_dot_product_attention) where the program has no dropout; 16-bit GEMMs are native on CUDA and
widened to fp32 on a CPU (slower there natively, measured).

Scalars: a constant is a Python float rounded once to the tensor's dtype (on the host, where it is
made), so that `x * c` is one kernel with no host-to-device copy (in exact mode a 0-d device tensor:
see `const`); a clipping coefficient stays a 0-d device tensor (never read back).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from simcluster.model import flash
from simcluster.numerics import random as _random
from simcluster.numerics.dtypes import dtype_name
from simcluster.numerics.limbs import BF16
from simcluster.numerics.modes import ExactNum, ExactOps, FastNum, FastOps, Widened
from simcluster.numerics.ops import Record
from simcluster.numerics.tensor import Partial

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
    """A numpy array on `device` (bf16 moves as its bits: torch cannot take ml_dtypes arrays)."""
    x = np.ascontiguousarray(x)
    if x.dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).to(device)
    return torch.from_numpy(x).to(device)


def torch_to_host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a numpy array (bf16 as ml_dtypes' bfloat16)."""
    t = t.detach().cpu()
    return t.view(torch.int16).numpy().view(BF16) if t.dtype == torch.bfloat16 else t.numpy()


class TorchArrays:
    """The array namespace on torch tensors of one device."""

    def __init__(self, device: torch.device | str = "cpu", *, correctly_rounded: bool = False) -> None:
        self.device = torch.device(device)
        self.correctly_rounded = correctly_rounded  # exact mode: every elementwise result IEEE's

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


SIXTEEN = (torch.bfloat16, torch.float16)


def _gemm(a: torch.Tensor, b: torch.Tensor, partial: bool, spec: str | None = None) -> torch.Tensor | None:
    """A 16-bit GEMM as a GPU's BLAS runs it (tensor cores: fp32 accumulation, one rounding at the end), or
    None where fast mode's widened form serves: on a CPU (torch's bf16 GEMMs there ran at 0.016-0.09
    TFLOP/s against fp32's 0.03-0.17 on this machine's AVX-512 cores, measured by `simcluster
    calibrate`), and for a partial sum, which must stay in fp32, without a 16-bit GEMM writing fp32
    (`out_dtype`: CUDA's)."""
    if a.dtype not in SIXTEEN or b.dtype != a.dtype or a.device.type != "cuda":
        return None
    if not partial:
        return torch.matmul(a, b) if spec is None else torch.einsum(spec, a, b)
    if spec is None and a.device.type == "cuda" and b.dim() == 2:
        return torch.mm(a.reshape(-1, a.shape[-1]), b, out_dtype=torch.float32).reshape(*a.shape[:-1], b.shape[1])
    return None


class TorchFastNum(FastNum):
    """Fast mode's primitives on torch: 16-bit einsums in the device's own 16-bit GEMMs."""

    def einsum(self, spec: str, a: Any, b: Any, partial: bool = False) -> Any:
        out = _gemm(a, b, partial, spec)
        return super().einsum(spec, a, b, partial) if out is None else (
            Partial.accumulating(out, self.xp.name(a.dtype), self.xp) if partial else out)


class TorchFastOps(FastOps):
    """Fast mode on torch tensors of one device (`device`: cuda:N, cpu, or meta)."""

    def __init__(self, device: torch.device | str = "cpu", record: Record | None = None, *,
                 cost_dtype: str = "fp32") -> None:
        super().__init__(record, cost_dtype=cost_dtype)
        self.xp = TorchArrays(device)
        self._num = TorchFastNum(self.xp)
        self._kernels = Widened(self.xp)
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] = {}

    def _matmul(self, a: Any, b: Any, partial: bool, out_shape: tuple[int, ...]) -> Any:
        out = _gemm(a, b, partial)
        if out is None:
            return super()._matmul(a, b, partial, out_shape)
        return Partial.accumulating(out, self.xp.name(a.dtype), self.xp) if partial else out

    @property
    def device(self) -> torch.device:
        return self.xp.device

    def adam(self, param: Any, grad: Any, m: Any, v: Any, step: int, *, lr: float, beta1: float = 0.9,
             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: Any = None,
             donate: bool = False) -> Any:
        """AdamW as torch.optim.AdamW(fused=True) runs it: one pass over the four tensors (the unfused
        form reads and writes them some fifteen times; 4.5x slower on one CPU core, measured). The same
        mathematics in another order of roundings: fast mode. Adam's moments are updated in place (the
        optimizer's own state: nothing else holds them); so is a donated parameter, as torch's optimizer
        updates its own; else the parameter is a new tensor (a delayed update still computes with the old
        one). A clipped gradient is scaled into a buffer kept for the next step (the same multiplication as
        `scale`): a new 4-byte-an-element tensor every step would cost a page fault every 4 KiB on a host
        whose allocator returns large blocks to the system (glibc above 32 MiB)."""
        fused = getattr(torch, "_fused_adamw_", None)
        if fused is None or param.dtype != torch.float32 or param.device.type == "meta":
            return super().adam(param, grad, m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, grad_scale=grad_scale, donate=donate)
        grad = grad.to(torch.float32)
        if grad_scale is not None:
            self._elementwise_cost("scale", tuple(grad.shape), 1)
            grad = torch.mul(grad, self.xp.const(grad, grad_scale), out=self._scratch(grad))
        self._cost("adam", tuple(param.shape), 12, 7)
        if not donate:
            param = param.clone()
        steps = torch.full((), float(step), dtype=torch.float32, device=param.device)
        fused([param], [grad], [m], [v], [], [steps], amsgrad=False, lr=lr, beta1=beta1,
              beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False)
        return param, m, v

    def _scratch(self, like: torch.Tensor) -> torch.Tensor:
        """A buffer of like's shape and dtype, the same one each time it is asked for (its values are
        the caller's to write: one user at a time)."""
        key = (tuple(like.shape), like.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            buffer = self._buffers[key] = torch.empty_like(like)
        return buffer

    def fused_attention(self, q: Any, k: Any, v: Any, *, causal: bool, scale: float) -> tuple[Any, Any]:
        """torch's scaled_dot_product_attention (FlashAttention on a GPU, its fused CPU kernel here): the
        s x s scores never exist; the backward is its own, through autograd on the kept graph."""
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=scale)
        self._flash("flash_attention", q, k, causal, backward=False)
        return out.detach(), (out, q_, k_, v_, causal)

    def fused_attention_backward(self, state: Any, dout: Any) -> tuple[Any, Any, Any]:
        out, q, k, v, causal = state
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
        self._flash("flash_attention_backward", q, k, causal, backward=True)
        return dq, dk, dv

    def _flash(self, name: str, q: Any, k: Any, causal: bool, backward: bool) -> None:
        """Records the fused kernel's cost, as the emulator charges it (model/flash.py)."""
        flops, nbytes = flash.cost(tuple(q.shape), tuple(k.shape), self.xp.name(q.dtype), causal, backward)
        self.kernel(name, flops=flops, nbytes=nbytes)

    def embedding_backward(self, ids: Any, dy: Any, rows: int, row_offset: int = 0) -> Any:
        """The rows' sums of dy as torch's embedding backward forms them: added row by row (index_add),
        not as the one-hot GEMM the exact form needs (tokens x rows x hidden multiply-adds, most of them by
        zero). Tokens outside this shard's rows go to a row past the end, dropped (no host sync)."""
        if self.device.type == "meta":
            return super().embedding_backward(ids, dy, rows, row_offset)
        self._cost("embedding_backward", tuple(dy.shape), 1, 3)
        flat = self.xp.asarray(ids).reshape(-1) - row_offset
        index = torch.where((flat >= 0) & (flat < rows), flat, rows)
        acc = torch.float64 if dy.dtype == torch.float64 else torch.float32
        out = torch.zeros((rows + 1, dy.shape[-1]), dtype=acc, device=dy.device)
        out.index_add_(0, index, dy.reshape(-1, dy.shape[-1]).to(acc))
        return Partial.accumulating(out[:rows], self.xp.name(dy.dtype), self.xp)

    def clip_coefficient(self, squares: Any, max_norm: float, eps: float) -> tuple[Any, bool]:
        """min(1, max_norm / (norm + eps)) as a 0-d device tensor: always applied, never read back (as
        torch.nn.utils.clip_grad_norm_ does; scaling by 1 is exact, so the result is the host's)."""
        return torch.clamp(self._norm_coefficient(squares, max_norm, eps), max=1.0), True


class TorchExactOps(ExactOps):
    """Exact mode on torch tensors of one device: the int64 limbs and the sliced float64 GEMMs of
    numerics/exact.py run there, order-independent by construction, so every output is the emulator's,
    byte for byte (slower than fast mode: each slice is a float64 GEMM, each data-dependent step a read
    of one boolean back to the host)."""

    def __init__(self, device: torch.device | str = "cpu", record: Record | None = None, *,
                 cost_dtype: str = "fp32") -> None:
        super().__init__(record, cost_dtype=cost_dtype)
        self.xp = TorchArrays(device, correctly_rounded=True)
        self._num = ExactNum(self.xp)

    @property
    def device(self) -> torch.device:
        return self.xp.device


def deterministic_math() -> None:
    """fp32 means fp32: no TF32 in cuBLAS matmuls or cuDNN (PyTorch's default allows it for convolutions)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


__all__ = ["TorchArrays", "TorchExactOps", "TorchFastOps", "deterministic_math", "host_to_torch", "torch_dtype", "torch_to_host"]
