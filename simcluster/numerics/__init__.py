"""Kernels and values: exact mode (limbs), fast mode (BLAS), meta mode (shapes only)."""

from simcluster.numerics.modes import ExactOps, FastOps, MetaOps, make_ops
from simcluster.numerics.ops import Mode, Ops
from simcluster.numerics.tensor import MetaTensor, Partial, ReduceOp

__all__ = ["ExactOps", "FastOps", "MetaOps", "MetaTensor", "Mode", "Ops", "Partial", "ReduceOp", "make_ops"]
