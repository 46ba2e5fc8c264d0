"""A mixture-of-experts FFN: router, dispatch, experts, combine, auxiliary loss.

The layer replaces a block's MLP (either model's: parallel/moe_shard.py). For tokens x (b, s, h):

- router: logits = x W_r (h -> E experts), probabilities p = softmax(logits) over the experts (the
  sum exact, as every softmax here);
- top-k: each token's k experts are those of the k largest probabilities. **Ties** (equal rounded
  probabilities) go to the lower expert index, so routing is a function of the exact numbers (every
  layout computes the same probabilities bit for bit, so routes every token alike). With node-limited
  routing (DeepSeek-V3), the experts are in groups and a token's k come from its best few (`choose`).
  The gates are the chosen probabilities (Switch, GShard), or with `normalize` those divided by their
  sum (Mixtral, Qwen, DeepSeek's norm_topk_prob);
- capacity (`capacity_factor` > 0, GShard/Switch token dropping): each expert takes at most
  C = ceil(capacity_factor * s * k / E) of a sequence's tokens, first choices before second ones and
  earlier tokens first; the rest are dropped (their slot contributes zero). 0: dropless (Megatron-Core's
  default, every routed token computed);
- dispatch: the routed tokens' rows, grouped by expert (in expert, token, choice order), through each
  expert's FFN h -> F -> h with GELU (the GPT's) or SwiGLU (the Llama's), no biases (Megatron-Core's
  experts), each expert a GEMM sized by the tokens it received, so imbalance is timed as it falls;
- combine: y_t = sum_j g_tj * expert_j(x_t), the sum over a token's k slots exact (a partial rounded
  once), so its order -- which rank computed which expert -- never changes a bit; plus, with `shared`
  experts (DeepSeek-MoE's), their output, every token through them: n of them are one FFN of n times
  an expert's inner size (a sum of FFNs is the FFN of their inner dimensions side by side);
- auxiliary load-balancing loss, per sequence (Switch's form over each sequence's tokens, as
  DeepSeek-V3's complementary sequence-wise loss): L = alpha * E * sum_e f_e P_e with f_e the share of
  the sequence's k*s choices that went to e (before dropping: a count, no gradient) and P_e the mean
  router probability of e. Per sequence, so data parallelism (which splits sequences) leaves it whole.

Every sum a parallel layout might split (a weight gradient over tokens, a combine over slots) is an
exact partial in exact mode. Routing needs the probabilities on the host (Megatron-Core reads the
token counts back too, to size its grouped GEMM). Meta mode has no numbers to route by: it is routed
as stated (`stated`: uniform, or skewed by a parameter) and records the same kernels, each expert's
GEMMs sized by the tokens the statement gives it. The rows reach their experts through a dispatcher
(moe_dispatch.py): `Local` slices them on this rank; expert parallelism's send them to the ranks
holding their experts and back (parallel/expert_parallel.py), which is why forward and backward are
generators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Generator

import numpy as np

from simcluster.model import fusion
from simcluster.model.moe_dispatch import Local
from simcluster.numerics.ops import Mode, Ops
from simcluster.numerics.tensor import MetaTensor, Partial


@dataclass(frozen=True)
class MoE:
    experts: int
    top_k: int
    ffn_hidden: int
    aux_coeff: float = 0.0  # alpha of the load-balancing loss (Switch: 1e-2; DeepSeek-V3's sequence-wise: 1e-4)
    capacity_factor: float = 0.0  # 0: dropless
    normalize: bool = False  # gates divided by their sum over the token's k choices
    activation: str = "gelu"  # the experts' FFN: "gelu" (GPT) or "swiglu" (Llama, Mixtral, DeepSeek)
    scores: str = "softmax"  # the router's: "softmax" over the experts, or "sigmoid" each (DeepSeek-V3)
    route_scale: float = 1.0  # the gates' factor (DeepSeek-V3: 2.5)
    shared: int = 0  # shared experts every token goes through, as one FFN of shared x ffn_hidden (DeepSeek: 1)
    groups: int = 1  # the experts in this many equal groups, in order (DeepSeek-V3: 8, a node's each)
    group_limit: int = 0  # a token's experts from at most this many groups (DeepSeek-V3: 4); 0: any
    overlap_shared: bool = False  # the shared experts while the rows travel (Megatron-Core's moe_shared_expert_overlap)

    def __post_init__(self) -> None:
        if self.activation not in ("gelu", "swiglu") or self.scores not in ("softmax", "sigmoid"):
            raise ValueError(f"moe activation must be gelu or swiglu (got {self.activation!r}), its scores "
                             f"softmax or sigmoid (got {self.scores!r})")
        if self.experts < 1 or not 1 <= self.top_k <= self.experts:
            raise ValueError(f"a mixture of experts needs 1 <= top_k <= experts, got top_k {self.top_k} of "
                             f"{self.experts} experts")
        if self.ffn_hidden < 1 or self.aux_coeff < 0 or self.capacity_factor < 0:
            raise ValueError("moe ffn_hidden must be positive; aux_coeff and capacity_factor not negative")
        if self.groups < 1 or self.experts % self.groups or not 0 <= self.group_limit <= self.groups:
            raise ValueError(f"moe groups must divide the {self.experts} experts (got {self.groups}) and the group "
                             f"limit be at most the groups (got {self.group_limit})")
        if self.limited and (self.top_k % self.group_limit or self.top_k // self.group_limit > self.per_group):
            raise ValueError(f"node-limited routing sums each group's top_k / group_limit best scores: top_k "
                             f"{self.top_k} must be a multiple of the group limit {self.group_limit}, and at "
                             f"most {self.per_group} (a group's experts) a group")

    @property
    def limited(self) -> bool:
        """Whether a token's experts come from fewer than all groups (node-limited routing)."""
        return 0 < self.group_limit < self.groups

    @property
    def per_group(self) -> int:
        return self.experts // self.groups

    def capacity(self, seq: int) -> int | None:
        """Tokens of one sequence an expert takes (None: dropless)."""
        if not self.capacity_factor:
            return None
        return max(1, math.ceil(self.capacity_factor * seq * self.top_k / self.experts))


