"""What meta mode costs against pipeline depth (issue 36; not a test): the default GPT with one layer a
stage and one micro-batch, pp = layers = P, one step, in meta mode; the wall time of `run_scenario`
(CPU seconds on this machine) and the growth exponent between successive depths (1: linear; the
goal is at most 1.1).

    python benchmarks/pipeline_depth.py [--depths 64,128,256,512] [--schedule 1f1b]
"""

from __future__ import annotations

import argparse
import math
import time

from simcluster.config.scenario import build
from simcluster.run.runner import run_scenario


def seconds(P: int, schedule: str) -> float:
    sc = build({}, ["run.numerics=meta", "run.steps=1", f"model.layers={P}", f"parallel.pp={P}", "parallel.dp=1",
                    f"cluster.nodes={max(1, P // 8)}", "cluster.gpus_per_node=8" if P >= 8 else
                    f"cluster.gpus_per_node={P}", "model.global_batch=1", "model.micro_batch=1",
                    "model.tied_head=false", f"parallel.schedule={schedule}", "parallel.zero=0"])
    t = time.perf_counter()
    run_scenario(sc, trace=False)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depths", default="64,128,256,512")
    p.add_argument("--schedule", default="1f1b")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    print(f"| P | seconds | exponent since the previous |")
    print("|---|---|---|")
    last = None
    for P in depths:
        s = seconds(P, args.schedule)
        growth = "" if last is None else f"{math.log(s / last[1]) / math.log(P / last[0]):.2f}"
        print(f"| {P} | {s:.2f} | {growth} |", flush=True)
        last = (P, s)


if __name__ == "__main__":
    main()
