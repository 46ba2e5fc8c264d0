"""Flat buffers: what DDP buckets and ZeRO shards are made of, in every mode.

A unit's tensors flattened into one 1-D buffer, padded to a multiple of the shard count, cut into
equal chunks, and back; a partial keeps its limbs, a meta tensor its shape. The methods of `Ops`
(ops.py), kept here as one idea.
"""

from __future__ import annotations

import math
from typing import Any

from simcluster.numerics.tensor import ITEMSIZE, MetaTensor, Partial, dtype_name


class FlatBuffers:
    """Mixed into Ops, whose `_cost(name, shape, flops_per, tensors)` charges the one kernel here and whose
    `xp` (arrays.py) holds the numbers."""

    _cost: Any
    xp: Any

    def flat(self, xs: list[Any]) -> Any:
        """The tensors (arrays or partials) as one 1-D buffer, in order."""
        total = sum(math.prod(tuple(x.shape)) for x in xs)
        self._cost("flatten", (total,), 0, 2, xs[0])
        first = xs[0]
        if isinstance(first, MetaTensor):
            return MetaTensor((total,), first.dtype, first.partial)
        if isinstance(first, Partial):
            parts = [x.limbs.reshape(-1, x.limbs.shape[-1]) for x in xs]
            return Partial(parts[0] if len(parts) == 1 else first.xp.concat(parts, 0), first.dtype, first.xp)
        parts = [x.reshape(-1) for x in xs]
        return parts[0] if len(parts) == 1 else self.xp.concat(parts, 0)  # (one tensor: a view, no copy)

    def unflat(self, flat: Any, shapes: list[tuple[int, ...]]) -> list[Any]:
        """Inverse of `flat` (views); trailing padding is ignored."""
        out, at = [], 0
        for shape in shapes:
            n = math.prod(tuple(shape))
            if isinstance(flat, MetaTensor):
                out.append(MetaTensor(tuple(shape), flat.dtype, flat.partial))
            elif isinstance(flat, Partial):
                out.append(Partial(flat.limbs[at:at + n].reshape(tuple(shape) + (flat.limbs.shape[-1],)), flat.dtype,
                                   flat.xp))
            else:
                out.append(flat[at:at + n].reshape(shape))
            at += n
        return out

    def pad(self, flat: Any, multiple: int) -> Any:
        """Zero-pad a 1-D buffer to a multiple of `multiple` elements."""
        n = flat.shape[0]
        size = -(-n // multiple) * multiple
        if size == n:
            return flat
        if isinstance(flat, MetaTensor):
            return MetaTensor((size,), flat.dtype, flat.partial)
        if isinstance(flat, Partial):
            xp = flat.xp
            pad = xp.zeros((size - n, flat.limbs.shape[-1]), xp.name(flat.limbs.dtype))
            return Partial(xp.concat([flat.limbs, pad], 0), flat.dtype, xp)
        return self.xp.concat([flat, self.xp.zeros((size - n,), self.xp.name(flat.dtype))], 0)

    def chunk(self, flat: Any, parts: int, index: int) -> Any:
        """Part `index` of `parts` equal parts of a 1-D buffer (a view)."""
        n = flat.shape[0] // parts
        if isinstance(flat, MetaTensor):
            return MetaTensor((n,), flat.dtype, flat.partial)
        if isinstance(flat, Partial):
            return Partial(flat.limbs[index * n:(index + 1) * n], flat.dtype, flat.xp)
        return flat[index * n:(index + 1) * n]

    def retag(self, p: Any, dtype: str) -> Any:
        """A partial charged and rounded as `dtype` from now on (its exact value unchanged); in fast
        mode its values are rounded to `dtype` and held in it, as a real bf16 all-reduce holds and sums
        its inputs (NCCL and gloo add 16-bit buffers in their own dtype: half the bytes of fp32 on the
        wire, as the emulator charges them)."""
        if p.__class__ is MetaTensor:
            name = dtype if dtype in ITEMSIZE else dtype_name(dtype)
            return p if p.dtype == name else MetaTensor(p.shape, name, p.partial)  # (immutable: itself)
        if isinstance(p, Partial):
            if p.exact:
                return Partial(p.limbs, dtype, p.xp)
            return Partial(p.finalize(dtype_name(dtype))[..., None], dtype, p.xp)
        return self.xp.astype(p, dtype_name(dtype))
