"""Traces for the tools people already use: the Chrome/Perfetto export's arrows, counters and metadata,
and the per-rank PyTorch-profiler export read back by Holistic Trace Analysis (HTA)."""

import json
import random
import re

import pytest

from simcluster.cli import main
from simcluster.config.scenario import load
from simcluster.engine.totals import covered
from simcluster.run.runner import run_all
from simcluster.viz import hta
from simcluster.viz.chrome import chrome_trace

PIPELINE = ["cluster.gpus_per_node=2", "parallel.dp=1", "parallel.pp=2", "parallel.zero=0", "model.tied_head=false",
            "model.global_batch=4", "model.micro_batch=1", "run.steps=1", "run.numerics=meta"]
FSDP_AND_PIPELINE = ["cluster.gpus_per_node=4", "parallel.dp=2", "parallel.pp=2", "parallel.zero=1",
                     "model.tied_head=false", "model.micro_batch=1", "run.steps=2", "run.numerics=meta"]


def exported(overrides):
    outcome = run_all(load(None, overrides))
    return outcome, chrome_trace(outcome.result.full_trace(), metadata={"mesh": outcome.report["mesh"]})


def slices_at(events, pid, tid, ts):
    """The slices enclosing `ts` on a thread (half-open: a slice that ends at ts does not), compared in
    whole ns (the export's us with three decimals: their float sums may land a hair past an end)."""
    ns = lambda us: round(us * 1000)  # noqa: E731
    return [e for e in events if e["ph"] == "X" and e["pid"] == pid and e["tid"] == tid
            and (ns(e["ts"]) <= ns(ts) < ns(e["ts"]) + ns(e["dur"]) or e["ts"] == ts)]


def arrows(events):
    ends: dict[int, dict[str, list]] = {}
    for e in events:
        if e["ph"] in "sf":
            ends.setdefault(e["id"], {"s": [], "f": []})[e["ph"]].append(e)
    return ends


def test_every_arrow_is_one_start_and_one_finish_bound_to_slices_of_its_category():
    _, doc = exported(FSDP_AND_PIPELINE)
    events = doc["traceEvents"]
    ends = arrows(events)
    assert ends
    for pair in ends.values():
        assert len(pair["s"]) == 1 and len(pair["f"]) == 1
        for end in pair["s"] + pair["f"]:
            bound = slices_at(events, end["pid"], end["tid"], end["ts"])
            assert bound and all(b["cat"] == end["cat"] == "communication" for b in bound)
            ops = {b["args"]["operation"] for b in bound}
            assert ops == {pair["s"][0]["name"]} or pair["s"][0]["name"] == "send" and ops <= {"send", "recv"}


def test_a_pipeline_draws_each_message_from_its_send_to_its_receive():
    """pp=2, 4 micro-batches, one step: 4 activations 0 -> 1 and 4 gradients 1 -> 0, 8 arrows."""
    _, doc = exported(PIPELINE)
    events = doc["traceEvents"]
    messages = [p for p in arrows(events).values() if p["s"][0]["name"] == "send"]
    assert len(messages) == 8
    directions = sorted((p["s"][0]["pid"], p["f"][0]["pid"]) for p in messages)
    assert directions == [(0, 1)] * 4 + [(1, 0)] * 4
    for p in messages:
        tail = slices_at(events, p["s"][0]["pid"], p["s"][0]["tid"], p["s"][0]["ts"])
        head = slices_at(events, p["f"][0]["pid"], p["f"][0]["tid"], p["f"][0]["ts"])
        assert tail[0]["args"]["operation"] == "send" and head[0]["args"]["operation"] == "recv"


def test_a_collective_draws_an_arrow_from_its_first_rank_to_each_other_rank():
    _, doc = exported(FSDP_AND_PIPELINE)
    events = doc["traceEvents"]
    fan: dict[tuple, list[int]] = {}
    for p in arrows(events).values():
        s = p["s"][0]
        if s["name"] not in ("send", "recv"):
            tail = slices_at(events, s["pid"], s["tid"], s["ts"])[0]
            fan.setdefault((tail["args"]["group"], tail["ts"], s["pid"]), []).append(p["f"][0]["pid"])
    assert fan
    for (group, _, first), heads in fan.items():
        members = [int(r) for r in re.findall(r"\d+", group.split("[", 1)[1])]
        assert first == min(members) and sorted(heads) == [r for r in members if r != first]


