"""FLOPs of a training step as the literature counts them: model FLOPs (for MFU) and hardware FLOPs
(for HFU), from the model's shapes.

Both count matrix multiplications only (2 FLOPs a multiply-add), per token:
- a layer's forward: 2 x its weight matrices' size, plus the attention core's two products, QK^T and
  PV, 2 x 2 x s x h (the whole s x s square, causal or not, as PaLM and Megatron-LM count it);
- a mixture of experts' layer: its router's weights, and top_k experts' (the routed, active
  parameters: DeepSeek-V3's 37B of 671B), dropped tokens or not;
- the LM head's forward: 2 x h x V (the input embedding is a lookup: no FLOPs);
- backward: twice the forward (the input and the weight gradients).
Model FLOPs = 3 x forward: PaLM's 6N + 12 l h s per token (Chowdhery et al. 2022, appendix B), which
Llama 3 reports MFU with: the full-square convention, which for a causal model counts twice the
attention products it needs. The causal convention counts those it needs, s (s + 1) / 2 of the s x s
(`causal`). Hardware FLOPs are what the kernels run: the model's, what recomputation runs again
(Narayanan et al. 2021, eq. 3, for full recomputation; Korthikanti et al. 2022, section 6, for
selective: full recomputation repeats every layer's forward, selective only the attention core's;
torchtitan's per-op policy the products it did not keep, wk, wo and w3), and
a causal fused attention kernel's blocks (flash.causal_share: about half the square; the unfused core
computes the whole square, masked). With the full square, for a GPT with a 4h MLP this is Megatron-LM's
72 B s l h^2 (1 + s/6h + V/12lh) for model FLOPs and, with full recomputation, its
96 B s l h^2 (1 + s/6h + V/16lh), the formula behind the TFLOP/s of its Table 1 (unfused attention).
"""

from __future__ import annotations

import math

from simcluster.model.config import ModelConfig, Recompute
from simcluster.model.flash import causal_share


def forward_per_token(model: ModelConfig) -> tuple[float, float, float]:
    """Forward FLOPs per token: (all layers' weight products, all layers' attention cores, the head)."""
    shapes = model.parameter_shapes()
    weights = sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.") and len(s) == 2)
    # a mixture of experts' (E, in, out) weights: a token runs through top_k of them (the router is above)
    weights += sum(model.moe_top_k * math.prod(s[1:]) for n, s in shapes.items() if len(s) == 3)
    return 2.0 * weights, 4.0 * model.layers * model.seq * model.hidden, 2.0 * model.hidden * model.vocab


def op_recomputed(model: ModelConfig) -> float:
    """Forward FLOPs per token that torchtitan's per-op checkpointing runs again: every layer's 2nd, 4th
    and 6th matmul (wk, wo, w3; activations.op_activations keeps the others' outputs)."""
    shapes = model.parameter_shapes()
    again = (".attn.wk", ".attn.wo", ".mlp.w3")
    return 2.0 * sum(math.prod(s) for n, s in shapes.items() if n.startswith("layers.") and n.endswith(again))


def step_flops(model: ModelConfig, tokens: int) -> tuple[float, float, float]:
    """(model FLOPs by the full-square convention, hardware FLOPs: what the kernels run, model FLOPs by
    the causal convention) of a step over `tokens` tokens (the causal convention is the full square's
    for a bidirectional model)."""
    layers, core, head = forward_per_token(model)
    useful = 3.0 * (layers + core + head)
    ran = core * (causal_share(model.seq, model.seq) if model.causal and model.attention_kernel == "flash" else 1.0)
    again = {Recompute.NONE: 0.0, Recompute.SELECTIVE: ran, Recompute.FULL: layers + ran,
             Recompute.OP: op_recomputed(model)}[model.recompute]
    needed = core * ((model.seq + 1) / (2 * model.seq) if model.causal else 1.0)
    return useful * tokens, (3.0 * (layers + ran + head) + again) * tokens, 3.0 * (layers + needed + head) * tokens
