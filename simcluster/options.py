"""The command line's own values (widths, windows, rank lists, output paths), checked before any work:
the scenario's values are checked where they enter (scenario.py)."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from simcluster.scenario import ScenarioError

MIN_WIDTH, MAX_WIDTH = 20, 10_000
MAX_US = 1e12  # a window's ends: 11.6 days of simulated time


def ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ScenarioError(f"--{what} wants comma-separated integers, got {text!r}") from None


def writable(path: str, what: str) -> None:
    """Refuse, before any work, an output path that cannot be written: a folder, a missing folder, a
    folder or file without write permission, a name too long."""
    p = Path(path)
    if len(p.name.encode()) > 255:
        raise ScenarioError(f"{what} {path!r}: the file name is longer than 255 bytes")
    try:
        if p.is_dir():
            raise ScenarioError(f"{what} {path!r} is a folder; give a file name")
        folder = p.parent if str(p.parent) else Path(".")
        if not folder.is_dir():
            raise ScenarioError(f"{what} {path!r}: the folder {str(folder)!r} does not exist")
        if not os.access(folder, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
            raise ScenarioError(f"{what} {path!r}: no permission to write there")
    except OSError as exc:
        raise ScenarioError(f"{what} {path!r}: {exc.strerror or exc}") from None


def writable_folder(path: str, what: str) -> None:
    """Refuse, before any work, a folder that cannot be made or written: a file, no permission."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ScenarioError(f"{what} {path!r} is a file; this format writes a folder of files")
    existing = p
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not os.access(existing, os.W_OK):
        raise ScenarioError(f"{what} {path!r}: no permission to write there")


def check_options(args: argparse.Namespace) -> None:
    """The command line's own values, before any work (the scenario's are checked by scenario.py)."""
    width = getattr(args, "width", None)
    if width is not None and not MIN_WIDTH <= width <= MAX_WIDTH:
        raise ScenarioError(f"--width must be between {MIN_WIDTH} and {MAX_WIDTH} columns, got {width}")
    start, end = getattr(args, "start_us", None), getattr(args, "end_us", None)
    for name, v in (("--start-us", start), ("--end-us", end)):
        if v is not None and not (math.isfinite(v) and 0 <= v <= MAX_US):
            raise ScenarioError(f"{name} must be a number of microseconds from 0 to {MAX_US:g}, got {v}")
    if start is not None and end is not None and end <= start:
        raise ScenarioError(f"--end-us ({end:g}) must be after --start-us ({start:g})")
    for option, what in (("svg", "--svg"), ("output", "-o/--output")):
        if getattr(args, option, None):
            (writable_folder if getattr(args, "format", None) == "hta" else writable)(getattr(args, option), what)


def checkpoint_overrides(args: argparse.Namespace) -> list[str]:
    """`run`'s checkpoint options as the scenario keys they set (paths as TOML strings)."""
    out = []
    for option, key in (("save_checkpoint", "run.save_checkpoint"), ("resume", "run.resume")):
        if getattr(args, option, None) is not None:
            out.append(f"{key}={json.dumps(getattr(args, option))}")
    if getattr(args, "at_step", None) is not None:
        out.append(f"run.save_at_step={args.at_step}")
    return out
