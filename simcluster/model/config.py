"""The model's configuration and parameters: sizes, architecture, parameter shapes and units,
deterministic initial weights and data, and where a forward pass sits in the step's batch.

Two architectures share it: "gpt" (learned positions, layer norm with biases, a GELU MLP, tied or
untied head) and "llama" (rotary positions, RMSNorm, a SwiGLU MLP, grouped-query attention, no biases,
untied head). A unit (embed, block{i}, head) is what a DDP bucket, a ZeRO-3 gather and a pipeline
chunk's boundaries are made of.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from simcluster.model.moe import MoE
from simcluster.numerics.divisors import divisors, listed
from simcluster.numerics.ops import Ops

ARCHS = ("gpt", "llama")
GQA = ("repeat_kv", "native")  # how attention takes grouped-query attention's key/value heads


class Recompute(Enum):
    NONE = "none"
    SELECTIVE = "selective"
    FULL = "full"
    OP = "op"  # torchtitan's per-op selective checkpointing (parallel/llama_shard.py, LlamaShard.block)


def takes_per_op(arch: str, attention_kernel: str, moe_experts: int) -> bool:
    """Whether a model can take torchtitan's per-op policy: it is written for its Llama (flash attention,
    no experts)."""
    return arch == "llama" and attention_kernel == "flash" and not moe_experts


@dataclass(frozen=True)
class ModelConfig:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn_hidden: int = 256
    seq: int = 32
    vocab: int = 128
    causal: bool = True
    tied_head: bool = True
    dropout: float = 0.0
    eps: float = 1e-5
    seed: int = 0
    recompute: Recompute = Recompute.NONE
    dtype: str = "fp32"  # logical dtype of activations, for the memory ledger
    arch: str = "gpt"  # "gpt"; "llama": RMSNorm, rotary positions, SwiGLU, grouped-query attention, no biases
    kv_heads: int | None = None  # llama: key/value heads (grouped-query attention); None: as many as heads
    gqa: str = "repeat_kv"  # llama: kv heads repeated before attention, or taken as they are ("native")
    rope_theta: float = 10000.0  # llama: base of the rotary frequencies
    attention_kernel: str = "flash"  # what the attention core costs: one fused kernel, or each step (flash.py)
    fused_kernels: bool = True  # bias+GELU, bias+dropout+residual, softmax as single kernels (fusion.py)
    loss_kernel: str = "unfused"  # the cross-entropy's passes over fp32 logits, or one kernel a pass over 16-bit ones
    # a mixture of experts in place of the MLP (model/moe.py): experts (0: dense), each token's, their FFN
    # size (None: ffn_hidden), dense layers first (DeepSeek-V3: 3), and the router (moe.MoE's fields)
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_ffn_hidden: int | None = None
    moe_first_dense: int = 0
    moe_aux_coeff: float = 0.0
    moe_capacity_factor: float = 0.0
    moe_scores: str = "softmax"
    moe_normalize: bool = False
    moe_route_scale: float = 1.0
    moe_skew: float = 0.0  # meta mode's stated routing (moe.stated): 0 uniform, 1 Zipf
    moe_shared_experts: int = 0  # every token through these too (DeepSeek-MoE), each of moe_ffn_hidden
    moe_shared_overlap: bool = False  # the shared experts under the all-to-all (moe.MoE.overlap_shared)
    moe_groups: int = 1  # node-limited routing (moe.choose): the experts' groups, and how many a token may use
    moe_group_limit: int = 0
    moe_bias_rate: float = 0.0  # DeepSeek-V3's bias update speed (moe_shard.bias_step; 0: no bias)

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "ffn_hidden", "seq", "vocab"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"model.{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise ValueError(f"heads={self.heads} must divide hidden={self.hidden}; valid: {listed(divisors(self.hidden))}")
        if self.arch not in ARCHS:
            raise ValueError(f"model.arch {self.arch!r} is not valid; valid: {', '.join(ARCHS)}")
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        if not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.heads % kv:
            raise ValueError(f"kv_heads={kv!r} must divide heads={self.heads}; valid: {listed(divisors(self.heads))}")
        if self.arch == "gpt" and kv != self.heads:
            raise ValueError(f"grouped-query attention (kv_heads={kv}) is part of the llama architecture; "
                             f"set model.arch = \"llama\" or kv_heads = heads")
        if self.arch == "llama" and self.tied_head:
            raise ValueError("the llama architecture has an untied LM head: set model.tied_head = false")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings rotate pairs: head dim hidden/heads = {self.head_dim} must be even")
        object.__setattr__(self, "kv_heads", kv)
        if self.gqa not in GQA:
            raise ValueError(f"model.gqa {self.gqa!r} is not valid; valid: {', '.join(GQA)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if self.attention_kernel not in ("flash", "unfused"):
            raise ValueError(f"model.attention_kernel {self.attention_kernel!r} is not valid; valid: flash, unfused")
        if self.loss_kernel not in ("unfused", "fused"):
            raise ValueError(f"model.loss_kernel {self.loss_kernel!r} is not valid; valid: unfused, fused")
        if self.moe_experts:
            self.moe  # (checks the router's fields)
        if self.recompute is Recompute.OP and not takes_per_op(self.arch, self.attention_kernel, self.moe_experts):
            raise ValueError("parallel.recompute = \"op\" (torchtitan's per-op checkpointing) is written for its "
                             "Llama: set model.arch = \"llama\", model.attention_kernel = \"flash\" and no "
                             "model.moe_experts, or use none, selective or full")

    @property
    def moe(self) -> Any:
        """The MoE layers' configuration (model/moe.py), or None for a dense model."""
        if not self.moe_experts:
            return None
        return MoE(self.moe_experts, self.moe_top_k, self.moe_ffn_hidden or self.ffn_hidden, self.moe_aux_coeff,
                   self.moe_capacity_factor, self.moe_normalize, "swiglu" if self.arch == "llama" else "gelu",
                   self.moe_scores, self.moe_route_scale,
                   self.moe_shared_experts, self.moe_groups, self.moe_group_limit, self.moe_shared_overlap)

    def is_moe(self, layer: int) -> bool:
        """Whether block `layer` has the mixture of experts (after the first dense ones)."""
        return self.moe_experts > 0 and layer >= self.moe_first_dense

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(_parameter_shapes(self))

    def _build_parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        h, F, V = self.hidden, self.ffn_hidden, self.vocab
        if self.arch == "llama":
            kv = self.kv_heads * self.head_dim
            shapes: dict[str, tuple[int, ...]] = {"wte": (V, h)}
            for i in range(self.layers):
                p = f"layers.{i}."
                shapes |= {p + "attn_norm.g": (h,), p + "attn.wq": (h, h), p + "attn.wk": (h, kv),
                           p + "attn.wv": (h, kv), p + "attn.wo": (h, h), p + "mlp_norm.g": (h,)}
                if self.is_moe(i):
                    e, f = self.moe_experts, self.moe_ffn_hidden or F
                    shapes |= {p + "moe.router": (h, e), p + "moe.experts.w_fc": (e, h, f),
                               p + "moe.experts.w_up": (e, h, f), p + "moe.experts.w_out": (e, f, h)}
                    if self.moe_shared_experts:  # one SwiGLU of their inner sizes side by side
                        n = self.moe_shared_experts * f
                        shapes |= {p + "moe.shared.w1": (h, n), p + "moe.shared.w3": (h, n), p + "moe.shared.w2": (n, h)}
                else:
                    shapes |= {p + "mlp.w1": (h, F), p + "mlp.w3": (h, F), p + "mlp.w2": (F, h)}
            return shapes | {"lnf.g": (h,), "head": (h, V)}
        shapes: dict[str, tuple[int, ...]] = {"wte": (V, h), "wpe": (self.seq, h)}
        for i in range(self.layers):
            p = f"layers.{i}."
            shapes |= {p + "ln1.g": (h,), p + "ln1.b": (h,), p + "attn.w_qkv": (h, 3 * h), p + "attn.b_qkv": (3 * h,),
                       p + "attn.w_proj": (h, h), p + "attn.b_proj": (h,), p + "ln2.g": (h,), p + "ln2.b": (h,)}
            if self.is_moe(i):  # GELU experts without biases (Megatron-Core's)
                e, f = self.moe_experts, self.moe_ffn_hidden or F
                shapes |= {p + "moe.router": (h, e), p + "moe.experts.w_fc": (e, h, f), p + "moe.experts.w_out": (e, f, h)}
                if self.moe_shared_experts:  # one GELU FFN of their inner sizes side by side
                    n = self.moe_shared_experts * f
                    shapes |= {p + "moe.shared.w1": (h, n), p + "moe.shared.w2": (n, h)}
            else:
                shapes |= {p + "mlp.w_fc": (h, F), p + "mlp.b_fc": (F,), p + "mlp.w_out": (F, h), p + "mlp.b_out": (h,)}
        shapes |= {"lnf.g": (h,), "lnf.b": (h,)}
        if not self.tied_head:
            shapes["head"] = (h, V)
        return shapes

    @property
    def parameters(self) -> int:
        return sum(math.prod(s) for s in self.parameter_shapes().values())


