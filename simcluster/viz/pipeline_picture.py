"""The familiar pipeline picture: one row per stage, one cell per time unit, numbered passes.

    stage 0: F0 F1 .. .. .. .. B1 B0
    stage 1: .. F0 F1 .. .. B1 B0 ..
    stage 2: .. .. F0 F1 B1 B0 .. ..

Read from a trace: a pass is the run of kernels labelled F<j>, B<j> or W<j> on a stage's compute
stream; the time unit defaults to the shortest pass. Idle cells are dots: the bubbles.
"""

from __future__ import annotations

import math

from simcluster.engine.trace import Trace

PASS_KINDS = {"forward": "F", "backward": "B", "weight_grad": "W"}


def passes(trace: Trace, rank: int) -> list[tuple[str, int, int]]:
    """(label, start, end) of each pass on the rank's compute stream, in order."""
    out: list[tuple[str, int, int]] = []
    for e in trace.lane(rank, "compute"):
        if e.kind not in PASS_KINDS:
            continue
        label = e.name.split("/", 1)[0].split(":", 1)[0]  # F3:block0 -> F3
        if not label or label[0] not in "FBW" or label == "loss":
            continue
        if out and out[-1][0] == label and out[-1][2] == e.start:
            out[-1] = (label, out[-1][1], e.end)
        else:
            out.append((label, e.start, e.end))
    return out


def picture(trace: Trace, ranks: list[int], unit_ns: int | None = None, width: int | None = None,
            names: dict[int, str] | None = None) -> str:
    """`width` (columns) caps the picture: the unit grows until it fits. `names`: each rank's row
    label (default: "stage i" for the i-th rank given)."""
    names = names or {r: f"stage {s}" for s, r in enumerate(ranks)}
    pad = max(len(names[r]) for r in ranks)
    by_rank = {r: passes(trace, r) for r in ranks}
    spans = [end - start for ps in by_rank.values() for _, start, end in ps]
    if not spans:
        return "(no passes in this trace)"
    end = max(e for ps in by_rank.values() for _, _, e in ps)
    unit = unit_ns or min(spans)
    if width is not None:
        cell = max(len(label) for ps in by_rank.values() for label, _, _ in ps) + 1
        unit = max(unit, math.ceil(end / max(1, (width - pad - 2) // cell)))
    cols = math.ceil(end / unit)
    width = max(len(label) for ps in by_rank.values() for label, _, _ in ps)
    lines, hidden = [], 0
    for r in ranks:
        owner: list[int | None] = [None] * cols  # the pass drawn in each cell: the last to reach it
        for i, (_, start, stop) in enumerate(by_rank[r]):
            for c in range(start // unit, math.ceil(stop / unit)):
                owner[c] = i
        hidden += len(by_rank[r]) - len({i for i in owner if i is not None})
        cells = ["." * width if i is None else by_rank[r][i][0].ljust(width) for i in owner]
        lines.append(f"{names[r] + ':':<{pad + 1}} " + " ".join(cells))
    if hidden:  # a picture that drops passes says so
        lines.append(f"({hidden} passes shorter than a column are hidden at this width; a wider --width shows more)")
    return "\n".join(lines)
