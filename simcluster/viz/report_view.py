"""The report as rich tables (and as plain text through a no-colour console)."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.markup import escape
from rich.table import Table

from simcluster.model.memory import tier_of
from simcluster.viz.timeline import format_ns


def _pairs(title: str) -> Table:
    """A table of (what, value) rows under a title."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("what", style="bold")
    t.add_column("value")
    return t


def hours(seconds: float) -> str:
    return f"{seconds / 86400:.3g} days" if seconds >= 2 * 86400 else f"{seconds / 3600:.3g} h"


def format_bytes(n: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as the paper tables)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


P2P = {"send->": "send (busiest peer)", "recv<-": "recv (busiest peer)"}


def _listed(counts: list[int], most: int = 6) -> str:
    """Counts as "12 9 14 ...", the first `most` of them."""
    shown = " ".join(f"{n:,}" for n in counts[:most])
    return shown + (f" ... ({len(counts)})" if len(counts) > most else "")


def step_time(r: dict[str, Any]) -> str:
    """The step time as Megatron-LM and torchtitan report one: the steady step, the first step and
    initialisation apart (report.step_times)."""
    rest = f"initialisation {format_ns(r['init_ns'])}, {format_ns(r['total_time_ns'])} in all"
    if r["steady_step_ns"] is None:
        return f"{format_ns(r['step_time_ns'])} (one step; {rest}; run.steps >= 2 gives the steady step)"
    steps = "step 2" if r["steps"] == 2 else f"the mean of steps 2-{r['steps']}"
    return (f"{format_ns(r['steady_step_ns'])} a steady step ({steps}); first step "
            f"{format_ns(r['first_step_ns'])}, {rest}")


