"""Megatron tensor parallelism for the GPT (Shoeybi et al. 2019), inside data parallelism.

Within a block, attention is split by heads and the MLP by its inner dimension: the QKV and first
MLP weights by columns (each rank computes its heads / its slice of ffn_hidden in full), the output
projections by rows (each rank's product is a partial sum). The paper's operators:
  f: identity forward, all-reduce of the input gradient backward (before a column-parallel layer);
  g: all-reduce of the partial output forward, identity backward (after a row-parallel layer).
The embedding is split by vocabulary rows (an all-reduce assembles the looked-up rows) and so is the
LM head: the cross-entropy all-reduces the row maximum, the sum of exponentials and the target logit,
so the full logits never exist on one rank. Layer norms, residuals and dropout run replicated.

With sequence parallelism (Korthikanti et al. 2022), activations between the tensor-parallel regions
are split by sequence: norms, dropout and residuals run on a rank's tokens only, `g` becomes an
all-gather into the region and `g-bar` a reduce-scatter out of it (their duals in the backward pass),
and the gradients of the norms and of the replicated biases become partial sums over tp as well.

Per step: 1. forward and backward of each micro-batch with the collectives above on the tp group;
2. every gradient (shards and replicated alike) summed over dp; 3. AdamW on this rank's shards.
All partial sums are exact, so the result equals the single-device run byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np

from simcluster.model.gpt import GPT, LOSS_SCALE, Slice, init_params
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.data_parallel import DPConfig, begin_step, finish_step, hold_model_state
from simcluster.program.context import Context


@dataclass(frozen=True)
class TPConfig:
    data: DPConfig = field(default_factory=DPConfig)
    sequence_parallel: bool = False  # Korthikanti et al. 2022: norms and dropout on sequence shards

    def check(self, tp: int) -> None:
        m = self.data.model
        if self.sequence_parallel and m.seq % tp:
            valid = [d for d in range(1, m.seq + 1) if m.seq % d == 0]
            raise ValueError(f"sequence parallelism: tp={tp} must divide seq={m.seq}; valid degrees: "
                             f"{', '.join(map(str, valid))}")
        for what, size in (("heads", m.heads), ("ffn_hidden", m.ffn_hidden), ("vocab", m.vocab)):
            if size % tp:
                valid = [d for d in range(1, size + 1) if size % d == 0]
                raise ValueError(f"tensor-parallel degree {tp} must divide {what}={size}; valid degrees: "
                                 f"{', '.join(map(str, valid))}")


def shard_kind(name: str) -> str:
    """How a parameter is split over tp: rows, cols, qkv (columns of each of q, k, v) or replicated."""
    if name == "wte":
        return "rows"
    if name == "head" or name.endswith("mlp.w_fc") or name.endswith("mlp.b_fc"):
        return "cols"
    if name.endswith("attn.w_qkv") or name.endswith("attn.b_qkv"):
        return "qkv"
    if name.endswith("attn.w_proj") or name.endswith("mlp.w_out"):
        return "rows"
    return "replicated"


def shard(x: Any, kind: str, t: int, r: int) -> Any:
    if kind == "replicated":
        return x
    if isinstance(x, MetaTensor):
        shape = list(x.shape)
        shape[0 if kind == "rows" else -1] //= t
        return MetaTensor(tuple(shape), x.dtype)
    if kind == "rows":
        n = x.shape[0] // t
        return x[r * n:(r + 1) * n]
    if kind == "cols":
        n = x.shape[-1] // t
        return x[..., r * n:(r + 1) * n]
    third = x.shape[-1] // 3  # qkv: columns r of each of q, k, v
    n = third // t
    return np.concatenate([x[..., i * third + r * n:i * third + (r + 1) * n] for i in range(3)], axis=-1)


def unshard(parts: list[Any], kind: str) -> Any:
    if kind == "replicated":
        return parts[0]
    if kind == "rows":
        return np.concatenate(parts, axis=0)
    if kind == "cols":
        return np.concatenate(parts, axis=-1)
    thirds = [np.split(p, 3, axis=-1) for p in parts]
    return np.concatenate([np.concatenate([t[i] for t in thirds], axis=-1) for i in range(3)], axis=-1)


class TPModel:
    """The GPT's pieces on one tp rank: local heads, local ffn slice, local vocabulary rows."""

    def __init__(self, ctx: Context, cfg: TPConfig) -> None:
        self.ctx, self.ops, self.cfg = ctx, ctx.ops, cfg
        self.m = cfg.data.model
        self.tp = ctx.mesh.tp
        self.t, self.r = self.tp.size, ctx.mesh.coord("tp")
        self.heads = self.m.heads // self.t
        self.vocab = self.m.vocab // self.t
        self.sp = cfg.sequence_parallel and self.t > 1
        self._keep_all = False
        self.seq = self.m.seq // self.t if self.sp else self.m.seq  # tokens of a sequence held between regions
        self.gpt = GPT(ctx.ops, self.m, memory=ctx.memory)  # for its unsharded helpers

    # -- helpers ---------------------------------------------------------------------------------
    def keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice, head_axis: bool = False) -> Any:
        """The slice of the single-device dropout mask that this rank's tensor covers."""
        if self.m.dropout == 0.0:
            return None
        full = [where.total] + list(shape[1:])
        offset = [where.offset] + [0] * (len(shape) - 1)
        if head_axis:
            full[1], offset[1] = self.m.heads, self.r * self.heads
        elif self.sp:  # (b, s/t, h): this rank's tokens
            full[1], offset[1] = self.m.seq, self.r * self.seq
        return self.ops.dropout_keep(self.m.seed + 7919 * step, name, shape, self.m.dropout, offset=tuple(offset),
                                     full_shape=tuple(full))

    def drop(self, x: Any, keep: Any) -> Any:
        return x if keep is None else self.ops.scale(self.ops.zero_where(keep, x), 1.0 / (1.0 - self.m.dropout))

    def reduce(self, partial: Any) -> Generator[Any, Any, Any]:
        """Sum a partial over tp and round once (where the single device rounds): all-reduce, or with
        sequence parallelism a reduce-scatter to this rank's tokens (g-bar forward, g backward)."""
        if self.sp:
            return self.ops.finalize((yield self.ctx.comm.reduce_scatter(partial, group=self.tp, dim=1)))
        return self.ops.finalize((yield self.ctx.comm.all_reduce(partial, group=self.tp)))

    def gather(self, x: Any) -> Generator[Any, Any, Any]:
        """Into the tensor-parallel region: all of the sequence (g forward, g-bar backward with SP)."""
        if not self.sp:
            return x
        return (yield self.ctx.comm.all_gather(x, group=self.tp, dim=1))

    # -- forward ---------------------------------------------------------------------------------
    def embed(self, p: dict[str, Any], ids: Any, step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops = self.ops
        mine = ops.embedding(ids, p["wte"], row_offset=self.r * self.vocab)  # zero outside my rows
        if self.sp:  # one owner per row, zeros elsewhere: the sum is exact in any order
            x = yield self.ctx.comm.reduce_scatter(mine, group=self.tp, dim=1)  # (b, s/t, h)
        else:
            x = (yield self.ctx.comm.all_reduce(mine, group=self.tp)) if self.t > 1 else mine
        first = self.r * self.seq if self.sp else 0
        pos = np.broadcast_to(np.arange(first, first + self.seq), (ids.shape[0], self.seq))
        x = ops.add(x, ops.embedding(pos, p["wpe"]))
        keep0 = self.keep("embed", tuple(x.shape), step, where)
        return self.drop(x, keep0), {"ids": ids, "keep0": keep0}

    def block_full(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice) -> Generator[Any, Any, Any]:
        """The block, keeping everything (for the backward pass of full recomputation)."""
        self._keep_all = True
        try:
            return (yield from self.block(p, x, i, step, where))
        finally:
            self._keep_all = False

    def block(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops, m, pre = self.ops, self.m, f"layers.{i}."
        a_mine, mu1, r1 = ops.layer_norm(x, p[pre + "ln1.g"], p[pre + "ln1.b"], m.eps)
        a = yield from self.gather(a_mine)  # (b, s, h)
        qkv = ops.add(ops.matmul(a, p[pre + "attn.w_qkv"]), p[pre + "attn.b_qkv"])  # (b, s, 3h/t): column parallel
        q, k, v = (self.gpt._heads(z) for z in self.gpt._split3(qkv))  # (b, a/t, s, d)
        core = self.core(q, k, v, i, step, where)
        out = core["out"]
        ctx_ = self.gpt._merge(out)  # (b, s, h/t)
        y = ops.add((yield from self.reduce(ops.matmul(ctx_, p[pre + "attn.w_proj"], partial=True))),
                    p[pre + "attn.b_proj"])  # row parallel + g
        keep_a = self.keep(f"resid_attn.{i}", tuple(y.shape), step, where)
        x1 = ops.add(x, self.drop(y, keep_a))
        c_mine, mu2, r2 = ops.layer_norm(x1, p[pre + "ln2.g"], p[pre + "ln2.b"], m.eps)
        c = yield from self.gather(c_mine)
        f = ops.add(ops.matmul(c, p[pre + "mlp.w_fc"]), p[pre + "mlp.b_fc"])  # (b, s, F/t)
        g = ops.gelu(f)
        z = ops.add((yield from self.reduce(ops.matmul(g, p[pre + "mlp.w_out"], partial=True))), p[pre + "mlp.b_out"])
        keep_m = self.keep(f"resid_mlp.{i}", tuple(z.shape), step, where)
        x2 = ops.add(x1, self.drop(z, keep_m))
        cache = {"x": x, "a": a, "mu1": mu1, "r1": r1, "q": q, "k": k, "v": v, "ctx": ctx_, "keep_a": keep_a, "x1": x1,
                 "c": c, "mu2": mu2, "r2": r2, "f": f, "g": g, "keep_m": keep_m, **core}
        return x2, (cache if self._keep_all else self.stored(cache))

    def core(self, q: Any, k: Any, v: Any, i: int, step: int, where: Slice) -> dict[str, Any]:
        """The attention core on this rank's heads: e, l, keep, out (b, a/t, s, d)."""
        ops, m = self.ops, self.m
        s = ops.attention_scores(q, k, 1.0 / np.sqrt(m.head_dim), self.gpt._allowed(q.shape[2]))
        e = ops.attention_weights(s, ops.max(s, -1))
        l_sum = ops.sum(e, -1, partial=True)
        keep = self.keep(f"attn.{i}", tuple(e.shape), step, where, head_axis=True)
        ek = e if keep is None else ops.zero_where(keep, e)
        out = ops.attention_output(ops.einsum("bask,bakd->basd", ek, v, partial=True), l_sum, q.dtype,
                                   1.0 / (1.0 - m.dropout))
        return {"e": e, "l": l_sum, "keep": keep, "out": out}

    def stored(self, cache: dict[str, Any]) -> dict[str, Any]:
        """What forward keeps for backward, by the recomputation policy."""
        policy = self.m.recompute.value
        if policy == "full":
            return {"x": cache["x"]}
        if policy == "selective":
            return {k: v for k, v in cache.items() if k not in ("e", "l", "keep")}
        return cache

    def held(self, x: Any) -> int:
        """Bytes a block keeps on this rank (model/activations.py)."""
        from simcluster.model.activations import layer_bytes

        return layer_bytes(s=self.m.seq, b=x.shape[0], h=self.m.hidden, a=self.m.heads, t=self.t, sp=self.sp,
                           recompute=self.m.recompute.value, dtype=self.m.dtype)

    def head(self, p: dict[str, Any], x: Any, targets: Any) -> Generator[Any, Any, Any]:
        """Vocab-parallel cross-entropy: the loss's partial sum over these tokens."""
        ops, m, comm, tp = self.ops, self.m, self.ctx.comm, self.tp
        xf_mine, muf, rf = ops.layer_norm(x, p["lnf.g"], p["lnf.b"], m.eps)
        xf = yield from self.gather(xf_mine)
        w = ops.transpose(p["wte"]) if m.tied_head else p["head"]  # (h, V/t)
        logits = ops.matmul(xf, w)  # (b, s, V/t)
        row_max = yield comm.all_reduce(ops.max(logits, -1), group=tp, op="max")
        e = ops.attention_weights(logits, row_max)
        sum_e = yield comm.all_reduce(ops.sum(e, -1, partial=True), group=tp)
        lse = ops.log_sum_exp(row_max, sum_e, logits.dtype)
        local = targets - self.r * self.vocab
        mine = (local >= 0) & (local < self.vocab)
        picked = ops.zero_where(mine, ops.gather_last(logits, np.where(mine, local, 0)))
        picked = (yield comm.all_reduce(picked, group=tp)) if self.t > 1 else picked  # one owner, zeros elsewhere
        loss_sum = ops.sum(ops.sub(lse, picked), None, partial=True)
        return loss_sum, {"targets": local, "mine": mine, "x_final": x, "xf": xf, "muf": muf, "rf": rf, "e": e,
                          "sum_e": sum_e, "w": w}

    # -- backward --------------------------------------------------------------------------------
    def head_backward(self, p: dict[str, Any], hc: dict[str, Any], tokens: int, scale: float,
                      grads: dict[str, Any]) -> Generator[Any, Any, Any]:
        ops, m = self.ops, self.m
        probs = ops.attention_probs(hc["e"], hc["sum_e"])
        onehot = ops.one_hot(np.where(hc["mine"], hc["targets"], 0), self.vocab, probs)
        onehot = ops.zero_where(hc["mine"][..., None], onehot)
        dlogits = ops.scale(ops.sub(probs, onehot), scale / tokens)
        w_grad = ops.einsum("bsh,bsv->hv", hc["xf"], dlogits, partial=True)  # (h, V/t)
        if m.tied_head:
            grads["wte"] = ops.transpose_partial(w_grad)
        else:
            grads["head"] = w_grad
        dxf = yield from self.reduce(ops.matmul(dlogits, ops.transpose(hc["w"]), partial=True))
        dx, grads["lnf.g"], grads["lnf.b"] = ops.layer_norm_backward(dxf, hc["x_final"], p["lnf.g"], hc["muf"],
                                                                      hc["rf"])
        return dx

    def block_backward(self, p: dict[str, Any], dx2: Any, c: dict[str, Any], i: int, grads: dict[str, Any],
                       step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops, m, pre = self.ops, self.m, f"layers.{i}."
        policy = m.recompute.value
        if policy == "full":  # the block again, collectives included
            with self.ctx.annotate("recompute", f"R{i}"):
                _, c = yield from self.block_full(p, c["x"], i, step, where)
        elif policy == "selective":
            with self.ctx.annotate("recompute", f"R{i}"):
                c = c | self.core(c["q"], c["k"], c["v"], i, step, where)
        dz_mine = self.drop(dx2, c["keep_m"])
        grads[pre + "mlp.b_out"] = ops.sum(dz_mine, (0, 1), partial=True)
        dz = yield from self.gather(dz_mine)  # g-bar backward: the whole sequence again
        grads[pre + "mlp.w_out"] = ops.einsum("bsf,bsh->fh", c["g"], dz, partial=True)
        df = ops.gelu_backward(ops.matmul(dz, ops.transpose(p[pre + "mlp.w_out"])), c["f"])  # (b, s, F/t)
        grads[pre + "mlp.w_fc"] = ops.einsum("bsh,bsf->hf", c["c"], df, partial=True)
        grads[pre + "mlp.b_fc"] = ops.sum(df, (0, 1), partial=True)
        dc = yield from self.reduce(ops.matmul(df, ops.transpose(p[pre + "mlp.w_fc"]), partial=True))  # f backward
        dx1_ln, grads[pre + "ln2.g"], grads[pre + "ln2.b"] = ops.layer_norm_backward(
            dc, c["x1"], p[pre + "ln2.g"], c["mu2"], c["r2"])
        dx1 = ops.add(dx2, dx1_ln)
        dy_mine = self.drop(dx1, c["keep_a"])
        grads[pre + "attn.b_proj"] = ops.sum(dy_mine, (0, 1), partial=True)
        dy = yield from self.gather(dy_mine)
        grads[pre + "attn.w_proj"] = ops.einsum("bsh,bsk->hk", c["ctx"], dy, partial=True)
        dout = self.gpt._heads(ops.matmul(dy, ops.transpose(p[pre + "attn.w_proj"])))
        dq, dk, dv = self.gpt.attention_backward(dout, c)
        dqkv = ops.concat([self.gpt._merge(dq), self.gpt._merge(dk), self.gpt._merge(dv)], -1)  # (b, s, 3h/t)
        grads[pre + "attn.w_qkv"] = ops.einsum("bsh,bsk->hk", c["a"], dqkv, partial=True)
        grads[pre + "attn.b_qkv"] = ops.sum(dqkv, (0, 1), partial=True)
        da = yield from self.reduce(ops.matmul(dqkv, ops.transpose(p[pre + "attn.w_qkv"]), partial=True))
        dx_ln, grads[pre + "ln1.g"], grads[pre + "ln1.b"] = ops.layer_norm_backward(
            da, c["x"], p[pre + "ln1.g"], c["mu1"], c["r1"])
        return ops.add(dx1, dx_ln)

    def embed_backward(self, ec: dict[str, Any], dx: Any, grads: dict[str, Any]) -> Generator[Any, Any, None]:
        ops = self.ops
        dx = self.drop(dx, ec["keep0"])
        if self.sp:  # my positions' rows of the position table; the rest are another rank's
            pos = np.broadcast_to(np.arange(self.r * self.seq, (self.r + 1) * self.seq), dx.shape[:2])
            grads["wpe"] = ops.embedding_backward(pos, dx, self.m.seq)
            dx = yield self.ctx.comm.all_gather(dx, group=self.tp, dim=1)  # the lookup needs every token
        else:
            grads["wpe"] = ops.sum(dx, 0, partial=True)
        rows = ops.embedding_backward(ec["ids"], dx, self.vocab, row_offset=self.r * self.vocab)
        grads["wte"] = rows if "wte" not in grads else ops.add_partial(rows, grads["wte"])


def megatron(ctx: Context, cfg: TPConfig) -> Generator[Any, Any, dict[str, Any]]:
    ops, tp, dp = ctx.ops, ctx.mesh.tp, ctx.mesh.dp
    t, r, d, n = tp.size, ctx.mesh.coord("tp"), ctx.mesh.coord("dp"), dp.size
    data, mcfg = cfg.data, cfg.data.model
    cfg.check(t)
    data.check(n)
    model = TPModel(ctx, cfg)
    master = {k: shard(v, shard_kind(k), t, r) for k, v in init_params(ops, mcfg).items()}
    local = sum(math.prod(v.shape) for v in master.values())
    state, sizes = hold_model_state(ctx, master, local, data.precision)
    scale = LOSS_SCALE[data.precision]
    losses, grads = [], {}
    for step in range(data.steps):
        weights = begin_step(ctx, master, sizes, data.precision)
        acc: dict[str, Any] = {}
        loss_sum = None
        for j in range(data.micro_batches):
            where, ids, targets = data.micro_batch(step, d, n, j)
            with ctx.annotate("forward", f"F{j}"):
                x, ec = yield from model.embed(weights, ids, step, where)
                caches = []
                for i in range(mcfg.layers):
                    x, c = yield from model.block(weights, x, i, step, where)
                    caches.append(c)
                    ctx.memory.hold("activations", f"mb{j}.block{i}", model.held(x))
                part, hc = yield from model.head(weights, x, targets)
            loss_sum = part if loss_sum is None else ops.add_partial(loss_sum, part)
            g: dict[str, Any] = {}
            with ctx.annotate("backward", f"B{j}"):
                dx = yield from model.head_backward(weights, hc, where.total * mcfg.seq, scale, g)
                for i in reversed(range(mcfg.layers)):
                    dx = yield from model.block_backward(weights, dx, caches[i], i, g, step, where)
                    ctx.memory.release("activations", f"mb{j}.block{i}")
                yield from model.embed_backward(ec, dx, g)
            if model.sp:  # norms, replicated biases and positions saw only this rank's tokens
                names = [k for k in g if k == "wpe" or shard_kind(k) == "replicated"]
                summed = yield [ctx.comm.all_reduce(g[k], group=tp, async_op=True) for k in names]
                g |= dict(zip(names, summed))
            for k, v in g.items():
                acc[k] = v if k not in acc else ops.add_partial(acc[k], v)
        master, grads, loss = yield from finish_step(ctx, master, acc, state, data, dp, step, loss_sum)
        losses.append(loss)
    return {"loss": losses, "params": master, "grads": grads, "adam_m": state.m, "adam_v": state.v}


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]]) -> dict[str, Any]:
    """The single-device view: shards joined over tp; replicas (tp for replicated tensors, and dp)
    must agree, a differing replica being reported as its own output."""
    by = {(c["dp"], c["tp"]): res for res, c in zip(results, coords)}
    dp = max(c["dp"] for c in coords) + 1
    tp = max(c["tp"] for c in coords) + 1
    out: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(by[0, 0]["loss"])}
    for kind in ("params", "grads", "adam_m", "adam_v"):
        for name in by[0, 0][kind]:
            k = shard_kind(name)
            for d in range(dp):
                parts = [np.asarray(by[d, t][kind][name]) for t in range(tp)]
                full = unshard(parts, k)
                key = f"{kind}.{name}"
                if d == 0:
                    out[key] = full
                elif full.tobytes() != out[key].tobytes():
                    out[f"{key}@dp{d}"] = full
                if k == "replicated":
                    for t in range(1, tp):
                        if parts[t].tobytes() != parts[0].tobytes():
                            out[f"{key}@dp{d}tp{t}"] = parts[t]
    return out
