"""The Llama's elementwise work as an eager PyTorch stack launches it (`model.fused_kernels = false`).

The numbers are the model's own (the same calls, in the same order); only what they cost changes: each
piece below is charged as the kernels that torchtitan's Llama 3 (torchtitan/models/norms.py and
models/llama/model.py at commit 6b03ffa, 2024-12-26, the stack of its published December 2024
benchmarks) launches for it without torch.compile, its tensors in the model's dtype (FSDP2's bf16
parameters) and the fp32 upcasts its code writes. For n elements of w bytes (r rows of the hidden
size h; an upcast or downcast is no kernel when the dtype is already fp32, as torch's `.float()` and
`.type_as` return the tensor itself):

RMSNorm, `(x.float() * rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight`:
  forward, 8 kernels: float (n w + 4n bytes), pow (8n), mean (4n + 4r), add eps (8r), rsqrt (8r),
    mul by the rstd (8n + 4r), type_as (4n + n w), mul by the weight (2n w + h w);
  backward, as autograd's derivative formulas (tools/autograd/derivatives.yaml) run them, 16 kernels:
    the weight's mul: grad x weight (2n w + h w), grad x its input (3n w), that summed over rows (n w +
    h w); type_as's: a cast (n w + 4n); the rstd's mul: grad x rstd (8n + 4r), grad x x (12n), that
    summed over the row (4n + 4r); rsqrt's -1/2 grad r^3: pow, mul, mul (12r each); mean's: the row's
    grad spread over it and divided (4r + 4n); pow's grad x (2 x^1): x^1, times 2, times grad (8n, 8n,
    12n); the two uses of x.float() summed (12n); float's: a cast (4n + n w).
Rotary embedding, `view_as_real(view_as_complex(x.float().reshape(..., -1, 2)) * freqs_cis).type_as(x)`,
  on q and on k each (n their elements; freqs_cis is s x d/2 complex64, 4 s d bytes):
  forward, 3 kernels: float (n w + 4n), the complex product (8n + 4 s d), type_as (4n + n w);
  backward, 3: type_as's cast (n w + 4n), grad x conj(freqs_cis) (8n + 4 s d), float's cast (4n + n w).
  (The rotation the model computes is the rotate-half form, q cos + rot(q) sin: the same products,
  pair by pair, on a permuted layout; the kernels are charged as torchtitan's interleaved-pair form
  runs them.)
repeat_kv, `x.unsqueeze(3).expand(...).reshape(...)` on k and on v with n_rep = heads / kv_heads > 1: a
  copy (n w + n_rep n w); its backward, the repeats' sum, is the model's own `sum`.
Pieces charged as the model's own ops already launch them (the same kernels eager torch runs):
the GEMMs, scaled_dot_product_attention (one flash kernel each way; the transposes around it are
views, and its output transposed back and `.contiguous()` is no copy: the kernel wrote it in that
layout), SwiGLU's silu and product (backward: autograd's two products and silu's backward, silu's
output kept from the forward: fusion.swiglu_backward), the residual adds. With `fused_kernels = true`
(the default: torch.compile's, and Megatron-Core's fused kernels) RMSNorm and SwiGLU are one kernel
each way (fusion.py) and the rest as the model's ops are charged.
"""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from typing import Any, ContextManager, Iterator

from simcluster.numerics.tensor import ITEMSIZE

Kernels = list[tuple[str, float, float]]  # (name, FLOPs, bytes)


