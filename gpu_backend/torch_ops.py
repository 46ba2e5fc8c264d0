"""The kernel set on torch tensors on the rank's device: fast mode as a GPU runs it, nothing through the host.

The kernels run over `TorchArrays`, the array namespace on torch tensors of one device (torch_arrays.py).
`TorchFastOps` is simcluster's fast mode (numerics/modes.py) over it: the
same kernels (numerics/kernels.py) written once, matmuls and einsums in cuBLAS with fp32 accumulation
for 16-bit inputs (TF32 off, so fp32 means fp32), 16-bit elementwise kernels widened to fp32 as the
fused GPU kernels run them, a fast Partial as an fp32 device tensor, and the counter-based random
numbers (numerics/random.py) ported so that dropout masks and initial weights are bit-identical.

`TorchExactOps` is exact mode over it: the int64 limbs and sliced float64 GEMMs of numerics/exact.py
on the device, byte-identical to the emulator. Both may use a fused attention (torch's
scaled_dot_product_attention) where the program has no dropout; 16-bit GEMMs are native on CUDA and on
a CPU with bf16 matrix tiles (AMX), widened to fp32 elsewhere (slower there natively, measured).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from simcluster.model import flash
from simcluster.numerics.modes import ExactNum, ExactOps, FastNum, FastOps, Widened
from simcluster.numerics.ops import Record
from simcluster.numerics.tensor import Partial

from gpu_backend.torch_arrays import (  # noqa: F401  (re-exported: the backend's callers import them here)
    TORCH_DTYPES, TorchArrays, host_to_torch, torch_dtype, torch_to_host)


SIXTEEN = (torch.bfloat16, torch.float16)
# A CPU with AMX tiles (Intel Sapphire Rapids on) multiplies bf16 natively through oneDNN: 0.8-1.2 TFLOP/s on
# one core of this machine against 0.11-0.19 for the widened fp32 GEMM (measured, 256x1024x4096 and
# neighbours); without them (AVX-512 alone, and fp16 without AMX-FP16) torch's 16-bit GEMMs ran at
# 0.016-0.17 TFLOP/s, slower than widening (`simcluster calibrate` on an earlier machine).
CPU_BF16_TILES = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _native(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the device multiplies this 16-bit dtype in its own units (fp32 accumulation, one rounding)."""
    return device.type == "cuda" or (device.type == "cpu" and dtype == torch.bfloat16 and CPU_BF16_TILES)


def _gemm(a: torch.Tensor, b: torch.Tensor, partial: bool, spec: str | None = None) -> torch.Tensor | None:
    """A 16-bit GEMM as a GPU's BLAS runs it (tensor cores: fp32 accumulation, one rounding at the end), where
    the device has such units (`_native`); a partial sum, which must stay in fp32, by a 16-bit GEMM that
    writes fp32 (mm's and bmm's `out_dtype` on CUDA, an einsum through `contract`; AMX's tiles behind an
    fp32 GEMM on a CPU). None where fast mode's widened form serves (no such units)."""
    if a.dtype not in SIXTEEN or b.dtype != a.dtype or not _native(a.dtype, a.device):
        return None
    if not partial:
        return torch.matmul(a, b) if spec is None else torch.einsum(spec, a, b)
    if spec is None and a.device.type == "cuda" and b.dim() == 2:
        return torch.mm(a.reshape(-1, a.shape[-1]), b, out_dtype=torch.float32).reshape(*a.shape[:-1], b.shape[1])
    if spec is not None and a.device.type == "cuda":  # (weight gradients, attention's partial products)
        return contract(spec, a, b, lambda x, y: torch.bmm(x, y, out_dtype=torch.float32))
    if a.device.type == "cpu":
        return _tiles_to_fp32(a, b, spec)
    return None


def contract(spec: str, a: torch.Tensor, b: torch.Tensor, bmm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
             ) -> torch.Tensor:
    """A two-operand einsum as one batched matrix product `bmm` of 3-D views (batch, rows, sum) and (batch,
    sum, columns): so a 16-bit einsum can write fp32 (`torch.bmm(..., out_dtype=)` has no einsum form).
    Without it a GPU widened both operands and multiplied in fp32 without tensor cores: the weight
    gradients of a 1.2B GPT took 0.34 s of its 0.60 s step on an H100 (torch.profiler, cutlass SIMT
    kernels). Every index of an operand is in the output or in the other operand (no sum over one alone)."""
    inputs, out = spec.split("->")
    sa, sb = inputs.split(",")
    batch = [c for c in out if c in sa and c in sb]
    rows, cols = [c for c in out if c in sa and c not in sb], [c for c in out if c in sb and c not in sa]
    summed = [c for c in sa if c in sb and c not in out]
    if len(batch) + len(rows) + len(summed) != len(sa) or len(batch) + len(cols) + len(summed) != len(sb):
        raise ValueError(f"einsum {spec!r} sums an index of one operand alone: not one matrix product")
    size = dict(zip(sa, a.shape)) | dict(zip(sb, b.shape))
    n = lambda letters: math.prod(size[c] for c in letters)  # noqa: E731
    x = a.permute([sa.index(c) for c in batch + rows + summed]).reshape(n(batch), n(rows), n(summed))
    y = b.permute([sb.index(c) for c in batch + summed + cols]).reshape(n(batch), n(summed), n(cols))
    order = batch + rows + cols
    z = bmm(x, y).reshape([size[c] for c in order])
    return z.permute([order.index(c) for c in out])


