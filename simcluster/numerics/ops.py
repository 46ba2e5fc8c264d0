"""The kernel set: one interface, three modes (exact, fast, meta).

Every op returns its result at once and reports a kernel (name, FLOPs, bytes moved) to `record`,
which the backend turns into work on the rank's current stream. Bytes are counted in the logical
`cost_dtype` (what a GPU would move), whatever holds the numbers here, and a tensor a 16-bit run keeps
in fp32 at 4 bytes an element.

The modes themselves are in modes.py.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from enum import Enum
from typing import Any, Callable, Iterator

import numpy as np

from simcluster.numerics import kernels as _k
from simcluster.numerics.arrays import NUMPY
from simcluster.numerics.attention_ops import AttentionOps
from simcluster.numerics.dtypes import is_fp32
from simcluster.numerics.flat import FlatBuffers
from simcluster.numerics.placement import Placement
from simcluster.numerics.tensor import ITEMSIZE, MetaTensor, Partial, dtype_name, logical_dtype

# (name, work, bytes): work is FLOPs, or a GEMM's (batch, m, n, k), which the cluster times by shape
Record = Callable[[str, Any, float], None]
# A GEMM whose sums stay partial (weight gradients, a row-parallel layer's output before its all-reduce) writes
# them in fp32 whatever its inputs: cuBLAS's fp32-out GEMM on a GPU (Megatron-LM's gradient accumulation
# fusion), at its 16-bit rate; on a CPU another kernel, at another rate (a profile may measure it apart).
GEMM_PARTIAL, EINSUM_PARTIAL = "matmul_partial", "einsum_partial"


class Mode(Enum):
    EXACT = "exact"
    FAST = "fast"
    META = "meta"


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    """numpy's broadcast of two shapes (equal shapes, the common case, without numpy)."""
    return tuple(a) if tuple(a) == tuple(b) else tuple(np.broadcast_shapes(a, b))


def _matmul_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if len(a) < 2 or len(b) != 2 or a[-1] != b[0]:
        raise ValueError(f"matmul of shapes {a} and {b}: need (..., k) @ (k, n)")
    return a[:-1] + (b[1],)


