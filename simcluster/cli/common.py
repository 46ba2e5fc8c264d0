"""What the commands share: simulating a scenario with progress on the terminal, the exit status a run's
outcome gives, the variant of a comparison that `timeline` and `export` draw, pictures written to a file."""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console
from rich.markup import escape

from simcluster.config.options import ints, say_error, say_warnings
from simcluster.config.scenario import Scenario, ScenarioError, load
from simcluster.run.runner import Outcome, run_all
from simcluster.viz.report_view import format_bytes


def scenario_of(args: argparse.Namespace, extra: list[str] | None = None) -> Scenario:
    """The scenario the command line names, with its overrides (and `extra` after them)."""
    return load(args.scenario, list(args.overrides) + (extra or []), at_scale=args.at_scale)


def ranks_of(args: argparse.Namespace, scenario: Scenario) -> list[int] | None:
    """`--ranks`, each checked against the scenario's world."""
    ranks = ints(getattr(args, "ranks", None), "ranks")
    if ranks is not None and not all(0 <= r < scenario.world_size for r in ranks):
        raise ScenarioError(f"--ranks {args.ranks}: ranks are 0 to {scenario.world_size - 1} in this scenario")
    return ranks


def simulated(err: Console, scenario: Scenario, fold: bool = True, trace: bool = True) -> Outcome:
    """The scenario's warnings, then its run, with a transient spinner (a bar over the variants of a
    comparison) on an interactive stderr. `trace`: keep every event (what a timeline draws; a report
    alone needs none: runner.run_scenario)."""
    say_warnings(err, scenario)
    if not err.is_terminal:
        return run_all(scenario, fold=fold, trace=trace)
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = [SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err, transient=True) as progress:
        task = progress.add_task(escape(f"simulating {scenario.name}"), total=len(scenario.variants) or None)

        def on_variant(i: int, n: int, label: str) -> None:
            progress.update(task, completed=i, description=escape(f"simulating {scenario.name}: {label}"))

        outcome = run_all(scenario, on_variant, fold=fold, trace=trace)
        progress.update(task, completed=len(scenario.variants))
    return outcome


def passed(outcome: Outcome) -> bool:
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


def status(outcome: Outcome, err: Console) -> int:
    """0: verified (or nothing to verify) and fits; 1: a verification failed; 3: out of memory; 4: hung
    (a failed rank, [faults])."""
    stalled = hung(outcome)
    for line in stalled:
        say_error(err, line)
    oom = out_of_memory(outcome)
    for line in oom:
        say_error(err, line)
    return 4 if stalled else 1 if not passed(outcome) else 3 if oom else 0


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


def terminal_svg(console: Console, title: str) -> str:
    """What the console printed, as an SVG that needs nothing from outside: rich's picture without its
    web font (Fira Code from a CDN, which an offline renderer cannot fetch), in the reader's own
    monospace font; every character of a run of text at its own column (`_placed`), so columns line up
    whatever that font's width, in a browser, rsvg-convert or cairosvg."""
    svg = re.sub(r"@font-face\s*\{[^}]*\}\s*", "", console.export_svg(title=title))
    svg = svg.replace("font-family: Fira Code, monospace;", "font-family: monospace;")
    return _RUN.sub(_placed, svg)


# a run of text as rich writes it: its start, its width in the picture, its characters
_RUN = re.compile(r'(<text [^>]*?)x="([\d.]+)"([^>]*?) textLength="([\d.]+)"([^>]*)>([^<]*)</text>')


def _placed(m: re.Match[str]) -> str:
    """A run of text with each character at its own column: x lists one position a character (SVG 1.1,
    which every renderer reads), so no font's advance width can move a label (an offline renderer that
    stretched the run by its textLength alone drew the timeline's last axis label 13 px, a column,
    left of its place). A run whose characters are not one column each keeps its stretched width."""
    head, x, middle, length, tail, text = m.groups()
    plain = html.unescape(text)
    chars = len(plain)
    if chars <= 1 or cell_len(plain) != chars:
        return f'{head}x="{x}"{middle} lengthAdjust="spacingAndGlyphs" textLength="{length}"{tail}>{text}</text>'
    step = float(length) / chars  # (rich's: a character's cell)
    xs = " ".join(f"{float(x) + i * step:g}" for i in range(chars))
    return f'{head}x="{xs}"{middle}{tail}>{text}</text>'


def svg_title(what: str, scenario: Any, args: argparse.Namespace) -> str:
    """A picture's title that says which run it is: the scenario, --at-scale, the variant, every --set."""
    parts = [f"{what}: {scenario.name}"]
    if getattr(args, "at_scale", False):
        parts.append("--at-scale")
    if getattr(args, "variant", None) is not None:
        parts.append(f"--variant {args.variant}")
    parts += [f"--set {o}" for o in getattr(args, "overrides", [])]
    return " ".join(parts)


def write_svg(path: str, svg: str) -> None:
    """A picture written to `path`, or a ScenarioError saying why it cannot be (a full or read-only
    device, a missing folder)."""
    try:
        Path(path).write_text(svg, encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"--svg {path}: {exc.strerror or exc}") from None

