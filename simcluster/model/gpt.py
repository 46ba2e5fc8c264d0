"""The single-device reference: a GPT-style decoder with a hand-written backward pass.

token + position embeddings (dropout) -> L pre-LN blocks -> final layer norm -> LM head (tied to the
token embedding or not) -> mean cross-entropy. A block: x + drop(attn(ln1(x))), then
x + drop(mlp(ln2(x))), attention with `heads` heads (causal or not, dropout on its weights), MLP
h -> ffn_hidden -> h with GELU (tanh form).

Everything goes through `ops` (numerics/ops.py), so the same code runs in exact, fast and meta mode,
and every sum that data, tensor, sequence or context parallelism split is an exact partial in exact
mode. Attention uses the two-pass form: out = round(sum_k e_k keep_k v_k) / round(sum_k e_k) / (1-p),
e = exp(s - max s), which ring attention reproduces block by block.

Recomputation: "selective" keeps q, k, v and recomputes the attention core (scores, weights, dropout
mask) in the backward pass; "full" keeps only each block's input and recomputes the block.

Shapes: b batch, s sequence, h hidden, a heads, d = h/a, F ffn_hidden, V vocab.
"""

from __future__ import annotations

import math
from typing import Any


from simcluster.model import flash, fusion
from simcluster.model.activations import layer_bytes
from simcluster.model.config import ModelConfig, Recompute, Slice, batch, init_params, unit_names, units
from simcluster.model.memory import MemoryLedger
from simcluster.model.optimizer import AdamState, adam_init, adam_step, clip_by_norm, square_sum
from simcluster.model.precision import LOSS_SCALE, PRECISIONS, grad_dtype, model_state_bytes, unscale, working_copy
from simcluster.numerics.ops import Mode, Ops
from simcluster.numerics.tensor import ITEMSIZE, MetaTensor, Partial


def _keep(ops: Ops, cfg: ModelConfig, name: str, shape: tuple[int, ...], step: int, where: Slice) -> Any:
    if cfg.dropout == 0.0:
        return None
    full = (where.total,) + tuple(shape[1:])
    offset = (where.offset,) + (0,) * (len(shape) - 1)
    return ops.dropout_keep(cfg.seed + 7919 * step, name, tuple(shape), cfg.dropout, offset=offset, full_shape=full)


def _drop(ops: Ops, x: Any, keep: Any, cfg: ModelConfig) -> Any:
    if keep is None:
        return x
    return ops.scale(ops.zero_where(keep, x), 1.0 / (1.0 - cfg.dropout))


def _drop_grad(ops: Ops, grad: Any, keep: Any, cfg: ModelConfig) -> Any:
    if keep is None:
        return grad
    with fusion.dropout_backward(ops, cfg, grad):
        return _drop(ops, grad, keep, cfg)


