"""Runs simcluster programs on torch.distributed (gloo on CPU, NCCL on GPU). Needs torch."""

from gpu_backend.backend import TorchBackend, launch, preflight, run_rank, spawn
from gpu_backend.processes import LaunchError

__all__ = ["LaunchError", "TorchBackend", "launch", "preflight", "run_rank", "spawn"]