class ReportView:
    def __init__(self, report: dict[str, Any], summary: bool = False) -> None:
        self.report, self.summary = report, summary  # summary: the first table and the verdict alone

    def _summary(self) -> Table:
        r = self.report
        sc, c = r["scenario"], r["cluster"]
        program = sc["model"].get("arch", "gpt") if sc["run"]["program"] == "transformer" else sc["run"]["program"]
        t = Table(title=f"scenario {escape(repr(sc['name']))}: {program}, {sc['run']['numerics']} numerics",
                  show_header=False, title_justify="left")
        t.add_column("what", style="bold")
        t.add_column("value")
        mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items())
        shape = f", a {c['torus']} {'torus' if c['torus_wraps'] else 'mesh'}" if c.get("torus") else ""
        if c.get("power_limit_w"):  # (a power limit: the clock it leaves)
            shape += f", at {c['power_limit_w']:g} W of {c['tdp_w']:g} (clock x {c['clock_scale']:.3f})"
        if c.get("sustained_compute", 1.0) != 1.0:  # (what a long run keeps of the benchmark rates)
            shape += f", compute-bound kernels at {c['sustained_compute']:g} of their benchmark rates through a run"
        t.add_row("cluster", escape(f"{c['preset']}: {c['nodes']} node(s) x {c['gpus_per_node']} {c['device']}{shape}"))
        t.add_row("mesh", f"{mesh} = {r['world_size']} ranks")
        t.add_row("parameters", f"{r['parameters']:,}")
        t.add_row("step time", step_time(r))
        if r["model_flops_per_step"]:  # (a program with a model)
            t.add_row("throughput", f"{r['tokens_per_s']:,.0f} tokens/s; {r['tflops_per_gpu']:.1f} TFLOP/s per GPU")
            causal = r["mfu_causal"] != r["mfu"]
            t.add_row("MFU / HFU", f"{100 * r['mfu']:.2f} % / {100 * r['hfu']:.2f} % (PaLM's model FLOPs / the "
                                   f"kernels' FLOPs)" + (f"; MFU {100 * r['mfu_causal']:.2f} % with causal attention's "
                                                         f"half-square" if causal else ""))
        t.add_row("compute idle", f"{100 * r['compute_idle_fraction']:.0f} % of the run (bubbles and waits, mean over ranks)")
        if "layer" in r:
            one, k = r["layer"], r["layer"]["kernels"]
            again = f", recompute {format_ns(one['recompute_ns'])} ({k['recompute']})" if k["recompute"] else ""
            t.add_row("one layer", f"{one['layer']} on rank 0, its kernels back to back: forward "
                                   f"{format_ns(one['forward_ns'])} ({k['forward']} kernels), backward "
                                   f"{format_ns(one['backward_ns'])} ({k['backward']}){again}")
        o = r["communication_overlap"]
        if o["per_rank"] and any(v["communication_ns"] for v in o["per_rank"].values()):
            exposed = max(v["communication_ns"] - v["hidden_ns"] for v in o["per_rank"].values())
            t.add_row("comm overlap", f"{100 * o['hidden_fraction']:.0f} % of communication time runs under compute; "
                                      f"{format_ns(exposed // r['steps'])} a step exposed on the worst rank")
        return t

    def _comm(self) -> Table:
        t = Table(title="communication per rank", title_justify="left")
        for col in ("group", "collective", "calls", "bytes sent", "time"):
            t.add_column(col, justify="left" if col in ("group", "collective") else "right")
        for row in self.report["communication"]:
            t.add_row(row["group"], row["collective"], str(row["calls_per_rank"]), format_bytes(row["bytes_per_rank"]),
                      format_ns(row["time_ns_per_rank"]))
        return t

    def _busy(self) -> Table:
        t = Table(title="busy time per stream", title_justify="left")
        t.add_column("stream")
        t.add_column("busy", justify="right")
        t.add_column("of step", justify="right")
        streams: dict[str, int] = {}
        for lanes in self.report["busy_ns"].values():
            for s, v in lanes.items():
                s = P2P.get(s[:6], s)  # one row per direction, not one per peer
                streams[s] = max(streams.get(s, 0), v)
        total = max(self.report["total_time_ns"], 1)
        kinds = self.report.get("compute_ns_by_kind") or {}
        # the busiest rank's compute stream, by kind of kernel (the JSON's compute_ns_by_kind)
        busiest = max(kinds.values(), key=lambda k: (sum(k.values()), k["gemm"]), default={})
        for s, v in streams.items():
            t.add_row(s, format_ns(v), f"{100 * v / total:.0f} %")
            if s == "compute" and sum(1 for ns in busiest.values() if ns) > 1:
                for kind, label in (("gemm", "GEMMs"), ("attention", "fused attention"), ("other", "other kernels")):
                    if busiest.get(kind):
                        t.add_row(f"  {label}", format_ns(busiest[kind]), f"{100 * busiest[kind] / total:.0f} %")
        return t

    def _memory(self) -> Table | None:
        peaks = self.report.get("memory_peak_bytes") or {}
        if not peaks:
            return None
        t = Table(title="peak memory (largest rank)", title_justify="left")
        t.add_column("category")
        t.add_column("peak", justify="right")
        m = self.report.get("memory") or {}
        host = m.get("host", {})
        categories = sorted({c for v in peaks.values() for c in v if c != "total" and c not in host})
        for c in [c for c in categories if tier_of(c) == "gpu"] + ["total"]:
            t.add_row(c, format_bytes(max(v.get(c, 0) for v in peaks.values())))
        if m:
            t.add_row("device", f"{m['capacity_bytes'] / 2**30:g} GiB ({format_bytes(m['capacity_bytes'])}): " + (
                "fits" if m["fits"] else f"[bold red]OUT OF MEMORY[/] on {m['ranks_over']} rank(s)"))
        for c in [c for c in categories if tier_of(c) != "gpu"]:  # offloaded: the host's memory and NVMe
            t.add_row(c, format_bytes(max(v.get(c, 0) for v in peaks.values())))
        for tier, h in host.items():
            t.add_row(f"{tier} (host)", f"{format_bytes(h['peak_bytes_per_node'])} a node of "
                      f"{format_bytes(h['capacity_bytes_per_node'])}: " + ("fits" if h["fits"] else "[bold red]DOES NOT FIT[/]"))
        return t

    def _verdict(self) -> Table:
        v = self.report["verification"]
        t = _pairs("verification")
        if "status" in v:
            t.add_row("verdict", v["status"])
            return t
        ok = v["passed"]
        word = "bit-exact" if v.get("bit_exact") else ("within tolerance" if ok else "MISMATCH")
        t.add_row("verdict", f"[{'green' if ok else 'bold red'}]{'PASS' if ok else 'FAIL'}[/]: {word} "
                  f"against {v['reference']}")
        if not ok and v.get("routing_differs"):
            t.add_row("routing differs", escape(f"{v['routing_differs']['count']} outputs: {v['routing_differs']['why']}"))
        kinds: dict[str, int] = {}
        for name in v["outputs"]:
            kind = name.split("[")[0].split(".")[0]
            kinds[kind] = kinds.get(kind, 0) + 1
        t.add_row("outputs compared", f"{v['outputs_compared']}: " + ", ".join(f"{k} x{n}" for k, n in kinds.items()))
        if "max_relative_error" in v:
            t.add_row("max relative error", f"{v['max_relative_error']:.3g}")
        for m in v["mismatches"]:
            t.add_row("mismatch", ", ".join(f"{k}={val}" for k, val in m.items()))
        return t

    def _checkpoint(self) -> Table | None:
        c = self.report.get("checkpoint")
        if not c:
            return None
        t = _pairs("checkpoint")
        if "resumed" in c:
            t.add_row("resumed from", escape(f"{c['resumed']['from']} at step {c['resumed']['step']} (the steps "
                                             f"before it are not rerun, nor verified)"))
        if "saved" in c:
            t.add_row("saved", escape(f"after step {c['step']} to {c['saved']}: {c['files']} files, "
                                      f"{format_bytes(c['bytes'])} (manifest.json, docs/checkpoint.md)"))
        return t

    def _faults(self) -> Table | None:
        f = self.report.get("faults")
        if not f:
            return None
        t = _pairs("faults")
        for line in f["injected"]:
            t.add_row("injected", escape(line))
        h = f["hang"]
        if h:
            t.add_row("[bold red]HUNG[/]", f"rank {h['failed_rank']} failed at {format_ns(h['failed_at_ns'])}; "
                      f"{h['ranks_waiting']} ranks' watchdogs fired, the last at {format_ns(h['ends_ns'])}")
            for w in h["watchdog"][:4]:
                t.add_row(f"rank {w['rank']}", escape(f"{w['call']}, SeqNum {w['seq']}: waited from "
                                                      f"{format_ns(w['began_ns'])}; never joined: {w['missing']}"))
            if len(h["watchdog"]) > 4:
                t.add_row("", f"... and {len(h['watchdog']) - 4} more ranks (--json lists them)")
        return t

    def _experts(self) -> Table | None:
        e = self.report.get("experts")
        if not e or not e["layers"]:
            return None
        t = _pairs("experts: the tokens routed to each")
        t.add_row("routing", f"{e['experts']} experts, top-{e['top_k']}, step {e['step']}: {e['routing']}")
        busiest = max(e["layers"], key=lambda r: (r["imbalance"], -r["layer"]))
        shown = e["layers"] if len(e["layers"]) <= 4 else [busiest]
        for r in shown:
            t.add_row(f"layer {r['layer']}", escape(f"{_listed(r['tokens_per_expert'])}; busiest "
                                                    f"{r['imbalance']:.2f}x even; {r['dropped']:,} dropped"))
        if len(shown) < len(e["layers"]):
            t.add_row("", f"(the busiest of {len(e['layers'])} layers; --json has them all)")
        return t

    def _goodput(self) -> Table | None:
        g = self.report.get("goodput")
        if not g:
            return None
        t = _pairs("goodput (the fraction of wall time that trains)")
        t.add_row("interruptions", f"{g['interruptions_per_gpu_hour']:.3g} per GPU-hour x {g['gpus']:,} GPUs: one every "
                  f"{g['mtbf_s'] / 3600:.3g} h")
        t.add_row("checkpoint", f"{format_bytes(g['checkpoint_bytes'])} in {g['checkpoint_s']:.3g} s; restart "
                  f"{g['restart_s']:.3g} s; step {g['step_s']:.3g} s")
        if g["goodput"] is None:
            t.add_row("goodput", g["why"])
            return t
        t.add_row("goodput", f"{100 * g['goodput']:.1f} % checkpointing every {g['checkpoint_every_steps']:,} steps")
        t.add_row("best interval", f"every {g['best_every_steps']:,} steps ({g['best_interval_s']:.0f} s of training): "
                  f"{100 * g['best_goodput']:.1f} %; Young sqrt(2CM) = {g['young_interval_s']:.0f} s, Daly "
                  f"{g['daly_interval_s']:.0f} s")
        return t

    def _target(self) -> Table | None:
        g = self.report.get("target")
        if not g:
            return None
        t = _pairs("time to the target loss (McCandlish et al. 2018)")
        t.add_row("batch", f"{g['batch_tokens']:,} tokens; B_noise {g['b_noise_tokens']:.3g} tokens")
        t.add_row("steps", f"{g['steps']:,.0f} (fewest possible {g['s_min']:,.0f}: {100 * g['time_efficiency']:.0f} %)")
        t.add_row("tokens", f"{g['tokens']:.3g} (fewest possible {g['e_min_tokens']:.3g}: "
                  f"{100 * g['data_efficiency']:.0f} %)")
        t.add_row("wall time", f"{hours(g['wall_s'])} at {g['step_s']:.3g} s a step; {g['gpu_hours']:,.0f} GPU-hours")
        return t

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.summary:
            parts = [self._summary(), self._verdict(), self._faults()]
        else:
            # (what a reader needs first, within a screen: the figures, the verdict, whether it fits; then why)
            parts = [self._summary(), self._verdict(), self._memory(), self._faults(), self._experts(), self._busy(),
                     self._comm(), self._checkpoint(), self._goodput(), self._target()]
        yield Group(*[p for p in parts if p is not None])


