"""`simcluster calibrate`: measure this machine with torch and write a hardware profile for
cluster.profile (the measuring is gpu_backend/calibrate.py's)."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from simcluster.config.options import without_torch


def add(sub: Any) -> None:
    cal = sub.add_parser("calibrate", help="measure this machine and write a hardware profile for cluster.profile",
                         description="Measure the machine this runs on with torch (its GPU if it has one, else the "
                                     "CPU): GEMM throughput on a grid of shapes per dtype, attention's batched "
                                     "products, memory bandwidth, the smallest kernel's time, and all-reduce bus "
                                     "bandwidth by message size over --nproc ranks (gloo on CPU, NCCL on GPUs). "
                                     "Writes a profile that a scenario uses with cluster.profile = \"FILE\" "
                                     "(needs the torch extra).")
    cal.add_argument("-o", "--output", default="profile.toml", help="where to write the profile (default profile.toml)")
    cal.add_argument("--nproc", type=int, default=2,
                     help="ranks for the all-reduce measurement (default 2; 1 measures no links)")
    cal.add_argument("--dist-backend", default="auto", choices=("auto", "gloo", "nccl"),
                     help="nccl when CUDA is present, else gloo (default: auto)")
    cal.add_argument("--dtypes", default="bf16,fp32", help="GEMM dtypes to measure, comma-separated (default "
                                                           "bf16,fp32; fp16 is timed as bf16 when not measured)")
    cal.add_argument("--quick", action="store_true", help="a smaller grid: seconds instead of a minute")
    cal.add_argument("--timeout", type=float, default=600.0, metavar="S",
                     help="give up on the all-reduce processes after S seconds (default 600)")
    cal.set_defaults(command_of=command)


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    if without_torch(err, "calibrate"):
        return 2
    from gpu_backend.calibrate import command as measure

    return measure(args, out, err)