class Ops(FlatBuffers, Placement, AttentionOps):
    """Kernels of one mode. Subclasses supply the numbers; this class supplies shapes and costs. Every
    number is made by `xp`, the array namespace (arrays.py): numpy on the host here, torch on the
    rank's device in the torch backend (gpu_backend/torch_ops.py)."""

    mode: Mode
    _num: Any
    xp: Any = NUMPY
    _kernels: Any = _k  # the transformer's kernels (fast mode widens 16-bit data for some)

    def __init__(self, record: Record | None = None, *, cost_dtype: str = "fp32") -> None:
        self._record = record if record is not None else (lambda name, flops, nbytes: None)
        self.cost_dtype = dtype_name(cost_dtype)
        self._item = ITEMSIZE[self.cost_dtype]

    # -- costs ---------------------------------------------------------------------------------
    def kernel(self, name: str, *, flops: float, nbytes: float) -> None:
        """A kernel with no numbers: only its cost (used by timing-only programs)."""
        self._record(name, float(flops), float(nbytes))

    @contextmanager
    def fused(self, name: str | None, *, flops: float | None = None, nbytes: float = 0.0) -> Iterator[None]:
        """The enclosed ops as one kernel moving `nbytes`: the same numbers, but what a fused GPU kernel
        keeps on chip (FlashAttention's score tiles, an activation between its bias and its GELU)
        costs neither memory traffic nor launches. `flops`: the kernel's (default: the enclosed
        ops'). No name: the enclosed ops ride in the kernel before them (a GEMM's epilogue)."""
        record, done = self._record, [0.0]

        def inside(_: str, work: Any, __: float) -> None:
            done[0] += 2.0 * math.prod(work) if work.__class__ is tuple else work

        self._record = inside
        try:
            yield
        finally:
            self._record = record
        if name is not None:
            record(name, float(done[0] if flops is None else flops), float(nbytes))

    def _item_of(self, *tensors: Any) -> int:
        """Bytes an element of a kernel's tensors: the run's dtype's, or 4 where one of them (a tensor or a
        dtype's name) is fp32 in a 16-bit run: the cross-entropy's upcast logits, master weights, moments."""
        return max(self._item, 4) if any(is_fp32(t) for t in tensors) else self._item

    # -- the interface -------------------------------------------------------------------------
    def matmul(self, a: Any, b: Any, *, partial: bool = False) -> Any:
        """a @ b over the last dim of a; with partial=True the sum over k stays unrounded."""
        out_shape = _matmul_shape(tuple(a.shape), tuple(b.shape))
        k, n = a.shape[-1], b.shape[1]
        n_out = _numel(out_shape)
        self._record(GEMM_PARTIAL if partial else "matmul", (1, n_out // n if n else 0, n, k),
                     (_numel(tuple(a.shape)) + _numel(tuple(b.shape)) + n_out) * self._item)
        return self._matmul(a, b, partial, out_shape)

    def finalize(self, p: Any, dtype: Any = None) -> Any:
        """Round a partial once to `dtype` (default: its own logical dtype) at the semantic rounding point."""
        # no kernel: on a GPU the rounding is the producer's (a GEMM's epilogue, a collective's output)
        if dtype is None:
            dtype = p.dtype if p.dtype.__class__ is str else self.xp.name(p.dtype)
            dtype = dtype if dtype in ("fp32", "fp64", "fp16", "bf16") else "fp32"
        return self._finalize(p, dtype)

    def sum(self, x: Any, axis: int | tuple[int, ...] | None, *, partial: bool = False) -> Any:
        """Sum over axes (None: all elements); exact in exact mode (a Partial when partial=True)."""
        shape = tuple(x.shape)
        axes = tuple(range(len(shape))) if axis is None else ((axis,) if isinstance(axis, int) else tuple(axis))
        for a in axes:
            if not -len(shape) <= a < len(shape):
                raise ValueError(f"sum over axis {a} of a tensor of shape {shape}")
        axes = tuple(a % len(shape) for a in axes)
        out_shape = tuple(n for i, n in enumerate(shape) if i not in axes)
        self._record("sum", float(_numel(shape)), (_numel(shape) + _numel(out_shape)) * self._item_of(x))
        return self._sum(x, axis, partial, out_shape)

    def add(self, a: Any, b: Any) -> Any:
        self._cost("add", broadcast_shape(a.shape, b.shape), 1, 3, a, b)
        return self._binary(self.xp.add, a, b)

    def sub(self, a: Any, b: Any) -> Any:
        self._cost("sub", broadcast_shape(a.shape, b.shape), 1, 3, a, b)
        return self._binary(self.xp.subtract, a, b)

    def mul(self, a: Any, b: Any) -> Any:
        self._cost("mul", broadcast_shape(a.shape, b.shape), 1, 3, a, b)
        return self._binary(self.xp.multiply, a, b)

    def scale(self, a: Any, s: Any) -> Any:
        """a * s (a number, or a 0-d value of the kernel set's): exact mode's product with s rounded to a's
        dtype, fast mode's as a GPU kernel computes it, in fp32 for 16-bit a (numerics/modes.py)."""
        self._cost("scale", tuple(a.shape), 1, 2, a)
        return self._unary(lambda x: self._num.times(x, s), a)

    def relu(self, a: Any) -> Any:
        self._cost("relu", tuple(a.shape), 1, 2, a)
        xp = self.xp
        return self._unary(lambda x: xp.maximum(x, xp.const(x, 0)), a)

    def relu_backward(self, grad: Any, pre: Any) -> Any:
        """grad where pre > 0, else 0."""
        self._cost("relu_backward", tuple(grad.shape), 1, 3, grad)
        xp = self.xp
        return self._binary(lambda g, p: xp.where(p > 0, g, xp.const(g, 0)), grad, pre)

    def transpose(self, a: Any) -> Any:
        """Swap the last two dims (a view: no kernel)."""
        if isinstance(a, MetaTensor):
            return MetaTensor(a.shape[:-2] + (a.shape[-1], a.shape[-2]), a.dtype)
        return self.xp.swapaxes(a, -1, -2)

    def uniform(self, seed: int, name: str, shape: tuple[int, ...], *, offset: tuple[int, ...] | None = None,
                full_shape: tuple[int, ...] | None = None, low: float = -1.0, high: float = 1.0) -> Any:
        """The block at `offset` of a counter-based uniform tensor of `full_shape` (float32)."""
        self._cost("uniform", tuple(shape), 1, 1, "fp32")
        if self.mode is Mode.META:
            return MetaTensor(tuple(shape), "fp32")
        return self.xp.uniform(seed, name, tuple(shape), offset=offset, full_shape=full_shape, low=low, high=high)

    # -- the transformer's kernels (numerics/kernels.py), one cost each --------------------------
    def _cost(self, name: str, shape: tuple[int, ...], flops_per: float, tensors: float, *like: Any) -> None:
        """`tensors` passes over `shape`'s elements, at the width of the tensors `like` (_item_of)."""
        n = _numel(tuple(shape))
        self._record(name, flops_per * n, tensors * n * self._item_of(*like))

    def einsum(self, spec: str, a: Any, b: Any, *, partial: bool = False) -> Any:
        """Two-operand einsum (letters only); exact over the summed letters in exact mode."""
        ia, rest = spec.split(",")
        ib, io = rest.split("->")
        size = dict(zip(ia, a.shape)) | dict(zip(ib, b.shape))
        out_shape = tuple(size[c] for c in io)
        gemm = (math.prod(size[c] for c in io if c in ia and c in ib),  # batch
                math.prod(size[c] for c in io if c not in ib), math.prod(size[c] for c in io if c not in ia),
                math.prod(size[c] for c in size if c not in io))  # k: the summed letters
        self._record(EINSUM_PARTIAL if partial else "einsum", gemm, (_numel(tuple(a.shape)) + _numel(tuple(b.shape)) + _numel(out_shape)) * self._item)
        if self.mode is Mode.META:
            return MetaTensor(out_shape, getattr(a, "dtype", "fp32"), partial)
        return self._num.einsum(spec, a, b, partial)

    def max(self, x: Any, axis: int = -1) -> Any:
        """Max over one axis, keeping it (size 1): exact in any order."""
        shape = tuple(x.shape)
        self._cost("max", shape, 1, 1, x)
        if self.mode is Mode.META:
            out = list(shape)
            out[axis] = 1
            return MetaTensor(tuple(out), x.dtype)
        return self.xp.max(x, axis)

    def exp(self, x: Any) -> Any:
        self._cost("exp", tuple(x.shape), 10, 2, x)
        return self._meta_like(x) if self.mode is Mode.META else self._num.exp(x)

    def log(self, x: Any) -> Any:
        self._cost("log", tuple(x.shape), 10, 2, x)
        return self._meta_like(x) if self.mode is Mode.META else self._num.log(x)

    def gelu(self, x: Any) -> Any:
        self._cost("gelu", tuple(x.shape), 20, 2)
        return self._meta_like(x) if self.mode is Mode.META else self._kernels.gelu(self._num, x)

    def gelu_backward(self, dy: Any, x: Any) -> Any:
        self._cost("gelu_backward", tuple(x.shape), 30, 3)
        return self._meta_like(x) if self.mode is Mode.META else self._kernels.gelu_backward(self._num, dy, x)

    def silu(self, x: Any) -> Any:
        self._cost("silu", tuple(x.shape), 8, 2)
        return self._meta_like(x) if self.mode is Mode.META else self._kernels.silu(self._num, x)

    def sigmoid(self, x: Any) -> Any:
        self._cost("sigmoid", tuple(x.shape), 6, 2)
        return self._meta_like(x) if self.mode is Mode.META else self._kernels.sigmoid(self._num, x)

    def silu_backward(self, dy: Any, x: Any) -> Any:
        self._cost("silu_backward", tuple(x.shape), 12, 3)
        return self._meta_like(x) if self.mode is Mode.META else self._kernels.silu_backward(self._num, dy, x)

    def layer_norm(self, x: Any, gamma: Any, beta: Any, eps: float = 1e-5) -> Any:
        """(y, mean, rstd)."""
        self._cost("layer_norm", tuple(x.shape), 8, 2)
        if self.mode is Mode.META:
            stat = MetaTensor(tuple(x.shape[:-1]) + (1,), x.dtype)
            return self._meta_like(x), stat, stat
        return self._kernels.layer_norm(self._num, x, gamma, beta, eps)

    def layer_norm_backward(self, dy: Any, x: Any, gamma: Any, mean: Any, rstd: Any) -> Any:
        """(dx, dgamma partial, dbeta partial) over this shard's tokens."""
        self._cost("layer_norm_backward", tuple(x.shape), 12, 3)
        if self.mode is Mode.META:
            g = MetaTensor(tuple(gamma.shape), gamma.dtype, True)
            return self._meta_like(x), g, g
        return self._kernels.layer_norm_backward(self._num, dy, x, gamma, mean, rstd)

    def rms_norm(self, x: Any, gamma: Any, eps: float = 1e-5) -> Any:
        """(y, rstd)."""
        self._cost("rms_norm", tuple(x.shape), 5, 2)
        if self.mode is Mode.META:
            return self._meta_like(x), MetaTensor(tuple(x.shape[:-1]) + (1,), x.dtype)
        return self._kernels.rms_norm(self._num, x, gamma, eps)

    def rms_norm_backward(self, dy: Any, x: Any, gamma: Any, rstd: Any) -> Any:
        """(dx, dgamma partial)."""
        self._cost("rms_norm_backward", tuple(x.shape), 8, 3)
        if self.mode is Mode.META:
            return self._meta_like(x), MetaTensor(tuple(gamma.shape), gamma.dtype, True)
        return self._kernels.rms_norm_backward(self._num, dy, x, gamma, rstd)

    def log_sum_exp(self, row_max: Any, sum_exp: Any, dtype: Any = "fp32") -> Any:
        self._cost("log_sum_exp", tuple(sum_exp.shape), 10, 2, sum_exp)
        if self.mode is Mode.META:
            return MetaTensor(tuple(sum_exp.shape), dtype_name(dtype))
        return self._kernels.log_sum_exp(self._num, row_max, sum_exp, dtype)

    def embedding(self, ids: Any, table: Any, row_offset: int = 0) -> Any:
        """table[ids - row_offset], zero for ids outside this shard's rows; (..., h)."""
        out_shape = tuple(ids.shape) + (table.shape[-1],)
        self._cost("embedding", out_shape, 0, 2)
        if self.mode is Mode.META:
            return MetaTensor(out_shape, table.dtype)
        xp = self.xp
        if not table.shape[0]:  # (no rows: a capacity dropped every token this rank routed)
            return xp.zeros(out_shape, xp.name(table.dtype))
        local = xp.asarray(ids) - row_offset  # (ids made on the host move to the data's device)
        mine = (local >= 0) & (local < table.shape[0])
        return xp.where(mine[..., None], table[xp.where(mine, local, 0)], xp.const(table, 0))

    def embedding_backward(self, ids: Any, dy: Any, rows: int, row_offset: int = 0) -> Any:
        """Partial (rows, h): the exact sum of dy over the tokens of each row."""
        self._cost("embedding_backward", tuple(dy.shape), 1, 3)
        if self.mode is Mode.META:
            return MetaTensor((rows, dy.shape[-1]), dy.dtype, True)
        return _k.embedding_backward(self._num, self.xp.asarray(ids), dy, rows, row_offset)

    def dropout_keep(self, seed: int, name: str, shape: tuple[int, ...], p: float, *,
                     offset: tuple[int, ...] | None = None, full_shape: tuple[int, ...] | None = None) -> Any:
        """Boolean keep-mask of the block at `offset` of a full mask: a pure function of (seed, name, index)."""
        if not 0 <= p < 1:
            raise ValueError(f"dropout probability must be in [0, 1), got {p!r}")
        self._record("dropout_mask", float(_numel(tuple(shape))), float(_numel(tuple(shape))))  # 1 byte each
        if self.mode is Mode.META:
            return MetaTensor(tuple(shape), "bool")
        u = self.xp.uniform(seed, name, tuple(shape), offset=offset, full_shape=full_shape, low=0.0, high=1.0)
        return u >= self.xp.const(u, p)

    def where(self, mask: Any, a: Any, b: Any) -> Any:
        """a where mask, else b. A mask the host knows to be uniform may be given as True or False: the same
        kernel is charged, and no data is read for it."""
        shape = tuple(np.broadcast_shapes(tuple(getattr(mask, "shape", ())), tuple(getattr(a, "shape", ())),
                                          tuple(getattr(b, "shape", ()))))
        self._cost("where", shape, 1, 3)
        if self.mode is Mode.META:
            return MetaTensor(shape, getattr(a, "dtype", "fp32") if not np.isscalar(a) else getattr(b, "dtype", "fp32"))
        if mask is True or mask is False:
            return self.xp.where(self.xp.asarray(mask), a, b) if np.isscalar(a if mask else b) else (a if mask else b)
        return self.xp.where(mask, a, b)

    def zero_where(self, keep: Any, x: Any) -> Any:
        """x where `keep`, else zero of x's dtype (a dropout mask applied)."""
        self._cost("mask", tuple(x.shape), 1, 2, x)
        if self.mode is Mode.META:
            return self._meta_like(x)
        return self.xp.where(keep, x, self.xp.const(x, 0))

    def div(self, a: Any, b: Any) -> Any:
        self._cost("div", broadcast_shape(a.shape, b.shape), 1, 3, a, b)
        return self._binary(self.xp.divide, a, b)

    def adam(self, param: Any, grad: Any, m: Any, v: Any, step: int, *, lr: float, beta1: float = 0.9,
             beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, grad_scale: Any = None,
             donate: bool = False) -> Any:
        """AdamW on fp32 master weights: (param, m, v). `grad_scale` (a clipping coefficient): the step of
        scale(grad, grad_scale), which a kernel set may compute without keeping the scaled gradient.
        `donate`: the caller gives `param` up (nothing else holds it), so a kernel set may write the new
        weights into it; without it the old tensor is left as it was."""
        if grad_scale is not None:  # (named the optimizer's: a weight-sized pass, timed at the rate measured for those)
            self._cost("adam", tuple(grad.shape), 1, 2, grad)
            grad = self._unary(lambda x, xp=self.xp: x * xp.const(x, grad_scale), grad)
        self._cost("adam", tuple(param.shape), 12, 7, param)
        if self.mode is Mode.META:
            return param, m, v
        new, m, v = _k.adam(self.xp, param, grad, m, v, step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                            weight_decay=weight_decay)
        if not donate:
            return new, m, v
        self.xp.write(param, new)  # (here too, so that a parameter donated while still in use shows on the emulator)
        return param, m, v

    def sgd(self, param: Any, grad: Any, *, lr: float) -> Any:
        self._cost("sgd", tuple(param.shape), 2, 3, param)
        return param if self.mode is Mode.META else _k.sgd(self.xp, param, grad, lr=lr)

    def concat(self, xs: list[Any], dim: int) -> Any:
        shape = list(xs[0].shape)
        shape[dim] = sum(x.shape[dim] for x in xs)
        self._cost("concat", tuple(shape), 0, 2)
        if self.mode is Mode.META:
            return MetaTensor(tuple(shape), xs[0].dtype)
        return self.xp.concat(xs, dim)

    def expand_last(self, x: Any) -> Any:
        """x[..., None] (a view: no kernel)."""
        if isinstance(x, MetaTensor):
            return MetaTensor(tuple(x.shape) + (1,), x.dtype)
        return x[..., None]

    def gather_last(self, x: Any, index: Any) -> Any:
        """x[..., index] along the last dim, index shaped like x without it."""
        self._cost("gather", tuple(index.shape), 0, 2, x)
        if self.mode is Mode.META:
            return MetaTensor(tuple(index.shape), x.dtype)
        return self.xp.take_last(x, self.xp.asarray(index))

    def sub_one_hot(self, x: Any, index: Any, keep: Any = None) -> Any:
        """x - one_hot(index) on the last axis, byte for byte (rows where `keep`, if given), with no one-hot made."""
        self._cost("sub_one_hot", tuple(x.shape), 0, 2, x)
        if self.mode is Mode.META:
            return self._meta_like(x)
        xp = self.xp
        index = xp.asarray(index)
        picked = xp.take_last(x, index)
        one = xp.const(picked, 1) if keep is None else xp.astype(xp.asarray(keep), xp.name(picked.dtype))
        return xp.put_last(x, index, self._binary(xp.subtract, picked, one))

    def one_hot(self, index: Any, n: int, like: Any) -> Any:
        shape = tuple(index.shape) + (n,)
        self._cost("one_hot", shape, 0, 1)
        if self.mode is Mode.META:
            return MetaTensor(shape, like.dtype)
        return self.xp.one_hot(self.xp.asarray(index), n, like.dtype)

    def add_partial(self, a: Any, b: Any) -> Any:
        """Sum of two partials (exact in exact mode)."""
        self._cost("add", tuple(a.shape), 1, 3, a, b)
        if self.mode is Mode.META:
            return a
        total = a + b
        return self.xp.asarray(total) if isinstance(total, np.generic) else total  # 0-d arrays add to a scalar

    def transpose_partial(self, p: Any) -> Any:
        """Swap the last two logical dims of a partial (a view)."""
        if isinstance(p, MetaTensor):
            return MetaTensor(p.shape[:-2] + (p.shape[-1], p.shape[-2]), p.dtype, p.partial)
        if isinstance(p, Partial):
            return Partial(p.xp.swapaxes(p.limbs, -2, -3), p.dtype, p.xp)
        return self.xp.swapaxes(p, -1, -2)

    def mean(self, x: Any, axis: int | tuple[int, ...] | None) -> Any:
        """round(exact sum) / n: the sum may be split; the division happens once, after it."""
        total = self.sum(x, axis)
        n = _numel(tuple(x.shape)) // max(1, _numel(tuple(total.shape)))
        return self._meta_like(total) if self.mode is Mode.META else total / self.xp.const(total, n)

    def cast(self, x: Any, dtype: str, *, out: Any = None) -> Any:
        """x rounded to a storage dtype ('bf16', 'fp16', 'fp32'). `out`: a tensor of that shape and dtype
        that the caller gives up, which then holds the result (no new tensor)."""
        if out is None and logical_dtype(x) == dtype_name(dtype):
            return x  # (no kernel: torch's .float() of an fp32 tensor is the tensor)
        n = _numel(tuple(x.shape))
        self._record("cast", float(n), n * (self._item_of(x) + self._item_of(dtype)))  # (x read, the dtype written)
        if self.mode is Mode.META:
            return MetaTensor(tuple(x.shape), dtype_name(dtype))
        if out is not None:
            if tuple(out.shape) != tuple(x.shape) or self.xp.name(out.dtype) != dtype_name(dtype):
                raise ValueError(f"cast into a {self.xp.name(out.dtype)} {tuple(out.shape)} tensor: "
                                 f"the result is {dtype_name(dtype)} {tuple(x.shape)}")
            self.xp.write(out, x)
            return out
        return self.xp.astype(x, dtype_name(dtype), copy=False)  # (the same tensor where nothing changes)

    def _meta_like(self, x: Any) -> Any:
        return MetaTensor(tuple(x.shape), getattr(x, "dtype", "fp32"))

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



__all__ = ["Mode", "Ops", "broadcast_shape"]
