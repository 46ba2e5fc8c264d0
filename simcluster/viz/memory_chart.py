"""Memory over time for one rank: one row per category, bar heights scaled to the rank's peak total.

    parameters   ▂▂▂▂▂▂▂▂▂▂
    activations  ▁▃▅▇▅▃▁▁▁▁
    total        ▃▅▇█▇▅▃▂▂▂   peak 1.2 MB at 340 us

Each column shows the largest amount held in its time slice. Given the device's capacity, the caption
says what share of it the peak is; a peak above half of it scales the bars to the capacity instead
(a full bar is a full device), and columns above it are drawn as "!" in the total row: out of memory.
"""

from __future__ import annotations

from rich.console import Console, ConsoleOptions, RenderResult
from rich.text import Text

from simcluster.engine.trace import Trace
from simcluster.model.memory import tier_of
from simcluster.viz.report_view import format_bytes

BARS = " ▁▂▃▄▅▆▇█"


def bar(v: float, top: float) -> str:
    """One column: eighths of `top`, and the lowest bar for anything held at all (a row of a few kB
    under a peak of GBs is there, not empty)."""
    return BARS[min(8, max(1 if v > 0 else 0, round(8 * v / top)))]


class MemoryChart:
    def __init__(self, trace: Trace, *, rank: int | None = None, width: int = 80, capacity: int | None = None) -> None:
        peaks = trace.memory_peaks()
        if rank is None:  # the rank that holds the most at its peak
            rank = max(peaks, key=lambda r: (peaks[r]["total"], -r)) if peaks else 0
        self.trace, self.rank, self.width, self.capacity = trace, rank, width, capacity
        self.end = max(trace.end, 1)

    def scale(self, peak: int) -> int:
        """What a full bar means: the peak, or the capacity when the peak is above half of it."""
        if self.capacity and 2 * peak > self.capacity:
            return max(peak, self.capacity)
        return peak or 1

    def series(self) -> dict[str, list[int]]:
        """Per category (and "total"): the most held in each of `width` time slices."""
        events = [e for e in self.trace.memory if e.rank == self.rank and tier_of(e.category) == "gpu"]
        categories = sorted({e.category for e in events})
        held = dict.fromkeys(categories, 0)
        out = {c: [0] * self.width for c in categories + ["total"]}
        i = 0
        for col in range(self.width):
            t1 = (col + 1) * self.end / self.width
            for c in categories:
                out[c][col] = held[c]
            out["total"][col] = sum(held.values())
            while i < len(events) and events[i].at < t1:
                j = i
                while j < len(events) and events[j].at == events[i].at:  # one instant: net the changes
                    held[events[j].category] += events[j].bytes
                    j += 1
                i = j
                for c in categories:
                    out[c][col] = max(out[c][col], held[c])
                out["total"][col] = max(out["total"][col], sum(held.values()))
        return out

    def rows(self) -> list[tuple[str, str]]:
        series = self.series()
        top = self.scale(max(series["total"], default=0))
        over = self.capacity or float("inf")
        return [(name, "".join("!" if name == "total" and v > over else bar(v, top) for v in values))
                for name, values in series.items()]

    def caption(self) -> str:
        total = self.series()["total"]
        peak = max(total, default=0)
        at = total.index(peak) * self.end / self.width if total else 0
        head = f"rank {self.rank}: peak {format_bytes(peak)} at {at / 1e3:.3g} us"
        if not self.capacity:
            return head + " (bars scaled to the peak)"
        share = f"{100 * peak / self.capacity:.3g} % of the device's {format_bytes(self.capacity)}"
        if peak > self.capacity:
            return head + f", OUT OF MEMORY: {share} (bars scaled to the peak; ! above the capacity)"
        return head + f", {share} (bars scaled to the {'capacity' if self.scale(peak) > peak else 'peak'})"

    def plain(self) -> str:
        rows = self.rows()
        w = max((len(n) for n, _ in rows), default=0) + 2
        return "\n".join([self.caption()] + [n.ljust(w) + bars for n, bars in rows])

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.width + 16 > options.max_width:
            fitted = MemoryChart(self.trace, rank=self.rank, width=max(10, options.max_width - 16),
                                 capacity=self.capacity)
            yield from fitted.__rich_console__(console, options)
            return
        caption = self.caption()
        yield Text(caption, style="bold red" if "OUT OF MEMORY" in caption else "bold")
        rows = self.rows()
        w = max((len(n) for n, _ in rows), default=0) + 2
        for name, bars in rows:
            text = Text(name.ljust(w), style="dim")
            for ch in bars:
                text.append(ch, style="bold red" if ch == "!" else "cyan" if name != "total" else "bold cyan")
            yield text
