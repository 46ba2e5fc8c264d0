"""The transformer's kernels, written once against a mode's primitives (exact or fast).

Every sum that a parallel algorithm may split goes through `num.sum` / `num.einsum` with
partial=True, and is rounded by `num.round` at the point where the math rounds; everything else is
elementwise. The pieces are small enough that a sharded version can put a collective between them
(vocab-parallel cross-entropy: max, all-reduce max, sum of exp, all-reduce sum; ring attention: max
over key blocks, then sums of weights and weighted values over key blocks).

Shapes in comments: t tokens, h hidden, V vocab, b batch, a heads, s queries, k keys, d head dim.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

GELU_C = float(np.sqrt(2.0 / np.pi))


class Num(Protocol):
    """A mode's primitives. `partial` results are unrounded sums (Partial in exact mode); `xp` is the
    array namespace of its numbers (arrays.py), which everything elementwise here goes through."""

    xp: Any

    def einsum(self, spec: str, a: np.ndarray, b: np.ndarray, partial: bool = False) -> Any: ...

    def sum(self, x: np.ndarray, axis: Any, partial: bool = False) -> Any: ...

    def round(self, p: Any, dtype: Any) -> np.ndarray: ...

    def exp(self, x: np.ndarray) -> np.ndarray: ...

    def log(self, x: np.ndarray) -> np.ndarray: ...

    def tanh(self, x: np.ndarray) -> np.ndarray: ...


def _c(num: Num, x: Any, value: float) -> Any:
    """A constant in x's dtype (rounded once)."""
    return num.xp.const(x, value)


# -- GELU (tanh approximation, as GPT-2) ---------------------------------------------------------

def gelu(num: Num, x: np.ndarray) -> np.ndarray:
    inner = _c(num, x, GELU_C) * (x + _c(num, x, 0.044715) * x * x * x)
    return _c(num, x, 0.5) * x * (_c(num, x, 1.0) + num.tanh(inner))


