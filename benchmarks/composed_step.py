"""Seconds per training step of the composed program in exact mode, on 16 emulated ranks (not a test).

Issue 11 asks for the figure: the exact-mode 4D run of a 2-layer model on 16 ranks. Each row runs the
same model (2 layers, hidden 64, 8 heads, sequence 32, 4 sequences of 2 micro-batches per replica,
bf16) under one layout, two steps, and divides the wall time of the whole simulation (both passes:
the ranks' programs and the timed replay) by the steps; the single-device reference beside it.

    python benchmarks/composed_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import time

from simcluster.engine import simulate
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import Parallelism
from simcluster.parallel.reference import reference
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

LAYOUTS = [  # (label, mesh degrees, parallelism options)
    ("dp16, ZeRO-3", dict(dp=16), dict()),
    ("tp4 sp x dp4", dict(dp=4, tp=4), dict(sp=True)),
    ("pp2 x cp2 x tp2 x dp2, ring", dict(dp=2, pp=2, cp=2, tp=2), dict(sp=True, attention="ring")),
    ("pp2 x cp2 x tp2 x dp2, ulysses", dict(dp=2, pp=2, cp=2, tp=2), dict(sp=True, attention="ulysses")),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    print(f"{'arch':<6} {'layout':<32} {'ranks':>5} {'s/step':>8} {'one device s/step':>18}")
    for arch in ("gpt", "llama"):
        model = ModelConfig(layers=2, hidden=64, heads=8, ffn_hidden=256, seq=32, vocab=128, tied_head=False,
                          arch=arch, kv_heads=4 if arch == "llama" else None, dropout=0.1)
        for label, degrees, options in LAYOUTS:
            dp = degrees.get("dp", 1)
            zero = 3 if "ZeRO-3" in label else 1
            data = TrainingConfig(model=model, global_batch=4 * dp, micro_batches=2, steps=args.steps, precision="bf16",
                            zero=zero, clip_grad=1.0, weight_decay=0.1)
            mesh = DeviceMesh(**degrees)
            t = time.perf_counter()
            simulate(composed, Parallelism(data=data, **options), mesh=mesh,
                     cluster=preset("dgx-a100", nodes=2, gpus_per_node=8))
            per = (time.perf_counter() - t) / args.steps
            reference.cache_clear()
            t = time.perf_counter()
            reference(data)
            one = (time.perf_counter() - t) / args.steps
            print(f"{arch:<6} {label:<32} {mesh.world_size:>5} {per:>8.2f} {one:>18.3f}")


if __name__ == "__main__":
    main()
