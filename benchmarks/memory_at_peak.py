"""What a torch-backend step holds at its peak, by the program line that made it (not a test).

The ~1.2B GPT of gpu_step.py (or smaller, with the same flags) on one device, one rank, fast mode: every
tensor a torch operation makes is followed until it is freed (a TorchDispatchMode; a storage is freed
when the last tensor on it is), and at the largest total the live ones are grouped by the innermost
frames of simcluster's and gpu_backend's code that made them; beside it, the emulator's predicted peak
by category. What found, on an H200, a 1.2B GPT's initial weights kept beside their flat copies, a
one-hot of the targets as wide as the logits and a step's gradients held through the next (42 GiB
measured, 30 predicted; now 33.9 and 33.8).

On `--device meta` nothing is computed (any size runs here in seconds), but torch's attention has no
fused kernel there: its math form keeps the whole score matrices, which the table shows apart.

    python benchmarks/memory_at_peak.py [--hidden 2048] [--layers 20] [--heads 16] [--seq 2048]
                                        [--vocab 50304] [--batch 4] [--steps 2] [--device cuda|cpu|meta]
                                        [--frames 3] [--rows 25] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import collections
import traceback
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gpu_backend.backend import measured
from gpu_step import sets_of  # (the GPT gpu_step.py trains; this script's folder is on the path)
from simcluster.config.scenario import load
from simcluster.run.job import job_of
from simcluster.run.runner import run_scenario


class LiveTensors(TorchDispatchMode):
    """The bytes of the storages torch's operations made that are still alive, and the live set at the peak."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames
        self.live: dict[int, tuple[int, str]] = {}  # storage -> (bytes, where it was made)
        self.users: collections.Counter = collections.Counter()  # storage -> tensors on it, alive
        self.total = self.peak = 0
        self.at_peak: dict[int, tuple[int, str]] = {}

    def _where(self) -> str:
        ours = [f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno} {f.name}" for f in reversed(traceback.extract_stack())
                if "/simcluster/" in f.filename or "/gpu_backend/" in f.filename]
        return " < ".join(ours[:self.frames]) or "(outside the program)"

    def _freed(self, key: int) -> None:
        self.users[key] -= 1
        if not self.users[key]:
            self.total -= self.live.pop(key)[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                key = t.untyped_storage()._cdata
                if key not in self.live:
                    self.live[key] = (t.untyped_storage().nbytes(), self._where())
                    self.total += self.live[key][0]
                    if self.total > self.peak:
                        self.peak, self.at_peak = self.total, dict(self.live)
                self.users[key] += 1
                weakref.finalize(t, self._freed, key)
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 2048), ("layers", 20), ("heads", 16), ("seq", 2048), ("vocab", 50304),
                          ("batch", 4), ("steps", 2), ("frames", 3), ("rows", 25)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda", help="cuda (nccl), cpu (gloo) or meta (gloo, no numbers)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more scenario settings")
    a = p.parse_args()
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device(a.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sets = sets_of(a) + ["run.numerics=fast", "run.verify=false", f"run.steps={a.steps}", *a.set]
    sc = load(None, sets)
    job = job_of(sc, fold=False)
    tracker = LiveTensors(a.frames)
    with tracker:
        measured(job.program, job.args, job.mesh, mode="fast", device=device)
    dist.destroy_process_group()
    predicted = run_scenario(load(None, sets + ["run.numerics=meta"]), fold=False, trace=False).report["memory"]
    by: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for nbytes, where in tracker.at_peak.values():
        by[where] += nbytes
        count[where] += 1
    print(f"peak of the live tensors: {tracker.peak / 2**30:.2f} GiB on {device.type}; "
          f"predicted: {predicted['peak_bytes'] / 2**30:.2f} GiB")
    if device.type == "meta":
        print("(meta: torch's attention has no fused kernel here and keeps its score matrices; a GPU's does not)")
    print(f"{'GiB':>8} {'tensors':>7}  made at (innermost first)")
    for where, nbytes in by.most_common(a.rows):
        print(f"{nbytes / 2**30:8.3f} {count[where]:7d}  {where}")


if __name__ == "__main__":
    main()
