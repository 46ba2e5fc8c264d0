"""Where data lives and how it is laid out, without kernels of their own: head splits and merges, views,
a message's share, host-made index arrays and tables moved to the data's device, fused attention where a
kernel set has it, and the gradient-clipping coefficient (which a device never reads back). The methods
of `Ops` (ops.py), kept here as one idea, as flat.py keeps the flat buffers."""

from __future__ import annotations

from typing import Any

from simcluster.numerics import limbs as _limbs
from simcluster.numerics import tensor as _tensor
from simcluster.numerics.tensor import MetaTensor, Partial, dtype_name


class Placement:
    """Mixed into Ops, whose `xp` holds the numbers and whose `mode`, `_binary` and `finalize` it uses."""

    xp: Any
    mode: Any
    _binary: Any
    finalize: Any
    _meta_like: Any

    def heads(self, x: Any, head_dim: int) -> Any:
        """(b, s, a*d) -> (b, a, s, d)."""
        bsz, s, width = x.shape
        if x.__class__ is MetaTensor:
            return MetaTensor((bsz, width // head_dim, s, head_dim), x.dtype)
        return self.xp.contiguous(self.xp.permute(x.reshape(bsz, s, width // head_dim, head_dim), (0, 2, 1, 3)))

    def merge_heads(self, x: Any) -> Any:
        """(b, a, s, d) -> (b, s, a*d)."""
        bsz, a, s, d = x.shape
        if x.__class__ is MetaTensor:
            return MetaTensor((bsz, s, a * d), x.dtype)
        return self.xp.contiguous(self.xp.permute(x, (0, 2, 1, 3))).reshape(bsz, s, a * d)

    def repeat(self, x: Any, n: int, dim: int) -> Any:
        """Each slice along `dim` n times in a row (grouped-query attention's kv heads)."""
        if x.__class__ is MetaTensor:
            shape = list(x.shape)
            shape[dim] *= n
            return MetaTensor(tuple(shape), x.dtype)
        return self.xp.repeat(x, n, dim)

    def unrepeat_partial(self, p: Any, n: int, dim: int) -> Any:
        """The gradient of `repeat` on a partial sum: each run of n slices along `dim` added, unrounded
        (exact in exact mode). No kernel of its own: a fused attention kernel that takes grouped-query
        attention's key/value heads as they are sums their query heads' gradients as it goes."""
        shape, dim = tuple(p.shape), dim % len(p.shape)
        out = shape[:dim] + (shape[dim] // n,) + shape[dim + 1:]
        if p.__class__ is MetaTensor:
            return MetaTensor(out, p.dtype, p.partial)
        summed = p.xp.sum(p.limbs.reshape(out[:dim + 1] + (n,) + out[dim + 1:] + (p.limbs.shape[-1],)), dim + 1)
        return Partial(_limbs.normalize(summed, p.xp) if p.exact else summed, p.dtype, p.xp)

    def fused_attention(self, q: Any, k: Any, v: Any, *, causal: bool, scale: float) -> tuple[Any, Any] | None:
        """softmax(q k^T scale (causal)) v over whole sequences as one kernel, and what its backward needs:
        (out, state), or None where this kernel set has none (the emulator's: its numbers come from the
        two-pass form, which exact mode needs and whose pieces the cost model charges as the model's
        attention kernel says). q, k, v (b, a, s, d)."""
        return None

    def fused_attention_backward(self, state: Any, dout: Any) -> tuple[Any, Any, Any]:
        """dq, dk, dv of `fused_attention` (only a kernel set that has it is asked)."""
        raise NotImplementedError(f"{type(self).__name__} has no fused attention")

    def split(self, x: Any, parts: int, dim: int) -> list[Any]:
        """`parts` equal pieces along `dim` (views: no kernel; a message's share, Megatron's scatter)."""
        if x.__class__ is MetaTensor:
            return _tensor.split(x, parts, dim)
        dim %= len(x.shape)
        if x.shape[dim] % parts:
            raise ValueError(f"dim {dim} of size {x.shape[dim]} does not split into {parts} equal parts")
        n = x.shape[dim] // parts
        return [x[(slice(None),) * dim + (slice(i * n, (i + 1) * n),)] for i in range(parts)]

    def maximum(self, a: Any, b: Any) -> Any:
        """Elementwise max (a running row maximum: part of the attention kernel, no kernel of its own)."""
        return self._binary(self.xp.maximum, a, b)

    def finite_or(self, x: Any, other: Any) -> Any:
        """x where finite, else `other` (a running maximum before any key was seen: part of its kernel)."""
        if x.__class__ is MetaTensor:
            return x
        return self.xp.where(self.xp.isfinite(x), x, other)

    def zeros_like(self, x: Any) -> Any:
        return self._meta_like(x) if x.__class__ is MetaTensor else self.xp.zeros_like(x)

    def from_host(self, x: Any) -> Any:
        """An array made on the host (token ids, a mask of owned elements) where this rank's data lives: a
        data loader's copy to the device; on the host, the array itself."""
        return x if self.mode.value == "meta" else self.xp.asarray(x)

    def positions(self, positions: Any, batch: int) -> Any:
        """(batch, n) indices of the host's positions `positions` (n,), for a position table's lookup."""
        if self.mode.value == "meta":
            return MetaTensor((batch, len(positions)), "int64")
        return self.xp.broadcast_to(self.xp.asarray(positions), (batch, len(positions)))

    def causal(self, rows: Any, cols: Any) -> Any:
        """Which keys (positions `cols`) each query (positions `rows`) may attend to; None in meta mode."""
        if self.mode.value == "meta":
            return None
        xp = self.xp
        return xp.asarray(rows)[:, None] >= xp.asarray(cols)[None, :]

    def partial_of(self, values: Any) -> Any:
        """`values` held as a partial sum of one term each, in the mode's form (exact: limbs)."""
        if values.__class__ is MetaTensor:
            return MetaTensor(values.shape, values.dtype, True)
        if self.mode.value == "exact":
            return Partial.from_values(self.xp.astype(values, "fp64"), xp=self.xp)
        return Partial.accumulating(values, self.xp.name(values.dtype), self.xp)

    def constant(self, table: Any, dtype: Any) -> Any:
        """A table computed once on the host (rotary cos/sin), rounded once to `dtype`, where the data lives."""
        if self.mode.value == "meta":
            return MetaTensor(tuple(table.shape), dtype_name(dtype) if dtype.__class__ is str else self.xp.name(dtype))
        return self.xp.astype(self.xp.asarray(table), dtype)

    def clip_coefficient(self, squares: Any, max_norm: float, eps: float) -> tuple[Any, bool]:
        """max_norm / (sqrt(round(squares)) + eps) in float32, and whether the gradients must be scaled by
        it: on the host, where the value is at hand, only when it is below 1; a device backend answers
        True and scales by min(1, coefficient) (scaling by 1 is exact), never reading the value back."""
        coefficient = self._norm_coefficient(squares, max_norm, eps)
        return coefficient, bool(coefficient < 1)

    def _norm_coefficient(self, squares: Any, max_norm: float, eps: float) -> Any:
        xp = self.xp
        total = xp.astype(self.finalize(squares, "fp32"), "fp32")
        return xp.const(total, max_norm) / (xp.sqrt(total) + xp.const(total, eps))
