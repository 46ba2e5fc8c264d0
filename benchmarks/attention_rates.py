"""The fused attention kernels' rates on the GPU this runs on, beside the ones the H100 preset charges (not a test).

The preset times attention at one measured forward rate, non-causal (cuDNN 9.1's 631.3 TFLOP/s; a table file
may set FlashAttention-2's), the backward at 0.82 of it, and a causal kernel as the blocks it runs at that same
rate (model/flash.py: the diagonal's blocks whole, about half the square). Published figures say a causal kernel
runs its blocks slower than that (Shah et al. 2024, "FlashAttention-3", H100 SXM5, head dim 128, 4K tokens,
forward: cuDNN 518 causal against 609, FlashAttention-2 319 against 368; cuDNN 9.1.0 itself on an H200 at locked
clocks, 4 x 4,096 tokens of 16 heads: 542 against 654 forward, 444 against 517 backward, and PyTorch's
FlashAttention-2 314 against 354 and 249 against 287: cudnn-frontend's benchmark/benchmark_results.csv,
2024-05-07). Which of them holds, kernel by kernel,
is what two fidelity tables hinge on (benchmarks/fidelity.py: Megatron-Core's smallest rows, Llama 3's 128K
row). This measures it: torch's scaled_dot_product_attention with each backend the device has (FlashAttention-2,
cuDNN, memory-efficient; on a CPU its own kernels), causal and not, forward and backward, at 16,384 tokens a call
(batch x sequence) and 16 heads of 128; then each causal with dropout drawn inside it (Megatron-LM's default
attention dropout, 0.1, which Megatron-Core's table runs: a kernel draws a random number a probability, which
the preset charges nothing for).

Figures in FlashAttention's convention: the forward 4 b h s^2 d FLOPs, half of it when causal; the backward 2.5
times the forward's. `per block` is a causal rate over the same kernel's non-causal one, each taken over the
blocks the kernel runs (flash.causal_share): 1 where the preset is right about causal kernels. `preset` is the
dgx-h100 preset's figure for the same row before its sustained share (a benchmark's rate, as these are).

    python benchmarks/attention_rates.py [--seqs 2048,4096,8192] [--repeats 20] [--device cuda] [--dropout 0.1]

Without a GPU it runs on the CPU at small sizes, which proves the script and says nothing of a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from simcluster.model.flash import causal_share
from simcluster.topology.cluster import ATTENTION_BACKWARD
from simcluster.topology.presets import PRESETS
from sustained_gemm import seconds_of  # (one call's seconds: CUDA events, or the host's clock)

HEADS, HEAD_DIM, TOKENS = 16, 128, 16384
BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
            ("efficient", SDPBackend.EFFICIENT_ATTENTION))


def forward_flops(batch: int, heads: int, seq: int, dim: int, causal: bool) -> float:
    """QK^T and PV, 2 s^2 d FLOPs each a head, the causal half of them when causal (FlashAttention's count)."""
    return 4.0 * batch * heads * seq * seq * dim * (0.5 if causal else 1.0)


def preset_rates(seq: int, causal: bool) -> tuple[float, float]:
    """The H100 preset's forward and backward TFLOP/s in the same convention, before sustained_compute: its rate
    over the blocks a causal kernel runs is the non-causal rate, so over half the square it is that x 0.5 / share."""
    h100 = PRESETS["dgx-h100"]
    forward = h100.peak_tflops * h100.attention_efficiency * (0.5 / causal_share(seq, seq) if causal else 1.0)
    return forward, forward * ATTENTION_BACKWARD


def seconds(run: Callable[[], None], device: torch.device, repeats: int,
            before: Callable[[], None] | None = None) -> float:
    """The median seconds of `run()` over `repeats` calls (after two untimed), `before()` untimed ahead of each (on a
    GPU its kernels are queued ahead of the start event, so they are not counted either)."""
    def once() -> float:
        if before is not None:
            before()
        return seconds_of(run, device)
    once(), once()
    return statistics.median(once() for _ in range(repeats))


def measure(backend: SDPBackend, device: torch.device, dtype: torch.dtype, seq: int, tokens: int, heads: int,
            dim: int, causal: bool, repeats: int, dropout: float = 0.0) -> tuple[float, float] | None:
    """(forward, backward) TFLOP/s of one backend, or None where it cannot run this shape on this device (or drop
    out: `dropout`, the share of the probabilities it drops, drawn inside the kernel)."""
    batch = max(1, tokens // seq)
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq, dim, generator=gen, device=device).to(dtype).requires_grad_()
               for _ in range(3))
    grad = torch.randn(batch, heads, seq, dim, generator=gen, device=device).to(dtype)
    held: list[torch.Tensor] = []

    def forward() -> None:
        held[:] = [torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal)]

    def backward() -> None:
        held[0].backward(grad)

    try:
        with sdpa_kernel([backend]), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # (torch says why a kernel it was not allowed was not used)
            fwd = seconds(forward, device, repeats)
            bwd = seconds(backward, device, repeats, before=forward)
    except RuntimeError:  # ("No viable backend": not on this device, dtype or shape, or not with dropout)
        return None
    flops = forward_flops(batch, heads, seq, dim, causal)
    return flops / fwd / 1e12, 2.5 * flops / bwd / 1e12


