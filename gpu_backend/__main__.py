"""Run a simcluster scenario on torch.distributed and put it beside the emulator's prediction.

    torchrun --nproc-per-node 4 -m gpu_backend SCENARIO [--set KEY=VALUE ...]   # torchrun's processes
    python -m gpu_backend SCENARIO [--set ...] [--nproc 4]                       # spawns its own
    simcluster run SCENARIO --backend torch                                      # the same, from simcluster

Every scenario `simcluster run` accepts, in exact or fast mode: gloo on CPU, NCCL on GPUs (one rank per
device). Before any process computes, the program runs on the emulator in meta mode and a mismatched
collective or a deadlock is refused with the emulator's diagnosis; while it runs, a collective that
does not finish within --watchdog seconds is reported (which call, which ranks joined) instead of hanging.
Exit status: 0 when the real run's outputs equal the emulator's and verify against one device, 1 when
not (or a rank failed), 2 for a mistake in the scenario or a program the preflight refuses.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import nullcontext
from typing import Any, Sequence

from rich.console import Console

from simcluster import checkpoint
from simcluster.config.options import say_error, say_warnings, scenario_arguments, torch_arguments, without_torch
from simcluster.config.scenario import Scenario, ScenarioError, load
from simcluster.engine.errors import SimulationError
from simcluster.program.comm import ProgramError
from simcluster.run.job import Job
from simcluster.run.runner import Outcome
from simcluster.viz.outcome_view import render_torch

EMULATOR_S = 3600.0  # under torchrun, how long the other ranks wait for rank 0's emulator run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gpu_backend", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    scenario_arguments(p, fold=False)
    torch_arguments(p)
    p.add_argument("--json", action="store_true", help="print the report as one JSON document instead")
    return p


def run(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Both ways in: under torchrun (RANK set) this process is one rank; otherwise spawn the ranks."""
    if without_torch(err, "the torch backend"):
        return 2
    from gpu_backend import scenario_run
    from gpu_backend.processes import LaunchError, check_backend
    from gpu_backend.backend import launch

    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        sc = load(args.scenario, args.overrides, at_scale=args.at_scale)
        job = scenario_run.prepare(sc, int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])) if under_torchrun \
            else job.mesh.world_size
        kind = check_backend(args.dist_backend, local)  # at once: nccl without CUDA is a mistake, not a hang
        scenario_run.check(sc, job)
    except (ScenarioError, SimulationError, ProgramError, LaunchError) as exc:
        say_error(err, str(exc))
        return 2
    if not under_torchrun or os.environ["RANK"] == "0":
        say_warnings(err, sc)
    try:
        # the checkpoint folder (if the run saves) locked by the process that commits the checkpoint
        with checkpoint.saving(sc) if not under_torchrun or os.environ["RANK"] == "0" else nullcontext():
            if under_torchrun:
                outcome = _as_torchrun_rank(sc, job, kind, args.watchdog, err)
                if isinstance(outcome, int):  # not rank 0 (0), or this rank failed (1, said on stderr)
                    return outcome
            else:
                if err.is_terminal:
                    err.print("the emulator's run (the prediction" + (", and the numbers to compare)" if
                              sc.run.verify else ")") + " ...", highlight=False)
                emulated = scenario_run.emulate(sc, job)
                if err.is_terminal:
                    err.print(f"running {job.mesh.world_size} processes on {kind} ...", highlight=False)
                runs = launch(job.program, *job.args, mesh=job.mesh, mode=job.mode, backend=kind,
                              timeout_s=args.timeout, watchdog_s=args.watchdog, check=False, digests=True,
                              expected=scenario_run.expected(sc, emulated))
                outcome = scenario_run.finish(sc, job, runs, kind, emulated)
    except LaunchError as exc:
        say_error(err, str(exc))
        return 1
    except ScenarioError as exc:  # a checkpoint folder another run is saving into; one that cannot be written
        say_error(err, str(exc))
        return 2
    return render_torch(outcome, out, args.json, getattr(args, "width", None) or out.width,
                        getattr(args, "summary", False))


def _as_torchrun_rank(sc: Scenario, job: Job, kind: str, watchdog_s: float, err: Console) -> Outcome | int:
    """This process as rank RANK of torchrun's WORLD_SIZE: rank 0 runs the emulator and hands each rank the
    digests of its expected outputs; each runs; rank 0 gathers the runs (digests, and the outputs that
    differ) and finishes."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gpu_backend import scenario_run
    from gpu_backend.backend import measured
    from gpu_backend.processes import keep_freed_memory

    device = torch.device("cpu")
    if kind == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()
    dist.init_process_group(kind, timeout=timedelta(seconds=watchdog_s))
    try:
        first = dist.get_rank() == 0
        # objects between the ranks over gloo, which waits as long as rank 0's emulator may take
        talk = dist.new_group(backend="gloo", timeout=timedelta(seconds=EMULATOR_S))
        emulated = scenario_run.emulate(sc, job) if first else None
        expected = scenario_run.expected(sc, emulated) if first else None
        mine_expected: list[Any] = [None]
        dist.scatter_object_list(mine_expected, expected, src=0, group=talk)
        try:
            mine = measured(job.program, job.args, job.mesh, mode=job.mode, device=device, watchdog_s=watchdog_s,
                            digests=True, expected=mine_expected[0])
        except Exception as exc:  # noqa: BLE001  (one line per failing rank, not a traceback each)
            text = str(exc) if isinstance(exc, ProgramError) else f"{type(exc).__name__}: {exc}"
            say_error(err, f"rank {dist.get_rank()}: {text}")
            return 1
        runs = [None] * dist.get_world_size() if first else None
        dist.gather_object(mine, runs, dst=0, group=talk)  # to rank 0 alone, which reports
        if not first:
            return 0
    finally:
        dist.destroy_process_group()
    return scenario_run.finish(sc, job, runs, kind, emulated)


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    return run(args, Console(highlight=False), Console(stderr=True, highlight=False))


if __name__ == "__main__":
    sys.exit(main())
