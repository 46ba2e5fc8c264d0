"""Megatron-LM's Table 1 (megatron_table1.toml) as the benchmarks that compare against it load it:
fidelity.py and plan_megatron.py, with `--rows` and `--set` overrides for every row."""

from __future__ import annotations

import argparse
from pathlib import Path

from simcluster.config.scenario import Scenario, ScenarioError, load

TABLE = Path(__file__).with_name("megatron_table1.toml")


def arguments(p: argparse.ArgumentParser, rows: str) -> None:
    p.add_argument("--rows", default=rows, help=f"rows to run, e.g. 4-7 or 5,10 (default: {rows})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key in every row, e.g. cluster.profile=a100.toml (a profile that "
                        "`simcluster calibrate` measured on an A100) or model.attention_kernel=flash")


def table(args: argparse.Namespace, script: str) -> tuple[Scenario, list[int]]:
    """The table with the overrides, and the rows asked for; a bad key or row ends the script in one
    line."""
    try:
        sc = load(str(TABLE), args.set)
    except ScenarioError as e:
        raise SystemExit(f"{Path(script).name}: {e}") from None
    if args.set:
        print("with " + ", ".join(args.set))
    return sc, rows(args.rows, len(sc.variants), script)


def rows(text: str, count: int, script: str) -> list[int]:
    """'4-7' or '5,10' (or both: '1-3,10') as row numbers, each in 1..count."""
    out: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not (first.isdigit() and (last.isdigit() or not dash)) or (dash and int(last) < int(first)):
            raise SystemExit(f"{Path(script).name}: --rows {text!r}: expected rows like 4-7 or 5,10")
        out += range(int(first), int(last or first) + 1)
    if not out or not all(1 <= i <= count for i in out):
        raise SystemExit(f"{Path(script).name}: --rows {text!r}: the table's rows are 1 to {count}")
    return list(dict.fromkeys(out))
