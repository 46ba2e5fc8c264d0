"""What a run would cost here, estimated before it starts: what cannot finish is refused up front.

The estimates are lower bounds, from closed forms and from rates faster than this project's machines
reach (measured on the 2-core development machine, 2026-11-24):
- exact mode computes about 5e8 model FLOP/s (the default GPT at hidden 128: 2.0 GFLOP in 3.8 s, the
  single-device check included), fast mode about 1e10 (0.19 s); the bound assumes 1e9 and 2e10;
- meta mode replays 2e5 to 4e5 kernels a second (Megatron Table 1's rows) and keeps each kernel's
  trace event (about 460 bytes); the bound assumes 1e6 a second and 100 bytes;
- a GPT block is at least 20 kernels a micro-batch (forward and backward; Table 1's are ~220);
- exact and fast mode hold at least 32 bytes a parameter: fp32 weights, gradients and Adam's two
  moments on the single device the run is checked against, and as much again over the ranks.
A run whose bound exceeds a day, or this machine's memory, is refused with its estimate.
"""

from __future__ import annotations

import os
from dataclasses import replace

from simcluster.config.scenario import Scenario, ScenarioError
from simcluster.parallel.parallelism import CP_ALIKE
from simcluster.parallel.pipeline_schedules import PipelineShape, placement
from simcluster.run import pipeline_steady
from simcluster.run.job import COUNTABLE, faults_of, job_of
from simcluster.run.steady import SIMULATED

LIMIT_S = 24 * 3600
RATE = {"exact": 1e9, "fast": 2e10}  # model FLOP/s, optimistic
# Meta mode, per kernel of the estimate below (20 a block, each micro-batch): measured here, Llama 3
# 405B on 256 ranks unfolded, 645 k estimated kernels: 19 k a second and 8.5 kB each (trace events,
# streams and the data pass); folded on 16,384 GPUs, 40 k: 10 kB each. The bounds are 5-10x below.
KERNELS_PER_S, BYTES_PER_KERNEL = 1e5, 1000
KERNELS_PER_BLOCK = 20
# A transfer in the network model: measured here, the collectives program on 2,048 ranks, 6.7e7
# transfers in 52 s and 24 GB (1.3e6 a second, 355 bytes each); the bounds are 8x and 3.5x below.
FLOWS_PER_S, BYTES_PER_FLOW = 1e7, 100
BYTES_PER_PARAMETER = 32


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # (no sysconf: no memory bound)
        return 1 << 62


def duration(s: float) -> str:
    for unit, n in (("years", 365 * 86400), ("days", 86400), ("hours", 3600), ("minutes", 60)):
        if s >= 2 * n:
            return f"{s / n:,.0f} {unit}"
    return f"{s:,.0f} s"


def _bytes(n: float) -> str:
    for unit, k in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= k:
            return f"{n / k:,.1f} {unit}"
    return f"{n:,.0f} bytes"


MAX_RANKS = 2**18  # 262,144 GPUs: above the largest clusters built (about 10^5 GPUs in 2024-25)


def check(sc: Scenario, fold: bool = True, repeat: bool = True) -> None:
    """Refuse `sc` if even its lower-bound cost is more than this machine can do (before anything of
    its size is built: a GPT's parameter count and FLOPs are affine in its layers, so they come from
    two small copies of it). `repeat`: a meta-mode run may simulate its identical steps once (steady.py)."""
    if sc.world_size > MAX_RANKS:
        p = sc.parallel
        raise ScenarioError(f"the mesh dp={p.dp:,} x pp={p.pp:,} x cp={p.cp:,} x tp={p.tp:,} has "
                            f"{sc.world_size:,} ranks; simcluster simulates at most {MAX_RANKS:,} (the largest "
                            f"clusters have about 10^5 GPUs)")
    memory = physical_memory()
    m = sc.model
    if sc.run.program != "transformer":
        _transfers(sc, memory)
    if sc.run.numerics == "meta":
        if sc.run.program != "transformer":
            return
        _countable(sc)
        kernels, _, folds, why = _meta_kernels(sc, fold, repeat)
        seconds, nbytes = kernels / KERNELS_PER_S, kernels * BYTES_PER_KERNEL
        if seconds > LIMIT_S or nbytes > memory:
            steps, micro = _meta_counts(sc, repeat)
            raise ScenarioError(
                f"meta mode would replay at least {kernels:.1e} kernels ({steps:,} step{'s' if steps != 1 else ''} x "
                f"{micro} micro-batches x "
                f"{m.layers:,} layers{why}): at least {duration(seconds)} and {_bytes(nbytes)} here (this machine "
                f"has {_bytes(memory)}); lower run.steps, model.layers or the micro-batch count" +
                ("" if folds else ", or the mesh"))
        return
    size = _size(sc)
    if size is None:
        return
    parameters, flops = size
    seconds = flops / RATE.get(sc.run.numerics, RATE["fast"])
    nbytes = float(parameters) * BYTES_PER_PARAMETER
    if seconds > LIMIT_S or nbytes > memory:
        raise ScenarioError(
            f"{sc.run.numerics} mode would need at least {_bytes(nbytes)} of memory (this machine has "
            f"{_bytes(memory)}) and at least {duration(seconds)} here for {parameters:,} parameters over "
            f"{run_steps(sc)}; use run.numerics = meta (timing and memory, without the numbers), or a smaller "
            f"model or fewer steps")


def meta_seconds(sc: Scenario, fold: bool = True) -> float:
    """The lower bound of a meta-mode GPT run's time here (what `check` refuses past a day)."""
    return _meta_kernels(sc, fold, True)[0] / KERNELS_PER_S


