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
}
IDLE = "."


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

    def rows(self) -> list[tuple[str, str]]:
        """(lane label, glyphs) for every lane."""
        by_lane: dict[tuple[int, str], list[TraceEvent]] = {lane: [] for lane in self.lanes}
        for e in self.trace:
            if (e.rank, e.stream) in by_lane:
                by_lane[(e.rank, e.stream)].append(e)
        return [(f"r{rank} {stream}", "".join(self._row(by_lane[(rank, stream)]))) for rank, stream in self.lanes]

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
        return "  ".join(f"{g} {kind}" for kind, (g, _) in GLYPHS.items() if g in used) + f"  {IDLE} idle"

    def plain(self) -> str:
        rows = self.rows()
        w = max((len(label) for label, _ in rows), default=0) + 2
        lines = [label.ljust(w) + glyphs for label, glyphs in rows]
        lines.append(self._axis(w))
        lines.append(self._legend({c for _, g in rows for c in g}))
        return "\n".join(lines)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        styles = {g: s for g, s in GLYPHS.values()}
        w = max((len(f"r{rank} {stream}") for rank, stream in self.lanes), default=0) + 2
        if w + self.width > options.max_width:  # fit the terminal rather than wrap lanes
            fitted = Timeline(self.trace, width=max(10, options.max_width - w), start=self.start, end=self.end)
            fitted.lanes = self.lanes
            yield from fitted.__rich_console__(console, options)
            return
        rows = self.rows()
        for label, glyphs in rows:
            text = Text(label.ljust(w), style="dim")
            for ch in glyphs:
                text.append(ch, style=styles.get(ch, "dim"))
            yield text
        yield Text(self._axis(w), style="dim")
        yield Text(self._legend({c for _, g in rows for c in g}), style="dim")