class GPT:
    """Forward, backward and step of the reference model on one device, through `ops`."""

    def __init__(self, ops: Ops, cfg: ModelConfig, memory: MemoryLedger | None = None) -> None:
        self.ops = ops
        self.cfg = cfg
        self.memory = memory if memory is not None else MemoryLedger()
        self.item = ITEMSIZE[cfg.dtype]
        self._mask: Any = None

    # -- pieces --------------------------------------------------------------------------------
    def _linear(self, x: Any, w: Any, b: Any) -> Any:
        return self.ops.add(self.ops.matmul(x, w), b)

    def split_heads(self, x: Any) -> Any:
        """(b, s, a*d) -> (b, a, s, d), for all heads or a tensor-parallel rank's share of them."""
        return self.ops.heads(x, self.cfg.head_dim)

    def merge_heads(self, x: Any) -> Any:
        """(b, a, s, d) -> (b, s, h)."""
        return self.ops.merge_heads(x)

    def split_qkv(self, x: Any) -> tuple[Any, Any, Any]:
        """q, k, v from the QKV projection's output (b, s, 3w): its thirds."""
        n = x.shape[-1] // 3
        if isinstance(x, MetaTensor):
            part = MetaTensor(x.shape[:-1] + (n,), x.dtype)
            return part, part, part
        return x[..., :n], x[..., n:2 * n], x[..., 2 * n:]

    def causal_mask(self, s: int) -> Any:
        if not self.cfg.causal or self.ops.mode is Mode.META:  # meta mode needs no mask
            return None
        if self._mask is None or self._mask.shape[0] != s:
            self._mask = self.ops.causal(range(s), range(s))
        return self._mask

    def attention_core(self, q: Any, k: Any, v: Any, layer: int, step: int, where: Slice) -> dict[str, Any]:
        """The two-pass core: e, l, keep and the output (b, a, s, d); or the kernel set's fused attention
        where it has one and there is no dropout (whose masks are ours): the output and its state."""
        ops, cfg = self.ops, self.cfg
        fused = None if cfg.dropout else ops.fused_attention(q, k, v, causal=cfg.causal,
                                                               scale=1.0 / math.sqrt(cfg.head_dim))
        if fused is not None:
            return {"out": fused[0], "flash": fused[1]}
        with flash.forward(ops, cfg, q, k):
            s = ops.attention_scores(q, k, 1.0 / math.sqrt(cfg.head_dim), self.causal_mask(q.shape[2]))
            e = ops.attention_weights(s, ops.max(s, -1))
            l_sum = ops.sum(e, -1, partial=True)
            keep = _keep(ops, cfg, f"attn.{layer}", tuple(e.shape), step, where)
            ek = e if keep is None else ops.zero_where(keep, e)
            o_sum = ops.einsum("bask,bakd->basd", ek, v, partial=True)
            out = ops.attention_output(o_sum, l_sum, q.dtype, 1.0 / (1.0 - cfg.dropout))
        return {"e": e, "l": l_sum, "keep": keep, "out": out}

    # -- one block -----------------------------------------------------------------------------
    def block_forward(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice) -> tuple[Any, dict[str, Any]]:
        ops, cfg, pre = self.ops, self.cfg, f"layers.{i}."
        a, mu1, r1 = ops.layer_norm(x, p[pre + "ln1.g"], p[pre + "ln1.b"], cfg.eps)
        qkv = self._linear(a, p[pre + "attn.w_qkv"], p[pre + "attn.b_qkv"])  # (b, s, 3h)
        q, k, v = (self.split_heads(t) for t in self.split_qkv(qkv))
        core = self.attention_core(q, k, v, i, step, where)
        ctx = self.merge_heads(core["out"])  # (b, s, h)
        y = self._linear(ctx, p[pre + "attn.w_proj"], p[pre + "attn.b_proj"])
        keep_a = _keep(ops, cfg, f"resid_attn.{i}", tuple(y.shape), step, where)
        x1 = ops.add(x, _drop(ops, y, keep_a, cfg))
        c, mu2, r2 = ops.layer_norm(x1, p[pre + "ln2.g"], p[pre + "ln2.b"], cfg.eps)
        f = self._linear(c, p[pre + "mlp.w_fc"], p[pre + "mlp.b_fc"])  # (b, s, F)
        g = ops.gelu(f)
        z = self._linear(g, p[pre + "mlp.w_out"], p[pre + "mlp.b_out"])
        keep_m = _keep(ops, cfg, f"resid_mlp.{i}", tuple(z.shape), step, where)
        x2 = ops.add(x1, _drop(ops, z, keep_m, cfg))
        cache = {"x": x, "a": a, "mu1": mu1, "r1": r1, "q": q, "k": k, "v": v, "ctx": ctx, "keep_a": keep_a,
                 "x1": x1, "c": c, "mu2": mu2, "r2": r2, "f": f, "g": g, "keep_m": keep_m, **core}
        return x2, cache

    def _stored(self, cache: dict[str, Any]) -> dict[str, Any]:
        """What the forward pass keeps for backward, by the recomputation policy."""
        if self.cfg.recompute is Recompute.FULL:
            return {"x": cache["x"]}
        if self.cfg.recompute is Recompute.SELECTIVE:
            return {k: v for k, v in cache.items() if k not in ("e", "l", "keep", "flash")}
        return cache

    def block_backward(self, p: dict[str, Any], dx2: Any, cache: dict[str, Any], i: int, step: int,
                       grads: dict[str, Any], where: Slice) -> Any:
        """dx into the block; its gradients go to `grads`."""
        ops, cfg, pre = self.ops, self.cfg, f"layers.{i}."

        if cfg.recompute is Recompute.FULL:
            _, cache = self.block_forward(p, cache["x"], i, step, where)
        elif cfg.recompute is Recompute.SELECTIVE:
            cache = cache | self.attention_core(cache["q"], cache["k"], cache["v"], i, step, where)
        c_ = cache
        dz = _drop(ops, dx2, c_["keep_m"], cfg)
        grads[pre + "mlp.w_out"] = ops.einsum("bsf,bsh->fh", c_["g"], dz, partial=True)
        grads[pre + "mlp.b_out"] = ops.sum(dz, (0, 1), partial=True)
        dg = ops.matmul(dz, ops.transpose(p[pre + "mlp.w_out"]))
        df = ops.gelu_backward(dg, c_["f"])
        grads[pre + "mlp.w_fc"] = ops.einsum("bsh,bsf->hf", c_["c"], df, partial=True)
        grads[pre + "mlp.b_fc"] = ops.sum(df, (0, 1), partial=True)
        dc = ops.matmul(df, ops.transpose(p[pre + "mlp.w_fc"]))
        dx1_ln, grads[pre + "ln2.g"], grads[pre + "ln2.b"] = ops.layer_norm_backward(
            dc, c_["x1"], p[pre + "ln2.g"], c_["mu2"], c_["r2"])
        dx1 = ops.add(dx2, dx1_ln)
        dy = _drop(ops, dx1, c_["keep_a"], cfg)
        grads[pre + "attn.w_proj"] = ops.einsum("bsh,bsk->hk", c_["ctx"], dy, partial=True)
        grads[pre + "attn.b_proj"] = ops.sum(dy, (0, 1), partial=True)
        dout = self.split_heads(ops.matmul(dy, ops.transpose(p[pre + "attn.w_proj"])))  # (b, a, s, d)
        dq, dk, dv = self.attention_backward(dout, c_)
        dqkv = ops.concat([self.merge_heads(dq), self.merge_heads(dk), self.merge_heads(dv)], -1)  # (b, s, 3h)
        grads[pre + "attn.w_qkv"] = ops.einsum("bsh,bsk->hk", c_["a"], dqkv, partial=True)
        grads[pre + "attn.b_qkv"] = ops.sum(dqkv, (0, 1), partial=True)
        da = ops.matmul(dqkv, ops.transpose(p[pre + "attn.w_qkv"]))
        dx_ln, grads[pre + "ln1.g"], grads[pre + "ln1.b"] = ops.layer_norm_backward(
            da, c_["x"], p[pre + "ln1.g"], c_["mu1"], c_["r1"])
        return ops.add(dx1, dx_ln)

    def attention_backward(self, dout: Any, c_: dict[str, Any], fold: Any = None) -> tuple[Any, Any, Any]:
        """dq, dk, dv (b, a, s, d) of the two-pass core (the FlashAttention backward), or of the fused one.
        `fold`: dk's and dv's partial sums added over each key/value head's query heads before they are
        rounded (grouped-query attention's heads as they are: llama_shard.py's fold_kv)."""
        ops, cfg = self.ops, self.cfg
        if "flash" in c_:
            return ops.fused_attention_backward(c_["flash"], dout)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        with flash.backward(ops, cfg, c_["q"], c_["k"]):
            with fusion.probabilities(ops, cfg):
                probs = ops.attention_probs(c_["e"], c_["l"])  # P = e / l
                pd = probs if c_["keep"] is None else _drop(ops, probs, c_["keep"], cfg)
            dv = ops.einsum("bask,basd->bakd", pd, dout) if fold is None else \
                ops.finalize(fold(ops.einsum("bask,basd->bakd", pd, dout, partial=True)))
            dpd = ops.einsum("basd,bakd->bask", dout, c_["v"])
            dp = dpd if c_["keep"] is None else _drop_grad(ops, dpd, c_["keep"], cfg)
            with fusion.softmax_backward(ops, cfg, probs):
                delta = ops.sum(ops.mul(dout, c_["out"]), -1)  # (b, a, s): sum over d, never split
                ds = ops.mul(probs, ops.sub(dp, ops.expand_last(delta)))
            dq = ops.scale(ops.einsum("bask,bakd->basd", ds, c_["k"]), scale)
            dk = ops.einsum("bask,basd->bakd", ds, c_["q"]) if fold is None else \
                ops.finalize(fold(ops.einsum("bask,basd->bakd", ds, c_["q"], partial=True)))
            dk = ops.scale(dk, scale)
        return dq, dk, dv

    # -- the whole model -------------------------------------------------------------------------
    def head_weight(self, p: dict[str, Any]) -> Any:
        return ops_t(self.ops, p["wte"]) if self.cfg.tied_head else p["head"]

    # -- units: what ZeRO-3 gathers one at a time ----------------------------------------------
    def embed_forward(self, p: dict[str, Any], ids: Any, step: int, where: Slice) -> tuple[Any, dict[str, Any]]:
        ops, cfg = self.ops, self.cfg
        bsz, s = ids.shape
        x = ops.add(ops.embedding(ids, p["wte"]), ops.embedding(ops.positions(range(s), bsz), p["wpe"]))
        keep0 = _keep(ops, cfg, "embed", tuple(x.shape), step, where)
        return _drop(ops, x, keep0, cfg), {"ids": ids, "keep0": keep0}

    def head_forward(self, p: dict[str, Any], x: Any, targets: Any) -> tuple[Any, dict[str, Any]]:
        """The loss's partial sum over these tokens; `p` holds lnf.* and the head weight (wte if tied)."""
        ops, cfg = self.ops, self.cfg
        xf, muf, rf = ops.layer_norm(x, p["lnf.g"], p["lnf.b"], cfg.eps)
        logits, low = wide_logits(ops, ops.matmul(xf, self.head_weight(p)))  # (b, s, V)
        m = ops.max(logits, -1)
        e = ops.attention_weights(logits, m)  # exp(logits - max)
        sum_e = ops.sum(e, -1, partial=True)
        lse = ops.log_sum_exp(m, sum_e, logits.dtype)
        picked = ops.gather_last(logits, targets)
        loss_sum = ops.sum(ops.sub(lse, picked), None, partial=True)
        return loss_sum, {"targets": targets, "x_final": x, "xf": xf, "muf": muf, "rf": rf, "e": e, "sum_e": sum_e,
                          "low": low}

    def head_backward(self, p: dict[str, Any], hc: dict[str, Any], where: Slice,
                      loss_scale: float = 1.0) -> tuple[Any, dict[str, Any]]:
        """dx into the last block, and the head unit's gradients; with a tied head, "wte" holds the
        head's share of the embedding gradient (the embed unit adds its own)."""
        ops, cfg = self.ops, self.cfg
        grads: dict[str, Any] = {}
        probs = ops.attention_probs(hc["e"], hc["sum_e"])  # softmax of the logits
        dlogits = narrow_logits(ops, ops.scale(ops.sub(probs, ops.one_hot(hc["targets"], cfg.vocab, probs)),
                                               loss_scale / self.tokens(where)), hc["low"])
        dxf = ops.matmul(dlogits, ops.transpose(self.head_weight(p)))
        dx, grads["lnf.g"], grads["lnf.b"] = ops.layer_norm_backward(dxf, hc["x_final"], p["lnf.g"], hc["muf"], hc["rf"])
        head_grad = ops.einsum("bsh,bsv->hv", hc["xf"], dlogits, partial=True)  # (h, V)
        if cfg.tied_head:
            grads["wte"] = ops.transpose_partial(head_grad)
        else:
            grads["head"] = head_grad
        return dx, grads

    def embed_backward(self, ec: dict[str, Any], dx: Any, head_wte: Any = None) -> dict[str, Any]:
        ops, cfg = self.ops, self.cfg
        dx = _drop(ops, dx, ec["keep0"], cfg)
        grads = {"wpe": ops.sum(dx, 0, partial=True), "wte": ops.embedding_backward(ec["ids"], dx, cfg.vocab)}
        if head_wte is not None:
            grads["wte"] = ops.add_partial(grads["wte"], head_wte)
        return {"wte": grads["wte"], "wpe": grads["wpe"]}

    # -- the whole model -------------------------------------------------------------------------
    def forward(self, p: dict[str, Any], ids: Any, targets: Any, step: int,
                where: Slice | None = None) -> tuple[Any, dict[str, Any]]:
        """The loss's partial sum over these tokens (divide by the global token count with `loss`),
        and everything backward needs."""
        where = where or Slice(0, ids.shape[0])
        x, ec = self.embed_forward(p, ids, step, where)
        self.memory.hold("activations", "embed", self.held_bytes(ec))
        blocks = []
        for i in range(self.cfg.layers):
            x, cache = self.block_forward(p, x, i, step, where)
            stored = self._stored(cache)
            self.memory.hold("activations", f"block{i}", self.layer_bytes(x))
            blocks.append(stored)
        loss_sum, hc = self.head_forward(p, x, targets)
        self.memory.hold("activations", "head", self.held_bytes(hc))
        return loss_sum, {"embed": ec, "blocks": blocks, "head": hc, "where": where}

    def tokens(self, where: Slice) -> int:
        return where.total * self.cfg.seq

    def loss(self, loss_sum: Any, where: Slice) -> Any:
        """The mean loss over the global batch, from the (all-reduced) partial sum."""
        return self.ops.scale(self.ops.finalize(loss_sum), 1.0 / self.tokens(where))

    def backward(self, p: dict[str, Any], cache: dict[str, Any], step: int,
                 loss_scale: float = 1.0) -> dict[str, Any]:
        """Gradients of the global mean loss, as partial sums over these tokens (round with `finish`)."""
        cfg, where = self.cfg, cache["where"]
        dx, head = self.head_backward(p, cache["head"], where, loss_scale)
        head_wte = head.pop("wte", None)
        grads = dict(head)
        self.memory.release("activations", "head")
        for i in reversed(range(cfg.layers)):
            block: dict[str, Any] = {}
            dx = self.block_backward(p, dx, cache["blocks"][i], i, step, block, where)
            grads |= block
            self.memory.release("activations", f"block{i}")
        embed = self.embed_backward(cache["embed"], dx, head_wte)
        grads |= embed
        self.memory.release("activations", "embed")
        return grads

    def finish(self, grads: dict[str, Any]) -> dict[str, Any]:
        """Round every gradient once (after any all-reduce of the partials)."""
        return {k: self.ops.finalize(v) for k, v in grads.items()}

    def layer_bytes(self, x: Any, t: int = 1, sp: bool = False) -> int:
        """What one block keeps for backward on this rank (model/activations.py), for x (b, s, h)."""
        b, s, _ = x.shape
        return layer_bytes(s=s, b=b, h=self.cfg.hidden, a=self.cfg.heads, t=t, sp=sp,
                           recompute=self.cfg.recompute.value, dtype=self.cfg.dtype,
                           attention_kernel=self.cfg.attention_kernel)

    def held_bytes(self, tensors: dict[str, Any]) -> int:
        total = 0
        for v in tensors.values():
            if isinstance(v, tuple):  # e.g. a norm's statistics
                total += self.held_bytes(dict(enumerate(v)))
                continue
            if v is None or isinstance(v, (int, float, str)):
                continue
            n = math.prod(v.shape)
            dtype = str(getattr(v, "dtype", ""))
            is_mask = dtype in ("bool", "torch.bool")
            wide = dtype in ("fp32", "float32", "torch.float32") and self.item < 4  # (16-bit runs' fp32 logits)
            total += n * (1 if is_mask else 4 if wide else self.item)
        return total


