"""Where a run's steps begin and end, read off the replayed streams (their items and end times), so
that a report can give the step time as Megatron-LM and torchtitan do (a steady iteration, apart from
the first step and from initialisation) without a walk over the events.

    initialisation   from 0 to the first forward pass's start, on any rank (weights made, copied)
    first step       from there to the end of step 0's optimizer (its last `O0` kernel, any rank)
    the other steps  from there to the end of the last step's optimizer: a steady step is their mean
    (what follows the last optimizer, a ZeRO all-gather of the updated weights, followed step 0's
    optimizer too: the report counts it in the first step, report.step_times)

Kernel items alone are read (the compute and host streams'), and only as far as needed: backwards to
the last optimizer kernel (a one-step run stops there), else forwards to step 1's first forward kernel.
"""

from __future__ import annotations

from typing import Any

from simcluster.engine.streams import KERNEL, KERNELS
from simcluster.engine.trace import pass_label
from simcluster.topology.cluster import HOST

FORWARD = "forward"
KERNEL_STREAMS = ("compute", HOST)  # the streams kernels run on (the rest communicate)


def _labelled(item: tuple) -> tuple[str, str] | None:
    """(kind, label) of a kernel item (F3 from "F3:block0/matmul"), None for any other item."""
    if item[0] == KERNEL:
        return item[2], pass_label(item[1])
    if item[0] == KERNELS:
        return item[2], pass_label(item[1] or "")
    return None


def _step(label: str) -> int | None:
    """3 for an optimizer's label O3, else None."""
    return int(label[1:]) if label[:1] == "O" and label[1:].isdigit() else None


def marks(streams: list[Any]) -> tuple[int | None, int | None, int | None]:
    """(when the first forward pass starts, when step 0's optimizer ends, when the last step's optimizer
    ends) over the streams; None where there is none (a program without passes or optimizer)."""
    first = step0 = None
    last: tuple[int, int] | None = None  # (step, end) of the last optimizer kernel of any stream
    for s in streams:
        if s.name not in KERNEL_STREAMS:
            continue
        items, ends = s.items, s.end_times
        for i, item in enumerate(items):
            seen = _labelled(item)
            if seen is not None and seen[0] == FORWARD:
                start = ends[i - 1] if i else 0  # (a kernel starts when the item before it ended)
                first = start if first is None else min(first, start)
                break
        mine = None
        for i in range(len(items) - 1, -1, -1):
            seen = _labelled(items[i])
            if seen is not None and _step(seen[1]) is not None:
                mine = (_step(seen[1]), ends[i])
                break
        if mine is None:
            continue
        last = mine if last is None else max(last, mine)
        end = mine[1] if mine[0] == 0 else None
        for i, item in enumerate(items if mine[0] else ()):
            seen = _labelled(item)
            if seen is None:
                continue
            if seen[1] == "O0":
                end = ends[i]
            elif end is not None and seen[0] == FORWARD:  # (step 1 has begun here)
                break
        if end is not None:
            step0 = end if step0 is None else max(step0, end)
    return first, step0, None if last is None else last[1]
