"""Pipeline schedules as data: for each stage, the ordered list of the passes it runs.

A pass is (kind, micro-batch, chunk): kind "F" (forward), "B" (backward; with the weight gradient
unless the schedule splits it off), or "W" (weight gradient, ZB-H1 only). `chunk` is the global
model chunk: with v virtual stages, stage s holds chunks s, s + p, ..., s + (v-1)p of the p*v chunks
that the layers are cut into. Print a schedule with `describe`, draw a run of it with the timeline.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

Pass = tuple[str, int, int]  # (kind, micro-batch, global chunk)


class Schedule(Enum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED = "interleaved"
    ZB_H1 = "zb-h1"


@dataclass(frozen=True)
class PipelineShape:
    stages: int  # p
    micro_batches: int  # m
    virtual: int = 1  # v, model chunks per stage (interleaved only)

    @property
    def chunks(self) -> int:
        return self.stages * self.virtual


def check(schedule: Schedule, shape: PipelineShape, layers: int) -> None:
    """Clear errors for configurations a schedule cannot run."""
    p, m, v = shape.stages, shape.micro_batches, shape.virtual
    for name, value in (("stages", p), ("micro-batches", m), ("virtual stages", v)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"pipeline {name} must be a positive integer, got {value!r}")
    if schedule is not Schedule.INTERLEAVED and v != 1:
        raise ValueError(f"virtual stages v={v} need the interleaved schedule, not {schedule.value}")
    if p > layers:
        raise ValueError(f"{p} pipeline stages for {layers} layers: every stage needs at least one layer")
    if p * v > layers:
        raise ValueError(f"p x v = {p} x {v} = {p * v} model chunks for {layers} layers: every chunk needs a layer; "
                         f"valid v for p={p}: {', '.join(str(x) for x in range(1, layers // p + 1))}")
    if schedule is Schedule.INTERLEAVED and m % p:
        raise ValueError(f"the interleaved schedule needs the micro-batch count m={m} to be a multiple of p={p}")


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
    groups of p go through chunk 0, then chunk 1, ...; 1. warm-up: 2(p - s - 1) + (v - 1)p forwards;
    2. steady state: one forward, one backward; 3. cool-down: the remaining backwards."""
    p, m, v = shape.stages, shape.micro_batches, shape.virtual
    total = m * v

    def virtual(i: int, forward: bool) -> tuple[int, int]:
        group, within = divmod(i, p * v)
        k = within // p  # model chunk on this stage
        if not forward:
            k = v - 1 - k
        return group * p + within % p, k * p + stage  # (micro-batch, global chunk)

    warmup = min((p - stage - 1) * 2 + (v - 1) * p, total)
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


BUILDERS = {Schedule.GPIPE: gpipe, Schedule.ONE_F_ONE_B: one_f_one_b, Schedule.INTERLEAVED: interleaved,
            Schedule.ZB_H1: zb_h1}


def build(schedule: Schedule | str, shape: PipelineShape) -> list[list[Pass]]:
    """Every stage's passes, in order."""
    return [passes(schedule, shape, s) for s in range(shape.stages)]


def passes(schedule: Schedule | str, shape: PipelineShape, stage: int) -> list[Pass]:
    """One stage's passes, in order (what each rank needs: not every stage's)."""
    return BUILDERS[Schedule(schedule)](shape, stage)


def splits_weight_gradient(schedule: Schedule | str) -> bool:
    return Schedule(schedule) is Schedule.ZB_H1


def describe(schedule: Schedule | str, shape: PipelineShape) -> str:
    """The order of passes on each stage, one line per stage (chunks shown when v > 1)."""
    lines = []
    for s, ops in enumerate(build(schedule, shape)):
        cells = [f"{k}{j}" + (f".{c}" if shape.virtual > 1 else "") for k, j, c in ops]
        lines.append(f"stage {s}: " + " ".join(cells))
    return "\n".join(lines)
