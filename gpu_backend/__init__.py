"""Runs simcluster.parallel programs on torch.distributed (gloo on CPU, NCCL on GPU). Needs torch."""

from gpu_backend.runner import TorchBackend, pick_backend, run_rank, spawn

__all__ = ["TorchBackend", "pick_backend", "run_rank", "spawn"]
