"""Pipeline schedules as data: for each stage, the ordered list of the passes it runs.

A pass is (kind, micro-batch, chunk): kind "F" (forward), "B" (backward; with the weight gradient
unless the stage also has a "W" pass for the same micro-batch and chunk), or "W" (that weight
gradient, deferred: the zero-bubble schedules and DualPipe). `chunk` is the global model chunk; where
each chunk lives, which layers it runs and which chunk feeds it is the schedule's `Placement`:
  - one chunk per stage (GPipe, 1F1B, ZB-H1): chunk s on stage s;
  - interleaved, v chunks per stage: stage s holds chunks s, s + p, ..., s + (v-1)p of p*v;
  - ZB-V: two chunks per stage in a V: chunk s and chunk 2p-1-s, so stage 0 holds the first chunk
    and the last (the loss);
  - DualPipe: two copies of the model, one per direction: chunks 0..p-1 run the layers forwards from
    stage 0 (chunk g on stage g), chunks p..2p-1 run the same p pieces of layers from stage p-1
    backwards (chunk p+c, piece c, on stage p-1-c); the first half of the micro-batches takes the
    first chain, the second half the other. Every stage holds two pieces, 2x the parameters.
Print a schedule with `describe`, draw a run of it with the timeline.
"""

from __future__ import annotations

import functools

from collections import deque
from dataclasses import dataclass
from enum import Enum

Pass = tuple[str, int, int]  # (kind, micro-batch, global chunk)


