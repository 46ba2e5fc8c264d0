"""simcluster's torch backend against the same training written in plain, idiomatic PyTorch (not a test).

The same GPT or Llama (sizes, layers, sequence, batch; dropout off) is trained two ways on this machine,
each as 2 processes over gloo with one math thread each (2 cores), in fp32 or in bf16 mixed precision:

  plain     torch.nn modules, F.scaled_dot_product_attention, AdamW (fp32 master weights), gradient
            clipping, under DDP or FSDP2's `fully_shard`; bf16 by torch.autocast;
  simcluster `simcluster run --backend torch` in fast mode: the per-rank program, its kernels from the
            torch kernel set (gpu_backend/torch_ops.py), DDP (zero 0) or ZeRO-3 (FSDP).

The figure is seconds a step (wall clock of each rank, 2 ranks on 2 cores: CPU seconds): the time of
N + 2 steps less that of 2, over N, so that start-up and weight initialisation cancel; the slower
rank's; the least of R repeats (of each of the two runs whose difference is taken): this machine is
shared, and one slow run is noise, not the program. The last column is the ratio (issue 35's goal: at most 1.25).

    python benchmarks/backend_vs_torch.py [--sizes 256,1024,2048] [--arch gpt,llama] [--dtype fp32,bf16]
                                          [--layout ddp,fsdp] [--steps N] [--repeat R]
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gpu_backend.backend import launch
from gpu_backend.processes import in_processes
from simcluster.config.scenario import load
from simcluster.run.job import job_of

SHAPES = {  # hidden: (layers, heads, sequence, vocab), one sequence per rank a step
    256: (4, 4, 256, 2048),
    1024: (2, 8, 256, 4096),
    2048: (1, 16, 256, 4096),
}


# -- the plain PyTorch model ------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, llama: bool) -> None:
        super().__init__()
        self.heads, self.kv, self.llama = heads, kv, llama
        d = h // heads
        norm = nn.RMSNorm if llama else nn.LayerNorm
        self.n1, self.n2 = norm(h), norm(h)
        self.q = nn.Linear(h, h, bias=not llama)
        self.kv_proj = nn.Linear(h, 2 * kv * d, bias=not llama)
        self.o = nn.Linear(h, h, bias=not llama)
        if llama:
            f = 4 * h
            self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)
        else:
            self.fc, self.out = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x: torch.Tensor, rope: Any) -> torch.Tensor:
        b, s, h = x.shape
        d = h // self.heads
        a = self.n1(x)
        q = self.q(a).view(b, s, self.heads, d).transpose(1, 2)
        k, v = self.kv_proj(a).view(b, s, 2, self.kv, d).permute(2, 0, 3, 1, 4)
        if self.llama:
            cos, sin = rope
            rot = lambda t: torch.cat([-t[..., d // 2:], t[..., :d // 2]], -1)  # noqa: E731
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv != self.heads)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, h))
        c = self.n2(x)
        if self.llama:
            return x + self.w2(F.silu(self.w1(c)) * self.w3(c))
        return x + self.out(F.gelu(self.fc(c), approximate="tanh"))


class Model(nn.Module):
    def __init__(self, h: int, layers: int, heads: int, seq: int, vocab: int, llama: bool) -> None:
        super().__init__()
        kv = heads // 2 if llama else heads
        self.llama = llama
        self.wte = nn.Embedding(vocab, h)
        self.wpe = None if llama else nn.Embedding(seq, h)
        self.blocks = nn.ModuleList(Block(h, heads, kv, llama) for _ in range(layers))
        self.norm = nn.RMSNorm(h) if llama else nn.LayerNorm(h)
        self.head = nn.Linear(h, vocab, bias=False)
        d = h // heads
        angle = torch.arange(seq)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)[None, :]
        self.register_buffer("cos", torch.cos(angle).repeat(1, 2), persistent=False)
        self.register_buffer("sin", torch.sin(angle).repeat(1, 2), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x, (self.cos, self.sin))
        return self.head(self.norm(x))


def plain_rank(device: Any, arch: str, h: int, dtype: str, layout: str, steps: int) -> float:
    """Seconds for `steps` steps of plain PyTorch on this rank (after one warm-up step)."""
    layers, heads, seq, vocab = SHAPES[h]
    torch.manual_seed(0)
    model = Model(h, layers, heads, seq, vocab, arch == "llama")
    if layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(0, vocab, (1, seq + 1))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, vocab), ids[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return time.perf_counter() - t


def plain(arch: str, h: int, dtype: str, layout: str, steps: int) -> float:
    seconds = in_processes(plain_rank, (arch, h, dtype, layout, steps), 2, "gloo", timeout_s=1800)
    return max(seconds) / steps


def simcluster_step(arch: str, h: int, dtype: str, layout: str, steps: int, repeat: int) -> float:
    layers, heads, seq, vocab = SHAPES[h]
    sets = [f"model.hidden={h}", f"model.layers={layers}", f"model.heads={heads}", f"model.ffn_hidden={4 * h}",
            f"model.seq={seq}", f"model.vocab={vocab}", "model.global_batch=2", f"model.dtype={dtype}",
            "model.tied_head=false", "run.numerics=fast", "parallel.dp=2", "cluster.gpus_per_node=2",
            f"parallel.zero={0 if layout == 'ddp' else 3}", "run.verify=false"]
    if arch == "llama":
        sets += ["model.arch=llama", f"model.kv_heads={heads // 2}"]
    if dtype == "fp32":
        sets = [s for s in sets if not s.startswith("model.dtype")] + ["model.dtype=fp32"]

    def seconds(n: int) -> float:
        job = job_of(load(None, [*sets, f"run.steps={n}"]), fold=False)
        runs = launch(job.program, *job.args, mesh=job.mesh, mode="fast", backend="gloo", timeout_s=1800,
                      check=False)
        return max(run.seconds for run in runs)
    longer = shorter = math.inf
    for _ in range(repeat):  # the least of each (the least of differences would take a slow short run's)
        longer, shorter = min(longer, seconds(steps + 2)), min(shorter, seconds(2))
    return (longer - shorter) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024,2048")
    p.add_argument("--arch", default="gpt,llama")
    p.add_argument("--dtype", default="fp32,bf16")
    p.add_argument("--layout", default="ddp,fsdp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    print(f"{'arch':<6} {'hidden':>6} {'dtype':<5} {'layout':<5} {'plain s/step':>12} {'simcluster s/step':>17} "
          f"{'ratio':>6}", flush=True)
    for arch in args.arch.split(","):
        for h in map(int, args.sizes.split(",")):
            for dtype in args.dtype.split(","):
                for layout in args.layout.split(","):
                    base = min(plain(arch, h, dtype, layout, args.steps) for _ in range(args.repeat))
                    ours = simcluster_step(arch, h, dtype, layout, args.steps, args.repeat)
                    print(f"{arch:<6} {h:>6} {dtype:<5} {layout:<5} {base:>12.3f} {ours:>17.3f} "
                          f"{ours / base:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
