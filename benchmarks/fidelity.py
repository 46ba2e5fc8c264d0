"""Predicted against published: Megatron-LM's weak-scaling table (not a test).

Runs each row of benchmarks/megatron_table1.toml (Narayanan et al. 2021, Table 1: GPT 1.7B on 32
A100s to 1T on 3,072) in meta mode, folded, and prints the predicted TFLOP/s per GPU (the report's
`tflops_per_gpu`: Megatron's Eq. 3 FLOPs over the simulated step) beside the paper's, with the
simulation's own wall time and peak memory (this process's resident set, which only grows: the
figure for a row is the most any row so far needed). The error's mean and maximum end the table.

    python benchmarks/fidelity.py [--rows 1-4] [--set cluster.profile=a100.toml]

`--set` overrides a key in every row: with a profile that `simcluster calibrate` measured on an A100
(ideally under the 2021 software stack), the kernels run at the measured rates instead of the
preset's datasheet-and-MAMF figures.
"""

from __future__ import annotations

import argparse
import resource
import time

from simcluster.run.runner import run_scenario
from table1 import arguments, table

PAPER = [137, 138, 142, 135, 138, 140, 148, 155, 163, 163]  # TFLOP/s per GPU, Table 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    arguments(p, "1-10")
    args = p.parse_args()
    sc, rows = table(args, __file__)
    print(f"{'row':>3} {'GPUs (TPxPPxDP)':<20} {'predicted':>9} {'paper':>6} {'error':>7} {'MFU':>6} "
          f"{'memory/GPU':>10} {'sim s':>6} {'sim GB':>7}")
    errors = []
    for i in rows:
        label, v = sc.variants[i - 1]
        t = time.perf_counter()
        r = run_scenario(v, trace=False).report  # (the report only: no events kept for a timeline)
        wall = time.perf_counter() - t
        m = r["mesh"]
        layout = f"{r['world_size']} ({m['tp']}x{m['pp']}x{m['dp']})"
        err = r["tflops_per_gpu"] / PAPER[i - 1] - 1
        errors.append(err)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        fits = "" if r["memory"]["fits"] else " OOM"
        print(f"{i:>3} {layout:<20} {r['tflops_per_gpu']:>9.1f} {PAPER[i - 1]:>6} {100 * err:>+6.1f}% "
              f"{100 * r['mfu']:>5.1f}% {r['memory']['peak_bytes'] / 1e9:>8.1f}GB{fits} {wall:>6.1f} {rss:>7.2f}",
              flush=True)
    print(f"mean |error| {100 * sum(abs(e) for e in errors) / len(errors):.1f} %, "
          f"max |error| {100 * max(abs(e) for e in errors):.1f} %")


if __name__ == "__main__":
    main()
