"""Seconds per training step of the reference model, exact mode against fast mode (not a test).

Target (issue 3): the 2-layer, hidden 64, 4 heads, sequence 32, batch 4, vocab 128 model under 0.5 s
per exact-mode step on one core, so that property tests can afford hundreds of examples.

    python benchmarks/exact_step.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import time

from simcluster.model.gpt import ModelConfig, train
from simcluster.numerics.modes import make_ops

MODELS = [
    ("tiny: L1 h16 a2 s8 b2 V32", ModelConfig(layers=1, hidden=16, heads=2, ffn_hidden=64, seq=8, vocab=32), 2),
    ("target: L2 h64 a4 s32 b4 V128", ModelConfig(layers=2, hidden=64, heads=4, ffn_hidden=256, seq=32, vocab=128), 4),
    ("target + dropout 0.1", ModelConfig(layers=2, hidden=64, heads=4, ffn_hidden=256, seq=32, vocab=128,
                                       dropout=0.1), 4),
    ("wider: L2 h128 a8 s64 b4 V256", ModelConfig(layers=2, hidden=128, heads=8, ffn_hidden=512, seq=64, vocab=256), 4),
]


def per_step(mode: str, cfg: ModelConfig, batch_size: int, steps: int) -> float:
    train(make_ops(mode), cfg, steps=1, batch_size=batch_size)  # warm-up
    t = time.perf_counter()
    train(make_ops(mode), cfg, steps=steps, batch_size=batch_size)
    return (time.perf_counter() - t) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    threads = os.environ.get("OMP_NUM_THREADS") or os.environ.get("OPENBLAS_NUM_THREADS") or "default"
    print(f"BLAS threads: {threads}")
    print(f"{'model':<32} {'params':>9} {'exact s/step':>13} {'fast s/step':>12} {'ratio':>6}")
    for name, cfg, b in MODELS:
        exact = per_step("exact", cfg, b, args.steps)
        fast = per_step("fast", cfg, b, args.steps)
        print(f"{name:<32} {cfg.parameters:>9,} {exact:>13.3f} {fast:>12.4f} {exact / fast:>6.0f}")


if __name__ == "__main__":
    main()
