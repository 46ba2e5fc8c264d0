"""`simcluster plan`: the parallel layouts of a scenario's model on its cluster, estimated, the best
simulated, best first (simcluster.analysis.planner)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Any

from rich.console import Console

from simcluster.cli.common import scenario_of
from simcluster.config.options import scenario_arguments
from simcluster.config.scenario import ScenarioError
from simcluster.report import document

JOBS = 4  # plan's default simulations at a time (at most): each holds a simulation's memory


def add(sub: Any) -> None:
    plan = sub.add_parser("plan", help="search the parallel layouts of a scenario's model on its cluster, best first",
                          description="Keep SCENARIO's model, cluster and global batch; search TP, PP (1F1B, "
                                      "INTERLEAVED, ZB-H1, ZB-V), CP, DP, ZeRO stage, micro-batch size and "
                                      "recomputation. Every "
                                      "layout is estimated in closed form; the best that fit are simulated (meta "
                                      "mode) and printed by simulated step time. Exit status 3 when none fits.")
    scenario_arguments(plan)
    plan.add_argument("--simulate", type=int, default=8, metavar="K",
                      help="how many of the best estimated layouts to simulate (default 8)")
    plan.add_argument("--jobs", type=int, default=None, metavar="N",
                      help="simulations run at a time, each in a process of its own with its own memory (default: "
                           f"the CPUs, at most {JOBS}); the same table whatever N")
    plan.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                      help="run the simulations as tasks on a Ray cluster: alone, a local one started for the "
                           "plan (as ray.init() starts it); with an address, a running one (auto, or "
                           "ray://HEAD:10001), to which this simcluster is shipped. Needs pip install "
                           "'simcluster[ray]'; the same table as without")
    plan.add_argument("--json", action="store_true", help="print the search as one JSON document instead")
    plan.add_argument("--fix", action="append", default=[], metavar="FIELD=VALUES",
                      help="search only layouts whose FIELD takes one of VALUES (comma-separated), e.g. "
                           "--fix cp=1 --fix zero=0,1 --fix recompute=full; fields: tp, pp, cp, dp, zero, "
                           "micro_batch, recompute, schedule, ep, dispatcher (alltoall, allgather), virtual (the interleaved schedule's chunks a "
                           "stage; 2 unless fixed), sp (1: sequence parallelism with tp, the default; 0: without, "
                           "as Megatron-LM before 2022)")
    plan.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    """The search, with a bar over the simulations on an interactive stderr (a line for each elsewhere)."""
    from simcluster.analysis.planner import parse_fixed, search
    from simcluster.viz.plan_view import plan_data, plan_table

    scenario = scenario_of(args)
    if args.simulate < 1:
        raise ScenarioError(f"--simulate must be at least 1, got {args.simulate}")
    if args.jobs is not None and args.jobs < 1:
        raise ScenarioError(f"--jobs must be at least 1, got {args.jobs}")
    jobs = args.jobs or min(os.cpu_count() or 1, JOBS)
    fixed = parse_fixed(args.fix)
    with contextlib.ExitStack() as stack:
        if err.is_terminal:  # a bar over the simulations
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            progress = stack.enter_context(Progress(TextColumn("{task.description}"), BarColumn(),
                                                    TimeElapsedColumn(), console=err, transient=True))
            task = progress.add_task("estimating every layout", total=None)

            def on_simulate(i: int, n: int, layout: Any) -> None:
                progress.update(task, total=n, completed=i, description=f"simulating {layout.label()}")
        else:  # a log or a pipe: a line a simulation, which may take minutes at scale
            def on_simulate(i: int, n: int, layout: Any) -> None:
                err.print(f"simulating {i + 1} of {n}: {layout.label()}", highlight=False, soft_wrap=True)

        found = search(scenario, simulate=args.simulate, on_simulate=on_simulate, fold=args.fold, fixed=fixed,
                       jobs=jobs, ray=args.ray)
    if not found.rows:
        if not found.valid:
            err.print(f"[bold red]error:[/] no valid layout of {scenario.name!r} among the {found.examined} "
                      f"examined{' (with --fix)' if fixed else ''}", markup=True, soft_wrap=True)
            return 2
        err.print(f"[bold red]error:[/] out of memory: none of the {found.valid} valid layouts of {scenario.name!r} "
                  f"fits (by estimate) in the device's memory; add nodes or shrink the model", markup=True,
                  soft_wrap=True)
        return 3
    err.print(f"estimated {found.examined} layouts at {found.per_minute:,.0f} a minute", highlight=False)
    if args.json:
        sys.stdout.write(document(plan_data(found)) + "\n")
    else:
        out.print(plan_table(found, f"plan for {scenario.name!r}"))
    return 0 if any(r.report["memory"]["fits"] for r in found.rows) else 3
