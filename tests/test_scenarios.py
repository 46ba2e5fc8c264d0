"""The scenario library and the command line: every scenario runs and verifies; list, export, errors."""

import io
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rich.console import Console

from simcluster.cli import main
from simcluster.config.scenario import library, load
from simcluster.report import document
from simcluster.report.schema import report_schema
from simcluster.run.runner import run_all
from simcluster.viz.outcome_view import render

SCENARIOS = [f.stem for f in library()]
# The lessons whose exact runs take longest (64 TPU chips three times and six pipeline schedules, ~50 s
# each; six variants over 8 ranks for rails, and offload's and fsdp_prefetch's, 10-22 s each on 2 cores):
# their golden pictures run with -m slow, to keep the default suite under 8 minutes; tests/test_torus.py,
# test_pipeline.py, test_rails.py, test_offload.py and test_zero_measures.py check what they teach in it.
HEAVY = {"torus", "pipeline_schedules", "rails", "offload", "fsdp_prefetch"}


def test_the_library_has_the_lessons():
    assert {"collectives", "allreduce_decomposed", "zero_memory", "fsdp_prefetch", "pipeline_schedules", "tp_cliff",
            "tp_sp_memory", "tp_overlap", "sequence_volume", "ring_long_sequence", "megatron_3d", "llama3_4d"} <= set(SCENARIOS)


GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in SCENARIOS])
def test_every_scenario_verifies_and_prints_its_golden_picture(name, request):
    """The plain-text output at a fixed width matches tests/golden/NAME.txt (regenerate on purpose with
    pytest --update-golden, and read the diff): it changes only when behaviour changes."""
    outcome = run_all(load(name))
    reports = [o.report for _, o in outcome.variants] or [outcome.report]
    assert all(r["verification"].get("passed", True) for r in reports)
    assert all(r["verification"].get("bit_exact", True) for r in reports)
    for r in reports:  # (the published schema holds every library report: docs/report.schema.json)
        jsonschema.validate(json.loads(document(r)), report_schema())
    buf = io.StringIO()
    render(outcome, Console(file=buf, width=110, color_system=None, force_terminal=False, legacy_windows=False), 80)
    text = buf.getvalue()
    path = GOLDEN / f"{name}.txt"
    if request.config.getoption("--update-golden") or not path.exists():
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(text)
    assert text == path.read_text()


def test_list_shows_every_scenario_with_its_description(capsys):
    assert main(["list"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for name in SCENARIOS:
        assert name in out


def test_compare_runs_each_variant(capsys):
    assert main(["run", "zero_memory", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [v["variant"] for v in rep["variants"]] == [f"zero={z}" for z in range(4)]
    peaks = [max(p["total"] for p in v["memory_peak_bytes"].values()) for v in rep["variants"]]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]  # DDP > ZeRO-1 > ZeRO-2 > ZeRO-3


def test_at_scale_runs_in_meta_mode(capsys):
    assert main(["run", "ring_long_sequence", "--at-scale", "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["scenario"]["run"]["numerics"] == "meta" and rep["scenario"]["model"]["seq"] == 131072


def test_exported_trace_has_the_chrome_trace_event_structure(tmp_path):
    path = tmp_path / "trace.json"
    assert main(["export", "collectives", "-o", str(path)]) == 0
    doc = json.loads(path.read_text())
    events = doc["traceEvents"]
    assert events
    lanes: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e)
        if e["ph"] == "X":
            assert e["dur"] >= 0
            lanes.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():  # a stream runs one thing at a time
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))
    starts = {e["id"] for e in events if e["ph"] == "s"}
    finishes = {e["id"] for e in events if e["ph"] == "f"}
    assert starts and starts == finishes  # every collective's flow arrow has its ends
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(4)}


def test_timeline_command_selects_ranks_and_streams(capsys):
    assert main(["timeline", "collectives", "--ranks", "1", "--streams", "compute", "--width", "40"]) == 0
    out = capsys.readouterr().out
    assert "r1 compute" in out and "r0" not in out and "comm" not in out


KEYS = ["model.hidden", "model.heads", "parallel.dp", "parallel.tp", "parallel.zero", "run.numerics", "cluster.nodes",
        "parallel.schedule", "model.dtype", "nonsense.key", "model.hiden", "run.steps"]
VALUES = st.one_of(st.integers(-3, 40), st.sampled_from(['"exact"', '"fast"', '"warp"', "true", "1.5", '"1f1b"',
                                                         '"bf16"', "[1, 2]", "{}"]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), min_size=1, max_size=3))
