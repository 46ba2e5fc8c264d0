"""A sweep drawn: a table with a bar per value for step time and for peak memory, and the same as SVG."""

from __future__ import annotations

from xml.sax.saxutils import escape as xml_escape

from rich.markup import escape
from rich.table import Table

from simcluster.analysis.sweep import DEGREES, Point
from simcluster.viz.report_view import format_bytes
from simcluster.viz.timeline import format_ns

BAR = 10  # columns of the longest bar (the table fits 80 columns with the dp column)


def bar(value: float, top: float, width: int = BAR) -> str:
    """A bar of eighths: `width` full blocks at `top`."""
    eighths = round(8 * width * value / top) if top else 0
    return "█" * (eighths // 8) + ("", "▏", "▎", "▍", "▌", "▋", "▊", "▉")[eighths % 8]


def table(key: str, points: list[Point], capacity: int | None = None) -> Table:
    """One row per value; a refused value's reason as a numbered note under the table."""
    ran = [p for p in points if not p.refused]
    top_t = max((p.step_ns for p in ran), default=0)
    top_m = max([p.peak_bytes for p in ran] + ([capacity] if capacity else []), default=0)
    refused = [p for p in points if p.refused]
    scale = [] if not capacity else [f"a full memory bar is the device's {format_bytes(capacity)}" if capacity == top_m
                                      else f"a full memory bar is the highest peak; the device holds {format_bytes(capacity)}"]
    notes = scale + \
        [f"({n}) {key}={p.value}: {p.refused}" for n, p in enumerate(refused, 1)]
    t = Table(title=escape(f"sweep of {key}"), title_justify="left", caption=escape("\n".join(notes)) or None,
              caption_justify="left")
    dp = key in DEGREES  # (dp follows the swept degree: its column says how)
    for col in (key.split(".", 1)[-1],) + (("dp",) if dp else ()) + ("step time", "", "peak memory", "", "verdict"):
        t.add_column(col, justify="right" if col in ("step time", "peak memory") else "left",
                     no_wrap=col != "verdict")
    for p in points:
        first = (escape(p.value),) + ((str(p.dp) if p.dp else "",) if dp else ())
        if p.refused:
            t.add_row(*first, "", "", "", "", f"refused ({refused.index(p) + 1})")
            continue
        t.add_row(*first, format_ns(p.step_ns), bar(p.step_ns, top_t), format_bytes(p.peak_bytes),
                  bar(p.peak_bytes, top_m), escape(p.verdict if p.fits else "OUT OF MEMORY\n" + p.verdict),
                  style=None if p.fits else "red")
    return t


def svg(key: str, points: list[Point], capacity: int | None = None, title: str = "") -> str:
    """Two bar charts side by side, step time and peak memory against the value (a dashed line at the
    device's capacity); a refused value is an empty slot, labelled."""
    width, height, pad, gap = 720, 300, 48, 40
    panel = (width - 2 * pad - gap) / 2
    ran = [p for p in points if not p.refused]
    charts = (("step time", [p.step_ns for p in points], max((p.step_ns for p in ran), default=1) or 1, format_ns),
              ("peak memory", [p.peak_bytes for p in points],
               max([p.peak_bytes for p in ran] + ([capacity] if capacity else []), default=1) or 1, format_bytes))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="monospace" '
           f'font-size="11">', f'<text x="{pad}" y="18" font-size="13">{xml_escape(title or f"sweep of {key}")}</text>']
    base_y, plot_h = height - pad, height - 2 * pad - 10
    for c, (name, values, top, fmt) in enumerate(charts):
        x0 = pad + c * (panel + gap)
        out.append(f'<text x="{x0:.1f}" y="{pad - 12}">{name}</text>')
        out.append(f'<line x1="{x0:.1f}" y1="{base_y}" x2="{x0 + panel:.1f}" y2="{base_y}" stroke="black"/>')
        slot = panel / max(1, len(points))
        for i, (p, v) in enumerate(zip(points, values)):
            x = x0 + i * slot + slot * 0.15
            label = f'<text x="{x0 + (i + 0.5) * slot:.1f}" y="{base_y + 14}" text-anchor="middle">{xml_escape(p.value)}</text>'
            out.append(label)
            if p.refused:
                out.append(f'<text x="{x0 + (i + 0.5) * slot:.1f}" y="{base_y - 6}" text-anchor="middle" '
                           f'fill="gray">refused</text>')
                continue
            h = plot_h * v / top
            colour = "#c0392b" if name == "peak memory" and not p.fits else "#2e86c1"
            out.append(f'<rect class="bar" x="{x:.1f}" y="{base_y - h:.1f}" width="{slot * 0.7:.1f}" height="{h:.1f}" '
                       f'fill="{colour}"><title>{xml_escape(p.value)}: {xml_escape(fmt(v))}</title></rect>')
            out.append(f'<text x="{x0 + (i + 0.5) * slot:.1f}" y="{base_y - h - 3:.1f}" text-anchor="middle">'
                       f'{xml_escape(fmt(v))}</text>')
        if name == "peak memory" and capacity:
            y = base_y - plot_h * capacity / top
            out.append(f'<line class="capacity" x1="{x0:.1f}" y1="{y:.1f}" x2="{x0 + panel:.1f}" y2="{y:.1f}" '
                       f'stroke="#c0392b" stroke-dasharray="4 3"/>')
            out.append(f'<text x="{x0 + panel:.1f}" y="{y - 3:.1f}" text-anchor="end" fill="#c0392b">device '
                       f'{xml_escape(format_bytes(capacity))}</text>')
    out.append(f'<text x="{width / 2:.0f}" y="{height - 8}" text-anchor="middle">{xml_escape(key)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
