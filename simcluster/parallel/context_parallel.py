"""Sequence (context) parallelism for the GPT on the cp axis, inside data parallelism.

Every rank holds all weights and s/P consecutive tokens of every sequence. Everything but attention
works token by token, so it runs locally; the weight gradients are partial sums over this rank's
tokens, summed over cp (and dp) like data parallelism's. Attention needs every token of a sequence:
`attention = "ulysses"` re-shards it by heads with all-to-alls (ulysses.py); "ring" passes keys and
values around a ring, "allgather" gathers them (ring_attention.py).

Per step: 1. forward and backward of each micro-batch on this rank's tokens; 2. gradients summed over
cp and dp, rounded once; 3. AdamW (the same update on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generator

import numpy as np

from simcluster.model.gpt import GPT, LOSS_SCALE, Slice, init_params
from types import SimpleNamespace

from simcluster.parallel import ring_attention, ulysses
from simcluster.parallel.data_parallel import DPConfig, begin_step, finish_step, hold_model_state
from simcluster.program.context import Context

ATTENTION = {
    "ulysses": ulysses,
    "ring": ring_attention,
    "allgather": SimpleNamespace(forward=ring_attention.allgather_forward, backward=ring_attention.allgather_backward),
}


@dataclass(frozen=True)
class CPConfig:
    data: DPConfig = field(default_factory=DPConfig)
    attention: str = "ulysses"  # "ulysses", "ring" or "allgather"

    @property
    def zigzag(self) -> bool:
        """Ring and all-gather attention balance causal work with the zigzag layout."""
        return self.attention != "ulysses" and self.data.model.causal

    def check(self, cp: int) -> None:
        m = self.data.model
        if self.attention not in ATTENTION:
            raise ValueError(f"attention {self.attention!r} is not valid; valid: {', '.join(ATTENTION)}")
        if self.zigzag and m.seq % (2 * cp):
            valid = [d for d in range(1, m.seq + 1) if m.seq % (2 * d) == 0]
            raise ValueError(f"causal {self.attention} attention uses the zigzag layout: seq={m.seq} must be "
                             f"divisible by 2 x cp = {2 * cp}; valid degrees: {', '.join(map(str, valid))}")
        if m.seq % cp:
            valid = [d for d in range(1, m.seq + 1) if m.seq % d == 0]
            raise ValueError(f"context-parallel degree {cp} must divide seq={m.seq}; valid degrees: "
                             f"{', '.join(map(str, valid))}")
        if self.attention == "ulysses" and m.heads % cp:
            valid = [d for d in range(1, m.heads + 1) if m.heads % d == 0]
            raise ValueError(f"ulysses degree {cp} must divide heads={m.heads}; valid degrees: "
                             f"{', '.join(map(str, valid))}")


def layout(seq: int, P: int, r: int, zigzag: bool) -> np.ndarray:
    """The positions of a sequence that rank r holds: a contiguous s/P, or with zigzag (for causal
    attention, so that every rank has as much work) chunks r and 2P-1-r of 2P chunks."""
    if not zigzag:
        n = seq // P
        return np.arange(r * n, (r + 1) * n)
    n = seq // (2 * P)
    return np.concatenate([np.arange(r * n, (r + 1) * n), np.arange((2 * P - 1 - r) * n, (2 * P - r) * n)])


def runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous runs of positions as (start, length)."""
    out: list[tuple[int, int]] = []
    for p in positions.tolist():
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class CPModel:
    def __init__(self, ctx: Context, cfg: CPConfig) -> None:
        self.ctx, self.ops, self.cfg, self.m = ctx, ctx.ops, cfg, cfg.data.model
        self.cp = ctx.mesh.cp
        self.P, self.r = self.cp.size, ctx.mesh.coord("cp")
        self.seq = self.m.seq // self.P  # tokens of a sequence on this rank
        self.gpt = GPT(ctx.ops, self.m, memory=ctx.memory)
        self.attention = ATTENTION[cfg.attention]
        self.zigzag = cfg.zigzag
        self.positions = layout(self.m.seq, self.P, self.r, self.zigzag)
        self._keep_all = False

    def keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice, axis: int, offset: int,
             size: int) -> Any:
        """The slice of the single-device dropout mask this rank's tensor covers (sharded on `axis`)."""
        if self.m.dropout == 0.0:
            return None
        full = [where.total] + list(shape[1:])
        off = [where.offset] + [0] * (len(shape) - 1)
        full[axis], off[axis] = size, offset
        return self.ops.dropout_keep(self.m.seed + 7919 * step, name, shape, self.m.dropout, offset=tuple(off),
                                     full_shape=tuple(full))

    def token_keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice) -> Any:
        """The dropout mask of this rank's tokens (b, s/P, ...), run by run of positions."""
        if self.m.dropout == 0.0:
            return None
        parts = [self.keep(name, (shape[0], n) + tuple(shape[2:]), step, where, 1, start, self.m.seq)
                 for start, n in runs(self.positions)]
        return parts[0] if len(parts) == 1 else self.ops.concat(parts, 1)

    def block_keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice, rows: np.ndarray,
                   cols: np.ndarray) -> Any:
        """The attention-dropout mask (b, a, rows, cols) for query positions `rows`, key positions `cols`."""
        if self.m.dropout == 0.0:
            return None
        b, a = shape[0], shape[1]
        full = (where.total, self.m.heads, self.m.seq, self.m.seq)
        seed = self.m.seed + 7919 * step
        grid = [[self.ops.dropout_keep(seed, name, (b, a, nr, nc), self.m.dropout, offset=(where.offset, 0, r0, c0),
                                       full_shape=full) for c0, nc in runs(cols)] for r0, nr in runs(rows)]
        rows_ = [row[0] if len(row) == 1 else self.ops.concat(row, 3) for row in grid]
        return rows_[0] if len(rows_) == 1 else self.ops.concat(rows_, 2)

    def allowed(self, rows: np.ndarray, cols: np.ndarray) -> Any:
        """Causal mask between query and key positions (None: everything allowed)."""
        if not self.m.causal or self.ops.mode.value == "meta":
            return None
        return rows[:, None] >= cols[None, :]

    def drop(self, x: Any, keep: Any) -> Any:
        return x if keep is None else self.ops.scale(self.ops.zero_where(keep, x), 1.0 / (1.0 - self.m.dropout))

    def core(self, q: Any, k: Any, v: Any, layer: int, step: int, where: Slice) -> dict[str, Any]:
        """The attention core on head-sharded, full-sequence q, k, v (b, a/P, s, d)."""
        ops, m = self.ops, self.m
        s = ops.attention_scores(q, k, 1.0 / np.sqrt(m.head_dim), self.gpt._allowed(q.shape[2]))
        e = ops.attention_weights(s, ops.max(s, -1))
        l_sum = ops.sum(e, -1, partial=True)
        heads = q.shape[1]
        keep = self.keep(f"attn.{layer}", tuple(e.shape), step, where, 1, self.r * heads, m.heads)
        ek = e if keep is None else ops.zero_where(keep, e)
        out = ops.attention_output(ops.einsum("bask,bakd->basd", ek, v, partial=True), l_sum, q.dtype,
                                   1.0 / (1.0 - m.dropout))
        return {"e": e, "l": l_sum, "keep": keep, "out": out}

    def block(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops, m, gpt, pre = self.ops, self.m, self.gpt, f"layers.{i}."
        a, mu1, r1 = ops.layer_norm(x, p[pre + "ln1.g"], p[pre + "ln1.b"], m.eps)
        qkv = ops.add(ops.matmul(a, p[pre + "attn.w_qkv"]), p[pre + "attn.b_qkv"])  # (b, s/P, 3h)
        q, k, v = (gpt._heads(t) for t in gpt._split3(qkv))  # (b, a, s/P, d)
        out, core = yield from self.attention.forward(self, q, k, v, i, step, where)
        ctx_ = gpt._merge(out)
        y = ops.add(ops.matmul(ctx_, p[pre + "attn.w_proj"]), p[pre + "attn.b_proj"])
        keep_a = self.token_keep(f"resid_attn.{i}", tuple(y.shape), step, where)
        x1 = ops.add(x, self.drop(y, keep_a))
        c, mu2, r2 = ops.layer_norm(x1, p[pre + "ln2.g"], p[pre + "ln2.b"], m.eps)
        f = ops.add(ops.matmul(c, p[pre + "mlp.w_fc"]), p[pre + "mlp.b_fc"])
        g = ops.gelu(f)
        z = ops.add(ops.matmul(g, p[pre + "mlp.w_out"]), p[pre + "mlp.b_out"])
        keep_m = self.token_keep(f"resid_mlp.{i}", tuple(z.shape), step, where)
        x2 = ops.add(x1, self.drop(z, keep_m))
        cache = {"x": x, "a": a, "mu1": mu1, "r1": r1, "q": q, "k": k, "v": v, "core": core, "ctx": ctx_,
                 "keep_a": keep_a, "x1": x1, "c": c, "mu2": mu2, "r2": r2, "f": f, "g": g, "keep_m": keep_m}
        policy = m.recompute.value
        if policy == "full" and not self._keep_all:
            return x2, {"x": x}
        if policy == "selective" and not self._keep_all:
            return x2, {k: v for k, v in cache.items() if k != "core"}
        return x2, cache

    def held(self, x: Any) -> int:
        """Bytes a block keeps on this rank: sequence-sharded like TP+SP of degree P (model/activations.py)."""
        from simcluster.model.activations import layer_bytes

        return layer_bytes(s=self.m.seq, b=x.shape[0], h=self.m.hidden, a=self.m.heads, t=self.P, sp=True,
                           recompute=self.m.recompute.value, dtype=self.m.dtype)

    def block_backward(self, p: dict[str, Any], dx2: Any, c: dict[str, Any], i: int, grads: dict[str, Any],
                       step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops, gpt, pre = self.ops, self.gpt, f"layers.{i}."
        policy = self.m.recompute.value
        if policy == "full":  # the block again, its attention communication included
            with self.ctx.annotate("recompute", f"R{i}"):
                self._keep_all = True
                try:
                    _, c = yield from self.block(p, c["x"], i, step, where)
                finally:
                    self._keep_all = False
        elif policy == "selective":
            with self.ctx.annotate("recompute", f"R{i}"):
                _, core = yield from self.attention.forward(self, c["q"], c["k"], c["v"], i, step, where)
                c = c | {"core": core}
        dz = self.drop(dx2, c["keep_m"])
        grads[pre + "mlp.w_out"] = ops.einsum("bsf,bsh->fh", c["g"], dz, partial=True)
        grads[pre + "mlp.b_out"] = ops.sum(dz, (0, 1), partial=True)
        df = ops.gelu_backward(ops.matmul(dz, ops.transpose(p[pre + "mlp.w_out"])), c["f"])
        grads[pre + "mlp.w_fc"] = ops.einsum("bsh,bsf->hf", c["c"], df, partial=True)
        grads[pre + "mlp.b_fc"] = ops.sum(df, (0, 1), partial=True)
        dc = ops.matmul(df, ops.transpose(p[pre + "mlp.w_fc"]))
        dx1_ln, grads[pre + "ln2.g"], grads[pre + "ln2.b"] = ops.layer_norm_backward(
            dc, c["x1"], p[pre + "ln2.g"], c["mu2"], c["r2"])
        dx1 = ops.add(dx2, dx1_ln)
        dy = self.drop(dx1, c["keep_a"])
        grads[pre + "attn.w_proj"] = ops.einsum("bsh,bsk->hk", c["ctx"], dy, partial=True)
        grads[pre + "attn.b_proj"] = ops.sum(dy, (0, 1), partial=True)
        dout = gpt._heads(ops.matmul(dy, ops.transpose(p[pre + "attn.w_proj"])))  # (b, a, s/P, d)
        dq, dk, dv = yield from self.attention.backward(self, dout, c["core"])
        dqkv = ops.concat([gpt._merge(dq), gpt._merge(dk), gpt._merge(dv)], -1)
        grads[pre + "attn.w_qkv"] = ops.einsum("bsh,bsk->hk", c["a"], dqkv, partial=True)
        grads[pre + "attn.b_qkv"] = ops.sum(dqkv, (0, 1), partial=True)
        da = ops.matmul(dqkv, ops.transpose(p[pre + "attn.w_qkv"]))
        dx_ln, grads[pre + "ln1.g"], grads[pre + "ln1.b"] = ops.layer_norm_backward(
            da, c["x"], p[pre + "ln1.g"], c["mu1"], c["r1"])
        return ops.add(dx1, dx_ln)

    def step(self, weights: dict[str, Any], step: int, d: int, n: int, j: int,
             grads: dict[str, Any]) -> Generator[Any, Any, Any]:
        """One micro-batch on this rank's tokens: the loss's partial sum; gradients added to `grads`."""
        ops, m, gpt, data = self.ops, self.m, self.gpt, self.cfg.data
        where, ids, targets = data.micro_batch(step, d, n, j)
        ids, targets = ids[:, self.positions], targets[:, self.positions]
        pos = np.broadcast_to(self.positions, ids.shape)
        with self.ctx.annotate("forward", f"F{j}"):
            x = ops.add(ops.embedding(ids, weights["wte"]), ops.embedding(pos, weights["wpe"]))
            keep0 = self.token_keep("embed", tuple(x.shape), step, where)
            x = self.drop(x, keep0)
            caches = []
            for i in range(m.layers):
                x, c = yield from self.block(weights, x, i, step, where)
                caches.append(c)
                self.ctx.memory.hold("activations", f"mb{j}.block{i}", self.held(x))
            loss_sum, hc = gpt.head_forward(weights, x, targets)
        g: dict[str, Any] = {}
        with self.ctx.annotate("backward", f"B{j}"):
            dx, head = gpt.head_backward(weights, hc, where, LOSS_SCALE[data.precision])
            head_wte = head.pop("wte", None)
            g |= head
            for i in reversed(range(m.layers)):
                dx = yield from self.block_backward(weights, dx, caches[i], i, g, step, where)
                self.ctx.memory.release("activations", f"mb{j}.block{i}")
            dx = self.drop(dx, keep0)
            g["wpe"] = ops.embedding_backward(pos, dx, m.seq)
            g["wte"] = ops.embedding_backward(ids, dx, m.vocab)
            if head_wte is not None:
                g["wte"] = ops.add_partial(g["wte"], head_wte)
        for k, v in g.items():
            grads[k] = v if k not in grads else ops.add_partial(grads[k], v)
        return loss_sum, where


def context_parallel(ctx: Context, cfg: CPConfig) -> Generator[Any, Any, dict[str, Any]]:
    ops, cp, dp = ctx.ops, ctx.mesh.cp, ctx.mesh.dp
    d, n = ctx.mesh.coord("dp"), dp.size
    data, mcfg = cfg.data, cfg.data.model
    cfg.check(cp.size)
    data.check(n)
    model = CPModel(ctx, cfg)
    master = init_params(ops, mcfg)
    state, sizes = hold_model_state(ctx, master, mcfg.parameters, data.precision)
    both = ctx.mesh.group("dp", "cp")  # every rank that saw some of the batch's tokens
    losses, grads = [], {}
    for step in range(data.steps):
        weights = begin_step(ctx, master, sizes, data.precision)
        acc: dict[str, Any] = {}
        loss_sum = None
        for j in range(data.micro_batches):
            part, _ = yield from model.step(weights, step, d, n, j, acc)
            loss_sum = part if loss_sum is None else ops.add_partial(loss_sum, part)
        master, grads, loss = yield from finish_step(ctx, master, acc, state, data, both, step, loss_sum)
        losses.append(loss)
    return {"loss": losses, "params": master, "grads": grads, "adam_m": state.m, "adam_v": state.v}


def assemble(results: list[dict[str, Any]], coords: list[dict[str, int]]) -> dict[str, Any]:
    """Every rank holds everything: rank 0's view, and any rank that differs reported as its own output."""
    out: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(results[0]["loss"])}
    for kind in ("params", "grads", "adam_m", "adam_v"):
        for name, value in results[0][kind].items():
            out[f"{kind}.{name}"] = value
            for rank in range(1, len(results)):
                other = results[rank][kind][name]
                if np.asarray(other).tobytes() != np.asarray(value).tobytes():
                    out[f"{kind}.{name}@rank{rank}"] = other
    return out
