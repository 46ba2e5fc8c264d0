"""The command line's own options, shared by every command (simcluster.cli, gpu_backend's): the arguments
that name a scenario and a torch run, the one-line error and warnings, and the command line's own values
(widths, windows, rank lists, output paths), checked before any work; the scenario's values are checked
where they enter (scenario.py). A leaf: it imports no command."""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path

from typing import Any

from rich.console import Console
from rich.markup import escape

from simcluster.config.scenario import ScenarioError, all_keys

MIN_WIDTH, MAX_WIDTH = 20, 10_000
MAX_US = 1e12  # a window's ends: 11.6 days of simulated time


def ints(text: str | None, what: str) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ScenarioError(f"--{what} wants comma-separated integers, got {text!r}") from None
    if not out:
        raise ScenarioError(f"--{what} wants at least one integer, e.g. --{what} 0,1; got {text!r}")
    return out


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


def scenario_arguments(p: argparse.ArgumentParser, optional: bool = True, fold: bool = True) -> None:
    p.add_argument("scenario", nargs="?" if optional else None,
                   help="a scenario file, or the name of one in scenarios/ (see `simcluster list`)"
                        + ("; default: the built-in default scenario" if optional else ""))
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a scenario key, e.g. --set parallel.tp=2 (repeatable): one of {len(all_keys())} in the "
                        f"sections {', '.join(sorted({k.split('.')[0] for k in all_keys() if '.' in k}))}; "
                        f"`simcluster keys [SECTION]` lists them with their meanings")
    p.add_argument("--at-scale", action="store_true",
                   help="apply the scenario's [at_scale] overrides first: a realistic size, in meta mode")
    if not fold:
        return
    p.add_argument("--no-fold", dest="fold", action="store_false",
                   help="in meta mode, simulate every rank instead of letting one stand for its identical peers "
                        "(data-parallel replicas, tensor-parallel peers): the same results, slower")


def variant_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variant", metavar="N|LABEL",
                   help="for a scenario with a [compare] table: which variant, by number from 1, by label or by "
                        "a part of one label (default: the first)")


def without_torch(err: Console, what: str) -> bool:
    """True, having said so in one line, when torch (the gpu_backend extra) is not installed."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        return False
    say_error(err, f"{what} needs torch: pip install 'simcluster[torch]' (the CPU build: torch==2.13.0)")
    return True


def say_error(err: Console, text: str) -> None:
    """One red 'error:' line (the text verbatim: a [compare] in it is not markup)."""
    err.print("[bold red]error:[/] " + escape(text), markup=True, soft_wrap=True, highlight=False)


def say_warnings(err: Console, scenario: Any) -> None:
    """A 'note:' line for what the command line did (to the [compare] table, to fit a layout); a yellow
    'warning:' line for each setting that does nothing in the scenario's layout."""
    for line in scenario.notes:
        err.print("[bold]note:[/] " + escape(line), markup=True, soft_wrap=True, highlight=False)
    for line in scenario.warnings():
        err.print("[bold yellow]warning:[/] " + escape(line), markup=True, soft_wrap=True, highlight=False)


def torch_arguments(p: argparse.ArgumentParser) -> None:
    """The options of a run on torch.distributed (`run --backend torch`, `python -m gpu_backend`)."""
    p.add_argument("--dist-backend", default="auto", choices=("auto", "gloo", "nccl"),
                   help="with --backend torch: nccl when CUDA is present, else gloo (default: auto)")
    p.add_argument("--nproc", type=int, help="with --backend torch: processes to spawn; must be the mesh's rank "
                                             "count, which is the default")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="with --backend torch: give up on the processes after S seconds (default 600)")
    p.add_argument("--watchdog", type=float, default=120.0, metavar="S",
                   help="with --backend torch: report a collective not finished after S seconds (default 120)")
