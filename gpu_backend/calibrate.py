"""`simcluster calibrate`: measure the machine it runs on and write a hardware profile (topology/profile.py).

What it measures, with the torch kernel set the backend runs (torch_ops.py; the GPU if there is one,
else the CPU):
- GEMM throughput on a grid of shapes (m, n, k) per dtype, through the kernel set's matmul (its
  16-bit GEMMs as the device runs them: native on a GPU and on a CPU with AMX tiles, else widened to
  fp32), and the batched products attention is timed by in the cost model (q k^T and weights x v:
  batch = batch * heads); for a 16-bit dtype, the GEMMs writing fp32 partial sums (weight gradients)
  too, which a CPU runs as another kernel (AMX behind an fp32 GEMM: a third of the native rate);
- memory bandwidth as the kernel set's elementwise kernels reach it: the bytes the cost model charges
  a mix of them (norms, activations and their gradients, softmax, residual adds, masks, casts,
  AdamW) over their time, less each kernel's launch; a plain copy's rate beside it;
- the time of the smallest kernel (a one-element add: launch and dispatch overhead);
- on a CPU, every other kernel of a training step as the program calls it: a real step of a small GPT
  and of a small Llama of two widths on the kernel set, each call timed (step_profile.py) and its time
  put on the kernels it records (the median of five such profiles), so each gets the rate it reaches in
  a step at two sizes (GELU's backward, the norms, the fused attention: 0.3 to 16 GB/s on this CPU
  against the mix's 4), not the mix's average; GEMMs keep the grid's figures, and the kernels over
  weight-sized tensors are measured apart at two larger sizes too (on a GPU, where a call returns
  before its kernel runs, the step's kernels keep the elementwise bandwidth: `stepped`);
- all-reduce times by message size over `nproc` ranks of one process group (gloo on CPU, NCCL on
  GPUs), fitted to t = alpha + bytes_on_the_ring / beta: beta is the link's bus bandwidth, alpha
  over the ring's 2(p-1) steps the latency per step.
Each figure is the median of several timed repetitions after warm-up (wall clock on CPU, CUDA events
on a GPU; the GEMM grid's shapes timed in turns, so that a busy spell of a shared machine slows one
timing of many shapes, not all of one's): a measurement, so two calibrations differ; a profile, once
written, gives the same predictions every run.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

from gpu_backend.processes import LaunchError, check_backend, cpu_share, in_processes, keep_freed_memory, power_limit_note
from gpu_backend.step_profile import REPEATS, WIDTHS, step_rates
from gpu_backend.torch_ops import TorchFastOps
from simcluster.config.options import say_error
from simcluster.topology import profile as _profile
from simcluster.topology.profile import Gemm

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}
# the datasheet's dense peaks (presets.py) where the device is one a preset describes
DATASHEET = {"A100": (312.0, 19.5), "H100": (989.0, 67.0)}


@dataclass(frozen=True)
class Grid:
    sizes: tuple[int, ...]  # m, n and k each take every one of these
    attention: tuple[tuple[int, int, int], ...]  # (batch * heads, sequence, head dimension)
    copy_bytes: int
    message_bytes: tuple[int, ...]
    repeats: int  # timings each figure is the median of; on a CPU, also the step profiles taken
    widths: tuple[int, ...] = WIDTHS  # (a CPU's) the model widths the step profile is taken at


GRIDS = {  # (device type, quick)
    ("cpu", True): Grid((64, 256), ((8, 128, 64),), 16 << 20, tuple(1 << e for e in range(12, 21, 2)), 3, (256, 512)),
    ("cpu", False): Grid((64, 256, 1024), ((16, 128, 64), (16, 512, 64)), 64 << 20,
                         tuple(1 << e for e in range(12, 25, 2)), 5),
    ("cuda", True): Grid((256, 1024, 4096), ((32, 1024, 128),), 256 << 20, tuple(1 << e for e in range(16, 27, 2)), 5),
    ("cuda", False): Grid((256, 1024, 4096, 8192), ((32, 1024, 128), (32, 4096, 128), (64, 2048, 64)), 1 << 30,
                          tuple(1 << e for e in range(12, 31, 2)), 10),
}


def _once(device: torch.device, fn: Callable[[], Any]) -> float:
    """seconds of one call of fn (CUDA events on a GPU, the wall clock on a CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _timer(device: torch.device) -> Callable[[Callable[[], Any], int], float]:
    """seconds per call of fn: the median of `repeats` timings, after two untimed calls."""
    def timed(fn: Callable[[], Any], repeats: int) -> float:
        fn(), fn()
        return statistics.median(_once(device, fn) for _ in range(repeats))
    return timed


def _spread(device: torch.device, fns: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """seconds per call of each of fns: the median of `repeats` timings taken in turns, one of each fn a
    turn, after two untimed calls of each. A shared machine's busy spell then slows one timing of many
    figures, not every timing of one (a GEMM grid timed shape by shape moved 0.75x to 1.97x a shape
    between two calibrations minutes apart)."""
    for fn in fns:
        fn(), fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, mine in zip(fns, times):
            mine.append(_once(device, fn))
    return [statistics.median(t) for t in times]


def _allreduce_times(device: torch.device, sizes: Sequence[int], repeats: int, kind: str = "all_reduce") -> list[float]:
    """(In each rank's process.) Seconds per all-reduce (or `kind`: all_gather, reduce_scatter) of each
    size in bytes (fp32: the whole tensor, gathered or scattered), the median of `repeats`, each started
    together after a barrier."""
    out = []
    p = dist.get_world_size()
    for nbytes in sizes:
        n = max(p, nbytes // 4 // p * p)
        x = torch.ones(n, dtype=torch.float32, device=device)
        part = torch.ones(n // p, dtype=torch.float32, device=device)
        call = {"all_reduce": lambda: dist.all_reduce(x),
                "all_gather": lambda: dist.all_gather_single(x, part),
                "reduce_scatter": lambda: dist.reduce_scatter_single(part, x)}[kind]
        times = []
        for i in range(repeats + 2):
            dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= 2:
                times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
    return out


def elementwise_rate(device: torch.device, grid: Grid, timed: Callable[[Callable[[], Any], int], float],
                     overhead_s: float, dtype: str = "fp32") -> float:
    """GB/s the cost model should charge the kernel set's elementwise kernels at: the bytes it charges a
    transformer layer's mix of them in a `dtype` run (ops.py's own accounting: activations in `dtype`,
    the master weights and Adam in fp32), over their measured time less a launch each."""
    charged = [0.0, 0]

    def record(name: str, work: Any, nbytes: float) -> None:
        charged[0] += nbytes
        charged[1] += 1

    ops = TorchFastOps(device, record, cost_dtype=dtype)
    rows, h = max(1, (grid.copy_bytes // 4) // (16 * 1024)), 1024  # (rows, h): a sixteenth of the copy's size
    x, dy = (torch.randn(rows, h, device=device).to(TORCH_DTYPES[dtype]) for _ in range(2))
    g, b = (torch.full((h,), v, device=device).to(TORCH_DTYPES[dtype]) for v in (1.0, 0.0))
    keep = torch.rand(rows, h, device=device) > 0.1
    p, m, v = (torch.randn(rows * h, device=device) for _ in range(3))
    v = v.abs()

    def mix() -> None:
        y, mean, rstd = ops.layer_norm(x, g, b)
        ops.layer_norm_backward(dy, x, g, mean, rstd)
        ops.gelu_backward(dy, ops.gelu(y))
        e = ops.attention_weights(y, ops.max(y, -1))
        ops.attention_probs(e, ops.sum(e, -1, partial=True))
        ops.add(ops.scale(ops.zero_where(keep, y), 1.1), x)
        ops.mul(ops.cast(ops.cast(y, "fp32"), dtype), dy)
        ops.adam(p, p, m.clone(), v.clone(), 3, lr=1e-3, weight_decay=0.01)

    mix()
    charged[:] = [0.0, 0]
    mix()
    nbytes, kernels = charged
    seconds = timed(mix, grid.repeats)
    return nbytes / max(seconds - kernels * overhead_s, seconds / 2) / 1e9


def kernel_rates(device: torch.device, grid: Grid, timed: Callable[[Callable[[], Any], int], float],
                 overhead_s: float, dtype: str = "fp32") -> list[Any]:
    """Kernels timed alone, as a `dtype` run charges them (the bytes ops.py records for each over its
    time, less a launch), where their rates are far from the mix's: those a step runs on tensors the
    size of the weights -- the fused AdamW (one pass over four fp32 tensors, after the gradient's scaling
    by the clipping coefficient, as a run with run.clip_grad, the default, calls it), the new master weights
    cast to a 16-bit working dtype, the gradients flattened into a bucket -- and the weights' initialisation
    (the counter-based generator: some twenty integer passes for each element it charges one write);
    each at two sizes, a sixteenth of the copy's and the copy's (a run's kernel at the rate between)."""
    charged: list[tuple[str, float]] = []
    ops = TorchFastOps(device, lambda name, work, nbytes: charged.append((name, nbytes)), cost_dtype=dtype)
    out = []
    for n in (grid.copy_bytes // 64, grid.copy_bytes // 4):  # (weight-sized: a cache's worth, far more)
        # as a step finds them: the optimizer's tensors long out of the caches (copies taken in turn, four
        # copies' bytes in all; one set reused stayed in the cache: AdamW at 36 GB/s, 7 in a step), and the
        # initialisation writing memory not touched before (what it makes is kept, as the weights are)
        copies = max(1, -(-4 * grid.copy_bytes // (16 * n)))
        sets = []
        for _ in range(copies):
            p, g, m, v = (torch.randn(n, device=device) for _ in range(4))
            sets.append((p, g, m, v.abs(), [t.to(TORCH_DTYPES[dtype]) for t in (m[: n // 2], v[: n // 2])]))
        turn = itertools.cycle(sets)
        kept: list[Any] = []
        clip = torch.tensor(0.5, device=device)  # (a run clips its gradients by default: the scaled copy is part of it)
        cases = {"adam": lambda p, g, m, v, half: ops.adam(p, g, m, v, 3, lr=1e-3, weight_decay=0.01, grad_scale=clip,
                                                           donate=True),
                 "cast": lambda p, g, m, v, half: _casts(ops, g[: n // 2], dtype, half),
                 "flatten": lambda p, g, m, v, half: ops.flat(half),
                 "uniform": lambda *_: kept.append(ops.uniform(7, "weights", (n // 2,)))}
        for name, case in cases.items():
            fn = (lambda case=case: case(*next(turn)))
            fn()
            charged.clear()
            fn()
            calls = [b for k, b in charged if k == name]
            if not calls or len(calls) != len(charged):  # (it must record that kernel alone)
                continue
            seconds = timed(fn, grid.repeats)
            kept.clear()
            out.append(_profile.Kernel(name, dtype, sum(calls) / max(seconds - len(calls) * overhead_s, seconds / 2) / 1e9,
                                       sum(calls) / len(calls)))
    return out


def _casts(ops: Any, master: torch.Tensor, dtype: str, half: list[torch.Tensor]) -> None:
    """The casts of a `dtype` step, as it makes them: the new master weights rounded into the working copy's
    buffer, and (16-bit) the gradients widened to fp32 for the optimizer into a new tensor (precision.unscale)."""
    ops.cast(master, dtype, out=None if dtype == "fp32" else half[0])
    if dtype != "fp32":
        ops.cast(half[1], "fp32")


def fit_link(sizes: Sequence[int], seconds: Sequence[float], ranks: int) -> tuple[float, int]:
    """(bus bandwidth in GB/s, latency per ring step in ns) of t = alpha + ring_bytes / beta, least squares;
    ring_bytes = 2(p-1)/p * bytes is what each rank sends in a ring all-reduce."""
    factor = 2 * (ranks - 1) / ranks
    xs, ys = [factor * b for b in sizes], list(seconds)
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx > 0 else 0.0
    per_step = 1e9 / (2 * (ranks - 1))
    if slope <= 0:  # noise swamped the slope (small messages slowest): the largest message's bandwidth,
        return xs[-1] / ys[-1] / 1e9, int(round(min(ys) * per_step))  # the fastest one's time as latency
    alpha = my - slope * mx
    if alpha <= 0:  # noise tipped the line below the origin: the smallest message is (nearly) all latency
        alpha = min(ys)
    return 1.0 / slope / 1e9, int(round(alpha * per_step))


def _measure(device: torch.device, grid: Grid, dtypes: tuple[str, ...]) -> dict[str, Any]:
    """This process's figures: the smallest kernel, a copy's rate, the elementwise mixes, the kernels
    timed alone, the GEMM grid."""
    timed = _timer(device)
    one, ops = torch.ones(1, device=device), TorchFastOps(device)
    # through the kernel set, as a program calls it: its Python is part of every kernel's cost
    overhead = timed(lambda: ops.add(one, one), grid.repeats * 20)
    src = torch.empty(grid.copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    copy_rate = 2 * grid.copy_bytes / timed(lambda: dst.copy_(src), grid.repeats) / 1e9
    memory = elementwise_rate(device, grid, timed, overhead)
    sixteen = elementwise_rate(device, grid, timed, overhead, "bf16") if {"bf16", "fp16"} & set(dtypes) else None
    measured = [k for dt in ("fp32",) + (("bf16",) if sixteen else ()) for k in kernel_rates(device, grid, timed, overhead, dt)]
    measured += [replace(k, dtype="fp16") for k in measured if k.dtype == "bf16"]
    shapes = [(1, m, n, k) for m in grid.sizes for n in grid.sizes for k in grid.sizes]
    for bh, s, d in grid.attention:  # attention's batched products: scores (s x d by d x s), output (s x s by s x d)
        shapes += [(bh, s, s, d), (bh, s, d, s)]
    products: list[tuple[Gemm, Any]] = []  # (each GEMM, its rate to come; its call's maker)
    for dt in dtypes:
        for batch, m, n, k in shapes:
            products.append((Gemm(dt, batch, m, n, k, 0.0), _product(ops, device, dt, batch, m, n, k)))
    for dt in (d for d in dtypes if d in ("bf16", "fp16")):  # a GEMM writing fp32 sums of 16-bit inputs
        for _, m, n, k in (s for s in shapes if s[0] == 1):  # (weight gradients): on a CPU another kernel
            products.append((Gemm(dt, 1, m, n, k, 0.0, partial=True), _product(ops, device, dt, 1, m, n, k, partial=True)))
    if device.type == "cpu":  # (a shared machine: the shapes in turns, every operand held meanwhile)
        seconds = _spread(device, [make() for _, make in products], grid.repeats)
    else:  # (a device of its own: shape by shape, one shape's operands held at a time)
        seconds = [timed(make(), grid.repeats) for _, make in products]
    gemm: list[Gemm] = [replace(g, tflops=_tflops(t, g.batch * g.m * g.n * g.k, overhead))
                        for (g, _), t in zip(products, seconds)]
    return {"overhead": overhead, "copy": copy_rate, "memory": memory, "sixteen": sixteen, "kernels": measured,
            "gemm": gemm}


def _product(ops: Any, device: torch.device, dt: str, batch: int, m: int, n: int, k: int,
             partial: bool = False) -> Callable[[], Callable[[], Any]]:
    """A maker of one GEMM's call through the kernel set, its operands made when it is."""
    def make() -> Callable[[], Any]:
        a = torch.randn(batch, m, k, device=device).to(TORCH_DTYPES[dt])
        b = torch.randn(batch, k, n, device=device).to(TORCH_DTYPES[dt])
        if partial:
            return lambda: ops.matmul(a[0], b[0], partial=True)
        return (lambda: ops.matmul(a[0], b[0])) if batch == 1 else (lambda: ops.einsum("bmk,bkn->bmn", a, b))
    return make


def _tflops(seconds: float, mnk: int, overhead_s: float) -> float:
    """A GEMM's rate: the kernel, not its launch."""
    return 2.0 * mnk / max(seconds - overhead_s, seconds / 2) / 1e12


def _slowest(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Figure by figure, the slowest rank's (a step ends when its slowest rank does)."""
    first = ranks[0]
    return {"overhead": max(r["overhead"] for r in ranks), "copy": min(r["copy"] for r in ranks),
            "memory": min(r["memory"] for r in ranks),
            "sixteen": None if first["sixteen"] is None else min(r["sixteen"] for r in ranks),
            "kernels": [replace(k, gbyte_per_s=min(r["kernels"][i].gbyte_per_s for r in ranks))
                        for i, k in enumerate(first["kernels"])],
            "gemm": [replace(g, tflops=min(r["gemm"][i].tflops for r in ranks)) for i, g in enumerate(first["gemm"])]}


def stepped(device: torch.device, overhead: float, dtypes: Sequence[str], nproc: int, kind: str, timeout_s: float,
            say: Callable[[str], None], repeats: int = REPEATS,
            widths: Sequence[int] = WIDTHS) -> tuple[list[_profile.Kernel], list[tuple[str, float]]]:
    """A training step's kernels at the rates they reach as the program calls them (step_profile.py), on a
    CPU, and by dtype the share of the step's time its calls that record no kernel take (the slowest
    rank's). Not on a GPU: a call returns when its kernel is queued, so timing the calls times the launches,
    and a small step's kernels are all launch. On an H100 (2026-11-27) such rates (flash attention at
    0.0075 GB/s) predicted 745 s a step for a 1.2B GPT measured at 0.22 s; without them, at the
    elementwise bandwidth measured apart, 0.23 s. There those kernels keep that bandwidth."""
    if device.type != "cpu":
        say("  a training step's kernels: at the elementwise bandwidth (a GPU's calls return before their "
            "kernels run: timing them would time the launches)")
        return [], []
    say(f"  a training step's kernels, as the program calls them ({', '.join(dtypes)}; GPT and Llama of width "
        f"{' and '.join(map(str, widths))})")
    runs = tuple(d for d in ("fp32", "bf16") if d in dtypes) or ("fp32",)  # (fp16 runs take bf16's rates)
    per_rank = in_processes(step_rates, (overhead, runs, nproc, repeats, tuple(widths)), nproc, kind, timeout_s=timeout_s)
    first = per_rank[0][0]
    out = [replace(k, gbyte_per_s=min(r[0][i].gbyte_per_s for r in per_rank)) for i, k in enumerate(first)]
    shares = {d: max(r[1][d] for r in per_rank) for d in per_rank[0][1]}
    shares |= {"fp16": shares["bf16"]} if "bf16" in shares else {}
    return out + [replace(k, dtype="fp16") for k in out if k.dtype == "bf16"], sorted(shares.items())


def calibrate(path: str, *, nproc: int = 2, backend: str = "auto", dtypes: Sequence[str] = ("bf16", "fp32"),
              quick: bool = False, timeout_s: float = 600.0, say: Callable[[str], None] = lambda _: None) -> dict:
    """Measure, write the profile at `path`, and return what was measured (for the caller to show)."""
    for d in dtypes:
        if d not in TORCH_DTYPES:
            raise ValueError(f"dtype {d!r} is not valid; valid: {', '.join(TORCH_DTYPES)}")
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, got {nproc}")
    kind = check_backend(backend, nproc) if nproc > 1 else ("nccl" if backend != "gloo" and
                                                           torch.cuda.is_available() else "gloo")
    device = torch.device("cuda", 0) if kind == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        name = torch.cuda.get_device_name(device)
    else:  # a CPU rank is one process of nproc on this CPU, with its share of the cores (as a launch runs it)
        torch.set_num_threads(cpu_share(nproc))
        keep_freed_memory()  # (measured here, not in a rank, when nproc is 1)
        name = f"cpu ({platform.machine()}, {torch.get_num_threads()} of {os.cpu_count()} cores: one rank of {nproc})"
    grid = GRIDS[(device.type, quick)]
    say(f"calibrating {name}")
    if device.type == "cpu" and nproc > 1:  # every rank measures at once, as a run shares the caches and memory
        say(f"  kernels measured on {nproc} ranks at once (the slowest rank's figures)")
        ranks = in_processes(_measure, (grid, tuple(dtypes)), nproc, kind, timeout_s=timeout_s)
        got = _slowest(ranks)
    else:
        got = _measure(device, grid, tuple(dtypes))
    overhead, memory, sixteen, measured, gemm = (got[k] for k in ("overhead", "memory", "sixteen", "kernels", "gemm"))
    stepped_kernels, host_share = stepped(device, overhead, dtypes, nproc, kind, timeout_s, say, grid.repeats, grid.widths)
    measured = stepped_kernels + list(measured)
    say(f"  smallest kernel: {overhead * 1e6:.1f} us")
    if host_share:
        say("  calls that record no kernel: " + ", ".join(f"{100 * v:.1f} % of the kernels' time ({d})"
                                                          for d, v in host_share if d != "fp16"))
    say(f"  memory: {memory:.2f} GB/s through the kernel set's elementwise kernels ({got['copy']:.1f} GB/s a copy)"
        + ("" if sixteen is None else f"; {sixteen:.2f} GB/s in a 16-bit run"))
    for dt in dtypes:
        say(f"  {dt} GEMMs: {sum(g.dtype == dt and not g.partial for g in gemm)} shapes, best "
            f"{max(g.tflops for g in gemm if g.dtype == dt and not g.partial):.3g} TFLOP/s")

    def best_of(kinds: tuple[str, ...]) -> float | None:
        return max((g.tflops for g in gemm if g.dtype in kinds and not g.partial), default=None)

    sheet = next((v for key, v in DATASHEET.items() if key in name and device.type == "cuda"), None)
    peak16 = sheet[0] if sheet else (best_of(("bf16", "fp16")) or best_of(("fp32", "fp64")))
    peak32 = sheet[1] if sheet else (best_of(("fp32",)) or best_of(("fp64",)) or peak16)

    link, allreduce, rates = None, [], []
    if nproc > 1:
        say(f"  all-reduce over {nproc} ranks ({kind}), {len(grid.message_bytes)} sizes")
        per_rank = in_processes(_allreduce_times, (grid.message_bytes, grid.repeats), nproc, kind, timeout_s=timeout_s)
        seconds = [max(ts) for ts in zip(*per_rank)]  # a call ends when its last rank does
        allreduce = list(zip(grid.message_bytes, seconds))
        link = fit_link(grid.message_bytes, seconds, nproc)
        say(f"  link: {link[0]:.3g} GB/s bus bandwidth, {link[1] / 1e3:.1f} us per ring step")
        big = grid.message_bytes[-2:]  # (bandwidth-bound: the largest messages)
        for rated in _profile.RATED:
            per_rank = in_processes(_allreduce_times, (big, grid.repeats, rated), nproc, kind, timeout_s=timeout_s)
            shares = [(nproc - 1) / nproc * b / (link[0] * 1e9) / max(t - (nproc - 1) * link[1] / 1e9, 1e-9)
                      for b, t in zip(big, (max(ts) for ts in zip(*per_rank)))]  # the ring's time at the link / measured
            rates.append((rated, min(1.0, statistics.median(shares))))
        say("  " + ", ".join(f"{k}: {v:.2f} of the link's rate" for k, v in rates))
    memory_gbyte = (torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None)
    notes = [f"measured with torch {torch.__version__} on {name}, {'quick' if quick else 'full'} grid",
             "peak_tflops: " + ("the datasheet's" if sheet else "the best GEMM measured (no datasheet for this device)"),
             "links inside a node are these; links between nodes (the NIC) stay the preset's"
             if link else "one rank: no links measured (the preset's stay)"] + [n for n in [power_limit_note(device)] if n]
    _profile.write(path, device=name, peak_tflops=peak16, peak_tflops_fp32=peak32, memory_gbyte_per_s=memory,
                   kernel_overhead_ns=max(1, int(round(overhead * 1e9))), gemm=gemm, link=link,
                   allreduce=allreduce, ranks=nproc, backend=kind, memory_gbyte=memory_gbyte, notes=notes,
                   memory_gbyte_per_s_16bit=sixteen, kernels=measured, shares_cores=device.type == "cpu" and nproc > 1,
                   collective_rates=rates, host_share=host_share)
    _profile.load(path)  # what was written reads back
    return {"device": name, "backend": kind, "ranks": nproc, "overhead_s": overhead, "memory_gbyte_per_s": memory,
            "memory_gbyte_per_s_16bit": sixteen, "kernels": measured, "host_share": host_share,
            "gemm": gemm, "link": link, "allreduce": allreduce, "peak_tflops": peak16, "path": path}


def command(args: argparse.Namespace, out: Console, err: Console) -> int:
    """`simcluster calibrate`: measure, write the profile, show what was measured."""
    try:
        got = calibrate(args.output, nproc=args.nproc, backend=args.dist_backend,
                        dtypes=[d.strip() for d in args.dtypes.split(",") if d.strip()], quick=args.quick,
                        timeout_s=args.timeout, say=lambda line: err.print(line, markup=False, highlight=False))
    except (LaunchError, ValueError, OSError) as exc:
        say_error(err, str(exc))
        return 2
    t = Table(title=f"measured: {got['device']}", title_justify="left")
    t.add_column("what")
    t.add_column("measured", justify="right")
    t.add_row("smallest kernel", f"{got['overhead_s'] * 1e6:.1f} us")
    t.add_row("memory bandwidth", f"{got['memory_gbyte_per_s']:.3g} GB/s")
    if got["memory_gbyte_per_s_16bit"] is not None:
        t.add_row("memory bandwidth, 16-bit run", f"{got['memory_gbyte_per_s_16bit']:.3g} GB/s")
    for k in got["kernels"]:
        if k.dtype != "fp16":
            size = f", {_size(k.nbytes)} a call" if k.nbytes else ""
            t.add_row(f"{k.name}, {k.dtype} run{size}", f"{k.gbyte_per_s:.3g} GB/s")
    for dt, partial in dict.fromkeys((g.dtype, g.partial) for g in got["gemm"]):
        rates = sorted(g.tflops for g in got["gemm"] if (g.dtype, g.partial) == (dt, partial))
        t.add_row(f"{dt} GEMM" + (", fp32 partial sums out" if partial else ""),
                  f"{rates[0]:.3g} .. {rates[-1]:.3g} TFLOP/s ({len(rates)} shapes)")
    if got["link"]:
        t.add_row(f"all-reduce, {got['ranks']} ranks ({got['backend']})",
                  f"{got['link'][0]:.3g} GB/s bus, {got['link'][1] / 1e3:.1f} us per step")
    out.print(t)
    out.print(f"wrote {got['path']}; use it with --set cluster.profile={got['path']}", markup=False, highlight=False)
    return 0


def _size(nbytes: float) -> str:
    """Bytes as a reader reads them: 4.2 MB, 470 MB, 786 kB."""
    unit, scale = next(((u, x) for u, x in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)) if nbytes >= x), ("B", 1.0))
    return f"{nbytes / scale:.3g} {unit}"


__all__ = ["GRIDS", "LaunchError", "calibrate", "command", "fit_link"]
