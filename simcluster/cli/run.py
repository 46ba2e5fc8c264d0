"""`simcluster run` (simulate, verify, report, draw; or, with `--backend torch`, the ranks on
torch.distributed) and `simcluster verify` (exact mode against one device, nothing else)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from simcluster.cli.common import passed, scenario_of, simulated, status, svg_title, terminal_svg, write_svg
from simcluster.config.options import scenario_arguments, torch_arguments
from simcluster.config.scenario import ScenarioError, dumps
from simcluster.report import document
from simcluster.viz.outcome_view import render


def add(sub: Any) -> None:
    run = sub.add_parser("run", help="simulate a scenario, verify it, print the report and the timeline",
                         description="Simulate SCENARIO, verify it against a single-device run, and print the report "
                                     "and the timeline (a table of the variants for a scenario with [compare]). "
                                     "Exit status 0 when it verifies and fits in the devices' memory, 1 when "
                                     "verification fails, 2 for a mistake in the scenario, 3 when a rank's peak "
                                     "memory exceeds its device's (a real run would die of OOM), 4 when a failed "
                                     "rank ([faults]) leaves the others hanging.")
    scenario_arguments(run)
    run.add_argument("--json", action="store_true", help="print the report as one JSON document instead (an error "
                     "too: {\"error\": ...})")
    run.add_argument("--summary", action="store_true", help="print the report's first table and the verdict alone")
    run.add_argument("--width", type=int, help="timeline width in columns (default: the terminal's)")
    run.add_argument("--svg", metavar="FILE", help="also save what is printed as an SVG picture")
    run.add_argument("--write-scenario", metavar="FILE", help="also write the scenario as run (every --set "
                     "applied, every key resolved) as a scenario file")
    run.add_argument("--backend", default="emulator", choices=("emulator", "torch"),
                     help="emulator (default), or torch: run the scenario's ranks as processes on torch.distributed "
                          "and report them beside the emulator's prediction (needs the torch extra)")
    ck = run.add_argument_group("checkpoints (run.program = transformer, exact or fast mode; docs/checkpoint.md)")
    ck.add_argument("--save-checkpoint", metavar="DIR", help="write a checkpoint to the folder DIR (made if missing): "
                    "each rank its own shards, then a manifest; sets run.save_checkpoint")
    ck.add_argument("--at-step", type=int, metavar="K", help="save after K steps (default: after the last); sets "
                    "run.save_at_step")
    ck.add_argument("--resume", metavar="DIR", help="start from the checkpoint in DIR, under this scenario's layout, "
                    "whatever layout saved it; sets run.resume")
    torch_arguments(run)
    run.set_defaults(command_of=command)
    verify = sub.add_parser("verify", help="check a scenario's numbers against one device, and nothing else",
                            description="Run SCENARIO in exact mode and compare every output with the single-device "
                                        "run byte for byte. Exit status 0 when bit-exact, 1 when not.")
    scenario_arguments(verify)
    verify.set_defaults(command_of=verify_command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    """`simcluster run`: the report (or its JSON) and the timeline; the exit status says what went wrong."""
    if args.backend == "torch":
        from gpu_backend.__main__ import run as run_on_torch  # (needs no torch to say it needs torch)

        return run_on_torch(args, out, err)
    scenario = scenario_of(args)
    if args.write_scenario:
        write_scenario(args.write_scenario, scenario)
    outcome = simulated(err, scenario, args.fold, trace=not args.json)  # (the JSON is the report: no timeline)
    if args.json:
        sys.stdout.write(document(outcome.report) + "\n")
    else:
        render(outcome, out, args.width or out.width, summary=args.summary)
    if args.svg:
        write_svg(args.svg, terminal_svg(out, svg_title("simcluster", scenario, args)))
    return status(outcome, err)


def write_scenario(path: str, scenario: Any) -> None:
    """The scenario as run, as a file `simcluster run` reads back to the same scenario."""
    if scenario.variants:
        raise ScenarioError("--write-scenario writes one scenario: pick a variant of [compare] with --set")
    try:
        Path(path).write_text(dumps(scenario.as_dict()))
    except OSError as exc:
        raise ScenarioError(f"--write-scenario {path}: {exc.strerror or exc}") from None


def verify_command(args: argparse.Namespace, out: Console, err: Console) -> int:
    """`simcluster verify`: one line a run, bit-exact or its first mismatch."""
    scenario = scenario_of(args, ["run.numerics=exact", "run.verify=true"])
    outcome = simulated(err, scenario, args.fold)
    labelled = [(label, o.report) for label, o in outcome.variants] or [(scenario.name, outcome.report)]
    for label, r in labelled:
        v = r["verification"]
        out.print(f"{label}: " + ("bit-exact" if v.get("bit_exact") else
                                  v.get("status") or f"MISMATCH {v.get('mismatches', [])[:1]}")
                  + f" ({v.get('outputs_compared', 0)} outputs)")
    return 0 if passed(outcome) else 1
