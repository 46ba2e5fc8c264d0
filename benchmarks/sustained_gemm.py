"""What a GPU keeps of its benchmark GEMM rate through a long load, `cluster.sustained_compute` (not a test).

First MAMF's way (S. Bekman's mamf-finder.py: the fastest of 100 timed runs of one GEMM after 50 warm-ups),
which is how the presets' matmul_efficiency was measured; then the same GEMM back to back for `--seconds`,
its rate taken a window (a second) at a time. The share is the mean rate of the last half over the MAMF figure: what
the H100 preset's sustained_compute stands for, there fitted to a published run (topology/presets.py), here
measured on the GPU this runs on. On a GPU each second also shows the SM clock and the board's power
(nvidia-smi), which say whether the clock is what falls. One GPU alone: a DGX holds eight at full load in one
chassis. `--kernel attention` does the same for torch's causal scaled-dot-product attention (FlashAttention on a
GPU: batch 1, 32 heads of 128, `--size` tokens), which the preset's share slows as it slows GEMMs; whether
attention, drawing less power, throttles less is what it measures.

    python benchmarks/sustained_gemm.py [--kernel gemm] [--seconds 60] [--window 1] [--size 8192] [--dtype bf16]
                                        [--device cuda]

Without a GPU it runs on the CPU at a small size, which proves the script and says nothing of a GPU.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from collections.abc import Callable

import torch

from simcluster.topology.presets import PRESETS

PRESET_H100 = PRESETS["dgx-h100"].sustained_compute  # fitted to a published run (topology/presets.py)


def seconds_of(run: Callable[[], None], device: torch.device) -> float:
    """One call's seconds: CUDA events on a GPU, the host's clock on a CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return time.perf_counter() - start
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    run()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def board(device: torch.device) -> str:
    """The SM clock (MHz) and the power drawn (W) now, or "" where nvidia-smi cannot say."""
    if device.type != "cuda":
        return ""
    try:
        out = subprocess.run(["nvidia-smi", "-i", str(device.index or 0), "--query-gpu=clocks.sm,power.draw",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    parts = [p.strip() for p in out.strip().split(",")]
    return f"{parts[0]:>6} MHz {parts[1]:>7} W" if len(parts) == 2 else ""


def main(argv: list[str] | None = None) -> float:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--kernel", default="gemm", choices=["gemm", "attention"])
    p.add_argument("--size", type=int, help="m = n = k, or the attention's tokens (default: 8192 on a GPU, 512 on a CPU)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--seconds", type=float, default=60.0, help="how long the sustained load runs")
    p.add_argument("--window", type=float, default=1.0, help="the seconds each reading covers")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    n = args.size or (8192 if device.type == "cuda" else 512)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(0)
    if args.kernel == "gemm":
        a, b = (torch.randn(n, n, generator=gen, device=device).to(dtype) for _ in range(2))  # random: the most power
        out = torch.empty(n, n, dtype=dtype, device=device)
        flops, shape = 2.0 * n ** 3, f"{n} x {n} x {n}"

        def kernel() -> None:
            torch.mm(a, b, out=out)
    else:  # the causal half of QK^T and PV: 2 x 2 s^2 d a head, halved
        q, k, v = (torch.randn(1, 32, n, 128, generator=gen, device=device).to(dtype) for _ in range(3))
        flops, shape = 2.0 * 32 * n * n * 128, f"causal attention, {n} tokens x 32 heads of 128,"

        def kernel() -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    for _ in range(50):
        kernel()
    fastest = min(seconds_of(kernel, device) for _ in range(100))
    mamf = flops / fastest / 1e12
    print(f"{shape} {args.dtype} on {device}: the fastest of 100 after 50 warm-ups (MAMF's way) "
          f"{mamf:.1f} TFLOP/s {board(device)}")
    per_window = max(1, round(args.window / fastest))
    rates = []
    for reading in range(1, max(1, round(args.seconds / args.window)) + 1):
        elapsed = seconds_of(lambda: [kernel() for _ in range(per_window)], device)
        rates.append(per_window * flops / elapsed / 1e12)
        print(f"  {reading * args.window:6.1f} s: {rates[-1]:8.1f} TFLOP/s ({rates[-1] / mamf:.3f}) {board(device)}",
              flush=True)
    late = rates[len(rates) // 2:]
    share = sum(late) / len(late) / mamf
    print(f"kept through the last {len(late) * args.window:g} s: {share:.3f} of the MAMF figure (the H100 preset's "
          f"sustained_compute, fitted to a published run: {PRESET_H100})")
    return share


if __name__ == "__main__":
    main()
