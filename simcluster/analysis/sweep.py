"""`simcluster sweep SCENARIO --key K --values a,b,c`: one run per value of a key, step time and peak
memory side by side, as a terminal chart and an SVG.

Sweeping a parallel degree (tp, pp, cp) keeps the cluster: dp follows, world / (pp x cp x tp), unless
the command line sets dp itself. A value the layout cannot take is a row saying why, not the end of
the sweep.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from simcluster.analysis.workers import in_order
from simcluster.config.scenario import Scenario, ScenarioError, load, parse_override
from simcluster.engine.errors import SimulationError
from simcluster.program.comm import ProgramError
from simcluster.run.runner import run_all

DEGREES = ("parallel.tp", "parallel.pp", "parallel.cp")


@dataclass(frozen=True)
class Point:
    value: str
    step_ns: int = 0
    peak_bytes: int = 0
    fits: bool = True
    verdict: str = ""
    refused: str = ""  # why this value could not run ("" when it ran)
    capacity_bytes: int = 0
    dp: int = 0  # the point's data-parallel degree (it follows a swept tp, pp or cp)


def overrides_for(base: Scenario, key: str, value: str, given: Sequence[str]) -> list[str]:
    """The --set list of one point: the user's, the swept value, and dp when a degree moves."""
    out = list(given) + [f"{key}={value}"]
    if key in DEGREES and "parallel.dp" not in {parse_override(o)[0] for o in given}:
        degree = parse_override(out[-1])[1]
        if isinstance(degree, int) and degree > 0:  # (anything else: the point's own load refuses it)
            p = dict(base.parallel.degrees, **{key.removeprefix("parallel."): degree})
            rest = p["pp"] * p["cp"] * p["tp"]
            if base.world_size % rest == 0:
                out.append(f"parallel.dp={base.world_size // rest}")
    return out


def sweep(name: str | None, key: str, values: Sequence[str], given: Sequence[str] = (), *, at_scale: bool = False,
          on_point: Callable[[int, int, str], None] | None = None, ray: str | None = None) -> tuple[Scenario, list[Point]]:
    """One point a value, in the values' order: here one after another, or as tasks on a Ray cluster
    (`ray`: workers.py), `on_point(i, n, value)` as each is waited for."""
    base = load(name, list(given), at_scale=at_scale)
    if base.variants:
        raise ScenarioError(f"scenario {base.name!r} has a [compare] table; sweep one of its variants with "
                            f"--set (a compared key picks one), or a scenario without one")
    announce = None if on_point is None else lambda i: on_point(i, len(values), values[i])
    sets = [overrides_for(base, key, value, given) for value in values]
    points = in_order(_point, list(zip(values, sets)), name, at_scale, ray=ray, announce=announce)
    return base, points


def _point(value_and_sets: tuple[str, list[str]], name: str | None, at_scale: bool) -> Point:
    """One value's run, or why it could not run."""
    value, sets = value_and_sets
    try:
        sc = load(name, sets, at_scale=at_scale)
        report = run_all(sc).report
    except (ScenarioError, SimulationError, ProgramError) as exc:
        return Point(value, refused=str(exc).splitlines()[0])
    v = report["verification"]
    verdict = "not verified" if not v.get("outputs_compared") else "bit-exact" if v.get("bit_exact") else \
        "within tolerance" if v.get("passed") else "MISMATCH"
    m = report["memory"]
    return Point(value, report["step_time_ns"], m["peak_bytes"], m["fits"], verdict,
                 capacity_bytes=m["capacity_bytes"], dp=sc.parallel.dp)


def capacity(points: list[Point]) -> int | None:
    """The device's memory, where the peaks come near it (above half): the scale memory is drawn at."""
    ran = [p for p in points if not p.refused]
    cap = min((p.capacity_bytes for p in ran), default=0)
    return cap if cap and 2 * max(p.peak_bytes for p in ran) > cap else None  # (none ran: cap is 0)


def as_json(key: str, points: list[Point]) -> dict[str, Any]:
    return {"key": key, "points": [p.__dict__ for p in points]}