def rms_norm(cfg: Any, shape: tuple[int, ...], backward: bool) -> Kernels:
    """RMSNorm's eager kernels on x of `shape` (..., h): forward or backward (the module docstring)."""
    w, h = ITEMSIZE[cfg.dtype], shape[-1]
    n = math.prod(shape)
    r = n // h if h else 0
    cast = w != 4  # (.float() and .type_as are no kernels on an fp32 tensor)
    if not backward:
        out = [("rms_norm.float", n, n * w + 4 * n)] * cast + [
            ("rms_norm.pow", n, 8 * n), ("rms_norm.mean", n, 4 * n + 4 * r), ("rms_norm.add_eps", r, 8 * r),
            ("rms_norm.rsqrt", r, 8 * r), ("rms_norm.mul_rstd", n, 8 * n + 4 * r)]
        return out + [("rms_norm.type_as", n, 4 * n + n * w)] * cast + [
            ("rms_norm.mul_weight", n, 2 * n * w + h * w)]
    return [("rms_norm_backward.mul_weight", n, 2 * n * w + h * w), ("rms_norm_backward.mul_input", n, 3 * n * w),
            ("rms_norm_backward.sum_weight", n, n * w + h * w)] + \
        [("rms_norm_backward.type_as", n, n * w + 4 * n)] * cast + [
            ("rms_norm_backward.mul_rstd", n, 8 * n + 4 * r), ("rms_norm_backward.mul_x", n, 12 * n),
            ("rms_norm_backward.sum_row", n, 4 * n + 4 * r)] + \
        [("rms_norm_backward.rsqrt", r, 12 * r)] * 3 + [
            ("rms_norm_backward.mean", n, 4 * r + 4 * n), ("rms_norm_backward.pow", n, 8 * n),
            ("rms_norm_backward.pow_scale", n, 8 * n), ("rms_norm_backward.pow_grad", n, 12 * n),
            ("rms_norm_backward.accumulate", n, 12 * n)] + \
        [("rms_norm_backward.float", n, 4 * n + n * w)] * cast


def rope(cfg: Any, shape: tuple[int, ...], seq: int, backward: bool) -> Kernels:
    """The rotary embedding's eager kernels on q or k of `shape` (b, heads, s, d) (the module docstring)."""
    w, d = ITEMSIZE[cfg.dtype], shape[-1]
    n = math.prod(shape)
    cast = w != 4
    tag = "rope_backward" if backward else "rope"
    return ([(f"{tag}.cast_up", n, n * w + 4 * n)] * cast + [(f"{tag}.complex_mul", 3 * n, 8 * n + 4 * seq * d)]
            + [(f"{tag}.cast_down", n, 4 * n + n * w)] * cast)


@contextmanager
def _charged(ops: Any, kernels: Kernels) -> Iterator[None]:
    """The enclosed ops charged as `kernels` instead of what they record: the first kernel takes their
    place, the rest follow it."""
    (name, flops, nbytes), rest = kernels[0], kernels[1:]
    with ops.fused(name, flops=flops, nbytes=nbytes):
        yield
    for name, flops, nbytes in rest:
        with ops.fused(name, flops=flops, nbytes=nbytes):
            pass


def repeat_kv(ops: Any, cfg: Any, x: Any, group: int) -> None:
    """Charge repeat_kv's copy of x (b, kv, s, d) for `group` query heads each (reads x, writes the
    repeats), when the model's kernels are not fused (a fused attention kernel reads the kv heads
    where they are)."""
    if not cfg.fused_kernels and group > 1:
        n = math.prod(tuple(x.shape))
        with ops.fused("repeat_kv", flops=0.0, nbytes=float((1 + group) * n * ITEMSIZE[cfg.dtype])):
            pass


def norm(ops: Any, cfg: Any, x: Any, backward: bool = False) -> ContextManager[None]:
    """Around the RMSNorm of x (or its backward): eager's kernels when the model's are not fused."""
    return nullcontext() if cfg.fused_kernels else _charged(ops, rms_norm(cfg, tuple(x.shape), backward))


def rotary(ops: Any, cfg: Any, x: Any, backward: bool = False) -> ContextManager[None]:
    """Around rotating q or k (or its backward): eager's kernels when the model's are not fused."""
    return nullcontext() if cfg.fused_kernels else _charged(ops, rope(cfg, tuple(x.shape), x.shape[2], backward))
