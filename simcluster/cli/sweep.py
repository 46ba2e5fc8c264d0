"""`simcluster sweep`: one run per value of a key, step time and peak memory side by side."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rich.console import Console

from simcluster.cli.common import svg_title, write_svg
from simcluster.config.options import scenario_arguments
from simcluster.config.scenario import ScenarioError, all_keys
from simcluster.report import document


def add(sub: Any) -> None:
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
    sweep.add_argument("--ray", nargs="?", const="local", default=None, metavar="ADDRESS",
                       help="run the points as tasks on a Ray cluster: alone, a local one started for the sweep; "
                            "with an address, a running one (auto, or ray://HEAD:10001). Needs pip install "
                            "'simcluster[ray]'; the same points as without")
    sweep.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    from simcluster.analysis.sweep import as_json, capacity, sweep
    from simcluster.viz import sweep_view

    if args.key not in all_keys():
        raise ScenarioError(f"--key {args.key!r} is not a scenario key; `simcluster keys` lists them")
    values = [v.strip() for v in args.values.split(",") if v.strip()]
    if not values:
        raise ScenarioError("--values needs at least one value, e.g. --values 1,2,4,8")

    def said(i: int, n: int, value: str) -> None:
        if err.is_terminal:
            err.print(f"({i + 1}/{n}) {args.key}={value}", markup=False, highlight=False)

    base, points = sweep(args.scenario, args.key, values, args.overrides, at_scale=args.at_scale, on_point=said,
                         ray=args.ray)
    if args.json:
        sys.stdout.write(document(as_json(args.key, points)) + "\n")
    else:
        out.print(sweep_view.table(args.key, points, capacity(points)))
    if args.svg:
        write_svg(args.svg, sweep_view.svg(args.key, points, capacity(points), title=svg_title(f"sweep of {args.key}", base, args)))
    if all(p.refused for p in points):
        return 2
    return 1 if any(p.verdict == "MISMATCH" for p in points) else 0
