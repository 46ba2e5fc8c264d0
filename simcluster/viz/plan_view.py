"""What `simcluster plan` prints: the simulated layouts, best first (a rich table), or as data."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from simcluster.analysis.planner import Search, bottleneck
from simcluster.viz.report_view import format_bytes
from simcluster.viz.timeline import format_ns


def plan_table(search: Search, title: str) -> Table:
    t = Table(title=f"{title}: {search.examined} layouts examined, {search.valid} valid, {search.fitting} fit by "
                    f"estimate; the {len(search.rows)} best simulated, one step each (its time without "
                    f"initialisation)", title_justify="left")
    for col in ("#", "layout", "ZeRO", "micro-batch", "recompute", "first step", "MFU", "peak memory", "bound by"):
        t.add_column(col, justify="left" if col in ("layout", "recompute", "bound by") else "right")
    for i, row in enumerate(search.rows, 1):
        r, lay = row.report, row.layout
        memory = format_bytes(r["memory"]["peak_bytes"]) + ("" if r["memory"]["fits"] else " OOM")
        t.add_row(str(i), lay.label(), str(lay.zero), str(lay.micro_batch), lay.recompute,
                  format_ns(r["step_time_ns"]), f"{100 * r['mfu']:.1f} %", memory, bottleneck(r))
    return t


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
