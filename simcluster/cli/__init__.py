"""`simcluster COMMAND`: run, verify, list, keys, timeline, export, sweep, plan, calibrate, import, completion.
Run `simcluster COMMAND --help` for each.

One module a command (two for the pairs that share everything): each `add`s its parser to the
sub-commands and sets the function that runs it; this module parses, checks the options every command
shares, and turns a user's mistake into one line and exit status 2.

    run.py       run, verify          library.py   list, keys
    timeline.py  timeline             export.py    export
    sweep.py     sweep                plan.py      plan
    calibrate.py calibrate            imports.py   import
    completion.py completion
    common.py    what they share
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

from rich.console import Console

from simcluster import __version__
from simcluster.cli import calibrate, completion, export, imports, library, plan, run, sweep, timeline
from simcluster.config.options import check_options, checkpoint_overrides, say_error
from simcluster.config.scenario import ScenarioError
from simcluster.engine.errors import SimulationError
from simcluster.program.comm import ProgramError
from simcluster.report import document

COMMANDS = (run, library, timeline, export, sweep, plan, calibrate, imports, completion)  # `--help`'s order


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="simcluster", description=(
        "A deterministic emulator of a GPU training cluster: runs a parallel training program on "
        "every simulated rank, checks its numbers bit for bit against one device, and times it."))
    p.add_argument("--version", action="version", version=f"simcluster {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except BrokenPipeError:  # `simcluster run | head`
        return 0


def _main(argv: Sequence[str] | None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command is None:
        p.print_help()
        return 2
    args.parser = p  # (what `completion` completes)
    out, err = Console(highlight=False, record=bool(getattr(args, "svg", None))), Console(stderr=True, highlight=False)
    try:
        check_options(args)
        if hasattr(args, "overrides"):
            args.overrides = list(args.overrides) + checkpoint_overrides(args)
        return args.command_of(args, out, err)
    except (ScenarioError, SimulationError, ProgramError) as exc:
        say_error(err, str(exc))
        if getattr(args, "json", False):  # (`| jq` reads a document either way)
            sys.stdout.write(document({"error": str(exc), "exit_status": 2}) + "\n")
        return 2


__all__ = ["COMMANDS", "main", "parser"]
