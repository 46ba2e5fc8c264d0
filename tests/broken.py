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


def unnormalised_merge(num, out_a, lse_a, out_b, lse_b):
    """kernels.attention_merge that weights each block's output by its share but forgets to divide by
    their sum: every row's output too large by the sum of its blocks' weights."""
    xp = num.xp
    top = xp.maximum(lse_a, lse_b)
    safe = xp.where(xp.isfinite(top), top, 0.0)
    wa, wb = num.exp(lse_a - safe), num.exp(lse_b - safe)
    return out_a * wa[..., None] + out_b * wb[..., None], safe + num.log(wa + wb)


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
