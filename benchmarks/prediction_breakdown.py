"""Where a calibrated prediction of a torch run differs from the run, kernel by kernel (not a test).

One row of calibrated_prediction.py taken apart: the torch run (2 gloo ranks on this CPU, fast mode) with
every call of the program into the kernel set timed as calibrate's step profile times it
(gpu_backend/calibrate.py `TimedKernels`), and every wait for a collective timed by its kind and shape; beside
each kernel name, the time the emulator charges rank 0 for it under the profile. Calls that record no
kernel (the cost model charges them nothing) are named `<method>`; the emulator's collectives and the
kernels it charges that the run does not call appear with a measured time of 0.

    python benchmarks/prediction_breakdown.py PROFILE [--arch gpt] [--hidden 1024] [--dtype fp32]
                                              [--layout ddp] [--steps 4] [--rows 30]

PROFILE: a profile written by `simcluster calibrate --nproc 2`. Figures are seconds a step (wall clock,
each rank's own; the run's and the emulator's steps include the weights' initialisation, as
calibrated_prediction.py's do).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

from calibrated_prediction import scenario_sets  # (the row taken apart; this script's folder is on the path)
from gpu_backend import backend
from gpu_backend.processes import in_processes
from gpu_backend.step_profile import TimedKernels
from simcluster.config.scenario import load
from simcluster.run.job import job_of
from simcluster.run.runner import run_scenario


def rank(device: Any, program: Any, args: Any, mesh: Any) -> tuple[float, dict[str, float]]:
    """(In each rank's process.) The run's seconds, and seconds by kernel name and by collective waited for."""
    timed = TimedKernels()
    waits: dict[str, float] = {}
    wait = backend.TorchBackend.wait

    def timed_wait(self: Any, work: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return wait(self, work)
        finally:
            shape = tuple(work.op.tensor.shape) if work.op.tensor is not None else ()
            key = f"wait {work.op.kind.name.lower()} {shape}"
            waits[key] = waits.get(key, 0.0) + time.perf_counter() - t0
    backend.TorchBackend.wait = timed_wait
    run = backend.measured(program, args, mesh, mode="fast", device=device, kernels=timed.wrap)
    return run.seconds, timed.seconds | waits


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile")
    p.add_argument("--arch", default="gpt", choices=("gpt", "llama"))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--layout", default="ddp", choices=("ddp", "fsdp"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rows", type=int, default=30)
    a = p.parse_args()
    sc = load(None, scenario_sets(a.profile, a.arch, a.hidden, a.dtype, a.layout, a.steps))
    job = job_of(sc, fold=False)
    runs = in_processes(rank, (job.program, job.args, job.mesh), 2, "gloo", timeout_s=1800)
    emulated = run_scenario(replace(sc, run=replace(sc.run, numerics="meta")), fold=False)
    charged: dict[str, float] = {}
    for e in emulated.result.trace.events:
        if e.rank == 0:  # a kernel by its name past its label; a collective by its kind
            key = e.name.rpartition("/")[2] if e.group == "" else f"emulated {e.kind}"
            charged[key] = charged.get(key, 0.0) + (e.end - e.start) / 1e9
    n = a.steps
    print(f"{a.arch} h{a.hidden} {a.dtype} {a.layout}: measured {runs[0][0] / n:.3f} / {runs[1][0] / n:.3f} s a step "
          f"(ranks 0 / 1), predicted {emulated.report['total_time_ns'] / n / 1e9:.3f}")
    names = sorted(set(runs[0][1]) | set(charged), key=lambda k: -max(runs[0][1].get(k, 0.0), charged.get(k, 0.0)))
    print(f"{'kernel or wait':<44} {'rank 0':>8} {'rank 1':>8} {'charged':>8} {'ratio':>6}")
    for name in names[:a.rows]:
        m0, m1, c = runs[0][1].get(name, 0.0) / n, runs[1][1].get(name, 0.0) / n, charged.get(name, 0.0) / n
        print(f"{name[:44]:<44} {m0:8.4f} {m1:8.4f} {c:8.4f} {m0 / c if c else float('inf'):6.2f}")


if __name__ == "__main__":
    main()
