"""What `simcluster run` prints for an outcome: a comparison's table (and its curve to a target loss),
or one run's report, timeline and memory chart; for a torch.distributed run, the measured figures
beside the prediction."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from simcluster.report import document
from simcluster.viz.memory_chart import MemoryChart
from simcluster.viz.report_view import ReportView, format_bytes, hours, target_curve
from simcluster.viz.timeline import Timeline, format_ns

if TYPE_CHECKING:  # (a renderer reads the outcome it is given; it does not run anything)
    from simcluster.run.runner import Outcome


def comparison(outcome: Outcome) -> Table:
    t = Table(title=f"scenario {escape(repr(outcome.scenario.name))}: {len(outcome.variants)} variants",
              title_justify="left")
    aims = any("target" in o.report for _, o in outcome.variants)
    for col in ("variant", "step time", "compute idle", "peak memory", "sent per rank", "verdict") + (
            ("to target", "GPU-hours") if aims else ()):
        t.add_column(col, justify="left" if col in ("variant", "verdict") else "right",
                     overflow="fold" if col == "variant" else "ellipsis")  # the values compared, never cut
    for label, o in outcome.variants:
        r = o.report
        memory = r["memory"]
        sent = sum(c["bytes_per_rank"] for c in r["communication"])
        v = r["verification"]
        status = v.get("status", "")
        verdict = ("HUNG" if "hung" in status else "n/a (meta)" if "meta" in status else "n/a" if status else
                   "bit-exact" if v.get("bit_exact") else ("ok" if v.get("passed") else "MISMATCH"))
        target = r.get("target")
        t.add_row(escape(label), format_ns(r["step_time_ns"]), f"{100 * r['compute_idle_fraction']:.0f} %",
                  format_bytes(memory["peak_bytes"]) + ("" if memory["fits"] else " OOM"), format_bytes(sent), verdict,
                  *((hours(target["wall_s"]), f"{target['gpu_hours']:,.0f}") if target else ("", ""))[:2 if aims else 0])
    return t


def repeated(outcome: Outcome) -> str:
    """'; steps 4-N repeat step 3 ...' for a run whose identical steps were simulated once (steady.py),
    '; micro-batches 69-512 repeat ...' for one whose pipeline rounds were (pipeline_steady.py)."""
    r, micro = outcome.result.repeated, outcome.result.micro
    out = ""
    if r:
        more, period = r
        shown = outcome.scenario.run.steps - more
        out += (f"; steps {shown + 1}-{shown + more} repeat step {shown} every {format_ns(period)}: drawn are the "
                f"first {shown}, the report counts all {shown + more}")
    if micro:
        shown, m, period = micro
        one = outcome.scenario.run.steps == 1
        out += (f"; micro-batches {shown + 1}-{m} each add the pipeline's steady round of {format_ns(period)}"
                f"{'' if one else ' a step'}: drawn {'is the step' if one else 'are the steps'} with {shown}, "
                f"the report counts all {m}")
    return out


def render(outcome: Outcome, console: Console, width: int = 100, summary: bool = False) -> None:
    """What `simcluster run` prints for an outcome: the comparison, or the report, timeline and memory
    (`summary`: the report's first table and the verdict alone)."""
    if outcome.variants:
        table = comparison(outcome)
        if console.is_terminal:
            console.print(table)
        else:  # piped, the console is 80 columns: the table gets the width it needs instead
            wide = console.measure(table, options=console.options.update(max_width=10_000)).maximum
            narrow, console.width = console.width, max(console.width, wide)
            console.print(table)
            console.width = narrow
        rows = [(label, o.report["target"]) for label, o in outcome.variants if "target" in o.report]
        if rows:
            console.print()
            console.print(target_curve(rows, min(width, console.width)))
        return
    console.print(ReportView(outcome.report, summary))
    if summary:
        return
    console.print()
    fold = outcome.result.fold
    console.print("[bold]timeline[/] (one lane per rank and stream" + (f"; {fold.describe()}" if fold else "")
                  + escape(repeated(outcome)) + ")", markup=True)
    console.print(Timeline(outcome.result.trace, width=width))
    if outcome.result.trace.memory:
        console.print()
        console.print("[bold]memory over time[/] (the rank with the highest peak)", markup=True)
        console.print(MemoryChart(outcome.result.trace, width=width,
                                  capacity=outcome.report["memory"]["capacity_bytes"]))


def measured_table(report: dict[str, Any]) -> Table:
    """A torch.distributed run's figures per rank beside the emulator's prediction."""
    section = report["torch"]
    caption = f"measured peak memory: {section['memory_measure']}"
    if section["device"] == "cpu":  # (the prediction's memory, and its "fits", are the scenario's GPU's)
        m = report["memory"]
        caption += (f"; predicted: on the scenario's {report['cluster']['device']} "
                    f"({format_bytes(m['capacity_bytes'])} each: {'fits' if m['fits'] else 'does NOT fit'}), "
                    f"not this host's memory")
    t = Table(title=escape(f"measured: torch.distributed, {section['backend']} on {section['device']}"),
              title_justify="left", caption=escape(caption), caption_justify="left")
    for col in ("rank", "step time", "predicted", "peak memory", "predicted"):
        t.add_column(col, justify="right")
    predicted = format_ns(section["predicted_step_time_s"] * 1e9)
    for rank, seconds in section["step_time_s"].items():
        t.add_row(rank, format_ns(seconds * 1e9), predicted, format_bytes(section["peak_memory_bytes"][rank]),
                  format_bytes(report["memory_peak_bytes"][rank]["total"]))
    return t


def render_torch(outcome: Outcome, out: Console, as_json: bool = False, width: int = 100,
                 summary: bool = False) -> int:
    """What a torch.distributed run prints: the emulator's report and timeline (the prediction), the
    measured figures, and how the real outputs compare; the exit status (0 when they agree)."""
    section = outcome.report["torch"]
    if as_json:
        sys.stdout.write(document(outcome.report) + "\n")
    else:
        render(outcome, out, width, summary)
        out.print()
        out.print(measured_table(outcome.report))
        a, v = section["against_emulator"], section["verification"]
        same = a["status"] if "status" in a else f"{a['identical']} of {a['compared']} outputs byte-identical to the emulator's" + (
            f", {a['within_tolerance']} within their bound (relative norm error)" if a["within_tolerance"] else "") + (
            f" ({a['not_compared']} not compared: weights and moments after Adam)" if a["not_compared"] else "")
        sent = section.get("outputs_sent")
        if sent and "status" not in a:
            same += f" (the ranks sent {sent['outputs'] - sent['sent_whole']} digests, {sent['sent_whole']} tensors)"
        out.print(f"torch.distributed against the emulator: {same}" + (
            "" if a["passed"] else f"; [bold red]{a['differing']} DIFFER[/]: {', '.join(a['differ'])}"), markup=True)
        verdict = v.get("status") or ("bit-exact" if v.get("bit_exact") else "passed" if v.get("passed") else "MISMATCH")
        out.print(f"torch.distributed against one device: {verdict}", markup=False)
        if not v.get("passed") and v.get("routing_differs"):
            out.print(f"routing differs in {v['routing_differs']['count']} outputs: {v['routing_differs']['why']}",
                      markup=False)
        if section.get("apart"):  # (a gap the tool can explain is said, not left to the reader)
            out.print("measured and predicted apart: " + "; ".join(section["apart"]), markup=False)
    return 0 if section["passed"] else 1
