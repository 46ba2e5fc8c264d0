"""The Llama-style model on one rank of a (pp, cp, tp) layout (Touvron et al. 2023; Llama 3, 2024).

What differs from the GPT (transformer_shard.py), piece by piece; the tp / sp / cp splits and the attention
over cp are the GPT's:
  - no position table and no biases; RMSNorm (Zhang & Sennrich 2019) instead of layer norm;
  - rotary position embedding (Su et al. 2021) on q and k at each token's global position (a cp rank
    rotates its own positions, zigzag included), in the rotate-half form q cos + rot(q) sin; the
    cos / sin table is computed once for the whole sequence, so every layout reads the same bits;
  - grouped-query attention (Ainslie et al. 2023): kv_heads key/value heads, each shared by
    heads/kv_heads query heads; tp splits the kv heads with their query heads; inside attention
    each kv head is repeated for its query heads (as Llama's reference code does) and the gradients
    of the repeats are summed exactly back onto it;
  - a SwiGLU MLP (Shazeer 2020): w2(silu(x w1) * (x w3)), w1 and w3 column parallel, w2 row parallel; or,
    after model.moe_first_dense layers, a mixture of SwiGLU experts (model/moe.py): each tp rank (with
    sequence parallelism) and each cp rank routes its own tokens through whole experts.
With tp = cp = pp = 1 this is the single-device model: the reference every layout is compared with,
itself checked against torch autograd.
"""

from __future__ import annotations

from typing import Any, Generator

import numpy as np

from simcluster.model import eager, fusion
from simcluster.model.gpt import Slice
from simcluster.numerics.ops import Mode
from simcluster.numerics.tensor import MetaTensor
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.transformer_shard import TransformerShard, weight_gradients
from simcluster.program.context import Context


