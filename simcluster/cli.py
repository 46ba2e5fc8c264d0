"""`simcluster COMMAND`: run, verify, list, keys, timeline, export, sweep, plan, calibrate. Run `simcluster COMMAND --help` for each."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from simcluster.commands import export, pick_variant, stage_rows, sweep_command, write_svg
from simcluster.config.options import (check_options, checkpoint_overrides, ints, say_error, say_warnings,
                                       scenario_arguments, torch_arguments, variant_argument, without_torch)
from simcluster.config.scenario import ScenarioError, library, load
from simcluster.engine.errors import SimulationError
from simcluster.program.comm import ProgramError
from simcluster.run.runner import Outcome, run_all
from simcluster.viz.outcome_view import render, repeated
from simcluster.viz.report_view import format_bytes
from simcluster.viz.timeline import Timeline


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simcluster", description=(
        "A deterministic emulator of a GPU training cluster: runs a parallel training program on "
        "every simulated rank, checks its numbers bit for bit against one device, and times it."))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="simulate a scenario, verify it, print the report and the timeline",
                         description="Simulate SCENARIO, verify it against a single-device run, and print the report "
                                     "and the timeline (a table of the variants for a scenario with [compare]). "
                                     "Exit status 0 when it verifies and fits in the devices' memory, 1 when "
                                     "verification fails, 2 for a mistake in the scenario, 3 when a rank's peak "
                                     "memory exceeds its device's (a real run would die of OOM), 4 when a failed "
                                     "rank ([faults]) leaves the others hanging.")
    scenario_arguments(run)
    run.add_argument("--json", action="store_true", help="print the report as one JSON document instead")
    run.add_argument("--width", type=int, default=100, help="timeline width in columns (default 100)")
    run.add_argument("--svg", metavar="FILE", help="also save what is printed as an SVG picture")
    run.add_argument("--backend", default="emulator", choices=("emulator", "torch"),
                     help="emulator (default), or torch: run the scenario's ranks as processes on torch.distributed "
                          "and report them beside the emulator's prediction (needs the torch extra)")
    ck = run.add_argument_group("checkpoints (run.program = gpt, exact or fast mode; docs/checkpoint.md)")
    ck.add_argument("--save-checkpoint", metavar="DIR", help="write a checkpoint to the folder DIR (made if missing): "
                    "each rank its own shards, then a manifest; sets run.save_checkpoint")
    ck.add_argument("--at-step", type=int, metavar="K", help="save after K steps (default: after the last); sets "
                    "run.save_at_step")
    ck.add_argument("--resume", metavar="DIR", help="start from the checkpoint in DIR, under this scenario's layout, "
                    "whatever layout saved it; sets run.resume")
    torch_arguments(run)
    verify = sub.add_parser("verify", help="check a scenario's numbers against one device, and nothing else",
                            description="Run SCENARIO in exact mode and compare every output with the single-device "
                                        "run byte for byte. Exit status 0 when bit-exact, 1 when not.")
    scenario_arguments(verify)
    sub.add_parser("list", help="the scenarios in scenarios/, with what each shows",
                   description="List the library's scenarios with a one-line description.")
    keys = sub.add_parser("keys", help="every scenario key: its meaning, default and valid values",
                          description="Print the keys a scenario file or --set takes, by section, with what each "
                                      "means, its default and the values it accepts.")
    keys.add_argument("which", nargs="?", metavar="SECTION|KEY",
                      help="one section (parallel) or one key (parallel.schedule); default: all")
    timeline = sub.add_parser("timeline", help="draw a scenario's timeline",
                              description="Simulate SCENARIO and draw its timeline: one lane per rank and stream.")
    scenario_arguments(timeline)
    variant_argument(timeline)
    timeline.add_argument("--ranks", help="ranks to draw, e.g. 0,1,4 (default: all)")
    timeline.add_argument("--streams", help="streams to draw, e.g. compute,comm:dp (default: all)")
    timeline.add_argument("--start-us", type=float, help="start of the window, in microseconds")
    timeline.add_argument("--end-us", type=float, help="end of the window, in microseconds")
    timeline.add_argument("--width", type=int, default=100, help="width in columns (default 100)")
    timeline.add_argument("--svg", metavar="FILE", help="also save the picture as SVG")
    timeline.add_argument("--passes", action="store_true",
                          help="the pipeline picture instead: one row per rank, numbered F/B/W passes")
    export = sub.add_parser("export", help="write a scenario's trace for Perfetto / chrome://tracing, or for HTA",
                            description="Simulate SCENARIO and write its trace: in the Chrome trace event format "
                                        "(Perfetto, chrome://tracing: one process per rank, arrows between the ranks "
                                        "of a collective and from each send to its receive, memory counters), or as "
                                        "PyTorch profiler traces, one file per rank, for Holistic Trace Analysis.")
    scenario_arguments(export)
    variant_argument(export)
    export.add_argument("-o", "--output", required=True,
                        help="where to write the trace: a JSON file (chrome), a directory (hta)")
    export.add_argument("--format", choices=("chrome", "hta"), default="chrome",
                        help="chrome (default): one JSON file; hta: rank-N.json per rank in the layout HTA's "
                             "TraceAnalysis(trace_dir=...) reads")
    sweep = sub.add_parser("sweep", help="one run per value of a key: step time and peak memory side by side",
                           description="Run SCENARIO once per value of KEY and chart step time and peak memory "
                                       "against it. Sweeping parallel.tp, pp or cp keeps the cluster: dp follows "
                                       "(world / (pp x cp x tp)) unless --set gives it. A value the layout cannot "
                                       "take is a row saying why.")
    scenario_arguments(sweep, fold=False)
    sweep.add_argument("--key", required=True, help="the key to sweep, e.g. parallel.tp (see `simcluster keys`)")
    sweep.add_argument("--values", required=True, help="its values, comma-separated, e.g. 1,2,4,8")
    sweep.add_argument("--svg", metavar="FILE", help="also write the chart as SVG")
    sweep.add_argument("--json", action="store_true", help="print the points as JSON instead")
    plan = sub.add_parser("plan", help="search the parallel layouts of a scenario's model on its cluster, best first",
                          description="Keep SCENARIO's model, cluster and global batch; search TP, PP (1F1B or "
                                      "interleaved), CP, DP, ZeRO stage, micro-batch size and recomputation. Every "
                                      "layout is estimated in closed form; the best that fit are simulated (meta "
                                      "mode) and printed by simulated step time. Exit status 3 when none fits.")
    scenario_arguments(plan)
    plan.add_argument("--simulate", type=int, default=8, metavar="K",
                      help="how many of the best estimated layouts to simulate (default 8)")
    plan.add_argument("--jobs", type=int, default=None, metavar="N",
                      help="simulations run at a time, each in a process of its own with its own memory (default: "
                           f"the CPUs, at most {JOBS}); the same table whatever N")
    plan.add_argument("--json", action="store_true", help="print the search as one JSON document instead")
    plan.add_argument("--fix", action="append", default=[], metavar="FIELD=VALUES",
                      help="search only layouts whose FIELD takes one of VALUES (comma-separated), e.g. "
                           "--fix cp=1 --fix zero=0,1 --fix recompute=full; fields: tp, pp, cp, dp, zero, "
                           "micro_batch, recompute, schedule, virtual (the interleaved schedule's chunks a "
                           "stage; 2 unless fixed), sp (1: sequence parallelism with tp, the default; 0: without, "
                           "as Megatron-LM before 2022)")
    cal = sub.add_parser("calibrate", help="measure this machine and write a hardware profile for cluster.profile",
                         description="Measure the machine this runs on with torch (its GPU if it has one, else the "
                                     "CPU): GEMM throughput on a grid of shapes per dtype, attention's batched "
                                     "products, memory bandwidth, the smallest kernel's time, and all-reduce bus "
                                     "bandwidth by message size over --nproc ranks (gloo on CPU, NCCL on GPUs). "
                                     "Writes a profile that a scenario uses with cluster.profile = \"FILE\" "
                                     "(needs the torch extra).")
    cal.add_argument("-o", "--output", default="profile.toml", help="where to write the profile (default profile.toml)")
    cal.add_argument("--nproc", type=int, default=2,
                     help="ranks for the all-reduce measurement (default 2; 1 measures no links)")
    cal.add_argument("--dist-backend", default="auto", choices=("auto", "gloo", "nccl"),
                     help="nccl when CUDA is present, else gloo (default: auto)")
    cal.add_argument("--dtypes", default="bf16,fp32", help="GEMM dtypes to measure, comma-separated (default "
                                                           "bf16,fp32; fp16 is timed as bf16 when not measured)")
    cal.add_argument("--quick", action="store_true", help="a smaller grid: seconds instead of a minute")
    cal.add_argument("--timeout", type=float, default=600.0, metavar="S",
                     help="give up on the all-reduce processes after S seconds (default 600)")
    return p


def _calibrate(args: argparse.Namespace, out: Console, err: Console) -> int:
    if without_torch(err, "calibrate"):
        return 2
    from gpu_backend.calibrate import command

    return command(args, out, err)


JOBS = 4  # plan's default simulations at a time (at most): each holds a simulation's memory
EXPORT_EVENTS = 10_000_000  # beyond this, `export` of a folded run writes the simulated ranks only


def _with_progress(err: Console, scenario: Any, fold: bool = True) -> Outcome:
    """Run, with a transient spinner (a bar over the variants of a comparison) on an interactive stderr."""
    if not err.is_terminal:
        return run_all(scenario, fold=fold)
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(escape(f"simulating {scenario.name}"), total=len(scenario.variants) or None)

        def on_variant(i: int, n: int, label: str) -> None:
            progress.update(task, completed=i, description=escape(f"simulating {scenario.name}: {label}"))

        outcome = run_all(scenario, on_variant, fold=fold)
        progress.update(task, completed=len(scenario.variants))
    return outcome


def _passed(outcome: Outcome) -> bool:
    reports = [o.report for _, o in outcome.variants] or [outcome.report]
    return all(r["verification"].get("passed", True) for r in reports)


def out_of_memory(outcome: Outcome) -> list[str]:
    """One line per run whose peak exceeds the device's memory: a real run would die there."""
    labelled = [(label, o.report) for label, o in outcome.variants] or [(outcome.scenario.name, outcome.report)]
    return [f"{label}: out of memory: rank peak {format_bytes(m['peak_bytes'])} > {format_bytes(m['capacity_bytes'])} "
            f"on the {r['cluster']['device']} ({m['ranks_over']} of {r['world_size']} ranks over)"
            for label, r in labelled if not (m := r["memory"])["fits"]]


