"""The single-device run every layout of the training is checked against: the GPT's own single-device
model (model/gpt.py), or for the Llama, which is defined once by its shards, the composed program on a
mesh of one rank. Apart from the configuration (data_parallel.py) so that the configuration imports
neither the program nor the engine."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from simcluster.engine import simulate
from simcluster.model.gpt import train
from simcluster.numerics.modes import make_ops
from simcluster.parallel.composed import assemble, composed
from simcluster.parallel.data_parallel import KINDS, TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset


def reference(cfg: TrainingConfig, mode: str = "exact") -> dict[str, Any]:
    """The single-device run that every data-parallel run must equal (cached: the configuration is
    immutable, and every variant of a comparison shares it, whatever its ZeRO stage, micro-batches or
    offload: one device has none of them). Do not modify what it returns."""
    return _reference(replace(cfg, micro_batches=1, zero=0, prefetch=True, overlap_grad_reduce=True,
                              offload_optimizer="none", offload_params="none"), mode)


@functools.lru_cache(maxsize=8)
def _reference(cfg: TrainingConfig, mode: str) -> dict[str, Any]:
    """(reference's cache: reference.cache_clear() empties it, for a caller that changes the model's code.)"""
    if cfg.model.arch != "gpt" or cfg.model.moe_experts:  # defined once, by its shards: a mesh of one
        return _one_rank(cfg, mode)

    out = train(make_ops(mode), cfg.model, steps=cfg.steps, batch_size=cfg.global_batch, lr=cfg.lr,
                weight_decay=cfg.weight_decay, clip_grad=cfg.clip_grad, precision=cfg.precision,
                delayed_update=cfg.delayed_update, grads_fp32=cfg.grads_fp32)
    flat: dict[str, Any] = {f"loss[{i}]": v for i, v in enumerate(out["loss"])}
    for kind in KINDS:
        for name, value in out[kind].items():
            flat[f"{kind}.{name}"] = value
    return flat


def _one_rank(cfg: TrainingConfig, mode: str) -> dict[str, Any]:
    parallelism, mesh = Parallelism(data=cfg), DeviceMesh()
    run = simulate(composed, parallelism, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=1), mode=mode)
    return assemble(run.results, [mesh.coords(0)], parallelism)


reference.cache_clear = _reference.cache_clear  # type: ignore[attr-defined]
