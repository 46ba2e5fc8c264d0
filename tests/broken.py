"""Broken variants of the algorithms, shared by the tests that show a check can fail."""

import numpy as np

from simcluster.parallel.composed import composed


def swapped_tp(ctx, plan):
    """Tensor-parallel ranks that compute each other's heads: the weights come out permuted."""
    real = ctx.mesh

    class Swap:
        def __getattr__(self, name):
            return getattr(real, name)

        def coord(self, axis):
            return real.size("tp") - 1 - real.coord("tp") if axis == "tp" else real.coord(axis)

    ctx.mesh = Swap()
    return (yield from composed(ctx, plan))


def no_rescale(ops, state, scores, v, kept):
    """ring_attention.online_merge that forgets to rescale the running sums when the maximum grows."""
    m, l_sum, o_sum = state
    m_new = ops.max(scores, -1) if m is None else np.maximum(m, ops.max(scores, -1))
    e = ops.attention_weights(scores, m_new)
    l_t, o_t = ops.sum(e, -1), ops.einsum("bask,bakd->basd", kept(e), v)
    return m_new, l_t if m is None else ops.add(l_sum, l_t), o_t if m is None else ops.add(o_sum, o_t)


class _WrongCoord:
    """A mesh view that gives a wrong coordinate along one axis."""

    def __init__(self, view, axis, wrong):
        self._view, self._axis, self._wrong = view, axis, wrong

    def coord(self, axis):
        c = self._view.coord(axis)
        return self._wrong(c, self._view.size(axis)) if axis == self._axis else c

    def __getattr__(self, name):
        return getattr(self._view, name)


def wrong_coord(program, axis, wrong):
    """`program` on ranks that believe their coordinate along `axis` is wrong(coordinate, size)."""
    def broken(ctx, cfg):
        ctx.mesh = _WrongCoord(ctx.mesh, axis, wrong)
        return (yield from program(ctx, cfg))
    return broken
