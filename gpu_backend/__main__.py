"""Run a simcluster program on torch.distributed and compare it with the emulator.

    torchrun --nproc-per-node 4 -m gpu_backend --mesh dp=2,tp=2      # launched by torchrun
    python -m gpu_backend --mesh dp=2,tp=2                            # spawns its own processes

Programs: `collectives` (every primitive on subgroups) and `mlp` (the TP x DP MLP, exact mode).
Rank 0 prints, per output, whether it equals the emulator's: bytes for integers and exact partials
(and for every output in exact mode), a float tolerance for float collectives.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from simcluster.engine import simulate
from simcluster.numerics.tensor import Partial
from simcluster.parallel.collectives_demo import collectives_demo
from simcluster.parallel.tp_dp_mlp import MLPConfig, train_mlp
from simcluster.program.mesh import DeviceMesh


def _mesh(text: str) -> DeviceMesh:
    sizes: dict[str, int] = {}
    for part in filter(None, text.split(",")):
        axis, _, n = part.partition("=")
        if not n.isdigit():
            raise SystemExit(f"error: --mesh wants axis=size pairs such as dp=2,tp=2, got {part!r}")
        sizes[axis.strip()] = int(n)
    try:
        return DeviceMesh(**sizes)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"error: --mesh {text}: {exc}") from None


def compare(emulated: Any, real: Any, path: str = "") -> list[str]:
    """Lines 'path: ok (bytes)' / 'path: ok (within 1e-5)' / 'path: DIFFERS'."""
    if isinstance(emulated, dict):
        return [line for k in emulated for line in compare(emulated[k], real[k], f"{path}{k}.")]
    if isinstance(emulated, list):
        return [line for i, (a, b) in enumerate(zip(emulated, real)) for line in compare(a, b, f"{path}{i}.")]
    name = path.rstrip(".")
    if emulated is None:
        return [f"{name}: {'ok' if real is None else 'DIFFERS'}"]
    a = emulated.limbs if isinstance(emulated, Partial) else np.asarray(emulated)
    b = real.limbs if isinstance(real, Partial) else np.asarray(real)
    if a.tobytes() == b.tobytes():
        return [f"{name}: ok (bytes)"]
    if a.dtype.kind == "f" and a.shape == b.shape and np.allclose(a, b, rtol=1e-5, atol=1e-6):
        return [f"{name}: ok (within 1e-5)"]
    return [f"{name}: DIFFERS"]


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m gpu_backend", description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="dp=2,tp=2", help="mesh degrees, e.g. dp=2,tp=2 (default)")
    p.add_argument("--program", default="collectives", choices=("collectives", "mlp"))
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    args = p.parse_args()
    mesh = _mesh(args.mesh)
    program, prog_args = (collectives_demo, (0,)) if args.program == "collectives" else (
        train_mlp, (MLPConfig(hidden=16, ffn_hidden=32, tokens=16, steps=2),))

    if "RANK" in os.environ:  # under torchrun: this process is one rank
        import torch
        import torch.distributed as dist

        from gpu_backend.runner import pick_backend, run_rank

        kind = args.backend if args.backend != "auto" else ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(kind)
        _, device = pick_backend(kind)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        mine = run_rank(program, prog_args, mesh, device=device)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return 0
        real = gathered
    else:
        from gpu_backend.runner import spawn

        real = spawn(program, *prog_args, mesh=mesh, backend=args.backend)
    emulated = simulate(program, *prog_args, mesh=mesh).results
    lines = [f"rank {r} {line}" for r in range(mesh.world_size) for line in compare(emulated[r], real[r])]
    print("\n".join(lines))
    bad = sum("DIFFERS" in line for line in lines)
    print(f"{len(lines) - bad} outputs equal the emulator's, {bad} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