def test_memory_counters_peak_where_the_report_says():
    outcome, doc = exported(FSDP_AND_PIPELINE)
    counters = [e for e in doc["traceEvents"] if e["ph"] == "C"]
    for rank, peaks in outcome.report["memory_peak_bytes"].items():
        mine = [c for c in counters if c["pid"] == int(rank)]
        assert max(sum(c["args"].values()) for c in mine) == peaks["total"]
        for category in peaks.keys() - {"total"}:
            assert max(c["args"].get(category, 0) for c in mine) == peaks[category]


def test_the_chrome_export_names_its_scenario_mesh_and_cluster(tmp_path):
    path = tmp_path / "t.json"
    assert main(["export", "tp_cliff", "--variant", "3", "-o", str(path)]) == 0
    other = json.loads(path.read_text())["otherData"]
    assert other["scenario"] == "tp_cliff" and other["world_size"] == 16
    assert other["mesh"]["tp"] == 16 and other["cluster"]["nodes"] == 2


def test_overlap_is_the_communication_time_under_compute():
    """By hand: communication covers 5..26 (21 ns); compute runs 0..10 and 20..30, over 5..10 and 20..26."""
    assert covered([(0, 10), (20, 30)], [(5, 25), (24, 26)]) == (21, 11)
    assert covered([(0, 10)], [(10, 20)]) == (10, 0)  # touching is not overlapping
    assert covered([], [(0, 5), (1, 2)]) == (5, 0)


def test_overlap_counts_every_ns_once_however_the_spans_lie():
    """Against counting nanoseconds one by one, on drawn spans (nested, touching, repeated, unsorted)."""
    rng = random.Random(7)
    for _ in range(200):
        spans = [[(s, s + rng.randrange(1, 12)) for s in (rng.randrange(60) for _ in range(rng.randrange(8)))]
                 for _ in range(2)]
        compute, other = ({t for s, e in side for t in range(s, e)} for side in spans)
        assert covered(*spans) == (len(other), len(compute & other))


def test_nccl_names_are_what_hta_counts_as_communication():
    assert hta.nccl_name("all_reduce", "bf16") == "ncclDevKernel_AllReduce_Sum_bf16_RING_LL" + hta.NCCL_ARGS
    assert hta.nccl_name("all_gather", "bf16") == "ncclDevKernel_AllGather_RING_LL" + hta.NCCL_ARGS
    assert hta.nccl_name("recv", "fp32") == "ncclDevKernel_SendRecv" + hta.NCCL_ARGS


@pytest.mark.parametrize("overrides", [["run.numerics=meta"], FSDP_AND_PIPELINE], ids=["fsdp-dp8", "pp2-dp2-zero1"])
def test_hta_reads_the_export_and_agrees_with_the_report(overrides, tmp_path, monkeypatch, capsys):
    """HTA's temporal breakdown and communication/computation overlap, per rank, from the files
    `simcluster export --format hta` writes, against simcluster's own report of the same run (timed in meta
    mode: the same events, no numbers to compute)."""
    from hta.trace_analysis import TraceAnalysis  # (the test extra installs it)

    monkeypatch.setenv("HTA_DISABLE_NS_ROUNDING", "1")  # (kernels of a few us: keep their ns)
    argv = ["export", "--format", "hta", "-o", str(tmp_path)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["run", "--json"] + argv[5:]) in (0, 1)
    report = json.loads(capsys.readouterr().out)
    analysis = TraceAnalysis(trace_dir=str(tmp_path))
    breakdown = analysis.get_temporal_breakdown(visualize=False).set_index("rank")
    overlap = analysis.get_comm_comp_overlap(visualize=False).set_index("rank")
    assert sorted(breakdown.index) == list(range(report["world_size"]))
    for rank, ours in report["communication_overlap"]["per_rank"].items():
        row = breakdown.loc[int(rank)]
        assert row["compute_time(us)"] == pytest.approx(report["busy_ns"][rank]["compute"] / 1000, abs=1e-6)
        exposed = ours["communication_ns"] - ours["hidden_ns"]
        assert row["non_compute_time(us)"] == pytest.approx(exposed / 1000, abs=1e-6)
        assert overlap.loc[int(rank), "comp_comm_overlap_pctg"] == round(100 * ours["hidden_ns"] / ours["communication_ns"], 2)
    assert any(v["hidden_ns"] for v in report["communication_overlap"]["per_rank"].values())