def gelu_backward(num: Num, dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    inner = _c(num, x, GELU_C) * (x + _c(num, x, 0.044715) * x * x * x)
    th = num.tanh(inner)
    dinner = _c(num, x, GELU_C) * (_c(num, x, 1.0) + _c(num, x, 3 * 0.044715) * x * x)
    grad = _c(num, x, 0.5) * (_c(num, x, 1.0) + th) + _c(num, x, 0.5) * x * (_c(num, x, 1.0) - th * th) * dinner
    return dy * grad


def silu(num: Num, x: np.ndarray) -> np.ndarray:
    """x sigmoid(x) = x / (1 + exp(-x)), with our layout-independent exp."""
    return x / (_c(num, x, 1.0) + num.exp(-x))


def sigmoid(num: Num, x: np.ndarray) -> np.ndarray:
    """1 / (1 + exp(-x)), with our layout-independent exp (DeepSeek-V3's router scores)."""
    return _c(num, x, 1.0) / (_c(num, x, 1.0) + num.exp(-x))


def silu_backward(num: Num, dy: np.ndarray, x: np.ndarray) -> np.ndarray:
    """dy sigmoid(x) (1 + x (1 - sigmoid(x)))."""
    sig = _c(num, x, 1.0) / (_c(num, x, 1.0) + num.exp(-x))
    return dy * (sig * (_c(num, x, 1.0) + x * (_c(num, x, 1.0) - sig)))


# -- normalisation over the last dim (per token: never split) ------------------------------------

def layer_norm(num: Num, x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float):
    """(y, mean, rstd); x (..., h)."""
    h = x.shape[-1]
    mean = num.round(num.sum(x, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    xc = x - mean
    var = num.round(num.sum(xc * xc, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    rstd = _c(num, x, 1.0) / num.xp.sqrt(var + _c(num, x, eps))
    return xc * rstd * gamma + beta, mean, rstd


def layer_norm_backward(num: Num, dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, mean: np.ndarray,
                        rstd: np.ndarray):
    """(dx, dgamma, dbeta): dgamma and dbeta are partial sums over this shard's tokens."""
    h = x.shape[-1]
    xhat = (x - mean) * rstd
    lead = tuple(range(x.ndim - 1))
    dgamma = num.sum(dy * xhat, lead, partial=True)
    dbeta = num.sum(dy, lead, partial=True)
    g = dy * gamma
    mean_g = num.round(num.sum(g, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    mean_gx = num.round(num.sum(g * xhat, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    dx = (g - mean_g - xhat * mean_gx) * rstd
    return dx, dgamma, dbeta


def rms_norm(num: Num, x: np.ndarray, gamma: np.ndarray, eps: float):
    """(y, rstd); x (..., h)."""
    h = x.shape[-1]
    ms = num.round(num.sum(x * x, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    rstd = _c(num, x, 1.0) / num.xp.sqrt(ms + _c(num, x, eps))
    return x * rstd * gamma, rstd


def rms_norm_backward(num: Num, dy: np.ndarray, x: np.ndarray, gamma: np.ndarray, rstd: np.ndarray):
    """(dx, dgamma partial)."""
    h = x.shape[-1]
    xhat = x * rstd
    dgamma = num.sum(dy * xhat, tuple(range(x.ndim - 1)), partial=True)
    g = dy * gamma
    mean_gx = num.round(num.sum(g * xhat, -1, partial=True), x.dtype)[..., None] / _c(num, x, h)
    return (g - xhat * mean_gx) * rstd, dgamma


# -- attention, in the two-pass form that ring attention can split over key blocks ----------------

def attention_scores(num: Num, q: np.ndarray, k: np.ndarray, scale: float, allowed: np.ndarray | None):
    """s = (q k^T) * scale, -inf where not allowed; q (b, a, s, d), k (b, a, k, d) -> (b, a, s, k)."""
    s = num.round(num.einsum("basd,bakd->bask", q, k, partial=True), q.dtype) * _c(num, q, scale)
    return s if allowed is None else num.xp.where(allowed, s, _c(num, q, -np.inf))


def attention_weights(num: Num, s: np.ndarray, row_max: np.ndarray) -> np.ndarray:
    """e = exp(s - max) (0 where masked); row_max (b, a, s, 1) is the max over all keys (any order)."""
    xp = num.xp
    safe = xp.where(xp.isfinite(row_max), row_max, _c(num, s, 0.0))
    return xp.where(xp.isfinite(s), num.exp(s - safe), _c(num, s, 0.0))


def attention_output(num: Num, o_sum: Any, l_sum: Any, dtype: Any, drop_scale: float) -> np.ndarray:
    """out = round(sum_k e*keep*v) / round(sum_k e) * 1/(1-p): the one rounding point of the core."""
    out = num.round(o_sum, dtype) / num.round(l_sum, dtype)[..., None]
    return num.times(out, drop_scale)  # (the dropout's scale as the mode multiplies a scalar: ops.scale)


def attention_probs(num: Num, e: np.ndarray, l_sum: Any) -> np.ndarray:
    """P = e / l (for the backward pass)."""
    return e / num.round(l_sum, e.dtype)[..., None]


def attention_block(num: Num, q: Any, k: Any, v: Any, scale: float, allowed: Any, keep: Any,
                    drop_scale: float) -> tuple[Any, Any]:
    """Fast mode: a block of keys as a FlashAttention kernel attends to it: the output normalised by the
    block's own sum of weights (dropout's `keep` applied, times drop_scale), and each query row's
    log-sum-exp; both float32. A row the block allows no key has lse -inf and output 0."""
    xp = num.xp
    s = attention_scores(num, q, k, scale, allowed)
    top = xp.max(s, -1)
    l_sum = num.sum(attention_weights(num, s, top), -1)
    some = l_sum > _c(num, l_sum, 0.0)
    one = xp.where(some, l_sum, _c(num, l_sum, 1.0))
    lse = xp.where(some, xp.where(xp.isfinite(top[..., 0]), top[..., 0], _c(num, l_sum, 0.0)) + num.log(one),
                   _c(num, l_sum, -np.inf))
    p = attention_weights(num, s, top) / one[..., None]
    if keep is not None:
        p = xp.where(keep, p, _c(num, p, 0.0))
    return num.einsum("bask,bakd->basd", p, v) * _c(num, q, drop_scale), lse


def attention_merge(num: Num, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
    """Two blocks' (output, lse) as one: lse = log(e^lse_a + e^lse_b), out = the outputs weighted by
    e^(lse_x - lse) (ring-flash-attention's update of out and lse); float32, in either order."""
    xp = num.xp
    top = xp.maximum(lse_a, lse_b)
    safe = xp.where(xp.isfinite(top), top, _c(num, top, 0.0))
    wa, wb = num.exp(lse_a - safe), num.exp(lse_b - safe)
    total = wa + wb
    some = total > _c(num, total, 0.0)
    one = xp.where(some, total, _c(num, total, 1.0))
    lse = xp.where(some, safe + num.log(one), _c(num, total, -np.inf))
    return (out_a * wa[..., None] + out_b * wb[..., None]) / one[..., None], lse


# -- cross-entropy over a (possibly sharded) vocabulary -------------------------------------------

def log_sum_exp(num: Num, row_max: np.ndarray, sum_exp: Any, dtype: Any) -> np.ndarray:
    """lse = max + log(sum exp(x - max)); row_max (t, 1), sum_exp partial (t,)."""
    return row_max[..., 0] + num.log(num.round(sum_exp, dtype))


# -- embedding ------------------------------------------------------------------------------------

def embedding_backward(num: Num, ids: np.ndarray, dy: np.ndarray, rows: int, row_offset: int = 0) -> Any:
    """Partial (rows, h): sum of dy over the tokens whose id falls in [row_offset, row_offset + rows)."""
    xp = num.xp
    flat_ids = ids.reshape(-1) - row_offset
    mine = (flat_ids >= 0) & (flat_ids < rows)
    onehot = xp.where(mine[:, None], xp.one_hot(xp.where(mine, flat_ids, 0), rows, dy.dtype), _c(num, dy, 0))
    return num.einsum("tv,th->vh", onehot, dy.reshape(-1, dy.shape[-1]), partial=True)


# -- optimizers (elementwise, fp32 master weights) -------------------------------------------------

def adam(xp: Any, param: Any, grad: Any, m: Any, v: Any, step: int, *, lr: float,
         beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0):
    """AdamW step; returns (param, m, v). Bias corrections are rounded once, in the param dtype."""
    def c(value: float) -> Any:
        return xp.const(param, value)
    m = c(beta1) * m + c(1 - beta1) * grad
    v = c(beta2) * v + c(1 - beta2) * grad * grad
    mhat = m / c(1 - beta1 ** step)
    vhat = v / c(1 - beta2 ** step)
    if weight_decay:  # torch.optim.AdamW: p.mul_(1 - lr * wd) before the update
        param = param * c(1 - lr * weight_decay)
    return param - c(lr) * mhat / (xp.sqrt(vhat) + c(eps)), m, v


def sgd(xp: Any, param: Any, grad: Any, *, lr: float) -> Any:
    return param - xp.const(param, lr) * grad
