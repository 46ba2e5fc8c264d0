"""`simcluster export`: a scenario's trace for Perfetto / chrome://tracing, or as PyTorch profiler traces for
Holistic Trace Analysis."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rich.console import Console

from simcluster.cli.common import pick_variant, scenario_of, simulated
from simcluster.config.options import say_error, scenario_arguments, variant_argument
from simcluster.run.runner import Outcome
from simcluster.viz.outcome_view import repeated

EXPORT_EVENTS = 10_000_000  # beyond this, `export` of a folded run writes the simulated ranks only


def add(sub: Any) -> None:
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
    export.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    outcome = simulated(err, pick_variant(scenario_of(args), args.variant, err), args.fold)
    result = outcome.result
    whole = result.fold is None or len(result.trace) * result.fold.copies <= EXPORT_EVENTS
    trace = result.full_trace() if whole else result.trace
    try:
        where = write(trace, args, outcome)
    except OSError as exc:
        say_error(err, f"-o {args.output}: {exc.strerror or exc}")
        return 2
    out.print(f"wrote {len(trace)} events to {where}" + ("" if whole else
              f" (the simulated ranks: every rank would be {len(result.trace) * result.fold.copies:,} events; "
              f"{result.fold.describe()})") + repeated(outcome), markup=False)
    return 0


def write(trace: Any, args: argparse.Namespace, outcome: Outcome) -> str:
    """Write the trace in args.format; say where."""
    r = outcome.report
    about = {"scenario": outcome.scenario.name, "mesh": r["mesh"], "world_size": r["world_size"], "cluster": r["cluster"]}
    if args.format == "hta":
        from simcluster.viz import hta

        c = r["cluster"]
        docs = hta.rank_traces(trace, gpus_per_node=c["gpus_per_node"], device=c["device"],
                               memory_bytes=r["memory"]["capacity_bytes"], dtype=r["scenario"]["model"]["dtype"],
                               world_size=r["world_size"], metadata=about)
        paths = hta.write(Path(args.output), docs)
        return f"{args.output} ({len(paths)} files, rank-N.json)"
    from simcluster.viz.chrome import dumps

    Path(args.output).write_text(dumps(trace, title=outcome.scenario.name, metadata=about))
    return args.output