class Schedule(Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"
    ZB_V = "zb-v"
    DUALPIPE = "dualpipe"


@dataclass(frozen=True)
class PipelineShape:
    stages: int  # p
    micro_batches: int  # m
    virtual: int = 1  # v, model chunks per stage (interleaved only)
    group: int = 0  # N, micro-batches that go through a chunk together (interleaved only; 0: p)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual

    @property
    def together(self) -> int:
        """N: the interleaved schedule's micro-batches a chunk runs before the next chunk's turn."""
        return self.group or self.stages


@dataclass(frozen=True)
class Placement:
    """Where a schedule's chunks live: chunk g runs piece `piece[g]` of the `pieces` contiguous runs of
    layers, on stage `stage[g]`; a micro-batch goes through each chain's chunks in order (the first
    embeds, the last has the head and the loss)."""

    pieces: int
    stage: tuple[int, ...]
    piece: tuple[int, ...]
    chains: tuple[tuple[int, ...], ...]

    @property
    def chunks(self) -> int:
        return len(self.stage)

    def prev(self, g: int) -> int | None:
        return self._neighbours[g][0]

    def next(self, g: int) -> int | None:
        return self._neighbours[g][1]

    @functools.cached_property
    def _neighbours(self) -> dict[int, tuple[int | None, int | None]]:
        """Each chunk's (previous, next) chunk on its chain (found once: a pipeline asks per pass)."""
        return {g: (chain[i - 1] if i else None, chain[i + 1] if i + 1 < len(chain) else None)
                for chain in self.chains for i, g in enumerate(chain)}

    def on(self, stage: int) -> list[int]:
        """The chunks a stage holds, in chunk order."""
        return list(self._by_stage.get(stage, ()))

    @functools.cached_property
    def _by_stage(self) -> dict[int, tuple[int, ...]]:
        found: dict[int, list[int]] = {}
        for g in range(self.chunks):
            found.setdefault(self.stage[g], []).append(g)
        return {s: tuple(gs) for s, gs in found.items()}


def placement(schedule: Schedule | str, shape: PipelineShape) -> Placement:
    return _placement(Schedule(schedule), shape)


@functools.lru_cache(maxsize=64)
def _placement(schedule: Schedule, shape: PipelineShape) -> Placement:
    """(Made once for every stage of a pipeline: a Placement is immutable, its neighbours cached in it.)"""
    p = shape.stages
    if schedule is Schedule.ZB_V:
        stage = tuple(g if g < p else 2 * p - 1 - g for g in range(2 * p))
        return Placement(2 * p, stage, tuple(range(2 * p)), (tuple(range(2 * p)),))
    if schedule is Schedule.DUALPIPE:
        stage = tuple(range(p)) + tuple(p - 1 - c for c in range(p))
        return Placement(p, stage, tuple(range(p)) * 2, (tuple(range(p)), tuple(range(p, 2 * p))))
    n = shape.chunks
    return Placement(n, tuple(g % p for g in range(n)), tuple(range(n)), (tuple(range(n)),))


def check(schedule: Schedule, shape: PipelineShape, layers: int, ends: int = 0) -> None:
    """Clear errors for configurations a schedule cannot run. `ends`: how many of the embedding and the
    loss count as a block in the split (pipeline.partition)."""
    p, m, v = shape.stages, shape.micro_batches, shape.virtual
    counted = f"{layers} layers" + (f" (and the {'embedding and the loss' if ends == 2 else 'embedding or the loss'}"
                                    " counted as layers)" if ends else "")
    layers += ends
    for name, value in (("stages", p), ("micro-batches", m), ("virtual stages", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")
    if schedule is not Schedule.INTERLEAVED and v != 1:
        raise ValueError(f"virtual stages v={v} need the interleaved schedule, not {schedule.value}")
    if p > layers:
        raise ValueError(f"{p} pipeline stages for {counted}: every stage needs at least one layer")
    if p * v > layers:
        raise ValueError(f"p x v = {p} x {v} = {p * v} model chunks for {counted}: every chunk needs a layer; "
                         f"valid v for p={p}: {', '.join(str(x) for x in range(1, layers // p + 1))}")
    n = shape.together
    if schedule is Schedule.INTERLEAVED and shape.group and not p <= n <= m:
        raise ValueError(f"the interleaved schedule's micro-batch group N={n} must lie in [p, m] = [{p}, {m}]")
    if schedule is Schedule.INTERLEAVED and m % n and (not shape.group or m % n < p):
        raise ValueError(f"the interleaved schedule needs the micro-batch count m={m} to be a multiple of "
                         f"{'p' if not shape.group else 'N'}={n}, or to leave at least p={p} after the last whole "
                         f"group (parallel.microbatch_group sets N, Megatron-LM's "
                         f"--microbatch-group-size-per-vp-stage)")
    if schedule is Schedule.ZB_V and 2 * p > layers:
        raise ValueError(f"ZB-V cuts the layers into 2 x p = {2 * p} chunks: {counted} are too few; "
                         f"valid p: {', '.join(str(x) for x in range(1, layers // 2 + 1))}")
    if schedule is Schedule.DUALPIPE and (p % 2 or m % 2 or m < 2 * p):
        raise ValueError(f"DualPipe needs an even number of stages (p={p}) and an even micro-batch count of at "
                         f"least 2p = {2 * p} (m={m}): half of them enter at each end")


def gpipe(shape: PipelineShape, stage: int) -> list[Pass]:
    """GPipe (Huang et al. 2019): 1. every forward; 2. every backward, last micro-batch first."""
    m = shape.micro_batches
    return [("F", j, stage) for j in range(m)] + [("B", j, stage) for j in reversed(range(m))]


def one_f_one_b(shape: PipelineShape, stage: int) -> list[Pass]:
    """1F1B (PipeDream-Flush; Narayanan et al. 2021): 1. warm-up: p - s - 1 forwards;
    2. steady state: one forward, one backward; 3. cool-down: the remaining backwards."""
    p, m = shape.stages, shape.micro_batches
    warmup = min(p - stage - 1, m)
    ops: list[Pass] = [("F", j, stage) for j in range(warmup)]
    f, b = warmup, 0
    while f < m:
        ops += [("F", f, stage), ("B", b, stage)]
        f, b = f + 1, b + 1
    ops += [("B", j, stage) for j in range(b, m)]
    return ops


def interleaved(shape: PipelineShape, stage: int) -> list[Pass]:
    """Interleaved 1F1B (Narayanan et al. 2021, section 2.2): v chunks per stage, micro-batches in
    groups of N (p unless set; the last group whatever is left) go through chunk 0, then chunk 1, ...;
    1. warm-up: 2(p - s - 1) + (v - 1)N forwards; 2. steady state: one forward, one backward; 3. cool-down:
    the remaining backwards. N as Megatron-LM's --microbatch-group-size-per-vp-stage (schedules.py,
    get_schedule_table), which Llama 3's pipeline set freely (Dubey et al. 2024, section 3.3.2) so that m
    need not be a multiple of p."""
    p, m, v, n = shape.stages, shape.micro_batches, shape.virtual, shape.together
    total = m * v
    table = [(j, k) for first in range(0, m, n) for k in range(v) for j in range(first, min(first + n, m))]

    def virtual(i: int, forward: bool) -> tuple[int, int]:
        j, k = table[i]  # micro-batch, model chunk on this stage
        return j, (k if forward else v - 1 - k) * p + stage  # (micro-batch, global chunk)

    warmup = min((p - stage - 1) * 2 + (v - 1) * n, total)
    ops: list[Pass] = [("F", *virtual(i, True)) for i in range(warmup)]
    f, b = warmup, 0
    while f < total:
        ops += [("F", *virtual(f, True)), ("B", *virtual(b, False))]
        f, b = f + 1, b + 1
    ops += [("B", *virtual(i, False)) for i in range(b, total)]
    return ops


def zb_h1(shape: PipelineShape, stage: int) -> list[Pass]:
    """ZB-H1 (Qi et al. 2024): backward split into B (input gradient) and W (weight gradient).
    Stage s keeps s W passes deferred, so that every stage has p micro-batches in flight, as 1F1B's
    first stage does: 1. warm-up: p - s - 1 forwards; 2. s pairs of F, B; 3. steady state: F, B, W;
    4. cool-down: B, W; 5. the deferred W passes fill the tail."""
    p, m = shape.stages, shape.micro_batches
    ops: list[Pass] = []
    f = b = w = 0
    for _ in range(min(p - stage - 1, m)):
        ops.append(("F", f, stage))
        f += 1
    for _ in range(stage):
        if f == m:
            break
        ops += [("F", f, stage), ("B", b, stage)]
        f, b = f + 1, b + 1
    while f < m:
        ops += [("F", f, stage), ("B", b, stage), ("W", w, stage)]
        f, b, w = f + 1, b + 1, w + 1
    while b < m:
        ops += [("B", b, stage), ("W", w, stage)]
        b, w = b + 1, w + 1
    ops += [("W", j, stage) for j in range(w, m)]
    return ops


def zb_v(shape: PipelineShape, stage: int) -> list[Pass]:
    """ZB-V (Qi et al. 2024, section 6): two chunks per stage in a V (chunk s, then chunk 2p-1-s on the
    way back), backward split into B and W. As torch.distributed.pipelining builds it (at T_F = T_B =
    T_W its bubble is only the last stage's wait for the first forward, (p-1) T_F/2: the paper's
    "zero bubble"): 1. warm-up: 2(p-s)-1 forwards of the first chunk; 2. s pairs of forwards,
    second chunk then first; 3. p-s rounds of F, B, W on the second chunk; 4. steady state: F, B, W on
    the first chunk then on the second; 5. cool-down: B passes, then the remaining W passes. The
    counts are those of max(m, 2p-1) micro-batches, the passes of micro-batches past m left out."""
    p, m = shape.stages, shape.micro_batches
    n = max(m, 2 * p - 1)
    first, second = stage, 2 * p - 1 - stage
    F1, B1, W1, F2, B2, W2 = (("F", first), ("B", first), ("W", first), ("F", second), ("B", second), ("W", second))
    ops: list[Pass] = []
    count = dict.fromkeys((F1, B1, W1, F2, B2, W2), 0)  # passes so far, by kind and chunk

    def put(*steps: tuple[str, int]) -> None:
        for kind, g in steps:
            ops.append((kind, count[(kind, g)], g))
            count[(kind, g)] += 1

    for _ in range(2 * (p - stage) - 1):
        put(F1)
    for _ in range(stage):
        put(F2, F1)
    for _ in range(p - stage):
        put(F2, B2, W2)
    while count[F2] < count[F1] or count[F1] < n:
        put(*([F1] if count[F1] < n else []), B1, W1, F2, B2, W2)
    for _ in range(stage):
        put(B1, B2)
    for _ in range(p - stage):
        put(B1, W1)
    while count[W2] < count[B2]:
        put(W2)
    while count[W1] < count[B1]:
        put(W1)
    return [op for op in ops if op[1] < m]


def dualpipe(shape: PipelineShape, stage: int) -> list[Pass]:
    """DualPipe (DeepSeek-V3 report, section 3.2.1; deepseek-ai/DualPipe): micro-batches enter at
    both ends, half at each. Phase 0 is the direction that starts on this stage's half of the
    pipeline, phase 1 the other; h = min(s, p-1-s). 1. 2(p/2-h-1) forwards of phase 0; 2. h+1 pairs
    F0 F1; 3. p/2-h-1 rounds B1 (W deferred), W, F1; 4. the main step, m/2-p+h+1 times: F0 B1 F1 B0
    (each F and the B after it run together, `pairs`, but the middle stages' first); 5. p/2-h-1
    rounds B1 F1 B0; 6. h+1 pairs B1 B0, deferring W from the middle one on; 7. p/2-h-1 rounds W B0
    (W deferred); 8. the h+1 deferred W passes left. Deferred W passes run oldest first."""
    return _dualpipe(shape, stage)[0]


def _dualpipe(shape: PipelineShape, stage: int) -> tuple[list[Pass], frozenset[int]]:
    """DualPipe's passes, and where a pass runs together with the next (`pairs`)."""
    p, m = shape.stages, shape.micro_batches
    h, half, second = min(stage, p - 1 - stage), m // 2, int(stage >= p // 2)
    chunk = (stage, 2 * p - 1 - stage)  # by direction: the forward chain's chunk here, the reverse one's
    done = {"F": [0, 0], "B": [0, 0]}
    waiting: deque[tuple[int, int]] = deque()
    ops: list[Pass] = []
    together: set[int] = set()  # a forward and a backward run as one (dualpipe.py's _forward_backward_chunk)

    def put(kind: str, phase: int, defer: bool = False) -> None:
        d = phase ^ second
        j = d * half + done[kind][d]
        done[kind][d] += 1
        ops.append((kind, j, chunk[d]))
        if defer:
            waiting.append((j, chunk[d]))

    def weight() -> None:
        ops.append(("W", *waiting.popleft()))

    for _ in range(2 * (p // 2 - h - 1)):
        put("F", 0)
    for _ in range(h + 1):
        put("F", 0)
        put("F", 1)
    for _ in range(p // 2 - h - 1):
        put("B", 1, defer=True)
        weight()
        put("F", 1)
    for i in range(half - p + h + 1):
        if i or h < p // 2 - 1:  # (the middle stages' first two run apart: "to further reduce bubble size")
            together.add(len(ops))
        put("F", 0)
        put("B", 1)
        together.add(len(ops))
        put("F", 1)
        put("B", 0)
    for _ in range(p // 2 - h - 1):
        put("B", 1)
        together.add(len(ops))
        put("F", 1)
        put("B", 0)
    defer = False
    for i in range(h + 1):
        defer = defer or (i == (h + 1) // 2 and h % 2 == 1)
        put("B", 1, defer)
        defer = defer or (i == (h + 1) // 2 and h % 2 == 0)
        put("B", 0, defer)
    for _ in range(p // 2 - h - 1):
        weight()
        put("B", 0, defer=True)
    while waiting:
        weight()
    return ops, frozenset(together)


BUILDERS = {Schedule.GPIPE: gpipe, Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.INTERLEAVED: interleaved,
            Schedule.ZB_H1: zb_h1, Schedule.ZB_V: zb_v, Schedule.DUALPIPE: dualpipe}


def build(schedule: Schedule | str, shape: PipelineShape) -> list[list[Pass]]:
    """Every stage's passes, in order."""
    return [passes(schedule, shape, s) for s in range(shape.stages)]


def passes(schedule: Schedule | str, shape: PipelineShape, stage: int) -> list[Pass]:
    """One stage's passes, in order (what each rank needs: not every stage's)."""
    return BUILDERS[Schedule(schedule)](shape, stage)


def pairs(schedule: Schedule | str, shape: PipelineShape, stage: int) -> frozenset[int]:
    """Where one stage's pass i runs together with pass i + 1, each computing while the other's communication
    is in flight: DualPipe's forward-backward chunks (its main step's F0 B1 and F1 B0, step 5's F1 B0; the
    expert all-to-all of one micro-batch under the other's compute, DeepSeek-V3 report section 3.2.1,
    Figure 4). No other schedule pairs passes."""
    return _dualpipe(shape, stage)[1] if Schedule(schedule) is Schedule.DUALPIPE else frozenset()


def label(kind: str, j: int, g: int, several: bool) -> str:
    """A pass's name in the trace: F3 (micro-batch 3), or F3.5 (on chunk 5) where the stage runs
    `several` chunks, as describe() writes them."""
    return f"{kind}{j}.{g}" if several else f"{kind}{j}"


def deferred(passes: list[Pass]) -> set[tuple[int, int]]:
    """The (micro-batch, chunk) pairs whose weight gradient is a W pass of its own."""
    return {(j, g) for kind, j, g in passes if kind == "W"}


def describe(schedule: Schedule | str, shape: PipelineShape) -> str:
    """The order of passes on each stage, one line per stage (chunks shown when v > 1)."""
    lines = []
    for s, ops in enumerate(build(schedule, shape)):
        several = placement(schedule, shape).chunks > shape.stages
        cells = [f"{k}{j}" + (f".{c}" if several else "") for k, j, c in ops]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)