def _meta_counts(sc: Scenario, repeat: bool) -> tuple[int, int]:
    """The steps and micro-batches a step a meta-mode run simulates (steady.py, pipeline_steady.py)."""
    m, p = sc.model, sc.parallel
    share = max(1, m.global_batch // p.dp)  # sequences a step, a data-parallel rank
    micro = max(1, share // m.micro_batch) if m.micro_batch else 1
    faulty = faults_of(sc) is not None
    steps = min(sc.run.steps, SIMULATED + 2) if repeat and not faulty else sc.run.steps
    rounds = pipeline_steady.micro_counts(m, p) if repeat and not faulty else None
    if rounds is not None:  # (three short runs: pipeline_steady.py)
        micro = sum(rounds.counts)
    return steps, micro


def _meta_kernels(sc: Scenario, fold: bool, repeat: bool) -> tuple[float, int, bool, str]:
    """A meta-mode GPT run's kernels at least: those of one replica (20 a block a micro-batch), times the
    ranks that run (every cp rank, but with Ulysses or all-gather attention, which may fold them; unfolded, every dp and tp rank
    too); the copies, whether it folds, and if not why."""
    p = sc.parallel
    faulty = faults_of(sc) is not None
    cluster = sc.cluster_spec().unfoldable  # (no folding: engine/__init__.py)
    folds = fold and not faulty and not cluster
    copies = (1 if folds and p.attention in CP_ALIKE else p.cp) * (1 if folds else p.dp * p.tp)
    steps, micro = _meta_counts(sc, repeat)
    why = "" if folds else (f" x {copies:,} copies: every dp and tp rank runs, " + (
        "[faults] turn folding off" if faulty else f"no folding: {cluster}" if cluster else "--no-fold"))
    return float(steps) * micro * sc.model.layers * KERNELS_PER_BLOCK * copies, copies, folds, why


def _size(sc: Scenario) -> tuple[int, float] | None:
    """A program's parameters and model FLOPs, a GPT's from two small copies of it (None: the run
    itself will say what is wrong with it)."""
    m, p = sc.model, sc.parallel
    v = p.virtual_stages if p.schedule == "interleaved" else 1
    unit = placement(p.schedule, PipelineShape(p.pp, 1, v)).pieces  # runs of layers the pipeline cuts
    layers = m.layers
    try:
        if sc.run.program != "transformer" or layers <= 2 * unit:
            job = job_of(sc, fold=False)
            return job.parameters, job.flops[0]
        one, two = (job_of(replace(sc, model=replace(m, layers=n * unit), variants=()), fold=False) for n in (1, 2))
    except ScenarioError:
        return None
    per = (two.parameters - one.parameters, (two.flops[0] - one.flops[0]))
    k = layers // unit - 1
    return one.parameters + k * per[0], one.flops[0] + k * per[1]


# The emulator counts time in int64 nanoseconds and bytes in int64 (numpy's): a model whose step or
# memory does not fit is refused, not overflowed. The step's floor: every rank at 1e16 FLOP/s, above
# any GPU built (the B200's dense FP4 peak is 9e15, NVIDIA's datasheet).
PEAK_FLOPS = 1e16


def _countable(sc: Scenario) -> None:
    """Meta mode, where any size is allowed: refuse one the emulator cannot count."""
    m = sc.model
    scores = float(m.global_batch) * m.heads * float(m.seq) ** 2  # the attention's s x s, every head
    if scores > COUNTABLE:
        raise ScenarioError(
            f"model.seq = {m.seq:,}: attention's scores (sequence x sequence for each of {m.heads} heads of "
            f"{m.global_batch} sequences, {scores:.1e} elements) are more than the emulator's int64 counts hold; "
            f"the longest contexts trained are about 10^6 tokens")
    size = _size(sc)
    if size is None:
        return
    parameters, flops = size
    step_ns = flops / sc.run.steps / (PEAK_FLOPS * sc.world_size) * 1e9  # (meta mode: no resume)
    if step_ns > COUNTABLE or parameters * 16 > COUNTABLE:
        raise ScenarioError(
            f"a model of {float(parameters):.2e} parameters ({float(flops):.2e} FLOPs) is beyond what the emulator "
            f"counts: a step of at least {duration(step_ns / 1e9)} even at 1e16 FLOP/s a GPU, and "
            f"{_bytes(parameters * 16.0)} of weights and optimizer state; the largest models have about 10^12 "
            f"parameters: lower model.hidden, model.layers or model.vocab")


def _transfers(sc: Scenario, memory: int) -> None:
    """The demonstration programs run unfolded; a collective over g ranks routes at least g (g - 1)
    transfers (a ring: g - 1 phases of g), each an object in the network model: refuse a world where
    that alone is too much. Per program, its calls' groups (collectives_demo.py, allreduce_decomposed.py,
    tp_dp_mlp.py)."""
    p, w = sc.parallel, sc.world_size
    dp = p.dp
    calls = {"collectives": [(6, w), (3, dp)], "allreduce": [(3, w)],
             "mlp": [(3 * sc.run.steps * p.tp, dp)]}[sc.run.program]
    flows = float(sum(n * g * (g - 1) for n, g in calls))
    seconds, nbytes = flows / FLOWS_PER_S, flows * BYTES_PER_FLOW
    if seconds > LIMIT_S or nbytes > memory:
        raise ScenarioError(f"run.program = {sc.run.program!r} on {w:,} ranks would route at least {flows:.1e} "
                            f"transfers (a collective over g ranks moves data between them in g - 1 phases): at "
                            f"least {duration(seconds)} and {_bytes(nbytes)} here (this machine has "
                            f"{_bytes(memory)}); use fewer ranks")


def run_steps(sc: Scenario) -> str:
    n = sc.run.steps
    return f"{n:,} step" + ("s" if n != 1 else "")
