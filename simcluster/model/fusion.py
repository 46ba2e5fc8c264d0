"""What a block's elementwise work costs when it runs as the fused kernels training stacks use.

The numbers are the unfused ops' (the same calls, in the same order); only what they cost changes.
Megatron-LM (megatron/model/fused_bias_gelu.py, fused_softmax.py and the bias-dropout-add of
transformer.py, since 2020; Megatron-core and torch.compile'd torchtitan fuse the same) runs:
  - a linear layer's bias add in the GEMM (its epilogue): no kernel of its own;
  - bias + GELU as one kernel: it reads the GEMM's output and writes the activation;
  - bias + dropout + residual add as one kernel: it reads the GEMM's output and the residual, and
    writes the sum (and the mask, a byte an element, with dropout);
  - scale + mask + softmax as one kernel, reading the scores once and writing the probabilities
    (unfused attention only: FlashAttention fuses the whole core, flash.py); its backward reads the
    probabilities and their gradient once and writes the scores' gradient;
  - dropout on the attention probabilities as PyTorch's one dropout kernel (transformer.py's
    `attention_dropout`, after the softmax): it draws the mask, reads the probabilities and writes
    them dropped with the mask (a byte an element); its backward (PyTorch's masked scale) reads the
    gradient and the mask and writes the gradient. The same two kernels drop the embeddings and, in
    backward, the residual branches (whose forward dropout is inside bias + dropout + residual, mask
    drawn there too).
The probabilities that backward reads are what the fused forward wrote (kept, or recomputed with
the block): the two-pass core's division e / l that makes them again, and their dropout, are no
pass of their own there.
A Llama's SwiGLU, silu(x w1) * (x w3), is one kernel each way: Megatron-Core's fused_bias_swiglu.py (on
unless --no-bias-swiglu-fusion; r0.8) reads both products and writes theirs, and its backward reads the
gradient and both products and writes both gradients, making silu again on chip; torch.compile fuses the
same pointwise ops (torchtitan's compiled runs). Its rotary embedding stays the model's own ops: Inductor
generates no code for torchtitan's complex product ("does not support code generation for complex
operators", pytorch/torchtitan#15), so compiled it runs about as eager does (model/eager.py).
`model.fused_kernels = false` issues every op as its own kernel, as eager PyTorch does.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager

from simcluster.numerics.tensor import ITEMSIZE


@dataclass(frozen=True)
class Unfused:
    """What these functions read of a model's config, for ops costed with no model's (a layer built alone, as its
    tests build one): every op its own kernel."""
    fused_kernels: bool = False
    dtype: str = "fp32"


UNFUSED = Unfused()


def _size(x: Any, cfg: Any) -> int:
    return math.prod(x.shape) * ITEMSIZE[cfg.dtype]


def _kernel(ops: Any, cfg: Any, name: str | None, nbytes: float = 0.0, *,
            attention: bool = False) -> ContextManager[None]:
    """The enclosed ops as one kernel (no name: inside the GEMM before them), or as they are when the
    model's kernels are not fused (or, for attention's softmax, when flash fuses the whole core)."""
    if not cfg.fused_kernels or (attention and cfg.attention_kernel == "flash"):
        return nullcontext()
    return ops.fused(name, nbytes=nbytes)


def bias(ops: Any, cfg: Any, y: Any, b: Any) -> Any:
    """y + b, in the GEMM that made y."""
    with _kernel(ops, cfg, None):
        return ops.add(y, b)


def bias_gelu(ops: Any, cfg: Any, y: Any, b: Any) -> tuple[Any, Any]:
    """(y + b, gelu(y + b)), one kernel."""
    with _kernel(ops, cfg, "bias_gelu", 2 * _size(y, cfg)):
        f = ops.add(y, b)
        return f, ops.gelu(f)


def bias_dropout_add(ops: Any, cfg: Any, y: Any, b: Any, residual: Any, drop: Any) -> Any:
    """residual + drop(y + b), one kernel; `drop` is the block's dropout (the identity without)."""
    moved = 3 * _size(y, cfg) + (math.prod(y.shape) if cfg.dropout else 0)
    with _kernel(ops, cfg, "bias_dropout_add", moved):
        return ops.add(residual, drop(ops.add(y, b)))


def softmax(ops: Any, cfg: Any, scores: Any) -> ContextManager[None]:
    """Around the softmax of unfused attention's scores (max, exponentials, row sums): one kernel."""
    return _kernel(ops, cfg, "scale_mask_softmax", 2 * _size(scores, cfg), attention=True)


def probabilities(ops: Any, cfg: Any) -> ContextManager[None]:
    """Around the backward's e / l: what the fused forward wrote, no pass of its own."""
    return _kernel(ops, cfg, None, attention=True)


def dropout(ops: Any, cfg: Any, x: Any) -> ContextManager[None]:
    """Around drawing a dropout mask for `x` and applying it: one kernel (inside FlashAttention's,
    which then counts neither its bytes nor a launch)."""
    return _kernel(ops, cfg, "dropout", 2 * _size(x, cfg) + math.prod(x.shape))


def dropout_backward(ops: Any, cfg: Any, grad: Any) -> ContextManager[None]:
    """Around a gradient's dropout (the forward's mask, scaled): one kernel."""
    return _kernel(ops, cfg, "dropout_backward", 2 * _size(grad, cfg) + math.prod(grad.shape))


def residual_mask(ops: Any, cfg: Any) -> ContextManager[None]:
    """Around drawing a residual branch's dropout mask: inside the bias + dropout + residual kernel,
    which counts its bytes."""
    return _kernel(ops, cfg, None)


def softmax_backward(ops: Any, cfg: Any, probs: Any) -> ContextManager[None]:
    """Around the scores' gradient P * (dP - rowsum(dO * O)): one kernel."""
    return _kernel(ops, cfg, "scale_mask_softmax_backward", 3 * _size(probs, cfg), attention=True)


def swiglu(ops: Any, cfg: Any, f1: Any, f3: Any) -> Any:
    """silu(f1) * f3, one kernel: reads f1 and f3, writes the product (Megatron-Core's bias_swiglu_impl;
    torch.compile fuses the two pointwise ops alike). Unfused: silu's kernel, then the product's."""
    with _kernel(ops, cfg, "swiglu", 3 * _size(f1, cfg)):
        return ops.mul(ops.silu(f1), f3)


def swiglu_backward(ops: Any, cfg: Any, dg: Any, f1: Any, f3: Any) -> tuple[Any, Any]:
    """(df1, df3) of g = silu(f1) * f3, one kernel: reads dg, f1 and f3, writes df1 and df3, silu(f1) made
    again on chip (Megatron-Core's SwiGLU backward; torch.compile's fusion of autograd's pointwise ops).
    Unfused, as autograd runs it: the two products and silu's backward, a kernel each, silu(f1) read from
    what the forward kept (model/activations.py: "silu output"), not made again."""
    with _kernel(ops, cfg, "swiglu_backward", 5 * _size(f1, cfg)):
        with nullcontext() if cfg.fused_kernels else ops.fused(None):
            s = ops.silu(f1)
        df3 = ops.mul(dg, s)
        df1 = ops.silu_backward(ops.mul(dg, f3), f1)
    return df1, df3
