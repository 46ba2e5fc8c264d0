"""Where a torch-backend step spends its GPU time: torch.profiler over one rank's fast-mode run (not a test).

The ~1.2B GPT of gpu_step.py (or smaller, with the same flags) on one GPU (NCCL, one rank; gloo on a CPU),
3 steps under torch.profiler; prints the kernels by GPU time (CPU time on a CPU) and the host's calls by
CPU time (launches, synchronisations, copies). What found the weight gradients running without tensor
cores (cutlass SIMT kernels, 0.34 s of a 0.60 s step) on an H100.

    python benchmarks/gpu_profile.py [--hidden 2048] [--layers 20] [--heads 16] [--seq 2048] [--vocab 50304]
                                     [--batch 4] [--steps 3] [--device cuda] [--rows 25]
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from gpu_backend.backend import measured
from simcluster.config.scenario import load
from simcluster.run.job import job_of


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 2048), ("layers", 20), ("heads", 16), ("seq", 2048), ("vocab", 50304),
                          ("batch", 4), ("steps", 3), ("rows", 25)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--device", default="cuda", help="cuda (nccl), or cpu (gloo) to try the script")
    a = p.parse_args()
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    sets = [f"model.hidden={a.hidden}", f"model.layers={a.layers}", f"model.heads={a.heads}",
            f"model.ffn_hidden={4 * a.hidden}", f"model.seq={a.seq}", f"model.vocab={a.vocab}",
            f"model.global_batch={a.batch}", "model.dtype=bf16", "model.tied_head=false", "model.dropout=0",
            "parallel.dp=1", "parallel.zero=0", "cluster.gpus_per_node=1", "run.numerics=fast", "run.verify=false",
            f"run.steps={a.steps}"]
    job = job_of(load(None, sets), fold=False)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        run = measured(job.program, job.args, job.mesh, mode="fast", device=device, digests=True)
    print(f"{a.steps} steps in {run.seconds:.3f} s ({run.seconds / a.steps:.4f} s a step, initialisation included); "
          f"peak {run.peak_bytes / 2**30:.1f} GiB ({run.memory_source})")
    events = prof.key_averages()
    device_time = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(events.table(sort_by=device_time, row_limit=a.rows, max_name_column_width=48))
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows // 2, max_name_column_width=48))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
