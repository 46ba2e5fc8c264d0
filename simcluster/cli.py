"""`simcluster run [SCENARIO] [--json] [--set key=value ...]`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from rich.console import Console

from simcluster.engine.errors import SimulationError
from simcluster.program.comm import ProgramError
from simcluster.runner import run_scenario
from simcluster.scenario import ScenarioError, all_keys, load
from simcluster.viz.report_view import ReportView
from simcluster.viz.timeline import Timeline


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simcluster", description=(
        "A deterministic emulator of a GPU training cluster: runs a parallel training program on "
        "every simulated rank, checks its numbers bit for bit against one device, and times it."))
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser("run", help="simulate a scenario, verify it, print the report and the timeline",
                         description="Simulate SCENARIO (a TOML file; the built-in default if omitted), verify "
                                     "it against a single-device run, and print the report and the timeline.")
    run.add_argument("scenario", nargs="?", help="scenario TOML file (default: the built-in default scenario)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a scenario key, e.g. --set parallel.tp=2 (repeatable). Keys: " + ", ".join(all_keys()))
    run.add_argument("--json", action="store_true", help="print the report as one JSON document instead")
    run.add_argument("--width", type=int, default=100, help="timeline width in columns (default 100)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    err = Console(stderr=True, highlight=False)
    try:
        scenario = load(args.scenario, args.overrides)
        outcome = run_scenario(scenario)
    except (ScenarioError, SimulationError, ProgramError) as exc:
        err.print(f"[bold red]error:[/] {exc}", markup=True, soft_wrap=True)
        return 2
    if args.json:
        sys.stdout.write(json.dumps(outcome.report, indent=2, sort_keys=True) + "\n")
    else:
        out = Console(highlight=False)
        out.print(ReportView(outcome.report))
        out.print()
        out.print("[bold]timeline[/] (one lane per rank and stream)", markup=True)
        out.print(Timeline(outcome.result.trace, width=args.width))
    return 0 if outcome.report["verification"].get("passed", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
