"""AdamW on fp32 master weights, and gradient clipping by global norm, as torch.optim.AdamW and
torch.nn.utils.clip_grad_norm_ define them.

AdamW (Loshchilov & Hutter 2019) decays the weights apart from the gradient: p <- p (1 - lr wd), then
the Adam update. The global norm is the square root of one exact sum of squares over every gradient
element of the model (numerics rule 1), so however the gradients are sharded (tp, pp, dp/ZeRO, cp),
the sum, the norm and the clipped gradients are the single device's, byte for byte; torch's own
norm of per-tensor norms rounds differently, within float32 tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from simcluster.numerics.ops import Mode, Ops
from simcluster.numerics.tensor import MetaTensor, nbytes

WEIGHT_DECAY = {"gpt": 0.01, "llama": 0.1}  # AdamW's default by architecture: Megatron-LM's; the Llama 3 paper's
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6)


@dataclass
class AdamState:
    m: dict[str, Any]
    v: dict[str, Any]
    step: int = 0


def adam_init(ops: Ops, params: dict[str, Any]) -> AdamState:
    if ops.mode is Mode.META:
        zeros = {k: MetaTensor(tuple(v.shape), "fp32") for k, v in params.items()}
        return AdamState(dict(zeros), dict(zeros))
    return AdamState({k: ops.zeros_like(v) for k, v in params.items()}, {k: ops.zeros_like(v) for k, v in params.items()})


def adam_step(ops: Ops, params: dict[str, Any], grads: dict[str, Any], state: AdamState, *, lr: float,
              weight_decay: float = 0.0, clip: Any = None, donate: bool = False) -> dict[str, Any]:
    """The new parameters. `clip`: a coefficient from clip_coefficient, the gradients scaled by it as
    clip_by_norm scales them (None: as they are). `donate`: the old parameters are the optimizer's alone,
    and may be overwritten (see Ops.adam)."""
    state.step += 1
    out = {}
    for k in params:
        out[k], state.m[k], state.v[k] = ops.adam(params[k], grads[k], state.m[k], state.v[k], state.step, lr=lr,
                                                  weight_decay=weight_decay, grad_scale=clip, donate=donate)
    return out


def square_sum(ops: Ops, grads: list[Any]) -> Any:
    """The exact sum of squares of every element (a partial: sum it over ranks, then round once): one
    kernel reading each gradient once, as torch's _foreach_norm and apex's multi_tensor_l2norm do (the
    flattening and the partial sums here are for the numbers' sake)."""
    total = None
    for g in grads:
        with ops.fused("grad_norm", nbytes=nbytes(g)):
            flat = ops.flat([g])
            part = ops.einsum("i,i->", flat, flat, partial=True)
            total = part if total is None else ops.add_partial(total, part)
    return total


def clip_coefficient(ops: Ops, squares: Any, max_norm: float) -> Any:
    """What the gradients are scaled by: max_norm / (norm + 1e-6) where that is below 1, norm = sqrt of
    the rounded sum of squares, in float32; None where they stay as they are."""
    if ops.mode is Mode.META:
        return None
    coefficient, scales = ops.clip_coefficient(squares, max_norm, CLIP_EPS)
    return coefficient if scales else None


def clip_by_norm(ops: Ops, grads: dict[str, Any], squares: Any, max_norm: float) -> dict[str, Any]:
    """The gradients clipped by their global norm (clip_coefficient)."""
    coefficient = clip_coefficient(ops, squares, max_norm)
    if coefficient is None:
        return grads
    return {k: ops.scale(g, coefficient) for k, g in grads.items()}
