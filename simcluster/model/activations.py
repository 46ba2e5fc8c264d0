"""What a transformer layer keeps for its backward pass: the memory model of activations.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", section 4:
the tensors Megatron-LM stores per layer, with 16-bit activations and 1-byte dropout masks. Our
numpy caches hold an equivalent set (e.g. the softmax numerators and mask rather than the dropout
output), but memory is charged as a GPU implementation would hold it, tensor by tensor, so the totals
are the paper's: sbh(34 + 5as/h) alone; with tensor parallelism t, the tensors inside the parallel
region shrink by t; with sequence parallelism everything does; selective recomputation drops the
attention core's 5as^2b; full recomputation keeps only the layer's input. A fused (flash) attention
kernel keeps no s x s tensor either: it keeps one fp32 softmax statistic per query row and head, and
regenerates its dropout mask from the random state (flash.py).
The MLP's terms are its width f's (the paper's 4h for the GPT's): GELU's input and output; a SwiGLU
MLP's (the Llama's) the input of Megatron-Core's fused SwiGLU (SwiGLUFunction saves it: w1's and w3's
outputs, 2f) and its output (w2's input, f), and unfused (eager PyTorch) SiLU's output too, which the
product saves. With grouped-query attention's kv heads taken as they are (model.gqa = "native") the
attention kernel keeps the kv heads' keys and values, not their repeats.
"""

from __future__ import annotations

from typing import Any

from simcluster.numerics.tensor import ITEMSIZE


def layer_activations(*, s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none",
                      dtype: str = "bf16", attention_kernel: str = "unfused", kv: int | None = None,
                      f: int | None = None, mlp: str = "gelu", fused: bool = True,
                      gqa: str = "repeat_kv", dropout: bool = True) -> dict[str, int]:
    """Bytes one layer keeps on one rank, by tensor. s, b: this micro-batch's sequence and batch; kv, f:
    a Llama's key/value heads and MLP width (default a and 4h); mlp: "gelu" or "swiglu"; fused: the
    model's fused kernels (model.fused_kernels); gqa: how attention takes the kv heads (model.gqa);
    dropout: whether the model drops out (without, no mask is kept: torch's dropout at p = 0 returns its
    input and saves nothing)."""
    if recompute not in ("none", "selective", "full", "op"):
        raise ValueError(f"recompute {recompute!r} is not valid; valid: none, selective, full, op")
    item = ITEMSIZE[dtype]
    sbh = s * b * h
    outside = t if sp else 1  # tensors outside the tensor-parallel region: split only with SP
    if recompute == "full":
        return {"layer input": item * sbh // outside}
    if recompute == "op":
        return op_activations(s=s, b=b, h=h, a=a, kv=a if kv is None else kv, f=4 * h if f is None else f, t=t,
                              sp=sp, item=item)
    kvh = s * b * (h // a) * (kv if gqa == "native" and kv is not None else a)  # the keys (or values) it keeps
    sbf = s * b * (4 * h if f is None else f)
    kept = {
        # attention block: 11sbh + 5as^2b
        "qkv input (layer norm output)": item * sbh // outside,
        "q, k": item * (sbh + kvh) // t,
        "v": item * kvh // t,
        "projection input": item * sbh // t,
        **({"attention dropout mask": sbh // outside} if dropout else {}),
        # MLP block: 19sbh (f = 4h)
        "mlp input (layer norm output)": item * sbh // outside,
        **({"gelu input": item * sbf // t, "gelu output": item * sbf // t} if mlp == "gelu" else
           {"swiglu input (w1 and w3 outputs)": 2 * item * sbf // t, "swiglu output (w2 input)": item * sbf // t}
           | ({} if fused else {"silu output": item * sbf // t})),
        **({"mlp dropout mask": sbh // outside} if dropout else {}),
        # the two layer norms' inputs: 4sbh
        "layer norm inputs": 2 * item * sbh // outside,
    }
    if attention_kernel == "flash":
        kept["softmax statistics (flash)"] = 4 * a * s * b // t
    elif recompute == "none":  # the attention core: recomputed under selective recomputation
        kept["softmax output"] = item * a * s * s * b // t
        if dropout:
            kept |= {"softmax dropout mask": a * s * s * b // t, "softmax dropout output": item * a * s * s * b // t}
    return kept


def op_activations(*, s: int, b: int, h: int, a: int, kv: int, f: int, t: int, sp: bool, item: int) -> dict[str, int]:
    """What torchtitan's per-op checkpointing keeps of a Llama block (parallelize_llama.py's _save_list, at
    commit 6b03ffa): the block's input, the outputs of its 1st, 3rd, 5th and 7th matmuls (wq, wv, w1, w2;
    w2's before its reduce-scatter, every token's partial sum), the attention kernel's output and its
    fp32 log-sum-exp per query row and head, and with sequence parallelism the two reduce-scatters'
    outputs. The rest (the norms, wk, wo, w3, the rotations, SiLU and its product) is made again."""
    sb, outside = s * b, t if sp else 1
    kept = {"layer input": item * sb * h // outside, "wq output": item * sb * h // t,
            "wv output": item * sb * kv * (h // a) // t, "attention output": item * sb * h // t,
            "softmax statistics (flash)": 4 * a * sb // t, "w1 output": item * sb * f // t,
            "w2 output (before its reduce)": item * sb * h}
    if sp and t > 1:
        kept["reduce-scatter outputs"] = 2 * item * sb * h // t
    return kept


MLP_KIND = {"gpt": "gelu", "llama": "swiglu"}  # each architecture's MLP
MLP = ("gelu input", "gelu output", "swiglu input (w1 and w3 outputs)", "swiglu output (w2 input)", "silu output")


def moe_activations(kept: dict[str, int], m: Any, *, b: int, parts: int = 1) -> dict[str, int]:
    """A layer's tensors (layer_activations) with its MLP's replaced by a mixture of experts' (model/moe.py):
    per token the router's scores (E), each of its k routed rows (h), the experts' two products and their
    SwiGLU (3 F_e each, 4 unfused: SiLU's output too; GELU experts, gpt's: the product and its GELU, 2 F_e),
    the k weighted outputs (h), and the shared experts' the same way, for the rank's share of the
    sequence's tokens (`parts`: the ranks sharing them out); the MLP's input stays."""
    item, tokens = ITEMSIZE[m.dtype], m.seq * b // parts
    k, f = m.moe_top_k, m.moe_ffn_hidden or m.ffn_hidden
    per = (3 + (not m.fused_kernels)) if m.moe.activation == "swiglu" else 2  # (unfused, SiLU's output too)
    out = {name: v for name, v in kept.items() if name not in MLP}
    return out | {"router scores": item * tokens * m.moe_experts,
                  "routed rows and weighted outputs": 2 * item * tokens * k * m.hidden,
                  "experts' products and activation": per * item * tokens * k * f,
                  "shared experts' products and activation": per * item * tokens * m.moe_shared_experts * f}


def layer_bytes(**kw: object) -> int:
    return sum(layer_activations(**kw).values())  # type: ignore[arg-type]