def _tiles_to_fp32(a: torch.Tensor, b: torch.Tensor, spec: str | None) -> torch.Tensor:
    """A bf16 GEMM written in fp32 on a CPU with AMX tiles: the inputs widened (exactly) and multiplied by
    oneDNN with its fp32 matmuls allowed to round their inputs to bf16, which for these is no rounding at
    all: bf16 products, fp32 accumulation, fp32 out, as cuBLAS's `out_dtype` GEMM. 0.28-0.39 TFLOP/s a
    core here against 0.14-0.17 for the fp32 GEMM of the widened inputs (weight-gradient shapes, h 512-2048,
    measured). The setting is the process's; it is restored at once, so no other fp32 GEMM rounds."""
    setting = torch.backends.mkldnn.matmul
    before = setting.fp32_precision
    a, b = a.to(torch.float32), b.to(torch.float32)
    setting.fp32_precision = "bf16"
    try:
        return torch.matmul(a, b) if spec is None else torch.einsum(spec, a, b)
    finally:
        setting.fp32_precision = before


class TorchFastNum(FastNum):
    """Fast mode's primitives on torch: 16-bit einsums in the device's own 16-bit GEMMs."""

    def einsum(self, spec: str, a: Any, b: Any, partial: bool = False) -> Any:
        out = _gemm(a, b, partial, spec)
        return super().einsum(spec, a, b, partial) if out is None else (
            Partial.accumulating(out, self.xp.name(a.dtype), self.xp) if partial else out)


class TorchKernels(Widened):
    """Fast mode's kernels on torch: the activations and their backwards in torch's own fused kernels (one
    pass over the tensor, computed in fp32 and rounded once to a 16-bit input's dtype, as `Widened` defines
    them), where the written-once form is a dozen passes of eager torch, each widening: 3 ms against
    0.7 ms a call of GELU's backward on 256 x 1024 bf16 elements, in a step (measured). The rest: `Widened`."""

    def gelu(self, num: Any, x: Any) -> Any:
        return torch.nn.functional.gelu(x, approximate="tanh")

    def gelu_backward(self, num: Any, dy: Any, x: Any) -> Any:
        if dy.dtype != x.dtype:  # (mixed: the written-once form, which rounds to the 16-bit one)
            return super().__getattr__("gelu_backward")(num, dy, x)
        return torch.ops.aten.gelu_backward(dy, x, approximate="tanh")

    def silu(self, num: Any, x: Any) -> Any:
        return torch.nn.functional.silu(x)

    def silu_backward(self, num: Any, dy: Any, x: Any) -> Any:
        if dy.dtype != x.dtype:
            return super().__getattr__("silu_backward")(num, dy, x)
        return torch.ops.aten.silu_backward(dy, x)


class TorchFastOps(FastOps):
    """Fast mode on torch tensors of one device (`device`: cuda:N, cpu, or meta)."""

    def __init__(self, device: torch.device | str = "cpu", record: Record | None = None, *,
                 cost_dtype: str = "fp32") -> None:
        super().__init__(record, cost_dtype=cost_dtype)
        self.xp = TorchArrays(device)
        self._num = TorchFastNum(self.xp)
        self._kernels = TorchKernels(self.xp)

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
        one). A clipped gradient is scaled in its fp32 copy where the cast made one (the same multiplication
        as `scale`; no buffer kept from step to step: the H200 showed one a flat unit, 1 GiB, never charged)."""
        fused = getattr(torch, "_fused_adamw_", None)
        if fused is None or param.dtype != torch.float32 or param.device.type == "meta":
            return super().adam(param, grad, m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, grad_scale=grad_scale, donate=donate)
        wide = grad.to(torch.float32)
        if grad_scale is not None:
            self._cost("adam", tuple(wide.shape), 1, 2, grad)  # (as the emulator charges it: Ops.adam)
            c = self.xp.const(wide, grad_scale)
            wide = torch.mul(wide, c) if wide is grad else wide.mul_(c)  # (the caller's gradient left as it is)
        grad = wide
        self._cost("adam", tuple(param.shape), 12, 7, param)
        if not donate:
            param = param.clone()
        steps = torch.full((), float(step), dtype=torch.float32, device=param.device)
        fused([param], [grad], [m], [v], [], [steps], amsgrad=False, lr=lr, beta1=beta1,
              beta2=beta2, weight_decay=weight_decay, eps=eps, maximize=False)
        return param, m, v

    def fused_attention(self, q: Any, k: Any, v: Any, *, causal: bool, scale: float) -> tuple[Any, Any]:
        """torch's scaled_dot_product_attention (FlashAttention on a GPU, its fused CPU kernel here): the
        s x s scores never exist; the backward is its own, through autograd on the kept graph. Fewer key/value
        heads than query heads (model.gqa = "native"): its grouped-query attention takes them as they are."""
        q_, k_, v_ = (t.detach().requires_grad_(True) for t in (q, k, v))
        with torch.enable_grad():
            out = torch.nn.functional.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, scale=scale,
                                                                   enable_gqa=k.shape[1] != q.shape[1])
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