@dataclass(frozen=True)
class Routing:
    """Where each token's choices went: host integers, the same on every layout for the same numbers
    (a stated routing, meta mode's, has only the counts: its index arrays are shapes)."""
    choice: Any  # (T, k) expert of each token's j-th choice
    pos: Any  # (T, k) its row in the dispatched rows, -1 where dropped
    token_of_row: Any  # (R,) the token each dispatched row is
    slot_of_row: Any  # (R,) t * k + j
    bounds: tuple[int, ...]  # E + 1: expert e's rows are [bounds[e], bounds[e + 1])
    chosen: np.ndarray  # (b, E) choices per sequence and expert, before dropping

    def tally(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens that chose each expert, tokens each expert computed): int64 (E,), the router's statistics."""
        return self.chosen.sum(0).astype(np.int64), np.diff(np.asarray(self.bounds, dtype=np.int64))


def stated(batch: int, seq: int, moe: MoE, skew: float = 0.0) -> Routing:
    """Meta mode's routing, which has no numbers to route by: each sequence's k * s choices shared out in
    proportion to (e + 1) ** -skew (0: uniform; 1: Zipf's law, expert 0 the busiest), in whole tokens by
    largest remainders (ties to the lower expert), then each expert's capacity applied per sequence."""
    if skew < 0:
        raise ValueError(f"moe routing skew must not be negative, got {skew!r}")
    weights = np.arange(1, moe.experts + 1, dtype=np.float64) ** -skew
    exact = seq * moe.top_k * weights / weights.sum()
    counts = np.floor(exact).astype(np.int64)
    short = seq * moe.top_k - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    counts = np.minimum(counts, seq)  # (a token chooses an expert once: at most s of a sequence's choices)
    cap = moe.capacity(seq)
    kept = counts if cap is None else np.minimum(counts, cap)
    per_expert = kept * batch
    bounds = tuple(int(v) for v in np.concatenate([[0], np.cumsum(per_expert)]))
    t_count, rows = batch * seq, int(per_expert.sum())
    return Routing(MetaTensor((t_count, moe.top_k)), MetaTensor((t_count, moe.top_k)), MetaTensor((rows,)),
                   MetaTensor((rows,)), bounds, np.tile(counts, (batch, 1)))


