"""Kernels and values: exact mode (limbs), fast mode (BLAS), meta mode (shapes only)."""

from simcluster.numerics.ops import ExactOps, FastOps, MetaOps, Mode, Ops, make_ops
from simcluster.numerics.tensor import MetaTensor, Partial, ReduceOp

__all__ = ["ExactOps", "FastOps", "MetaOps", "MetaTensor", "Mode", "Ops", "Partial", "ReduceOp", "make_ops"]
