"""The commands beyond `run`: `export` and `sweep`, and the choices `timeline` and `export` make
(which variant of a comparison, which ranks a pipeline picture draws)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from simcluster.config.scenario import ScenarioError, all_keys
from simcluster.run.runner import Outcome


def pick_variant(scenario: Any, wanted: str | None, err: Console) -> Any:
    """One variant of a comparison (timeline and export draw one run), named on stderr."""
    if not scenario.variants:
        if wanted is not None:
            raise ScenarioError(f"--variant {wanted}: scenario {scenario.name!r} has no [compare] table")
        return scenario
    labels = [label for label, _ in scenario.variants]
    if wanted is None:
        i = 0
    elif wanted.isdigit() and 1 <= int(wanted) <= len(labels):
        i = int(wanted) - 1
    elif wanted in labels:
        i = labels.index(wanted)
    elif len(having := [n for n, label in enumerate(labels) if wanted in label]) == 1:
        i = having[0]
    else:
        raise ScenarioError(f"--variant {wanted}: the variants are 1 to {len(labels)}: " +
                            "; ".join(f"{n} {label!r}" for n, label in enumerate(labels, 1)))
    err.print(f"variant {i + 1} of {len(labels)}: {labels[i]}" +
              ("" if wanted is not None else " (--variant N picks another)"), markup=False, highlight=False)
    return scenario.variants[i][1]


def export(trace: Any, args: argparse.Namespace, outcome: Outcome) -> str:
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


def write_svg(path: str, svg: str) -> None:
    """A picture written to `path`, or a ScenarioError saying why it cannot be (a full or read-only
    device, a missing folder)."""
    try:
        Path(path).write_text(svg, encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"--svg {path}: {exc.strerror or exc}") from None


def sweep_command(args: argparse.Namespace, out: Console, err: Console) -> int:
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

    base, points = sweep(args.scenario, args.key, values, args.overrides, at_scale=args.at_scale, on_point=said)
    if args.json:
        sys.stdout.write(json.dumps(as_json(args.key, points), indent=2, sort_keys=True) + "\n")
    else:
        out.print(sweep_view.table(args.key, points, capacity(points)))
    if args.svg:
        write_svg(args.svg, sweep_view.svg(args.key, points, capacity(points), title=f"{base.name}: {args.key}"))
    if all(p.refused for p in points):
        return 2
    return 1 if any(p.verdict == "MISMATCH" for p in points) else 0


def stage_rows(mesh: Any, ranks: list[int] | None) -> tuple[list[int], dict[int, str]]:
    """The ranks a pipeline picture draws (default: one per stage, of the first replica) and each row's
    name: "stage s" for those, "rank r (stage s)" for ranks the user picked elsewhere."""
    first = [r for r in range(mesh.world_size) if all(v == 0 for a, v in mesh.coords(r).items() if a != "pp")]
    chosen = sorted(first, key=lambda r: mesh.coords(r)["pp"]) if ranks is None else list(ranks)
    plain = set(chosen) <= set(first)
    return chosen, {r: f"stage {mesh.coords(r)['pp']}" if plain else f"rank {r} (stage {mesh.coords(r)['pp']})"
                    for r in chosen}
