"""Mixed precision: 16-bit weights and gradients against fp32 master weights and Adam moments, with a
static power-of-two loss scale for fp16, and the model-state bytes each choice costs."""

from __future__ import annotations

from typing import Any

from simcluster.numerics.ops import Ops

PRECISIONS = ("fp32", "bf16", "fp16")
# fp16 gradients underflow without loss scaling; a power of two keeps scaling and unscaling exact
LOSS_SCALE = {"fp32": 1.0, "bf16": 1.0, "fp16": 4096.0}


def model_state_bytes(psi: int, precision: str, grads_fp32: bool = False) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state for Adam (DESIGN.md, Memory).

    fp32: weights are the master copy (4 + 4 + 8 bytes per parameter); bf16 or fp16 mixed precision:
    16-bit weights and gradients, fp32 master weights and moments (2 + 2 + 12: the ZeRO paper's K = 12);
    with `grads_fp32`, fp32 gradients (2 + 4 + 12: Megatron-LM's distributed optimizer's 18 bytes for "bf16
    param, fp32 grads", its docs/source/distrib_optimizer.md).
    """
    if precision == "fp32":
        return {"parameters": 4 * psi, "gradients": 4 * psi, "optimizer": 8 * psi}
    if precision in ("bf16", "fp16"):
        return {"parameters": 2 * psi, "gradients": (4 if grads_fp32 else 2) * psi, "optimizer": 12 * psi}
    raise ValueError(f"precision {precision!r} is not valid; valid: {', '.join(PRECISIONS)}")


def working_copy(ops: Ops, master: dict[str, Any], precision: str) -> dict[str, Any]:
    """The weights the model computes with: the fp32 master itself, or its 16-bit rounding."""
    if precision == "fp32":
        return master
    return {k: ops.cast(v, precision) for k, v in master.items()}


def grad_dtype(precision: str, grads_fp32: bool = False) -> str:
    """What a gradient is rounded to once summed: the weights' dtype, or fp32 (`grads_fp32`)."""
    return "fp32" if grads_fp32 else precision


def unscale(ops: Ops, grads: dict[str, Any], precision: str) -> dict[str, Any]:
    """16-bit gradients to fp32 for the optimizer, divided by the loss scale (exactly: a power of two)."""
    out = {k: ops.cast(g, "fp32") for k, g in grads.items()}
    if LOSS_SCALE[precision] != 1.0:
        out = {k: ops.scale(g, 1.0 / LOSS_SCALE[precision]) for k, g in out.items()}
    return out
