"""The familiar pipeline picture: one row per stage, one cell per pass, numbered passes.

    stage 0: F0 F1 .. .. .. .. B1 B0
    stage 1: .. F0 F1 .. .. B1 B0 ..
    stage 2: .. .. F0 F1 B1 B0 .. ..

Read from a trace: a pass is the run of kernels labelled F<j>, B<j> or W<j> on a stage's compute
stream. Each pass gets a cell of its own, in the order the passes ran: right of the stage's previous
pass and right of every pass of the same micro-batch that had ended when it started (so a
micro-batch's forward moves down the stages left to right and its backward back up), in the first
column that allows. It is the picture of the papers, in passes, not to scale: a backward pass twice a
forward's length is one cell too (the timeline is to scale). Dots are columns in which a stage ran
no pass: its bubbles. Every pass is drawn: a picture wider than the page continues below, in blocks
of columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from xml.sax.saxutils import escape

from simcluster.engine.trace import Trace, pass_label

PASS_KINDS = {"forward": "F", "backward": "B", "weight_grad": "W"}


def passes(trace: Trace, rank: int) -> list[tuple[str, int, int]]:
    """(label, start, end) of each pass on the rank's compute stream, in order."""
    out: list[tuple[str, int, int]] = []
    for e in trace.lane(rank, "compute"):
        if e.kind not in PASS_KINDS:
            continue
        label = pass_label(e.name)
        if not label or label[0] not in "FBW" or label == "loss":
            continue
        if out and out[-1][0] == label and out[-1][2] == e.start:
            out[-1] = (label, out[-1][1], e.end)
        else:
            out.append((label, e.start, e.end))
    return out


@dataclass(frozen=True)
class Grid:
    """Each row's passes as (column, label), in the order they ran; `columns` in all."""

    rows: dict[int, list[tuple[int, str]]]
    columns: int


def micro_batch(label: str) -> str:
    """F3 -> 3; B0.2 (micro-batch 0 on chunk 2) -> 0."""
    return label[1:].split(".", 1)[0]


def grid(trace: Trace, ranks: list[int]) -> Grid:
    """Each pass one column past the rank's previous pass, and past every pass of its micro-batch (on
    any rank drawn) that had ended when it started: what it may have waited for (a stage's forward for
    the stage before it, a backward for the stage after it)."""
    every = sorted((start, end, r, label) for r in ranks for label, start, end in passes(trace, r))
    last = {r: -1 for r in ranks}  # each rank's latest column
    ended: dict[str, list[tuple[int, int]]] = {}  # by micro-batch: (end, column) of its passes so far
    rows: dict[int, list[tuple[int, str]]] = {r: [] for r in ranks}
    columns = 0
    for start, end, r, label in every:
        j = micro_batch(label)
        col = max([last[r]] + [c for stop, c in ended.get(j, ()) if stop <= start]) + 1
        last[r] = col
        ended.setdefault(j, []).append((end, col))
        rows[r].append((col, label))
        columns = max(columns, col + 1)
    return Grid(rows, columns)


def picture(trace: Trace, ranks: list[int], width: int | None = None, names: dict[int, str] | None = None) -> str:
    """The picture as text; `width` (characters) wraps it into blocks of columns that fit (every pass
    is drawn). `names`: each rank's row label (default: "stage i" for the i-th rank given)."""
    names = names or {r: f"stage {s}" for s, r in enumerate(ranks)}
    g = grid(trace, ranks)
    if not g.columns:
        return "(no passes in this trace)"
    pad = max(len(names[r]) for r in ranks)
    cell = max(len(label) for row in g.rows.values() for _, label in row)
    per_block = g.columns if width is None else max(1, (width - pad - 2 + 1) // (cell + 1))
    blocks = []
    for first in range(0, g.columns, per_block):
        last = min(g.columns, first + per_block)
        lines = [] if per_block >= g.columns else [f"(passes in columns {first + 1}-{last} of {g.columns})"]
        for r in ranks:
            cells = ["." * cell] * (last - first)
            for c, label in g.rows[r]:
                if first <= c < last:
                    cells[c - first] = label.ljust(cell)
            lines.append(f"{names[r] + ':':<{pad + 1}} " + " ".join(cells))
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


COLOURS = {"F": "#4e79a7", "B": "#f28e2b", "W": "#59a14f"}  # forward, backward, weight gradient


def svg(trace: Trace, ranks: list[int], names: dict[int, str] | None = None, title: str = "") -> str:
    """The whole picture as a self-contained SVG (no fonts to fetch, one row per rank, one box a pass)."""
    names = names or {r: f"stage {s}" for s, r in enumerate(ranks)}
    g = grid(trace, ranks)
    cell = max((len(label) for row in g.rows.values() for _, label in row), default=1)
    box, gap, row_h, left, top = 7 * cell + 8, 2, 22, 16 + 7 * max((len(names[r]) for r in ranks), default=0), 30
    width, height = left + g.columns * (box + gap) + 10, top + len(ranks) * row_h + 10
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="8" y="18" font-size="13">{escape(title)}</text>']
    for i, r in enumerate(ranks):
        y = top + i * row_h
        out.append(f'<text x="8" y="{y + 15}">{escape(names[r])}</text>')
        for c, label in g.rows[r]:
            x = left + c * (box + gap)
            out.append(f'<rect x="{x}" y="{y}" width="{box}" height="{row_h - 4}" '
                       f'fill="{COLOURS.get(label[0], "#bab0ac")}"><title>{escape(label)}</title></rect>')
            out.append(f'<text x="{x + box / 2}" y="{y + 13}" text-anchor="middle" fill="white">'
                       f'{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