def rope_table(seq: int, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (seq, head_dim), float64: angle p * theta^(-2i/d) for pair i, both halves alike."""
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angle = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    return np.tile(np.cos(angle), 2), np.tile(np.sin(angle), 2)


class LlamaShard(TransformerShard):
    learned_positions = False  # positions enter by rotating q and k
    def __init__(self, ctx: Context, parallelism: Parallelism) -> None:
        super().__init__(ctx, parallelism)
        m = self.m
        self.copies = max(1, self.t // m.kv_heads)  # tp ranks holding each kv head (Megatron replicates them)
        self.kv = max(1, m.kv_heads // self.t)  # this tp rank's key/value heads
        self.group = self.heads // self.kv  # this rank's query heads per kv head
        self.folds = m.gqa == "native" and self.group > 1  # kv heads as they are, into attention and out of it
        if self.ops.mode is Mode.META:  # (shapes only: no table the length of the sequence)
            self.cos = self.sin = MetaTensor((len(self.positions), m.head_dim), "fp64")
        else:
            cos, sin = rope_table(m.seq, m.head_dim, m.rope_theta)
            self.cos, self.sin = cos[self.positions], sin[self.positions]  # (s/cp, d): q and k's positions
        self._tables: dict[tuple[int, Any], Any] = {}  # (table, dtype) -> where the data lives, made once

    # -- pieces -------------------------------------------------------------------------------------
    def norm(self, x: Any, p: dict[str, Any], name: str) -> tuple[Any, tuple]:
        with eager.norm(self.ops, self.m, x):
            y, rstd = self.ops.rms_norm(x, p[name + ".g"], self.m.eps)
        return y, (rstd,)

    def norm_backward(self, dy: Any, x: Any, p: dict[str, Any], name: str, stats: tuple,
                      grads: dict[str, Any]) -> Any:
        with eager.norm(self.ops, self.m, x, backward=True):
            dx, grads[name + ".g"] = self.ops.rms_norm_backward(dy, x, p[name + ".g"], *stats)
        return dx

    def _table(self, t: np.ndarray, like: Any) -> Any:
        if self.ops.mode is Mode.META:
            return MetaTensor((1, 1) + t.shape, like.dtype)
        key = (id(t), like.dtype)
        if key not in self._tables:
            self._tables[key] = self.ops.constant(t, like.dtype)[None, None]
        return self._tables[key]

    def _rot(self, x: Any, sign: float) -> Any:
        """(x1, x2) -> (-x2, x1) (sign 1), or its transpose (x1, x2) -> (x2, -x1) (sign -1)."""
        half = x.shape[-1] // 2
        if self.ops.mode is Mode.META:
            lo = hi = MetaTensor(tuple(x.shape[:-1]) + (half,), x.dtype)
        else:
            lo, hi = x[..., :half], x[..., half:]
        if sign > 0:
            return self.ops.concat([self.ops.scale(hi, -1.0), lo], -1)
        return self.ops.concat([hi, self.ops.scale(lo, -1.0)], -1)

    def rope(self, x: Any) -> Any:
        """x (b, n, s/cp, d) rotated at its positions: x cos + rot(x) sin."""
        ops = self.ops
        with eager.rotary(ops, self.m, x):
            return ops.add(ops.mul(x, self._table(self.cos, x)), ops.mul(self._rot(x, 1.0), self._table(self.sin, x)))

    def rope_backward(self, dy: Any) -> Any:
        ops = self.ops
        with eager.rotary(ops, self.m, dy, backward=True):
            return ops.add(ops.mul(dy, self._table(self.cos, dy)),
                           self._rot(ops.mul(dy, self._table(self.sin, dy)), -1.0))

    def repeat(self, x: Any) -> Any:
        """(b, kv, s, d) -> (b, kv * group, s, d): each kv head for each of its query heads."""
        if self.group == 1:
            return x
        eager.repeat_kv(self.ops, self.m, x, self.group)
        return self.ops.repeat(x, self.group, 1)

    def expand_kv(self, x: Any) -> Any:
        """model.gqa = "native": each kv head for each of its query heads inside the attention kernel (which
        indexes it: no copy, no kernel); "repeat_kv": x, repeated before attention (`repeat`)."""
        return self.ops.repeat(x, self.group, 1) if self.folds else x

    def fold_kv(self, p: Any) -> Any:
        """model.gqa = "native": a key/value gradient's partial sums added over each kv head's query heads,
        unrounded, inside the kernel, before any exchange; the gradient is rounded once, after. "repeat_kv": p
        (`unrepeat` sums the repeats' rounded gradients)."""
        return self.ops.unrepeat_partial(p, self.group, 1) if self.folds else p

    def unrepeat(self, dx: Any) -> Generator[Any, Any, Any]:
        """The gradient of `repeat`: each kv head's repeats summed exactly, rounded once. A kv head that
        several tp ranks hold collects its query heads' gradients from all of them first."""
        if self.copies > 1:
            every = yield self.ctx.comm.all_gather(dx, group=self.tp, dim=1)  # (b, heads, s, d)
            first = self.tr // self.copies * self.copies * self.heads
            dx = (MetaTensor((dx.shape[0], self.copies * self.heads) + tuple(dx.shape[2:]), dx.dtype)
                  if self.ops.mode is Mode.META else every[:, first:first + self.copies * self.heads])
        if dx.shape[1] == self.kv:
            return dx
        b, n, s, d = dx.shape
        group = n // self.kv
        grouped = (MetaTensor((b, self.kv, group, s, d), dx.dtype) if self.ops.mode is Mode.META
                   else dx.reshape(b, self.kv, group, s, d))
        return self.ops.finalize(self.ops.sum(grouped, 2, partial=True))

    def adds_kv_input_gradient(self) -> bool:
        """A kv head that several tp ranks hold adds its input gradient once: on the first of them."""
        return self.tr % self.copies == 0

    # -- forward ------------------------------------------------------------------------------------
    def block(self, p: dict[str, Any], x: Any, i: int, step: int, where: Slice,
              saved: dict[str, Any] | None = None) -> Generator[Any, Any, Any]:
        """The block's output and what its backward keeps. `saved`: recomputing under the per-op policy
        (parallel.recompute = "op"), with what the forward kept; returns the cache once the last tensor
        the backward needs is made again."""
        ops, gpt, pre = self.ops, self.gpt, f"layers.{i}."
        sv = saved if saved is not None else {}
        a_mine, n1 = self.norm(x, p, pre + "attn_norm")
        names = ("wk",) if saved else ("wq", "wk", "wv")  # (the products the per-op policy did not keep)
        if self.overlap:  # every product of each gathered piece as it arrives
            a, made = yield from self.gather_matmuls(a_mine, [p[pre + "attn." + n] for n in names])
            made = dict(zip(names, made))
        else:
            a, made = (yield from self.gather(a_mine)), {}  # (b, s/cp, h)

        def mm(name: str) -> Any:
            return made[name] if name in made else ops.matmul(a, p[pre + "attn." + name])
        xq = sv["xq"] if saved else mm("wq")
        q = self.rope(gpt.split_heads(xq))  # (b, a/tp, s/cp, d)
        k = self.rope(gpt.split_heads(mm("wk")))  # (b, kv/tp, ...), repeated for the query heads unless native
        k = k if self.folds else self.repeat(k)
        xv = sv["xv"] if saved else mm("wv")
        v = gpt.split_heads(xv) if self.folds else self.repeat(gpt.split_heads(xv))
        out, core = (sv["out"], sv["core"]) if saved else (yield from self.attend(q, k, v, i, step, where))
        ctx_ = gpt.merge_heads(out)  # (b, s/cp, h/tp)
        if "y" in sv:  # (b, tokens, h)
            ops.matmul(ctx_, p[pre + "attn.wo"], partial=True)  # (made again, as torch does, and let go)
            y = sv["y"]
        else:
            y = yield from self.matmul_reduce(ctx_, p[pre + "attn.wo"])
        keep_a = self.token_keep(f"resid_attn.{i}", tuple(y.shape), step, where)
        x1 = ops.add(x, self.drop(y, keep_a))
        c_mine, n2 = self.norm(x1, p, pre + "mlp_norm")
        if self.m.is_moe(i):  # each tp rank routes its own tokens (sequence parallelism: parallelism.check)
            c = c_mine
            z, mlp = yield from self.moe_forward(p, c, i, step, where.total, self._keep_all)
        else:
            c, made = yield from self.gather_matmuls(c_mine, [p[pre + "mlp." + n] for n in ("w1", "w3")[bool(saved):]])
            f1, f3 = (sv["f1"], made[0]) if saved else made  # (b, s/cp, F/tp)
            g = fusion.swiglu(ops, self.m, f1, f3)
            mlp = {"f1": f1, "f3": f3, "g": g}
            if saved:  # (w2's product and what follows it the backward needs no more of: torch stops here)
                return None, {"x": x, "a": a, "a_mine": a_mine, "n1": n1, "q": q, "k": k, "v": v, "core": core,
                              "ctx": ctx_, "keep_a": keep_a, "x1": x1, "c": c, "c_mine": c_mine, "n2": n2,
                              "keep_m": sv["keep_m"], **mlp}
            z = yield from self.matmul_reduce(g, p[pre + "mlp.w2"])
        keep_m = self.token_keep(f"resid_mlp.{i}", tuple(z.shape), step, where)
        x2 = ops.add(x1, self.drop(z, keep_m))
        cache = {"x": x, "a": a, "a_mine": a_mine, "n1": n1, "q": q, "k": k, "v": v, "core": core, "ctx": ctx_,
                 "keep_a": keep_a, "x1": x1, "c": c, "c_mine": c_mine, "n2": n2, "keep_m": keep_m, **mlp}
        policy = self.m.recompute.value
        if policy == "full" and not self._keep_all:
            return x2, {"x": x}
        if policy == "selective" and not self._keep_all:
            return x2, {k_: v_ for k_, v_ in cache.items() if k_ != "core"}
        if policy == "op":  # torchtitan's _save_list: every second mm's output (wq, wv, w1, w2: the 1st, 3rd,
            # 5th, 7th), the attention kernel's, and the reduce-scatters' (sequence parallelism); w2's is
            # held by torch but read by no backward here, so it is not kept (its bytes: model/activations.py)
            kept = {"x": x, "xq": xq, "xv": xv, "out": out, "core": core, "f1": f1, "keep_m": keep_m}
            return x2, kept | ({"y": y, "z": z} if self.sp and self.t > 1 else {})
        return x2, cache

    # -- backward -----------------------------------------------------------------------------------
    def block_backward(self, p: dict[str, Any], dx2: Any, c: dict[str, Any], i: int, step: int, where: Slice,
                       grads: dict[str, Any], defer: list | None = None) -> Generator[Any, Any, Any]:
        ops, gpt, pre = self.ops, self.gpt, f"layers.{i}."
        weight_grad = weight_gradients(grads, defer)

        c = yield from self.recompute(p, c, i, step, where)
        if self.m.is_moe(i):  # this rank's tokens' (no gather)
            dc = yield from self.moe_backward(p, self.drop(dx2, c["keep_m"]), c, i, weight_grad)
        else:
            _, (dg,) = yield from self.gather_matmuls(  # (b, s/cp, F/tp)
                self.drop(dx2, c["keep_m"]), [ops.transpose(p[pre + "mlp.w2"])],
                then=lambda dz: weight_grad(pre + "mlp.w2", lambda: ops.einsum("bsf,bsh->fh", c["g"], dz, partial=True)))
            df1, df3 = fusion.swiglu_backward(ops, self.m, dg, c["f1"], c["f3"])

            def mlp_grads(whole: Any) -> None:
                weight_grad(pre + "mlp.w1", lambda: ops.einsum("bsh,bsf->hf", whole, df1, partial=True))
                weight_grad(pre + "mlp.w3", lambda: ops.einsum("bsh,bsf->hf", whole, df3, partial=True))
            dc = yield from self.reduce_under(lambda: ops.add_partial(
                ops.matmul(df1, ops.transpose(p[pre + "mlp.w1"]), partial=True),
                ops.matmul(df3, ops.transpose(p[pre + "mlp.w3"]), partial=True)), mlp_grads, c["c_mine"], c["c"])
        dx1 = ops.add(dx2, self.norm_backward(dc, c["x1"], p, pre + "mlp_norm", c["n2"], grads))
        _, (dctx,) = yield from self.gather_matmuls(
            self.drop(dx1, c["keep_a"]), [ops.transpose(p[pre + "attn.wo"])],
            then=lambda dy: weight_grad(pre + "attn.wo", lambda: ops.einsum("bsh,bsk->hk", c["ctx"], dy, partial=True)))
        dout = gpt.split_heads(dctx)  # (b, a/tp, s/cp, d)
        dq, dk, dv = yield from self.attend_backward(dout, c["core"])
        dq = gpt.merge_heads(self.rope_backward(dq))  # (b, s/cp, h/tp)
        dk = gpt.merge_heads(self.rope_backward((yield from self.unrepeat(dk))))  # (b, s/cp, kv d/tp)
        dv = gpt.merge_heads((yield from self.unrepeat(dv)))

        def attention_grads(whole: Any) -> None:
            for name, d in (("wq", dq), ("wk", dk), ("wv", dv)):
                weight_grad(pre + "attn." + name, lambda d=d: ops.einsum("bsh,bsk->hk", whole, d, partial=True))

        def input_gradient() -> Any:
            da = ops.matmul(dq, ops.transpose(p[pre + "attn.wq"]), partial=True)
            if self.adds_kv_input_gradient():
                for name, d in (("wk", dk), ("wv", dv)):
                    da = ops.add_partial(da, ops.matmul(d, ops.transpose(p[pre + "attn." + name]), partial=True))
            return da
        da = yield from self.reduce_under(input_gradient, attention_grads, c["a_mine"], c["a"])
        return ops.add(dx1, self.norm_backward(da, c["x"], p, pre + "attn_norm", c["n1"], grads))
