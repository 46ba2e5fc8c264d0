"""On a GPU: simcluster's torch backend against plain PyTorch and against the emulator's prediction (not a test).

One GPT (default ~1.2B: h 2048, 20 layers, 16 heads, s 2048, vocab 50304, untied head; 4 sequences a
step, bf16 mixed precision, dropout off) is trained on one GPU three ways:

  plain      torch.nn modules (backend_vs_torch.py's), F.scaled_dot_product_attention, AdamW with fp32
             weights under torch.autocast(bf16): what a PyTorch engineer would write;
  simcluster `simcluster run --backend torch --dist-backend nccl` in fast mode: the per-rank program on
             the torch kernel set, every tensor on the GPU;
  predicted  the emulator's steady step for the same scenario, on the scenario's H100 preset and, with
             --profile, on a `simcluster calibrate` profile taken on this GPU.

Seconds a step: plain PyTorch's by CUDA synchronisation around N steps after 2 warm-up steps;
simcluster's as the whole program of 2 + N steps less that of 2 steps, over N (its figure is the whole
program, initialisation included). MFU: the emulator's model FLOPs a step over the step and the
H100 SXM's dense bf16 peak (989 TFLOP/s, NVIDIA H100 datasheet).

    python benchmarks/gpu_step.py [--hidden 2048] [--layers 20] [--heads 16] [--seq 2048] [--vocab 50304]
                                  [--batch 4] [--steps 5] [--profile FILE] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from backend_vs_torch import Model

H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, NVIDIA H100 SXM datasheet


def sets_of(a: argparse.Namespace) -> list[str]:
    return [f"model.hidden={a.hidden}", f"model.layers={a.layers}", f"model.heads={a.heads}",
            f"model.ffn_hidden={4 * a.hidden}", f"model.seq={a.seq}", f"model.vocab={a.vocab}",
            f"model.global_batch={a.batch}", "model.dtype=bf16", "model.tied_head=false", "model.dropout=0",
            "parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.cp=1", "parallel.zero=0",
            "cluster.gpus_per_node=1"]


def simcluster(args: list[str], sets: list[str]) -> dict:
    cmd = [sys.executable, "-m", "simcluster.cli", "run", "--json", *args]
    for s in sets:
        cmd += ["--set", s]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(cmd)}\n{done.stderr[-3000:]}\n{done.stdout[-2000:]}")
    return json.loads(done.stdout)


def plain(a: argparse.Namespace, device: torch.device) -> tuple[float, int]:
    torch.manual_seed(0)
    model = Model(a.hidden, a.layers, a.heads, a.seq, a.vocab, False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        F.cross_entropy(logits.float().view(-1, a.vocab), ids[:, 1:].reshape(-1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync()
    t = time.perf_counter()
    for _ in range(a.steps):
        step()
    sync()
    peak = int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0
    return (time.perf_counter() - t) / a.steps, peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 2048), ("layers", 20), ("heads", 16), ("seq", 2048), ("vocab", 50304),
                          ("batch", 4), ("steps", 5)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--profile", help="a `simcluster calibrate` profile of this GPU, for a second prediction")
    p.add_argument("--device", default="cuda", help="cuda (nccl), or cpu (gloo) to try the script")
    a = p.parse_args()
    device = torch.device(a.device)
    dist = "nccl" if device.type == "cuda" else "gloo"
    sets = sets_of(a)
    rows = []

    base, base_peak = plain(a, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"plain PyTorch: {base:.4f} s/step, peak {base_peak / 2**30:.1f} GiB", flush=True)

    seconds, peaks = {}, {}
    for n in (2, 2 + a.steps):
        section = simcluster(["--backend", "torch", "--dist-backend", dist],
                             sets + ["run.numerics=fast", "run.verify=false", f"run.steps={n}"])["torch"]
        seconds[n] = max(section["step_time_s"].values()) * n
        peaks[n] = max(section["peak_memory_bytes"].values())
        print(f"simcluster, {n} steps: {seconds[n]:.3f} s in all ({section['memory_measure']}: "
              f"{peaks[n] / 2**30:.1f} GiB)", flush=True)
    ours = (seconds[2 + a.steps] - seconds[2]) / a.steps

    meta = sets + ["run.numerics=meta", "run.steps=3"]
    preset = simcluster([], meta)
    flops = preset["model_flops_per_step"]
    rows.append(("plain PyTorch (measured)", base, base_peak))
    rows.append(("simcluster --backend torch (measured)", ours, peaks[2 + a.steps]))
    rows.append(("emulator, H100 preset (predicted)", preset["steady_step_ns"] / 1e9, preset["memory"]["peak_bytes"]))
    if a.profile:
        calibrated = simcluster([], meta + [f"cluster.profile={a.profile}"])
        rows.append(("emulator, calibrated here (predicted)", calibrated["steady_step_ns"] / 1e9,
                     calibrated["memory"]["peak_bytes"]))
    print(f"\n{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}; "
          f"GPT h {a.hidden}, {a.layers} layers, s {a.seq}, batch {a.batch}, vocab {a.vocab}: "
          f"{flops / 1e12:.1f} model TFLOP a step")
    print(f"{'':<40} {'s/step':>8} {'MFU':>6} {'peak GiB':>9} {'/ plain':>8}")
    for label, s, peak in rows:
        print(f"{label:<40} {s:>8.4f} {flops / s / H100_BF16_PEAK:>6.1%} {peak / 2**30:>9.1f} {s / base:>8.2f}")


if __name__ == "__main__":
    main()