def init_params(ops: Ops, cfg: ModelConfig, names: Any = None) -> dict[str, Any]:
    """Deterministic initial weights: counter-based uniform, a pure function of (seed, name, index), so
    that a rank may make just its own (`names`; default: all) and get the same values."""
    params = {}
    shapes = _parameter_shapes(cfg)
    for name in shapes if names is None else names:
        shape = shapes[name]
        if name.endswith(".g"):
            params[name] = ops.uniform(cfg.seed, name, shape, low=0.8, high=1.2)
        elif name.endswith(".b") or ".b_" in name:
            params[name] = ops.uniform(cfg.seed, name, shape, low=-0.02, high=0.02)
        else:
            fan_in = shape[-2] if name not in ("wte", "wpe") else shape[1]  # (an expert's: (E, in, out))
            bound = math.sqrt(3.0 / fan_in)
            params[name] = ops.uniform(cfg.seed, name, shape, low=-bound, high=bound)
    return params


def batch(cfg: ModelConfig, seed: int, step: int, size: int, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and next-token targets, (size, seq) each, of sequences first .. first+size-1 of
    the step's data: a pure function of (seed, step, sequence index)."""
    from simcluster.numerics import random as _random

    idx = np.arange(first * (cfg.seq + 1), (first + size) * (cfg.seq + 1), dtype=np.int64).reshape(size, cfg.seq + 1)
    toks = (_random.bits(seed, f"tokens.{step}", idx) % np.uint64(cfg.vocab)).astype(np.int64)
    return toks[:, :-1], toks[:, 1:]


@dataclass(frozen=True)
class Slice:
    """Which sequences of the step's global batch this forward pass sees: [offset, offset + size) of `total`.

    The loss is normalised by the global token count and dropout masks are drawn at global positions,
    so the partial gradients of any split of the batch add up exactly to those of the whole batch.
    """

    offset: int
    total: int


def units(cfg: ModelConfig) -> list[str]:
    """The model's parameter units in forward order: "embed", "block0" .. "block{L-1}", "head" (a block's
    experts, a unit of their own, come with it: `companions`)."""
    return ["embed"] + [f"block{i}" for i in range(cfg.layers)] + ["head"]


def companions(cfg: ModelConfig, unit: str) -> list[str]:
    """The units that come with a pipeline unit: a mixture of experts' experts{i} with its block{i}, their own
    unit so that data parallelism can reduce them over the ranks holding the same experts (dp_wrap.py)."""
    if unit.startswith("block") and cfg.is_moe(int(unit[len("block"):])):
        return ["experts" + unit[len("block"):]]
    return []


def unit_names(cfg: ModelConfig, unit: str) -> list[str]:
    """The parameters of a unit, in a fixed order (what a bucket or a ZeRO-3 unit flattens)."""
    return list(_unit_names(cfg, unit))


def _unit_names(cfg: ModelConfig, unit: str) -> tuple[str, ...]:
    return _names_by_unit(cfg).get(unit, ())


@functools.lru_cache(maxsize=64)
def _names_by_unit(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """Every unit's parameter names, made in one pass (a lookup a unit: pipelines of a thousand stages
    ask for each of theirs on every rank)."""
    shapes = _parameter_shapes(cfg)
    blocks: dict[str, list[str]] = {}
    for n in shapes:
        if n.startswith("layers."):
            i, rest = n.split(".", 2)[1:]
            blocks.setdefault(("experts" if rest.startswith("moe.experts.") else "block") + i, []).append(n)
    return {"embed": tuple(n for n in ("wte", "wpe") if n in shapes),
            "head": tuple(n for n in ("lnf.g", "lnf.b", "head") if n in shapes),
            **{u: tuple(names) for u, names in blocks.items()}}


@functools.lru_cache(maxsize=64)
def _parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """(Cached: meta-mode programs at scale ask for it per unit and per step. Not to be mutated.)"""
    return cfg._build_parameter_shapes()