def plain(renderable: Any, width: int = 120) -> str:
    """Render to plain text at a fixed width (no colour): what golden tests compare."""
    buf = io.StringIO()
    Console(file=buf, width=width, color_system=None, force_terminal=False, legacy_windows=False).print(renderable)
    return buf.getvalue()


def target_curve(rows: list[tuple[str, dict[str, Any]]], width: int = 100) -> Table:
    """Wall time to the target loss per variant, as bars (the curve against GPUs), with what each
    variant buys over the one before it."""
    t = Table(title="wall time to the target loss", title_justify="left", box=None)
    for col in ("GPUs", "batch (tokens)", "", "wall time", "vs the row above"):
        t.add_column(col, justify="left" if col == "" else "right")
    longest = max(r["wall_s"] for _, r in rows) or 1.0
    bar = max(8, min(50, width - 56))
    before, gpus = None, 0
    for _, r in rows:
        gain = "" if before is None else f"{before / r['wall_s']:.2f}x for {r['gpus'] / gpus:g}x GPUs"
        t.add_row(f"{r['gpus']:,}", f"{r['batch_tokens']:,}", "█" * max(1, round(bar * r["wall_s"] / longest)),
                  hours(r["wall_s"]), gain)
        before, gpus = r["wall_s"], r["gpus"]
    return t