def main(argv: list[str] | None = None) -> list[tuple]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seqs", help="sequence lengths, comma-separated (default: 2048,4096,8192 on a GPU, 128,256 on a CPU)")
    p.add_argument("--repeats", type=int, default=20, help="timings each figure is the median of")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--dropout", type=float, default=0.1,
                   help="the dropout measured inside each kernel, causal, against none (default: 0.1, Megatron-LM's "
                        "--attention-dropout; 0: not measured)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    seqs = [int(s) for s in (args.seqs or ("2048,4096,8192" if gpu else "128,256")).split(",")]
    tokens, heads, dim = (TOKENS, HEADS, HEAD_DIM) if gpu else (512, 2, 64)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    print(f"scaled_dot_product_attention on {name}, {args.dtype}, {tokens} tokens a call, {heads} heads of {dim}; "
          f"TFLOP/s (FlashAttention's count), the median of {args.repeats}")
    print(f"{'backend':<10} {'seq':>6} {'causal':>6} {'forward':>8} {'backward':>8} {'bwd/fwd':>7} {'per block':>9} "
          f"{'preset fwd':>10} {'preset bwd':>10}")
    rows = []
    for label, backend in BACKENDS:
        for seq in seqs:
            plain = None
            for causal in (False, True):
                got = measure(backend, device, dtype, seq, tokens, heads, dim, causal, args.repeats)
                if got is None:
                    continue
                fwd, bwd = got
                per_block = ""
                if causal and plain is not None:  # each over the blocks it runs: causal_share / 0.5 of the half-square
                    per_block = f"{fwd * causal_share(seq, seq) / 0.5 / plain:9.3f}"
                plain = fwd if not causal else plain
                model = preset_rates(seq, causal)
                print(f"{label:<10} {seq:>6} {'yes' if causal else 'no':>6} {fwd:8.4g} {bwd:8.4g} {bwd / fwd:7.3f} "
                      f"{per_block:>9} {model[0]:10.1f} {model[1]:10.1f}", flush=True)
                rows.append((label, seq, causal, fwd, bwd))
    if args.dropout:
        dropped(args, device, dtype, seqs, (tokens, heads, dim), {(r[0], r[1]): r[3:] for r in rows if r[2]})
    return rows


def dropped(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, seqs: list[int],
            shape: tuple[int, int, int], without: dict[tuple[str, int], tuple[float, float]]) -> list[tuple]:
    """Each kernel's causal rates with `args.dropout` drawn inside it over its rates without (`without`, measured
    above), forward and backward: the preset charges a fused kernel nothing for dropout (1). On a CPU torch's own
    unfused kernels (math) are the ones that drop out, so they are measured there, with and without."""
    print(f"\nwith dropout {args.dropout} inside the kernel, causal: each rate over the same kernel's without "
          f"(the preset: 1)")
    print(f"{'backend':<10} {'seq':>6} {'forward':>8} {'backward':>8}")
    rows = []
    for label, backend in BACKENDS + (() if device.type == "cuda" else (("math", SDPBackend.MATH),)):
        for seq in seqs:
            plain = without.get((label, seq)) or measure(backend, device, dtype, seq, *shape, True, args.repeats)
            got = measure(backend, device, dtype, seq, *shape, True, args.repeats, dropout=args.dropout)
            if plain is None or got is None:
                continue
            fwd, bwd = got[0] / plain[0], got[1] / plain[1]
            print(f"{label:<10} {seq:>6} {fwd:8.3f} {bwd:8.3f}", flush=True)
            rows.append((label, seq, fwd, bwd))
    return rows


if __name__ == "__main__":
    main()
