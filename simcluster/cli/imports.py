"""`simcluster import megatron ARGS...` and `simcluster import torchtitan FILE.toml`: a Megatron-LM
command line or a torchtitan job file as a simcluster scenario (config/imports.py), with a line for
every option that could not be mapped."""

from __future__ import annotations

import argparse
import tomllib
from pathlib import Path
from typing import Any

from rich.console import Console

from simcluster.config import imports
from simcluster.config.scenario import ScenarioError, build, dumps
from simcluster.run.job import job_of
from simcluster.topology.presets import PRESETS


def add(sub: Any) -> None:
    p = sub.add_parser("import", help="a Megatron-LM command line or a torchtitan job file as a scenario",
                       description="Write a simcluster scenario (TOML) for a Megatron-LM command line "
                                   "(`simcluster import --nodes 16 megatron --tensor-model-parallel-size 8 ...`) or "
                                   "a torchtitan job file (`simcluster import torchtitan llama3_8b.toml`); every "
                                   "option that could not be mapped is named on stderr. The cluster is not in "
                                   "either: give it here (dp is what the other degrees leave of it).")
    p.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs a node (default 8)")
    p.add_argument("--preset", default="dgx-h100", choices=sorted(PRESETS), help="hardware (default dgx-h100)")
    p.add_argument("--output", "-o", metavar="FILE", help="write the scenario there (default: standard output)")
    p.add_argument("tool", choices=("megatron", "torchtitan"), help="whose configuration")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="ARGS",
                   help="megatron: its arguments; torchtitan: the job file")
    p.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    if args.nodes < 1 or args.gpus_per_node < 1:
        raise ScenarioError("--nodes and --gpus-per-node must be at least 1")
    cluster = {"nodes": args.nodes, "gpus_per_node": args.gpus_per_node, "preset": args.preset}
    if args.tool == "megatron":
        doc, notes = imports.megatron(list(args.rest), **cluster)
    else:
        if len(args.rest) != 1:
            raise ScenarioError("simcluster import torchtitan FILE.toml: one job file")
        path = Path(args.rest[0])
        try:
            job = tomllib.loads(path.read_text())
        except OSError as exc:
            raise ScenarioError(f"{path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ScenarioError(f"{path}: not valid TOML: {exc}") from None
        doc, notes = imports.torchtitan(job, **cluster)
    sc = build(dict(doc))  # (checked as any scenario: its keys, its degrees against the cluster, its layout)
    sc.cluster_spec()
    job_of(sc)
    text = dumps(doc)
    for note in notes:
        err.print(f"import: {note}", markup=False, highlight=False, soft_wrap=True)
    if args.output:
        try:
            Path(args.output).write_text(text)
        except OSError as exc:
            raise ScenarioError(f"--output {args.output}: {exc.strerror or exc}") from None
        err.print(f"wrote {args.output} ({sc.world_size} ranks, meta mode): simcluster run {args.output}",
                  markup=False, highlight=False, soft_wrap=True)
    else:
        out.print(text, markup=False, highlight=False, end="", soft_wrap=True)
    return 0