def hung(outcome: Outcome) -> list[str]:
    """The watchdogs' lines of each run that a failed rank left hanging (the first few ranks')."""
    labelled = [(label, o) for label, o in outcome.variants] or [(outcome.scenario.name, outcome)]
    out = []
    for label, o in labelled:
        hang = o.result.hang
        if hang is not None:
            out.append(f"{label}: the run hung: rank {hang.rank} failed at {hang.at_ns / 1e3:,.1f} us")
            out += [s.line() for s in hang.stuck[:4]]
            if len(hang.stuck) > 4:
                out.append(f"... and {len(hang.stuck) - 4} more ranks' watchdogs (--json lists them)")
    return out


def _status(outcome: Outcome, err: Console) -> int:
    """0: verified (or nothing to verify) and fits; 1: a verification failed; 3: out of memory; 4: hung
    (a failed rank, [faults])."""
    stalled = hung(outcome)
    for line in stalled:
        say_error(err, line)
    oom = out_of_memory(outcome)
    for line in oom:
        say_error(err, line)
    return 4 if stalled else 1 if not _passed(outcome) else 3 if oom else 0


def _plan(scenario: Any, args: argparse.Namespace, out: Console, err: Console) -> int:
    """`simcluster plan`: the search, with a bar over the simulations on an interactive stderr (a line
    for each elsewhere)."""
    from simcluster.analysis.planner import parse_fixed, search
    from simcluster.viz.plan_view import plan_data, plan_table

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
                       jobs=jobs)
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
        sys.stdout.write(json.dumps(plan_data(found), indent=2, sort_keys=True) + "\n")
    else:
        out.print(plan_table(found, f"plan for {scenario.name!r}"))
    return 0 if any(r.report["memory"]["fits"] for r in found.rows) else 3


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # `simcluster run | head`
        return 0


