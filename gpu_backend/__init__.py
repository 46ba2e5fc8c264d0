"""Runs simcluster programs on torch.distributed (gloo on CPU, NCCL on GPU). Needs torch."""

from gpu_backend.processes import LaunchError
from gpu_backend.runner import TorchBackend, launch, preflight, run_rank, spawn

__all__ = ["LaunchError", "TorchBackend", "launch", "preflight", "run_rank", "spawn"]