def top_k(probs: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, largest first; equal values: the lower index first."""
    order = np.argsort(-np.asarray(probs, dtype=np.float64), axis=-1, kind="stable")
    return order[..., :k]


def choose(scores: np.ndarray, moe: MoE) -> np.ndarray:
    """Each token's top_k experts (T, k) by its selection scores (T, E). With node-limited routing
    (DeepSeek-V3, section 2.1.2), only from its group_limit best groups, a group's score being the sum
    of its top_k / group_limit best (in float64, in descending order: the same sum on every layout);
    equal group scores: the lower group first."""
    s = np.asarray(scores, dtype=np.float64)
    if moe.limited:
        t = s.shape[0]
        grouped = s.reshape(t, moe.groups, moe.per_group)
        best = -np.sort(-grouped, axis=-1)[..., :moe.top_k // moe.group_limit]
        kept = top_k(best.sum(-1), moe.group_limit)  # (T, group_limit)
        allowed = np.zeros((t, moe.groups), dtype=bool)
        np.put_along_axis(allowed, kept, True, axis=-1)
        s = np.where(np.repeat(allowed, moe.per_group, axis=-1), s, -np.inf)
    return top_k(s, moe.top_k)


def capacity_keep(choice: np.ndarray, batch: int, seq: int, moe: MoE) -> np.ndarray:
    """Which of the choices (T, k) of b whole sequences of s tokens (sequence-major, in position order)
    their experts take: per sequence, first choices before second ones, then earlier tokens, each
    expert up to its capacity (all of them without one)."""
    keep = np.ones(choice.shape, dtype=bool)
    cap = moe.capacity(seq)
    if cap is not None:
        for b in range(batch):
            block = choice[b * seq:(b + 1) * seq]
            taken = np.zeros(moe.experts, dtype=np.int64)
            for j in range(choice.shape[1]):
                for t in range(seq):
                    e = block[t, j]
                    if taken[e] < cap:
                        taken[e] += 1
                    else:
                        keep[b * seq + t, j] = False
    return keep


def route(choice: np.ndarray, batch: int, seq: int, moe: MoE, keep: np.ndarray | None = None) -> Routing:
    """The dispatch of tokens (b * s of them, sequence-major) whose choices are `choice` (T, k): those
    `keep` says (default: capacity_keep over these tokens as whole sequences)."""
    t_count, k = choice.shape
    e_count = moe.experts
    keep = capacity_keep(choice, batch, seq, moe) if keep is None else keep
    tokens, slots = np.nonzero(keep)  # (token, choice) in token-major order
    experts = choice[tokens, slots]
    order = np.lexsort((slots, tokens, experts))  # by expert, then token, then choice
    tokens, slots, experts = tokens[order], slots[order], experts[order]
    pos = np.full((t_count, k), -1, dtype=np.int64)
    pos[tokens, slots] = np.arange(len(tokens))
    counts = np.bincount(experts, minlength=e_count)
    bounds = tuple(int(v) for v in np.concatenate([[0], np.cumsum(counts)]))
    chosen = np.stack([np.bincount(choice[b * seq:(b + 1) * seq].ravel(), minlength=e_count) for b in range(batch)])
    return Routing(choice, pos, tokens.astype(np.int64), (tokens * k + slots).astype(np.int64), bounds, chosen)


def balance_gradient(chosen: np.ndarray, seq: int, moe: MoE, scale: float, mine: int | None = None) -> np.ndarray:
    """The balance loss's gradient in a token's balance scores, (b * mine, E) float64 on the host: for
    the tokens of sequence b, scale * alpha * E * f_be / s, with f_be = its choices of e / (k s); `chosen`
    (b, E) and s are the whole sequences', of which this rank holds `mine` tokens each (default: all)."""
    coef = scale * moe.aux_coeff * moe.experts * chosen / (moe.top_k * seq * seq)
    return np.repeat(coef, seq if mine is None else mine, axis=0)


def host_float32(counts: Any) -> np.ndarray:
    """Host integers as the fp32 array a collective sums (whole numbers below 2^24: exact)."""
    return np.asarray(counts, dtype=np.float32)


def stack(ops: Ops, parts: list[Any]) -> Any:
    """The experts' gradient partials (one an expert) as one partial of the stacked weight (E, ...): their
    limbs side by side, nothing added or rounded (no kernel: a grouped GEMM writes them so)."""
    first = parts[0]
    if isinstance(first, MetaTensor):
        return MetaTensor((len(parts),) + tuple(first.shape), first.dtype, first.partial)
    if isinstance(first, Partial):
        return Partial(first.xp.stack([q.limbs for q in parts], 0), first.dtype, first.xp)
    return ops.xp.stack(parts, 0)


def local(steps: Generator[Any, Any, Any]) -> Any:
    """The value of a layer's forward or backward that needs no communication (every expert here)."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the layer communicated: run it inside a rank's program")


class MoELayer:
    """Forward and backward of the layer through `ops` (exact or fast mode). A `router.bias` among the
    weights (DeepSeek-V3's auxiliary-loss-free balancing: a buffer the training loop moves, no gradient)
    is added to the scores for choosing the experts only."""

    def __init__(self, ops: Ops, moe: MoE, prefix: str = "moe.", skew: float = 0.0, dispatcher: Any = None,
                 cfg: Any = None) -> None:
        self.ops, self.moe, self.pre, self.skew = ops, moe, prefix, skew
        self.cfg = cfg if cfg is not None else fusion.UNFUSED  # the model's config: what its SwiGLU costs (fusion.py)
        self.meta = ops.mode is Mode.META  # (routed as `stated` says, with `skew`: there are no numbers)
        # how the rows reach their experts and come back (moe_dispatch.py): on this rank (`Local`), or
        # expert parallelism's all-to-all or all-gather (parallel/expert_parallel.py)
        self.dispatcher = dispatcher if dispatcher is not None else Local(self)
        # where a sequence's tokens are shared out over ranks (sequence or context parallelism): how many
        # parts, and the generator summing a (b, E) count over them (the balance loss's f is the sequence's)
        self.parts, self.whole = 1, None
        # and the generator that says which of this rank's choices (b, s, k) an expert's capacity keeps, which
        # the whole sequence's order decides (None: this rank's tokens are whole sequences)
        self.sequences = None

    def _view(self, x: Any, shape: tuple[int, ...]) -> Any:
        return MetaTensor(shape, x.dtype) if self.meta else x.reshape(shape)

    def slice_rows(self, x: Any, lo: int, hi: int) -> Any:
        """Rows [lo, hi) of x (meta mode: their shape)."""
        return MetaTensor((hi - lo,) + tuple(x.shape[1:]), x.dtype) if self.meta else x[lo:hi]

    def _middle(self, x: Any) -> Any:
        """(T, n) -> (T, 1, n)."""
        return MetaTensor((x.shape[0], 1, x.shape[1]), x.dtype) if self.meta else x[:, None, :]

    def forward(self, p: dict[str, Any], x: Any, aux_scale: float = 1.0) -> Generator[Any, Any, tuple[Any, Any, dict]]:
        """(y (b, s, h), the auxiliary loss summed over the sequences times `aux_scale`, the cache); a
        generator, for the dispatcher's communication (none on one rank: `local`)."""
        ops, moe, pre = self.ops, self.moe, self.pre
        b, s, h = x.shape
        xf = self._view(x, (b * s, h))
        logits = ops.matmul(xf, p[pre + "router"])  # (T, E)
        scores = ops.softmax(logits) if moe.scores == "softmax" else ops.sigmoid(logits)
        bias = p.get(pre + "router.bias")
        select = scores if bias is None else ops.add(scores, bias)
        ops.kernel("topk", flops=float(b * s * moe.experts * moe.top_k), nbytes=float(b * s * moe.experts * 4))
        if self.meta:
            if moe.capacity_factor and self.sequences is not None:  # (the same calls, no numbers)
                yield from self.sequences(MetaTensor((b, s, moe.top_k), "int64"), moe)
            r = stated(b, s, moe, self.skew)
        else:
            choice, keep = choose(ops.xp.to_host(select), moe), None
            if moe.capacity_factor and self.sequences is not None:  # what the whole sequences' order drops
                keep = yield from self.sequences(choice.reshape(b, s, moe.top_k), moe)
            r = route(choice, b, s, moe, keep)
        one_hot = ops.one_hot(r.choice, moe.experts, scores)  # (T, k, E): a token's choices are distinct
        picked = ops.finalize(ops.sum(ops.mul(one_hot, self._middle(scores)), -1, partial=True))  # (T, k): one term each
        gates, total = picked, None
        if moe.normalize:
            total = ops.finalize(ops.sum(picked, -1, partial=True))
            gates = ops.div(picked, ops.expand_last(total))
        unscaled = gates
        if moe.route_scale != 1.0:
            gates = ops.scale(gates, moe.route_scale)
        shared_forward = (lambda: self._shared(p, xf)) if moe.shared else None  # (overlapped: while the rows travel)
        inputs, early, sent = yield from self.dispatcher.dispatch(xf, r, gates,
                                                                shared_forward if moe.overlap_shared else None)
        acts, out = [], []
        for e, x_e in enumerate(inputs):
            act, o = self._expert(p, e, x_e)
            acts.append(act)
            out.append(o)
        y = yield from self.dispatcher.combine(out, r, gates, sent)
        shared = None
        if shared_forward is not None:
            shared, out_shared = early if moe.overlap_shared else shared_forward()
            y = ops.add(y, out_shared)
        chosen = r.chosen
        if moe.aux_coeff and self.whole is not None:  # every part's choices of each expert, per sequence
            chosen = yield from self.whole(chosen)
        aux, aux_grad, balance = self._aux(scores, chosen, b, s, aux_scale)
        cache = {"x": xf, "scores": scores, "routing": r, "one_hot": one_hot, "total": total, "unscaled": unscaled,
                 "gates": gates, "inputs": inputs, "sent": sent, "acts": acts, "aux_grad": aux_grad,
                 "balance": balance, "shared": shared}
        return self._view(y, (b, s, h)), aux, cache

    def _expert(self, p: dict[str, Any], e: int, x: Any) -> tuple[dict[str, Any], Any]:
        w = lambda name: self._expert_weight(p, "experts." + name, e)  # noqa: E731
        return self._ffn(x, w("w_fc"), w("w_up") if self.moe.activation == "swiglu" else None, w("w_out"))

    def _shared(self, p: dict[str, Any], x: Any) -> tuple[dict[str, Any], Any]:
        """The shared experts over every token (T, h): the experts' FFN of their inner sizes side by side."""
        pre = self.pre + "shared."
        return self._ffn(x, p[pre + "w1"], p.get(pre + "w3"), p[pre + "w2"])

    def _ffn(self, x: Any, w_in: Any, w_up: Any, w_out: Any) -> tuple[dict[str, Any], Any]:
        """h -> F -> h without biases: GELU (the GPT's: no w_up) or SwiGLU; (what the backward keeps, the output)."""
        ops = self.ops
        f = ops.matmul(x, w_in)
        if w_up is None:
            g = ops.gelu(f)
            return {"f": f, "g": g}, ops.matmul(g, w_out)
        up = ops.matmul(x, w_up)
        g = fusion.swiglu(ops, self.cfg, f, up)
        return {"f": f, "up": up, "g": g}, ops.matmul(g, w_out)

    def _shared_backward(self, p: dict[str, Any], x: Any, act: dict[str, Any], dout: Any,
                         grads: dict[str, Any]) -> Any:
        pre = self.pre + "shared."
        return self._ffn_backward(x, act, dout, p[pre + "w1"], p.get(pre + "w3"), p[pre + "w2"],
                                  lambda w, g: grads.__setitem__(pre + {"in": "w1", "up": "w3", "out": "w2"}[w], g))

    def _expert_weight(self, p: dict[str, Any], name: str, e: int) -> Any:
        w = p[self.pre + name]
        return MetaTensor(tuple(w.shape[1:]), w.dtype) if self.meta else w[e]

    def _expert_backward(self, p: dict[str, Any], e: int, x: Any, act: dict[str, Any], dout: Any,
                         grads: dict[str, list[Any]]) -> Any:
        w = lambda name: self._expert_weight(p, "experts." + name, e)  # noqa: E731
        names = {"in": "experts.w_fc", "up": "experts.w_up", "out": "experts.w_out"}
        return self._ffn_backward(x, act, dout, w("w_fc"), w("w_up") if self.moe.activation == "swiglu" else None,
                                  w("w_out"), lambda n, g: grads[names[n]].append(g))

    def _ffn_backward(self, x: Any, act: dict[str, Any], dout: Any, w_in: Any, w_up: Any, w_out: Any,
                      put: Any) -> Any:
        """dx of _ffn; each weight's gradient (a partial over the rows) to put("out" / "in" / "up", partial)."""
        ops = self.ops
        put("out", ops.einsum("tf,th->fh", act["g"], dout, partial=True))
        dg = ops.matmul(dout, ops.transpose(w_out))
        if w_up is None:
            df = ops.gelu_backward(dg, act["f"])
            put("in", ops.einsum("th,tf->hf", x, df, partial=True))
            return ops.matmul(df, ops.transpose(w_in))
        df, d_up = fusion.swiglu_backward(ops, self.cfg, dg, act["f"], act["up"])
        put("in", ops.einsum("th,tf->hf", x, df, partial=True))
        put("up", ops.einsum("th,tf->hf", x, d_up, partial=True))
        return ops.add(ops.matmul(df, ops.transpose(w_in)), ops.matmul(d_up, ops.transpose(w_up)))

    def _aux(self, scores: Any, chosen: Any, b: int, s: int, scale: float) -> tuple[Any, Any, Any]:
        """This rank's part of the sequences' balance loss (its s tokens of each of b, of the `parts` a
        sequence is shared out in), its gradient in the balance scores (T, E), and those scores (the
        probabilities; sigmoid scores divided by their sum over the experts, as DeepSeek-V3's), or Nones."""
        ops, moe = self.ops, self.moe
        if not moe.aux_coeff:
            return None, None, None
        balance = scores
        if moe.scores == "sigmoid":
            balance = ops.div(scores, ops.expand_last(ops.finalize(ops.sum(scores, -1, partial=True))))
        # (meta: no table the size of the tokens; else rounded once to the scores' dtype)
        grad = (MetaTensor(tuple(scores.shape), scores.dtype) if self.meta
                else ops.constant(balance_gradient(chosen, s * self.parts, moe, scale, s), scores.dtype))
        wide = "fp64" if not self.meta and ops.xp.name(scores.dtype) == "fp64" else "fp32"  # (a loss: fp32 at least)
        loss = ops.finalize(ops.sum(ops.mul(balance, grad), None, partial=True), wide)
        return loss, grad, balance

    def backward(self, p: dict[str, Any], dy: Any, c: dict[str, Any], grads: dict[str, Any]) -> Generator[Any, Any, Any]:
        """dx (b, s, h); the weights' gradients go to `grads`: the router's a partial, each expert
        weight's a list of partials, one an expert of this rank's (a generator, as `forward`)."""
        ops, moe, pre = self.ops, self.moe, self.pre
        b, s, h = dy.shape
        r: Routing = c["routing"]
        dyt = self._view(dy, (b * s, h))
        expert_grads: dict[str, list[Any]] = {"experts.w_fc": [], "experts.w_out": [], "experts.w_up": []}
        shared_grads: dict[str, Any] = {}  # (put in `grads` after the router's, overlapped or not)
        shared_backward = (lambda: self._shared_backward(p, c["x"], c["shared"], dyt, shared_grads)
                           ) if c["shared"] is not None else None
        d_in, d_gates, early = yield from self.dispatcher.combine_backward(
            dyt, r, c["gates"], c["sent"], shared_backward if moe.overlap_shared else None)
        dx_rows = [self._expert_backward(p, e, x_e, c["acts"][e], d_in[e], expert_grads)
                   for e, x_e in enumerate(c["inputs"])]
        for name, partials in expert_grads.items():
            if partials:
                grads[pre + name] = partials
        dx = yield from self.dispatcher.dispatch_backward(dx_rows, r, c["sent"])
        if moe.route_scale != 1.0:
            d_gates = ops.scale(d_gates, moe.route_scale)
        d_picked = d_gates
        if moe.normalize:  # g = q / sum(q): dq_j = (dg_j - sum_i g_i dg_i) / sum(q)
            dot = ops.finalize(ops.sum(ops.mul(c["unscaled"], d_gates), -1, partial=True))
            d_picked = ops.div(ops.sub(d_gates, ops.expand_last(dot)), ops.expand_last(c["total"]))
        d_scores = ops.finalize(ops.sum(ops.mul(c["one_hot"], ops.expand_last(d_picked)), 1, partial=True))
        scores = c["scores"]
        if c["aux_grad"] is not None:
            d_balance = c["aux_grad"]
            if moe.scores == "sigmoid":  # s' = s / sum(s): ds_i = (g_i - sum_e g_e s'_e) / sum(s)
                dot = ops.finalize(ops.sum(ops.mul(c["balance"], d_balance), -1, partial=True))
                whole = ops.finalize(ops.sum(scores, -1, partial=True))
                d_balance = ops.div(ops.sub(d_balance, ops.expand_last(dot)), ops.expand_last(whole))
            d_scores = ops.add(d_scores, d_balance)
        if moe.scores == "softmax":
            delta = ops.finalize(ops.sum(ops.mul(scores, d_scores), -1, partial=True))
            d_logits = ops.mul(scores, ops.sub(d_scores, ops.expand_last(delta)))
        else:  # sigma' = sigma (1 - sigma): d sigma - (d sigma) sigma
            ds = ops.mul(d_scores, scores)
            d_logits = ops.sub(ds, ops.mul(ds, scores))
        grads[pre + "router"] = ops.einsum("th,te->he", c["x"], d_logits, partial=True)
        dx = ops.add(dx, ops.matmul(d_logits, ops.transpose(p[pre + "router"])))
        if shared_backward is not None:
            dx = ops.add(dx, early if moe.overlap_shared else shared_backward())
            grads.update(shared_grads)
        return self._view(dx, (b, s, h))