def _main(argv: Sequence[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    out, err = Console(highlight=False, record=bool(getattr(args, "svg", None))), Console(stderr=True, highlight=False)
    try:
        check_options(args)
        if hasattr(args, "overrides"):
            args.overrides = list(args.overrides) + checkpoint_overrides(args)
        if args.command == "list":
            t = Table(title="scenarios (simcluster run NAME)", title_justify="left")
            t.add_column("name")
            t.add_column("what it shows")
            for f in library():
                t.add_row(escape(f.stem), escape(load(str(f)).description))
            out.print(t)
            return 0
        if args.command == "keys":
            from simcluster.viz.keys_view import describe

            out.print(describe(args.which, width=max(60, min(out.width, 100))), markup=False, highlight=False)
            return 0
        if args.command == "sweep":
            return sweep_command(args, out, err)
        if args.command == "calibrate":
            return _calibrate(args, out, err)
        if args.command == "run" and args.backend == "torch":
            from gpu_backend.__main__ import run as run_on_torch  # (needs no torch to say it needs torch)

            return run_on_torch(args, out, err)
        overrides = list(args.overrides) + (["run.numerics=exact", "run.verify=true"] if args.command == "verify" else [])
        scenario = load(args.scenario, overrides, at_scale=args.at_scale)
        ranks = ints(getattr(args, "ranks", None), "ranks")
        if ranks is not None and not all(0 <= r < scenario.world_size for r in ranks):
            raise ScenarioError(f"--ranks {args.ranks}: ranks are 0 to {scenario.world_size - 1} in this scenario")
        if args.command == "plan":
            return _plan(scenario, args, out, err)
        if args.command in ("timeline", "export"):
            scenario = pick_variant(scenario, args.variant, err)
        say_warnings(err, scenario)
        outcome = _with_progress(err, scenario, getattr(args, "fold", True))
    except (ScenarioError, SimulationError, ProgramError) as exc:
        say_error(err, str(exc))
        return 2
    if args.command == "export":
        result = outcome.result
        whole = result.fold is None or len(result.trace) * result.fold.copies <= EXPORT_EVENTS
        trace = result.full_trace() if whole else result.trace
        try:
            where = export(trace, args, outcome)
        except OSError as exc:
            say_error(err, f"-o {args.output}: {exc.strerror or exc}")
            return 2
        out.print(f"wrote {len(trace)} events to {where}" + ("" if whole else
                  f" (the simulated ranks: every rank would be {len(result.trace) * result.fold.copies:,} events; "
                  f"{result.fold.describe()})") + repeated(outcome), markup=False)
        return 0
    if args.command == "timeline":
        result = outcome.result
        if result.repeated or result.micro:
            out.print(f"({repeated(outcome).lstrip('; ')})", markup=False)
        if result.fold is not None and ranks is None:  # the representatives, each standing for its peers
            out.print(f"(folded: {result.fold.describe()}; --ranks draws any rank)", markup=False)
            trace = result.trace
        else:
            trace = result.full_trace(ranks)
        if args.streams:
            keep = set(args.streams.split(","))
            present = sorted({name for _, name in trace.lanes})
            if not keep & set(present):
                say_error(err, f"--streams {args.streams}: no such stream here; the streams are {', '.join(present)}")
                return 2
            trace = type(trace)([e for e in trace if e.stream in keep], [l for l in trace.lanes if l[1] in keep])
        start = int(args.start_us * 1000) if args.start_us is not None else 0
        end = int(args.end_us * 1000) if args.end_us is not None else None
        if args.passes:
            from simcluster.viz.pipeline_picture import picture

            chosen, names = stage_rows(result.mesh, ranks)
            if ranks is None and len(chosen) < result.mesh.world_size:
                out.print("(one rank per stage, those of data-parallel replica 0" + (", tp 0, cp 0" if
                          result.mesh.sizes["tp"] * result.mesh.sizes["cp"] > 1 else "") + "; --ranks draws others)",
                          markup=False)
            out.print(picture(trace, chosen, width=args.width, names=names), highlight=False, markup=False,
                      soft_wrap=True)
        else:
            out.print(Timeline(trace, width=args.width, ranks=ranks, start=start, end=end))
        if args.svg and not _svg(args.svg, out.export_svg(title=f"simcluster timeline: {scenario.name}"), err):
            return 2
        return 0
    if args.command == "verify":
        labelled = [(label, o.report) for label, o in outcome.variants] or [(scenario.name, outcome.report)]
        for label, r in labelled:
            v = r["verification"]
            out.print(f"{label}: " + ("bit-exact" if v.get("bit_exact") else
                                      v.get("status") or f"MISMATCH {v.get('mismatches', [])[:1]}")
                      + f" ({v.get('outputs_compared', 0)} outputs)")
        return 0 if _passed(outcome) else 1
    if args.json:
        sys.stdout.write(json.dumps(outcome.report, indent=2, sort_keys=True) + "\n")
    else:
        render(outcome, out, args.width)
    if getattr(args, "svg", None) and not _svg(args.svg, out.export_svg(title=f"simcluster: {scenario.name}"), err):
        return 2
    return _status(outcome, err)


def _svg(path: str, svg: str, err: Console) -> bool:
    """commands.write_svg, its refusal said in one line (False)."""
    try:
        write_svg(path, svg)
    except ScenarioError as exc:
        say_error(err, str(exc))
        return False
    return True


if __name__ == "__main__":
    raise SystemExit(main())
