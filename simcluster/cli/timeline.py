"""`simcluster timeline`: a scenario's timeline, one lane per rank and stream, or its pipeline picture."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from simcluster.cli.common import (pick_variant, ranks_of, scenario_of, simulated, svg_title, terminal_svg,
                                   write_svg)
from simcluster.config.options import say_error, scenario_arguments, variant_argument
from simcluster.viz.outcome_view import repeated
from simcluster.viz.timeline import Timeline


def add(sub: Any) -> None:
    timeline = sub.add_parser("timeline", help="draw a scenario's timeline",
                              description="Simulate SCENARIO and draw its timeline: one lane per rank and stream.")
    scenario_arguments(timeline)
    variant_argument(timeline)
    timeline.add_argument("--ranks", help="ranks to draw, e.g. 0,1,4 (default: all)")
    timeline.add_argument("--streams", help="streams to draw, e.g. compute,comm:dp (default: all)")
    timeline.add_argument("--start-us", type=float, help="start of the window, in microseconds")
    timeline.add_argument("--end-us", type=float, help="end of the window, in microseconds")
    timeline.add_argument("--width", type=int, help="width in columns (default: the terminal's)")
    timeline.add_argument("--svg", metavar="FILE", help="also save the picture as SVG")
    timeline.add_argument("--passes", action="store_true",
                          help="the pipeline picture instead: one row per stage, a cell per F/B/W pass in the "
                               "order they ran (every pass drawn; wider than the page, it goes on below)")
    timeline.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    scenario = scenario_of(args)
    ranks = ranks_of(args, scenario)
    scenario = pick_variant(scenario, args.variant, err)
    outcome = simulated(err, scenario, args.fold)
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
    width = args.width or out.width
    start = int(args.start_us * 1000) if args.start_us is not None else 0
    end = int(args.end_us * 1000) if args.end_us is not None else None
    if args.passes:
        from simcluster.viz.pipeline_picture import picture, svg

        chosen, names = stage_rows(result.mesh, ranks)
        if ranks is None and len(chosen) < result.mesh.world_size:
            out.print("(one rank per stage, those of data-parallel replica 0" + (", tp 0, cp 0" if
                      result.mesh.sizes["tp"] * result.mesh.sizes["cp"] > 1 else "") + "; --ranks draws others)",
                      markup=False)
        out.print(picture(trace, chosen, width=width, names=names), highlight=False, markup=False,
                  soft_wrap=True)
        if args.svg:  # (the whole picture, whatever the page's width: drawn, not a screenshot)
            write_svg(args.svg, svg(trace, chosen, names, title=svg_title("simcluster pipeline", scenario, args)))
        return 0
    out.print(Timeline(trace, width=width, ranks=ranks, start=start, end=end))
    if args.svg:
        write_svg(args.svg, terminal_svg(out, svg_title("simcluster timeline", scenario, args)))
    return 0


def stage_rows(mesh: Any, ranks: list[int] | None) -> tuple[list[int], dict[int, str]]:
    """The ranks a pipeline picture draws (default: one per stage, of the first replica) and each row's
    name: "stage s" for those, "rank r (stage s)" for ranks the user picked elsewhere."""
    first = [r for r in range(mesh.world_size) if all(v == 0 for a, v in mesh.coords(r).items() if a != "pp")]
    chosen = sorted(first, key=lambda r: mesh.coords(r)["pp"]) if ranks is None else list(ranks)
    plain = set(chosen) <= set(first)
    return chosen, {r: f"stage {mesh.coords(r)['pp']}" if plain else f"rank {r} (stage {mesh.coords(r)['pp']})"
                    for r in chosen}
