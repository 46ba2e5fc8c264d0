"""A terminal timeline of a trace: one lane per (rank, stream), one glyph per time bucket.

Data stays separate from display: `Timeline` renders itself through `__rich_console__`, and
`plain()` gives the same picture as text (what the golden tests compare).
"""

from __future__ import annotations

from typing import Iterable

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from simcluster.engine.trace import Trace, TraceEvent

GLYPHS: dict[str, tuple[str, str]] = {
    "forward": ("F", "bold green"),
    "backward": ("B", "bold blue"),
    "weight_grad": ("W", "bold cyan"),
    "recompute": ("R", "green"),
    "optimizer": ("O", "magenta"),
    "compute": ("C", "white"),
    "all_reduce": ("A", "bold red"),
    "reduce_scatter": ("S", "red"),
    "all_gather": ("G", "yellow"),
    "all_to_all": ("X", "bold yellow"),
    "broadcast": ("b", "red"),
    "reduce": ("r", "red"),
    "send": (">", "bright_magenta"),
    "recv": ("<", "bright_magenta"),
    "barrier": ("|", "white"),
    "copy": ("H", "bright_cyan"),  # between a GPU and its host's memory or NVMe
}
IDLE = "."
SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "all_to_all": "A2A", "broadcast": "BC",
         "reduce": "RD", "send": "SEND", "recv": "RECV", "barrier": "BAR",
         "copy": "COPY"}
PASSES = {"F": "forward", "B": "backward", "W": "weight-gradient", "R": "recomputed forward"}


def label_legend(labels: set[str]) -> str:
    """What the labels written over wide blocks mean, for those present ("" when none is)."""
    parts = []
    numbered = [lab for lab in labels if lab[:1] in PASSES and lab[1:].split(".")[0].isdigit()]  # F3, F3.5
    passes = sorted({lab[0] for lab in numbered}, key="FBWR".index)
    if passes:
        n = min(int(lab[1:].split(".")[0]) for lab in numbered)
        names = [PASSES[p] for p in passes]
        names = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        parts.append(" ".join(f"{p}{n}" for p in passes) + f": the {names} pass"
                     + ("es" if len(passes) > 1 else "") + f" of micro-batch {n}")
    steps = sorted(int(lab[1:]) for lab in labels if lab[:1] == "O" and lab[1:].isdigit())
    if steps:
        parts.append(f"O{steps[0]}: the optimizer of step {steps[0]}")
    parts += [f"{short} {kind}" for kind, short in SHORT.items() if short in labels]
    return "over a block wide enough, its label: " + "; ".join(parts) if parts else ""


def label_of(e: TraceEvent) -> str:
    """A block's label: the pass (F3, B3, W2, O0) for kernels, the collective's short name otherwise."""
    if e.group:
        return SHORT.get(e.kind, e.kind)
    head = e.name.split("/", 1)[0] if "/" in e.name else ""
    return head.split(":", 1)[0][:6]


def format_ns(ns: float) -> str:
    if ns >= 1e9:
        return f"{ns / 1e9:.3g} s"
    if ns >= 1e6:
        return f"{ns / 1e6:.3g} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.3g} us"
    return f"{ns:.0f} ns"


