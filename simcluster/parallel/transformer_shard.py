"""A transformer on one rank of a (pp, cp, tp) layout: one block definition that knows its mesh axes (the
GPT's; llama_shard.py changes what the Llama changes).

The same pieces as the single-device model (model/gpt.py), split the way the parallelism (parallelism.py) says:
  tp  attention by heads and the MLP by its inner dimension: QKV and the first MLP layer column
      parallel, the output projections row parallel, with the paper's operators
        f: identity forward, all-reduce of the input gradient backward (before a column-parallel layer),
        g: all-reduce of the partial output forward, identity backward (after a row-parallel layer);
      the embedding and the LM head by vocabulary rows (the cross-entropy all-reduces the row
      maximum, the sum of exponentials and the target logit; full logits never exist on one rank).
      With sequence parallelism `g` is a reduce-scatter to this rank's tokens and `f` an all-gather of
      the sequence, and norms, dropout and residuals run on a rank's tokens only;
  cp  every rank holds s/cp tokens of each sequence (zigzag for causal ring or all-gather attention);
      attention exchanges them as its module says (ulysses.py, ring_attention.py, allgather_attention.py,
      rsa.py: one interface, forward and backward); everything else is per token.
A rank's residual stream holds the positions `tokens`: its cp share, and with SP its tp share of that.

Every forward piece returns what its backward needs; the recomputation policy decides what is kept
("selective" drops the attention core, "full" keeps the block's input and runs the block again,
collectives included). All partial sums are exact, so any layout gives the single-device bytes.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Any, ContextManager, Generator

import numpy as np

from simcluster.model import flash, fusion
from simcluster.model.activations import MLP_KIND, layer_activations, moe_activations
from simcluster.model.gpt import GPT, Slice, narrow_logits, wide_logits
from simcluster.numerics.tensor import ITEMSIZE, logical_dtype, nbytes
from simcluster.parallel import allgather_attention, local_attention, ring_attention, rsa, tensor_parallel, ulysses
from simcluster.parallel.moe_shard import Experts
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.positions import layout, runs
from simcluster.program.context import Context

ATTENTION = {
    "ulysses": ulysses,
    "ring": ring_attention,
    "allgather": allgather_attention,
    "rsa": rsa,
}


def weight_gradients(grads: dict[str, Any], defer: list | None) -> Any:
    """Where a linear layer's weight gradient goes: computed now into `grads`, or, with `defer` (ZB-H1
    splits the weight gradients off the backward pass), kept there as a thunk for the W pass."""
    def put(name: str, thunk: Any) -> None:
        if defer is None:
            grads[name] = thunk()
        else:
            defer.append((name, thunk))
    return put


class TransformerShard(Experts):
    """Embedding, blocks and head on one rank; forward and backward are generators (they communicate).
    `cp`, `P`, `r`, `positions`, `zigzag`, `core`, `block_keep`, `allowed` are what the attention
    modules (local_attention.py, ulysses.py, ring_attention.py, allgather_attention.py, rsa.py) use."""

    learned_positions = True  # a position table (wpe) added to the token embedding

    def __init__(self, ctx: Context, parallelism: Parallelism) -> None:
        m = parallelism.model
        self.ctx, self.ops, self.m = ctx, ctx.ops, m
        self.tp, self.cp = ctx.mesh.tp, ctx.mesh.cp
        self.t, self.tr = self.tp.size, ctx.mesh.coord("tp")
        self.P, self.r = self.cp.size, ctx.mesh.coord("cp")
        self.sp = parallelism.sp and self.t > 1
        self.overlap = self.sp and parallelism.tp_comm_overlap  # tensor_parallel.py's pieces under the GEMMs
        # Megatron-LM's column-parallel backward (tensor_parallel.reduce_under); torch's async TP, the overlap
        # without it, leaves a reduce-scatter of summed GEMMs where it falls
        self.async_backward = parallelism.tp_async_backward
        self.heads, self.vocab = m.heads // self.t, m.vocab // self.t  # this tp rank's share
        self.zigzag = parallelism.zigzag(self.P)
        self.positions = layout(m.seq, self.P, self.r, self.zigzag)  # what q, k and v cover: s/cp
        self.tokens = self.token_positions(ctx.rank)
        self.attention = ATTENTION[parallelism.attention] if self.P > 1 else local_attention
        self.keeps_scores = parallelism.attention == "rsa" and self.P > 1  # whole score rows, whatever the kernel
        self.gpt = GPT(ctx.ops, m, memory=ctx.memory)  # its unsharded helpers
        self._keep_all = False
        self.init_experts(ctx, parallelism.data.precision, parallelism.dispatcher)  # a mixture of experts' part (moe_shard.py)

    def token_positions(self, rank: int) -> np.ndarray:
        """The positions of a sequence whose tokens `rank` holds in the residual stream: its cp share, and
        with sequence parallelism its tp part of that."""
        c = self.ctx.mesh.mesh.coords(rank)
        positions = layout(self.m.seq, self.P, c["cp"], self.zigzag)
        n = len(positions) // self.t if self.sp else len(positions)
        return positions[c["tp"] * n:(c["tp"] + 1) * n] if self.sp else positions

    # -- dropout masks: the slice of the single-device mask that this rank's tensor covers ----------
    def _mask(self, name: str, shape: tuple[int, ...], step: int, offset: tuple[int, ...],
              full: tuple[int, ...]) -> Any:
        return self.ops.dropout_keep(self.m.seed + 7919 * step, name, shape, self.m.dropout, offset=offset,
                                     full_shape=full)

    def token_keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice) -> Any:
        """For a residual-stream tensor (b, tokens, h), run by run of positions."""
        if self.m.dropout == 0.0:
            return None
        rest = tuple(shape[2:])
        parts = [self._mask(name, (shape[0], n) + rest, step, (where.offset, start) + (0,) * len(rest),
                            (where.total, self.m.seq) + rest) for start, n in runs(self.tokens)]
        return parts[0] if len(parts) == 1 else self.ops.concat(parts, 1)

    def block_keep(self, name: str, shape: tuple[int, ...], step: int, where: Slice, rows: np.ndarray,
                   cols: np.ndarray) -> Any:
        """For attention weights (b, a/tp, rows, cols): query positions `rows`, key positions `cols`."""
        if self.m.dropout == 0.0:
            return None
        b, a, h0 = shape[0], shape[1], self.tr * self.heads
        full = (where.total, self.m.heads, self.m.seq, self.m.seq)
        grid = [[self._mask(name, (b, a, nr, nc), step, (where.offset, h0, r0, c0), full) for c0, nc in runs(cols)]
                for r0, nr in runs(rows)]
        rows_ = [row[0] if len(row) == 1 else self.ops.concat(row, 3) for row in grid]
        return rows_[0] if len(rows_) == 1 else self.ops.concat(rows_, 2)

    def allowed(self, rows: np.ndarray, cols: np.ndarray) -> Any:
        """Causal mask between query and key positions (None: everything allowed)."""
        if not self.m.causal:
            return None
        return self.ops.causal(rows, cols)

    def drop(self, x: Any, keep: Any) -> Any:
        return x if keep is None else self.ops.scale(self.ops.zero_where(keep, x), 1.0 / (1.0 - self.m.dropout))

    def drop_grad(self, grad: Any, keep: Any) -> Any:
        """A gradient through dropout: the forward's mask, scaled (one kernel)."""
        if keep is None:
            return grad
        with fusion.dropout_backward(self.ops, self.m, grad):
            return self.drop(grad, keep)

    # -- the tensor-parallel operators (tensor_parallel.py) -------------------------------------------
    def reduce(self, partial: Any) -> Generator[Any, Any, Any]:
        return (yield from tensor_parallel.g(self.ctx, partial, self.tp, self.sp))

    def gather(self, x: Any) -> Generator[Any, Any, Any]:
        return (yield from tensor_parallel.gather(self.ctx, x, self.tp, self.sp))

    def gather_matmuls(self, x: Any, weights: list[Any], then: Any = None) -> Generator[Any, Any, Any]:
        """(the gathered input, its products with `weights`): f and the column-parallel GEMMs after it."""
        return (yield from tensor_parallel.gather_matmuls(self.ctx, x, weights, self.tp, self.sp, self.overlap, then))

    def matmul_reduce(self, x: Any, w: Any) -> Generator[Any, Any, Any]:
        """A row-parallel GEMM and g after it."""
        return (yield from tensor_parallel.matmul_reduce(self.ctx, x, w, self.tp, self.sp, self.overlap,
                                                         local_sum=not self.async_backward))

    def reduce_under(self, partial: Any, then: Any, mine: Any, kept: Any,
                     gemm: tuple[Any, Any] | None = None) -> Generator[Any, Any, Any]:
        """f backward of a column-parallel GEMM (`partial()`, its input gradient), its weight gradients
        (`then(input)`) beside it; `mine`, this rank's tokens of the input, `kept`, the input gathered.
        `gemm`, (x, w) where that gradient is one GEMM's, x @ w: with the overlap and without the async
        backward (torch's async TP), its reduce-scatter in pieces under it, as the forward's output
        projections' (torch's pattern matcher fuses a reduce-scatter of one GEMM's output, wherever it is)."""
        return (yield from tensor_parallel.reduce_under(self.ctx, partial, then, self.tp, self.sp, self.async_backward,
                                                        mine, kept, self.overlap, gemm))

    def tp_sum(self, x: Any, op: str = "sum") -> Generator[Any, Any, Any]:
        return (yield from tensor_parallel.tp_sum(self.ctx, x, self.tp, op))

    # -- attention over cp --------------------------------------------------------------------------
    def core(self, q: Any, k: Any, v: Any, layer: int, step: int, where: Slice) -> dict[str, Any]:
        """The two-pass core on full-sequence q, k, v (b, a', s, d): this tp rank's heads, or with
        ulysses this cp rank's share of them (k, v: their kv heads, expand_kv's). The kernel set's fused
        attention where it has one (gpt.py), given the kv heads as they are."""
        ops, m = self.ops, self.m
        fused = None if m.dropout else ops.fused_attention(q, k, v, causal=m.causal, scale=1.0 / math.sqrt(m.head_dim))
        if fused is not None:
            return {"out": fused[0], "flash": fused[1]}
        k, v = self.expand_kv(k), self.expand_kv(v)
        with flash.forward(ops, m, q, k):
            s = ops.attention_scores(q, k, 1.0 / math.sqrt(m.head_dim), self.gpt.causal_mask(q.shape[2]))
            with fusion.softmax(ops, m, s):
                e = ops.attention_weights(s, ops.max(s, -1))
                l_sum = ops.sum(e, -1, partial=True)
            keep, ek = None, e
            if m.dropout:
                h0 = self.tr * self.heads + self.r * q.shape[1]
                with fusion.dropout(ops, m, e):
                    keep = self._mask(f"attn.{layer}", tuple(e.shape), step, (where.offset, h0, 0, 0),
                                      (where.total, m.heads, m.seq, m.seq))
                    ek = ops.zero_where(keep, e)
            out = ops.attention_output(ops.einsum("bask,bakd->basd", ek, v, partial=True), l_sum, q.dtype,
                                       1.0 / (1.0 - m.dropout))
        return {"e": e, "l": l_sum, "keep": keep, "out": out}

    folds = False  # grouped-query attention's kv heads taken as they are (llama_shard.py, model.gqa = "native")

    def expand_kv(self, x: Any) -> Any:
        """Key/value heads as the query heads see them (the identity here: one each)."""
        return x

    def fold_kv(self, p: Any) -> Any:
        """A key/value gradient's partial sums added over each kv head's query heads (here p: one each)."""
        return p

    def attend(self, q: Any, k: Any, v: Any, i: int, step: int, where: Slice) -> Generator[Any, Any, Any]:
        """(b, a/tp, s/cp, d) in and out; and what the backward pass needs."""
        return (yield from self.attention.forward(self, q, k, v, i, step, where))

    def attend_backward(self, dout: Any, core: dict[str, Any]) -> Generator[Any, Any, Any]:
        return (yield from self.attention.backward(self, dout, core))

    # -- forward ------------------------------------------------------------------------------------
    def embed(self, p: dict[str, Any], ids: Any, step: int, where: Slice) -> Generator[Any, Any, Any]:
        """ids (b, s/cp) -> x (b, tokens, h)."""
        ops = self.ops
        mine = ops.embedding(ids, p["wte"], row_offset=self.tr * self.vocab)  # zero outside my vocabulary rows
        if self.sp:  # one owner per row, zeros elsewhere: the sum is exact in any order
            x = yield self.ctx.comm.reduce_scatter(mine, group=self.tp, dim=1)
        else:
            x = yield from self.tp_sum(mine)
        if self.learned_positions:
            x = ops.add(x, ops.embedding(ops.positions(self.tokens, ids.shape[0]), p["wpe"]))
        keep0 = None
        if self.m.dropout:
            with fusion.dropout(ops, self.m, x):
                keep0 = self.token_keep("embed", tuple(x.shape), step, where)
                x = self.drop(x, keep0)
        return x, {"ids": ids, "keep0": keep0}

    def block(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice) -> Generator[Any, Any, Any]:
        ops, m, gpt, pre = self.ops, self.m, self.gpt, f"layers.{i}."
        a_mine, mu1, r1 = ops.layer_norm(x, p[pre + "ln1.g"], p[pre + "ln1.b"], m.eps)
        a, (qkv,) = yield from self.gather_matmuls(a_mine, [p[pre + "attn.w_qkv"]])  # (b, s/cp, h), (b, s/cp, 3h/tp)
        qkv = fusion.bias(ops, m, qkv, p[pre + "attn.b_qkv"])
        q, k, v = (gpt.split_heads(z) for z in gpt.split_qkv(qkv))  # (b, a/tp, s/cp, d)
        out, core = yield from self.attend(q, k, v, i, step, where)
        ctx_ = gpt.merge_heads(out)  # (b, s/cp, h/tp)
        y = yield from self.matmul_reduce(ctx_, p[pre + "attn.w_proj"])  # row parallel, g
        with fusion.residual_mask(ops, m):
            keep_a = self.token_keep(f"resid_attn.{i}", tuple(y.shape), step, where)  # (b, tokens, h)
        x1 = fusion.bias_dropout_add(ops, m, y, p[pre + "attn.b_proj"], x, lambda z: self.drop(z, keep_a))
        c_mine, mu2, r2 = ops.layer_norm(x1, p[pre + "ln2.g"], p[pre + "ln2.b"], m.eps)
        if m.is_moe(i):  # each tp rank routes its own tokens through GELU experts (no biases: Megatron-Core's)
            c = c_mine
            z, mlp = yield from self.moe_forward(p, c, i, step, where.total, self._keep_all)
            with fusion.residual_mask(ops, m):
                keep_m = self.token_keep(f"resid_mlp.{i}", tuple(z.shape), step, where)
            x2 = ops.add(x1, self.drop(z, keep_m))
        else:
            c, (fc,) = yield from self.gather_matmuls(c_mine, [p[pre + "mlp.w_fc"]])
            f, g = fusion.bias_gelu(ops, m, fc, p[pre + "mlp.b_fc"])  # (b, s/cp, F/tp)
            z = yield from self.matmul_reduce(g, p[pre + "mlp.w_out"])
            with fusion.residual_mask(ops, m):
                keep_m = self.token_keep(f"resid_mlp.{i}", tuple(z.shape), step, where)
            x2 = fusion.bias_dropout_add(ops, m, z, p[pre + "mlp.b_out"], x1, lambda z: self.drop(z, keep_m))
            mlp = {"f": f, "g": g}
        cache = {"x": x, "a": a, "a_mine": a_mine, "mu1": mu1, "r1": r1, "q": q, "k": k, "v": v, "core": core,
                 "ctx": ctx_, "keep_a": keep_a, "x1": x1, "c": c, "c_mine": c_mine, "mu2": mu2, "r2": r2,
                 "keep_m": keep_m, **mlp}
        policy = m.recompute.value
        if policy == "full" and not self._keep_all:
            return x2, {"x": x}
        if policy == "selective" and not self._keep_all:
            return x2, {k: v for k, v in cache.items() if k != "core"}
        return x2, cache

    def held(self, x: Any, layer: int = 0) -> int:
        """Bytes block `layer` keeps on this rank (model/activations.py): TP (and SP) shrink what they
        split, and cp splits everything (every rank keeps its tokens' share, scores included; RSA
        keeps its rows of the scores whatever the model's attention kernel)."""
        kernel = "unfused" if self.keeps_scores else self.m.attention_kernel
        kept = layer_activations(s=self.m.seq, b=x.shape[0], h=self.m.hidden, a=self.m.heads, t=self.t, sp=self.sp,
                                 recompute=self.m.recompute.value, dtype=self.m.dtype, attention_kernel=kernel,
                                 kv=self.m.kv_heads, f=self.m.ffn_hidden, mlp=MLP_KIND[self.m.arch],
                                 fused=self.m.fused_kernels, gqa=self.m.gqa, dropout=self.m.dropout > 0)
        if self.keeps_scores and self.m.recompute.value == "op":  # (the per-op policy keeps the core: RSA's rows)
            core = layer_activations(s=self.m.seq, b=x.shape[0], h=self.m.hidden, a=self.m.heads, t=self.t,
                                     sp=self.sp, dtype=self.m.dtype, dropout=self.m.dropout > 0)
            kept |= {k: v for k, v in core.items() if k.startswith("softmax")}
        if self.m.is_moe(layer) and self.m.recompute.value != "full":
            kept = moe_activations(kept, self.m, b=x.shape[0], parts=self.t if self.sp else 1)
        return sum(kept.values()) // self.P

    def norm(self, x: Any, p: dict[str, Any], name: str) -> tuple[Any, tuple]:
        """The model's normalisation (layer norm) over the last dim: y and what its backward needs."""
        y, mean, rstd = self.ops.layer_norm(x, p[name + ".g"], p[name + ".b"], self.m.eps)
        return y, (mean, rstd)

    def norm_backward(self, dy: Any, x: Any, p: dict[str, Any], name: str, stats: tuple,
                      grads: dict[str, Any]) -> Any:
        dx, grads[name + ".g"], grads[name + ".b"] = self.ops.layer_norm_backward(dy, x, p[name + ".g"], *stats)
        return dx

    def head(self, p: dict[str, Any], x: Any, targets: Any) -> Generator[Any, Any, Any]:
        """Vocab-parallel cross-entropy: the loss's partial sum over these tokens (targets (b, s/cp))."""
        ops, m = self.ops, self.m
        xf_mine, stats = self.norm(x, p, "lnf")
        xf = yield from self.gather(xf_mine)
        w = ops.transpose(p["wte"]) if m.tied_head else p["head"]  # (h, V/tp)
        fused = m.loss_kernel == "fused"
        if not fused:
            self._working(xf, 13, "forward")  # fp32 logits; two fp32 steps to e at a time, and a boolean mask
        raw = ops.matmul(xf, w)  # (b, s/cp, V/tp)
        with self._pass("cross_entropy_max", raw):
            logits, low = wide_logits(ops, raw)  # fp32 for the cross-entropy
            local_max = ops.max(logits, -1)
        row_max = yield from self.tp_sum(local_max, "max")
        with self._pass("cross_entropy", raw):
            e = ops.attention_weights(logits, row_max)
            local_sum = ops.sum(e, -1, partial=True)
        sum_e = yield from self.tp_sum(local_sum)
        lse = ops.log_sum_exp(row_max, sum_e, logits.dtype)
        local = targets - self.tr * self.vocab
        mine = (local >= 0) & (local < self.vocab)
        picked = ops.zero_where(mine, ops.gather_last(logits, local * mine))  # (an index of 0 where not mine)
        picked = yield from self.tp_sum(picked)  # one owner, zeros elsewhere
        loss_sum = ops.sum(ops.sub(lse, picked), None, partial=True)
        if not fused:
            self.ctx.memory.release("temporaries", "cross-entropy forward")
        kept = {"raw": raw, "row_max": row_max} if fused else {"e": e}  # (a fused kernel's backward makes e again)
        return loss_sum, {"targets": local, "mine": mine, "x_final": x, "xf": xf, "stats": stats, **kept,
                          "sum_e": sum_e, "low": low}  # (not w: a weight, which the backward takes again, not an activation)

    # -- backward -----------------------------------------------------------------------------------
    def head_backward(self, p: dict[str, Any], hc: dict[str, Any], tokens: int, scale: float, grads: dict[str, Any],
                      defer: list | None = None) -> Generator[Any, Any, Any]:
        """dx into the last block; gradients into `grads` (a tied head's share of the embedding's as
        "wte"). With `defer`, an untied head's weight gradient waits for the W pass (ZB-H1)."""
        ops, m = self.ops, self.m
        raw = hc.pop("raw", None)  # (fused: the 16-bit logits, which its kernel reads again for e)
        # unfused, beside e: the softmax, then each result from the one before; fused, the gradient it writes
        self._working(hc["xf"], 4 if raw is None else ITEMSIZE[logical_dtype(raw)], "backward")
        # softmax - one_hot(targets) (their columns on this rank), scaled: two vocabulary-wide fp32 buffers at
        # a time (the exponentials are let go once the softmax has them)
        with self._pass("cross_entropy_backward", raw, writes=True):
            e = hc.pop("e") if raw is None else ops.attention_weights(wide_logits(ops, raw)[0], hc["row_max"])
            dlogits = ops.sub_one_hot(ops.attention_probs(e, hc["sum_e"]), hc["targets"] * hc["mine"], hc["mine"])
            dlogits = narrow_logits(ops, ops.scale(dlogits, scale / tokens), hc["low"])
        w_grad = lambda: ops.einsum("bsh,bsv->hv", hc["xf"], dlogits, partial=True)  # noqa: E731  (h, V/tp)
        if m.tied_head:
            grads["wte"] = ops.transpose_partial(w_grad())
        elif defer is not None:
            defer.append(("head", w_grad))
        else:
            grads["head"] = w_grad()
        w = ops.transpose(p["wte"]) if m.tied_head else p["head"]  # (h, V/tp)
        self.ctx.memory.release("temporaries", "cross-entropy backward")
        dxf = yield from self.reduce(ops.matmul(dlogits, ops.transpose(w), partial=True))
        return self.norm_backward(dxf, hc["x_final"], p, "lnf", hc["stats"], grads)

    def _pass(self, name: str, logits: Any, writes: bool = False) -> ContextManager:
        """model.loss_kernel = "fused" (given the logits as the head's GEMM wrote them): the enclosed ops as one
        kernel that reads them once, upcast on chip (and writes their gradient in their dtype); unfused, each op
        a kernel of its own."""
        if self.m.loss_kernel != "fused" or logits is None:
            return nullcontext()
        return self.ops.fused(name, nbytes=(2 if writes else 1) * nbytes(logits))

    def _working(self, xf: Any, per_logit: int, way: str) -> None:
        """The cross-entropy's vocabulary-wide buffers beyond the head's cache while it runs, in bytes a logit
        (the largest of a step's temporaries: on an H200 a 50K vocabulary's were 7 of a 1.2B GPT's 42 GiB)."""
        tokens = xf.shape[0] * xf.shape[1]
        self.ctx.memory.hold("temporaries", f"cross-entropy {way}", per_logit * tokens * self.vocab)

    def block_backward(self, p: dict[str, Any], dx2: Any, c: dict[str, Any], i: int, step: int, where: Slice,
                       grads: dict[str, Any], defer: list | None = None) -> Generator[Any, Any, Any]:
        """dx into the block; its gradients into `grads`, the linear layers' as thunks into `defer` if given."""
        ops, gpt, pre = self.ops, self.gpt, f"layers.{i}."
        weight_grad = weight_gradients(grads, defer)

        c = yield from self.recompute(p, c, i, step, where)
        dz_mine = self.drop_grad(dx2, c["keep_m"])
        if self.m.is_moe(i):  # this rank's tokens' (no gather)
            dc = yield from self.moe_backward(p, dz_mine, c, i, weight_grad)
        else:
            grads[pre + "mlp.b_out"] = ops.sum(dz_mine, (0, 1), partial=True)
            # g backward with SP: the whole sequence again
            _, (dg,) = yield from self.gather_matmuls(dz_mine, [ops.transpose(p[pre + "mlp.w_out"])], then=lambda dz: (
                weight_grad(pre + "mlp.w_out", lambda: ops.einsum("bsf,bsh->fh", c["g"], dz, partial=True))))
            df = ops.gelu_backward(dg, c["f"])  # (b, s/cp, F/tp)

            def fc_grads(whole: Any) -> None:
                weight_grad(pre + "mlp.w_fc", lambda: ops.einsum("bsh,bsf->hf", whole, df, partial=True))
                weight_grad(pre + "mlp.b_fc", lambda: ops.sum(df, (0, 1), partial=True))
            fc = (df, ops.transpose(p[pre + "mlp.w_fc"]))
            dc = yield from self.reduce_under(lambda: ops.matmul(*fc, partial=True), fc_grads, c["c_mine"], c["c"], fc)
        dx1_ln, grads[pre + "ln2.g"], grads[pre + "ln2.b"] = ops.layer_norm_backward(
            dc, c["x1"], p[pre + "ln2.g"], c["mu2"], c["r2"])
        dx1 = ops.add(dx2, dx1_ln)
        dy_mine = self.drop_grad(dx1, c["keep_a"])
        grads[pre + "attn.b_proj"] = ops.sum(dy_mine, (0, 1), partial=True)
        _, (dctx,) = yield from self.gather_matmuls(dy_mine, [ops.transpose(p[pre + "attn.w_proj"])], then=lambda dy: (
            weight_grad(pre + "attn.w_proj", lambda: ops.einsum("bsh,bsk->hk", c["ctx"], dy, partial=True))))
        dout = gpt.split_heads(dctx)  # (b, a/tp, s/cp, d)
        dq, dk, dv = yield from self.attend_backward(dout, c["core"])
        dqkv = ops.concat([gpt.merge_heads(dq), gpt.merge_heads(dk), gpt.merge_heads(dv)], -1)  # (b, s/cp, 3h/tp)

        def qkv_grads(whole: Any) -> None:
            weight_grad(pre + "attn.w_qkv", lambda: ops.einsum("bsh,bsk->hk", whole, dqkv, partial=True))
            weight_grad(pre + "attn.b_qkv", lambda: ops.sum(dqkv, (0, 1), partial=True))
        qkv = (dqkv, ops.transpose(p[pre + "attn.w_qkv"]))
        da = yield from self.reduce_under(lambda: ops.matmul(*qkv, partial=True), qkv_grads, c["a_mine"], c["a"], qkv)
        dx_ln, grads[pre + "ln1.g"], grads[pre + "ln1.b"] = ops.layer_norm_backward(
            da, c["x"], p[pre + "ln1.g"], c["mu1"], c["r1"])
        return ops.add(dx1, dx_ln)

    def recompute(self, p: dict[str, Any], c: dict[str, Any], i: int, step: int,
                  where: Slice) -> Generator[Any, Any, dict[str, Any]]:
        """What the recomputation policy dropped, again: the whole block (its collectives included), its
        attention core, or (per op) what the block's ops make but the forward did not keep."""
        policy = self.m.recompute.value
        if policy == "none":
            return c
        with self.ctx.annotate("recompute", f"R{i}"):
            if policy == "op":
                return (yield from self.block(p, c["x"], i, step, where, saved=c))[1]
            if policy == "full":
                self._keep_all = True
                try:
                    return (yield from self.block(p, c["x"], i, step, where))[1]
                finally:
                    self._keep_all = False
            _, core = yield from self.attend(c["q"], c["k"], c["v"], i, step, where)
            return c | {"core": core}

    def copy_gradients(self, hc: dict[str, Any], grads: dict[str, Any]) -> None:
        """On the head's stage, a tied head's copy of the embedding: the head gave wte its gradient; the
        positions' table gets none here (zeros, the first stage's are summed in)."""
        if self.learned_positions:
            x = hc["x_final"]
            grads["wpe"] = self.ops.embedding_backward(self.ops.positions(self.tokens, x.shape[0]),
                                                       self.ops.scale(x, 0.0), self.m.seq)

    def embed_backward(self, ec: dict[str, Any], dx: Any, grads: dict[str, Any]) -> Generator[Any, Any, None]:
        ops = self.ops
        dx = self.drop_grad(dx, ec["keep0"])
        if self.learned_positions:  # rows of my positions; zeros elsewhere
            grads["wpe"] = ops.embedding_backward(ops.positions(self.tokens, dx.shape[0]), dx, self.m.seq)
        dx = yield from self.gather(dx)  # the lookup needs every token of the cp share
        rows = ops.embedding_backward(ec["ids"], dx, self.vocab, row_offset=self.tr * self.vocab)
        grads["wte"] = rows if "wte" not in grads else ops.add_partial(rows, grads["wte"])
