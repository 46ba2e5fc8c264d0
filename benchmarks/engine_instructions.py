"""Instructions per run of the throughput benchmark's program (not a test): a figure that, unlike
wall time on a shared machine, does not move with the neighbours (within about 2%: hash
randomisation changes dict layouts). Needs valgrind; runs the program 1 and 3 times under
cachegrind and prints (I(3) - I(1)) / 2, so start-up and imports cancel.

    python benchmarks/engine_instructions.py [--kernels K]      (about 30 s)
    python benchmarks/engine_instructions.py --exact            (about 2 min)

--exact counts exact mode's arithmetic instead of the engine: two training steps of a small model
(2 layers, hidden 8) in a 4D layout (dp, pp, cp and tp 2, ring attention, ZeRO-3, bf16) on 16 simulated
ranks, as the bit-exact tests run it: most of its instructions are exact mode's, on small arrays.
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run_exact(times: int) -> None:
    from simcluster.engine import default_cluster, simulate
    from simcluster.model.config import ModelConfig
    from simcluster.parallel.composed import composed
    from simcluster.parallel.data_parallel import TrainingConfig
    from simcluster.parallel.parallelism import Parallelism
    from simcluster.program.mesh import DeviceMesh

    small = ModelConfig(layers=2, hidden=8, heads=4, ffn_hidden=4, seq=8, vocab=6, tied_head=False, dropout=0.1)
    data = TrainingConfig(model=small, global_batch=4, micro_batches=2, steps=2, precision="bf16", zero=3)
    for _ in range(times):
        gc.collect()
        simulate(composed, Parallelism(data=data, sp=True, attention="ring"), mesh=DeviceMesh(dp=2, pp=2, cp=2, tp=2),
                 cluster=default_cluster(16), mode="exact")


def run(times: int, kernels: int) -> None:
    from engine_throughput import many_small

    from simcluster.engine.gcpause import gc_paused
    from simcluster.engine.interpreter import Interpreter
    from simcluster.engine.timing import Replay
    from simcluster.program.mesh import DeviceMesh
    from simcluster.topology.cluster import Cluster
    from simcluster.topology.presets import preset

    mesh = DeviceMesh(dp=8, tp=8)
    cluster = Cluster(preset("dgx-a100", nodes=8, gpus_per_node=8))
    for _ in range(times):
        gc.collect()
        with gc_paused():
            interp = Interpreter(mesh, "meta", cost_dtype="bf16")
            interp.run(many_small, 100, kernels)
            Replay(interp.ranks, interp.calls, cluster, "bf16").run()
        del interp
    gc.collect()


def instructions(times: int, kernels: int, exact: bool) -> int:
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                          sys.executable, __file__, "--inner", str(times), "--kernels", str(kernels)]
                         + (["--exact"] if exact else []), capture_output=True, text=True, check=True).stderr
    return int(re.search(r"I\s+refs:\s+([\d,]+)", out).group(1).replace(",", ""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kernels", type=int, default=2, help="K as in engine_throughput.py (2: one kernel per event)")
    p.add_argument("--exact", action="store_true", help="count exact mode's arithmetic instead (two exact runs)")
    p.add_argument("--inner", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.inner:
        run_exact(args.inner) if args.exact else run(args.inner, args.kernels)
        return
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed; engine_throughput.py gives wall-clock figures without it")
    per_run = (instructions(3, args.kernels, args.exact) - instructions(1, args.kernels, args.exact)) / 2
    what = ("exact mode: a small model's 2 steps on 16 ranks, 4D" if args.exact
            else f"64 ranks, 100 rounds, K={args.kernels}")
    print(f"{per_run / 1e6:,.0f} M instructions per run ({what})")


if __name__ == "__main__":
    main()