def test_random_scenario_documents_never_give_a_traceback(tmp_path_factory, pairs):
    """Random documents: either a run, or one clear line on stderr and exit status 2; never a traceback."""
    doc = "\n".join(f'"{k}" = {v}' for k, v in pairs) + '\n"run.numerics" = "meta"\n'
    path = tmp_path_factory.mktemp("doc") / "random.toml"
    path.write_text(doc)
    proc = subprocess.run([sys.executable, "-m", "simcluster.cli", "run", str(path), "--json"], capture_output=True,
                          text=True, timeout=300)
    assert "Traceback" not in proc.stderr
    if proc.returncode == 0:
        json.loads(proc.stdout)
    else:
        assert proc.returncode == 2
        assert len(proc.stderr.strip().splitlines()) == 1 and proc.stderr.startswith("error:")


def test_a_piped_comparison_keeps_every_value_compared(capsys):
    """Piped output is 80 columns wide; the [compare] table takes the width it needs, each variant on a line."""
    assert main(["run", "pipeline_schedules", "--set", "run.numerics=meta"]) == 0
    out = capsys.readouterr().out
    for schedule, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 1), ("dualpipe", 1)]:
        assert f"schedule={schedule}, virtual_stages={v} " in out


def test_timeline_passes_draws_the_pipeline_grid(capsys):
    # (meta mode: the same times, without the numbers)
    assert main(["timeline", "pipeline_schedules", "--set", "parallel.schedule=1f1b", "--set",
                 "parallel.virtual_stages=1", "--set", "run.numerics=meta", "--passes", "--ranks", "0,1,2,3",
                 "--width", "400"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"stage {s}" for s in range(4)]
    for line in lines:  # every stage runs every micro-batch's forward and backward
        for j in range(8):
            assert f"F{j}" in line and f"B{j}" in line
    # narrower than the passes need, the picture goes on below in blocks, every pass drawn
    assert main(["timeline", "pipeline_schedules", "--set", "run.numerics=meta", "--passes", "--ranks", "0,1,2,3",
                 "--width", "60"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.startswith("stage ")]
    assert len(rows) > 4 and all(len(line) <= 60 for line in lines)
    drawn = sum(len(set(line.split(": ")[1].split()) - {".."}) for line in rows)
    assert drawn == 4 * 16 and any(line.startswith("(passes in columns 1-") for line in lines)


@pytest.mark.parametrize("name", SCENARIOS)
def test_every_scenario_has_a_realistic_size_in_meta_mode(name, capsys):
    """At scale some layouts do not fit in 80 GB (DDP of 7B, GPipe's 32 micro-batches): exit status 3
    and a line saying so, exactly when a report says a rank's peak exceeds its device."""
    status = main(["run", name, "--at-scale", "--json"])
    out = capsys.readouterr()
    rep = json.loads(out.out)
    reports = rep["variants"] if "variants" in rep else [rep]
    assert all(r["scenario"]["run"]["numerics"] == "meta" and r["step_time_ns"] > 0 for r in reports)
    over = [r for r in reports if r["memory"]["peak_bytes"] > r["memory"]["capacity_bytes"]]
    assert all(r["memory"]["fits"] == (r not in over) for r in reports)
    assert status == (3 if over else 0)
    assert out.err.count("out of memory") == len(over)
