"""`simcluster list` (the scenarios in scenarios/, with what each shows) and `simcluster keys` (every
scenario key: its meaning, default and valid values; or the scenario file's JSON Schema)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from simcluster.config.json_schema import scenario_schema
from simcluster.config.scenario import ScenarioError, library, load


def add(sub: Any) -> None:
    listed = sub.add_parser("list", help="the scenarios in scenarios/, with what each shows",
                            description="List the library's scenarios with a one-line description.")
    listed.set_defaults(command_of=list_command)
    keys = sub.add_parser("keys", help="every scenario key: its meaning, default and valid values",
                          description="Print the keys a scenario file or --set takes, by section, with what each "
                                      "means, its default and the values it accepts.")
    keys.add_argument("which", nargs="?", metavar="SECTION|KEY",
                      help="one section (parallel) or one key (parallel.schedule); default: all")
    keys.add_argument("--json-schema", action="store_true",
                      help="print the scenario file's JSON Schema instead (for an editor's TOML support; "
                           "docs/scenario.schema.json is a copy)")
    keys.set_defaults(command_of=keys_command)


def list_command(args: argparse.Namespace, out: Console, err: Console) -> int:
    t = Table(title="scenarios (simcluster run NAME)", title_justify="left")
    t.add_column("name")
    t.add_column("what it shows")
    for f in library():
        t.add_row(escape(f.stem), escape(load(str(f)).description))
    out.print(t)
    return 0


def keys_command(args: argparse.Namespace, out: Console, err: Console) -> int:
    from simcluster.viz.keys_view import describe

    if args.json_schema:
        if args.which is not None:
            raise ScenarioError("keys --json-schema prints the whole scenario's schema: give no SECTION or KEY")
        out.print(json.dumps(scenario_schema(), indent=2), markup=False, highlight=False, soft_wrap=True)
        return 0
    out.print(describe(args.which, width=max(60, min(out.width, 100))), markup=False, highlight=False)
    return 0