class Timeline:
    def __init__(self, trace: Trace, *, width: int = 96, ranks: Iterable[int] | None = None,
                 start: int = 0, end: int | None = None) -> None:
        if width < 10:
            raise ValueError(f"timeline width must be at least 10 columns, got {width}")
        self.trace = trace
        self.width = width
        self.start = start
        self.end = trace.end if end is None else end
        keep = None if ranks is None else set(ranks)
        self.lanes = [lane for lane in trace.lanes if keep is None or lane[0] in keep]

    def _row(self, events: list[TraceEvent]) -> list[str]:
        span = max(self.end - self.start, 1)
        best = [0.0] * self.width
        row = [IDLE] * self.width
        for e in events:
            lo, hi = max(e.start, self.start), min(e.end, self.end)
            if hi <= lo:
                continue
            c0 = int((lo - self.start) * self.width // span)
            c1 = min(self.width - 1, int((hi - 1 - self.start) * self.width // span))
            for c in range(c0, c1 + 1):
                b0 = self.start + c * span / self.width
                b1 = self.start + (c + 1) * span / self.width
                overlap = min(hi, b1) - max(lo, b0)
                if overlap > best[c]:
                    best[c] = overlap
                    row[c] = GLYPHS.get(e.kind, ("?", ""))[0]
        return row

    def _labels(self, events: list[TraceEvent], row: list[str]) -> list[str]:
        """Write each block's label (F3, B3, AG...) over its glyphs where the block is wide enough."""
        span = max(self.end - self.start, 1)
        blocks: list[tuple[str, int, int]] = []  # (label, first column, last column)
        for e in events:
            lo, hi = max(e.start, self.start), min(e.end, self.end)
            if hi <= lo:
                continue
            label = label_of(e)
            c0 = int((lo - self.start) * self.width // span)
            c1 = min(self.width - 1, int((hi - 1 - self.start) * self.width // span))
            if blocks and blocks[-1][0] == label and blocks[-1][2] >= c0 - 1:
                blocks[-1] = (label, blocks[-1][1], max(blocks[-1][2], c1))
            else:
                blocks.append((label, c0, c1))
        out = list(row)
        for label, c0, c1 in blocks:
            if label and c1 - c0 + 1 >= len(label) + 1:
                self.written.add(label)
                for i, ch in enumerate(label):
                    out[c0 + i] = ch
        return out

    def _lanes(self) -> dict[tuple[int, str], list[TraceEvent]]:
        by_lane: dict[tuple[int, str], list[TraceEvent]] = {lane: [] for lane in self.lanes}
        for e in self.trace:
            if (e.rank, e.stream) in by_lane:
                by_lane[(e.rank, e.stream)].append(e)
        return by_lane

    def rows(self, labels: bool = True) -> list[tuple[str, str]]:
        """(lane label, glyphs) for every lane; block labels written in where they fit."""
        by_lane = self._lanes()
        self.written: set[str] = set()  # the labels written in (for the legend)
        out = []
        for lane in self.lanes:
            row = self._row(by_lane[lane])
            out.append((f"r{lane[0]} {lane[1]}", "".join(self._labels(by_lane[lane], row) if labels else row)))
        return out

    def _axis(self, label_width: int) -> str:
        left, right = format_ns(self.start), format_ns(self.end)
        mid = format_ns((self.start + self.end) / 2)
        line = [" "] * self.width
        for i, ch in enumerate(left):
            line[i] = ch
        m0 = self.width // 2 - len(mid) // 2
        if len(left) < m0 and m0 + len(mid) < self.width - len(right):  # room for the middle label
            for i, ch in enumerate(mid):
                line[m0 + i] = ch
        for i, ch in enumerate(right):
            line[self.width - len(right) + i] = ch
        return " " * label_width + "".join(line)

    def _legend(self, used: set[str]) -> str:
        glyphs = "  ".join(f"{g} {kind}" for kind, (g, _) in GLYPHS.items() if g in used) + f"  {IDLE} idle"
        labels = label_legend(self.written)
        return glyphs + ("\n" + labels if labels else "")

    def plain(self, labels: bool = True) -> str:
        kinds = self.rows(labels=False)
        rows = self.rows(labels) if labels else kinds
        w = max((len(label) for label, _ in rows), default=0) + 2
        lines = [label.ljust(w) + glyphs for label, glyphs in rows]
        lines.append(self._axis(w))
        lines.append(self._legend({c for _, g in kinds for c in g}))
        return "\n".join(lines)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        styles = {g: s for g, s in GLYPHS.values()}
        w = max((len(f"r{rank} {stream}") for rank, stream in self.lanes), default=0) + 2
        if w + self.width > options.max_width:  # fit the terminal rather than wrap lanes
            fitted = Timeline(self.trace, width=max(10, options.max_width - w), start=self.start, end=self.end)
            fitted.lanes = self.lanes
            yield from fitted.__rich_console__(console, options)
            return
        kinds, rows = self.rows(labels=False), self.rows()
        for (label, glyphs), (_, plain) in zip(rows, kinds):
            text = Text(label.ljust(w), style="dim")
            for ch, kind in zip(glyphs, plain):  # coloured by what runs there, labels written over it
                style = styles.get(kind, "dim")
                text.append(ch, style=f"reverse {style}" if ch != kind else style)
            yield text
        yield Text(self._axis(w), style="dim")
        yield Text(self._legend({c for _, g in kinds for c in g}), style="dim")
