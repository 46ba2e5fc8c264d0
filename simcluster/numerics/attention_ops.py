"""The attention core's kernels, as a mixin of Ops (as flat.py and placement.py are): the scores, the
weights and their sums for the exact two-pass form, and fast mode's flash blocks, each (out, lse),
merged by their log-sum-exps; and the softmax and log-softmax they make. Shapes: b batch, a heads, s queries,
k keys, d head dim."""

from __future__ import annotations

from typing import Any

from simcluster.numerics.tensor import MetaTensor, dtype_name


class AttentionOps:
    """Needs, of the class it is mixed into: mode, _num, _kernels, _record, _cost, _meta_like, _item (and max,
    sum, sub, log_sum_exp, expand_last for the softmaxes)."""

    def attention_scores(self, q: Any, k: Any, scale: float, allowed: Any = None) -> Any:
        """(b, a, s, k) scores, -inf where `allowed` is False."""
        b, a, sq, d = q.shape
        sk = k.shape[2]
        self._record("attention_scores", (b * a, sq, sk, d), (b * a * (sq + sk) * d + b * a * sq * sk) * self._item)
        if self.mode.value == "meta":
            return MetaTensor((b, a, sq, sk), q.dtype)
        return self._kernels.attention_scores(self._num, q, k, scale, allowed)

    def attention_weights(self, s: Any, row_max: Any) -> Any:
        self._cost("attention_weights", tuple(s.shape), 10, 2, s)
        return self._meta_like(s) if self.mode.value == "meta" else self._kernels.attention_weights(self._num, s, row_max)

    def attention_output(self, o_sum: Any, l_sum: Any, dtype: Any = "fp32", drop_scale: float = 1.0) -> Any:
        self._cost("attention_output", tuple(o_sum.shape), 2, 2)
        if self.mode.value == "meta":
            return MetaTensor(tuple(o_sum.shape), dtype_name(dtype))
        return self._kernels.attention_output(self._num, o_sum, l_sum, dtype, drop_scale)

    def attention_block(self, q: Any, k: Any, v: Any, scale: float, allowed: Any = None, keep: Any = None,
                        drop_scale: float = 1.0) -> tuple[Any, Any]:
        """Fast mode: one block of keys and values attended to as a FlashAttention kernel does (Dao 2023;
        torch's _scaled_dot_product_flash_attention returns the same pair): (out, lse), the block's
        output (b, a, s, d) normalised by its own weights and each query row's log-sum-exp (b, a, s),
        both float32 (-inf, output 0, where the block allows a row no key). Blocks combine by
        attention_merge; the backward pass needs only q, k, v, the merged output and lse."""
        if self.mode.value == "exact":
            raise TypeError("attention_block is fast mode's (a float merge): exact mode sums blocks exactly")
        b, a, sq, d = q.shape
        sk = k.shape[2]
        self._record("attention_scores", (b * a, sq, sk, d), (b * a * (sq + sk) * d + b * a * sq * sk) * self._item)
        self._cost("attention_weights", (b, a, sq, sk), 10, 2)
        self._record("einsum", (b * a, sq, d, sk), (b * a * (sq * sk + sk * d + sq * d)) * self._item)
        if self.mode.value == "meta":
            return MetaTensor((b, a, sq, d), "fp32"), MetaTensor((b, a, sq), "fp32")
        return self._kernels.attention_block(self._num, q, k, v, scale, allowed, keep, drop_scale)

    def attention_merge(self, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
        """Two blocks' (out, lse) as one (attention_block), in float32."""
        self._cost("attention_merge", tuple(out_a.shape), 4, 3, out_a)
        if self.mode.value == "meta":
            return MetaTensor(tuple(out_a.shape), "fp32"), MetaTensor(tuple(lse_a.shape), "fp32")
        return self._kernels.attention_merge(self._num, out_a, lse_a, out_b, lse_b)

    def attention_probs(self, e: Any, l_sum: Any) -> Any:
        self._cost("attention_probs", tuple(e.shape), 1, 2, e)
        return self._meta_like(e) if self.mode.value == "meta" else self._kernels.attention_probs(self._num, e, l_sum)

    def softmax(self, x: Any) -> Any:
        """Over the last dim: exp(x - max) / round(sum), the sum exact."""
        e = self.attention_weights(x, self.max(x, -1))
        return self.attention_probs(e, self.sum(e, -1, partial=True))

    def log_softmax(self, x: Any) -> Any:
        """x - (max + log round(sum exp(x - max))) over the last dim."""
        m = self.max(x, -1)
        lse = self.log_sum_exp(m, self.sum(self.attention_weights(x, m), -1, partial=True),
                               getattr(x, "dtype", "fp32"))
        return self.sub(x, self.expand_last(lse))