def ops_t(ops: Ops, w: Any) -> Any:
    return ops.transpose(w)


def wide_logits(ops: Ops, logits: Any) -> tuple[Any, str | None]:
    """The LM head's logits as the cross-entropy takes them, and their own dtype if it was narrower: in
    16-bit training upcast to fp32 first, so the softmax, its log-sum-exp and the loss are fp32
    (Megatron-LM's `output.float()` before its vocab-parallel cross-entropy; torchtitan's loss in fp32)."""
    dtype = logits.dtype if isinstance(logits, MetaTensor) else ops.xp.name(logits.dtype)
    return (ops.cast(logits, "fp32"), dtype) if dtype in ("bf16", "fp16") else (logits, None)


def narrow_logits(ops: Ops, dlogits: Any, dtype: str | None) -> Any:
    """The fp32 cross-entropy's gradient back in the logits' dtype, for the head's products (the upcast's
    backward)."""
    return dlogits if dtype is None else ops.cast(dlogits, dtype)


def train(ops: Ops, cfg: ModelConfig, *, steps: int, batch_size: int, lr: float = 1e-3, weight_decay: float = 0.0,
          clip_grad: float | None = None, precision: str = "fp32",
          params: dict[str, Any] | None = None, delayed_update: bool = False,
          grads_fp32: bool = False) -> dict[str, Any]:
    """`steps` AdamW steps on one device over the whole batch: the reference for every parallel run.
    With `clip_grad`, the gradients are first scaled to that global norm if they exceed it. With
    `delayed_update` (ZeRO-Offload's DPU), step s > 0 computes its gradients with the weights from
    before step s-1's update (the update with step s-1's gradients is still running on the host):
    gradients one step stale, applied to the master weights in order.

    Returns the losses, the last step's gradients (in the gradient dtype, times the loss scale), the
    fp32 master weights and
    Adam moments, and the memory ledger.
    """
    model_state_bytes(0, precision)  # validates
    model = GPT(ops, cfg)
    master = init_params(ops, cfg) if params is None else params
    state = adam_init(ops, master)
    sizes = model_state_bytes(cfg.parameters, precision, grads_fp32)
    model.memory.hold("parameters", "weights", sizes["parameters"])
    model.memory.hold("optimizer", "adam", sizes["optimizer"])
    losses = []
    grads: dict[str, Any] = {}
    first: dict[str, Any] = {}
    used = master  # the weights the next step computes with
    for step in range(steps):
        ids, targets = (ops.from_host(x) for x in batch(cfg, cfg.seed, step, batch_size))
        where = Slice(0, batch_size)
        weights = working_copy(ops, used, precision)
        loss_sum, cache = model.forward(weights, ids, targets, step, where)
        loss = model.loss(loss_sum, where)
        model.memory.hold("gradients", "grads", sizes["gradients"])
        partials = model.backward(weights, cache, step, loss_scale=LOSS_SCALE[precision])
        grads = {k: ops.finalize(ops.retag(v, grad_dtype(precision, grads_fp32))) for k, v in partials.items()}
        first = first or grads
        unscaled = unscale(ops, grads, precision)
        if clip_grad:
            unscaled = clip_by_norm(ops, unscaled, square_sum(ops, list(unscaled.values())), clip_grad)
        before, master = master, adam_step(ops, master, unscaled, state, lr=lr, weight_decay=weight_decay)
        used = before if delayed_update else master
        model.memory.release("gradients", "grads")
        losses.append(loss)
    return {"loss": losses, "grads": grads, "first_grads": first, "params": master, "adam_m": state.m, "adam_v": state.v,
            "peak_activation_bytes": model.memory.peak("activations"), "memory": model.memory}


__all__ = ["AdamState", "GPT", "ModelConfig", "PRECISIONS", "Partial", "Recompute", "Slice", "adam_init", "adam_step",
           "LOSS_SCALE", "batch", "grad_dtype", "init_params", "model_state_bytes", "train", "unit_names", "units",
           "unscale", "working_copy"]
