"""What `simcluster plan` prints: the simulated layouts, best first (a rich table), or as data."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from simcluster.analysis.planner import Search, bottleneck
from simcluster.viz.report_view import format_bytes
from simcluster.viz.timeline import format_ns


def plan_table(search: Search, title: str) -> Table:
    t = Table(title=f"{title}: {search.examined} layouts examined, {search.valid} valid, {search.fitting} fit by "
                    f"estimate; the {len(search.rows)} best simulated, one step each (its time without "
                    f"initialisation)", title_justify="left")
    t.box = box.SIMPLE_HEAD  # (no side borders: the layout keeps its line at 80 columns)
    t.caption = ("each layout with its best-estimated ZeRO stage (Z), micro-batch (mb) and recomputation (+sel, "
                 "+full, +op); --fix its degrees to see its other variants; step: the first (one simulated)")
    t.caption_justify = "left"
    t.pad_edge, t.padding = False, (0, 1)
    for col in ("#", "layout", "step", "MFU", "peak", "bound by"):
        t.add_column(col, justify="left" if col in ("layout", "bound by") else "right",
                     no_wrap=col != "bound by", overflow="fold", min_width=8 if col == "bound by" else None)
    for i, row in enumerate(search.rows, 1):
        r = row.report
        memory = format_bytes(r["memory"]["peak_bytes"]) + ("" if r["memory"]["fits"] else " OOM")
        t.add_row(str(i), one_line(row.layout), format_ns(r["step_time_ns"]), percent(r["mfu"]), memory,
                  bottleneck(r))
    return t


def one_line(lay: Any) -> str:
    """A layout in one line: its degrees and schedule, ZeRO stage, micro-batch and recomputation."""
    return f"{lay.label()} Z{lay.zero} mb{lay.micro_batch}" + {"none": "", "selective": " +sel"}.get(
        lay.recompute, f" +{lay.recompute}")


def percent(fraction: float) -> str:
    """MFU with the digits a small model needs too (0.03 %, not 0.0 %)."""
    return f"{100 * fraction:.2g}%" if fraction else "0%"


def plan_data(search: Search) -> dict[str, Any]:
    """The search as JSON-ready data (no wall-clock figures: the same scenario gives the same bytes)."""
    rows = []
    for row in search.rows:
        r = row.report
        rows.append({"layout": dict(vars(row.layout)), "step_time_ns": r["step_time_ns"],
                     "first_step_ns": r["first_step_ns"], "init_ns": r["init_ns"], "mfu": r["mfu"],
                     "hfu": r["hfu"], "tflops_per_gpu": r["tflops_per_gpu"], "tokens_per_s": r["tokens_per_s"],
                     "memory": r["memory"], "bound_by": bottleneck(r),
                     "estimate": {"seconds": row.estimate.seconds, "memory_bytes": row.estimate.memory_bytes}})
    return {"examined": search.examined, "valid": search.valid, "fitting_by_estimate": search.fitting, "rows": rows}
