"""The program model: per-rank generator programs over a device mesh (backend-neutral)."""

from simcluster.program.comm import Comm, CommKind, CommOp, ProgramError, Work
from simcluster.program.context import COMPUTE, Context, Program
from simcluster.program.mesh import AXES, DeviceMesh, MeshView, ProcessGroup

__all__ = ["AXES", "COMPUTE", "Comm", "CommKind", "CommOp", "Context", "DeviceMesh", "MeshView",
           "ProcessGroup", "Program", "ProgramError", "Work"]
