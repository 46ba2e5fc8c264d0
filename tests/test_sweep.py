"""`simcluster sweep`: one run per value, charted; degrees keep the cluster; refusals are rows."""

import json
import xml.etree.ElementTree as ET

from simcluster.analysis.sweep import overrides_for
from simcluster.cli import main
from simcluster.config.scenario import load

META = ["--set", "run.numerics=meta"]


def test_a_zero_sweep_shows_memory_falling_stage_by_stage(capsys):
    assert main(["sweep", "--key", "parallel.zero", "--values", "0,1,2,3", "--json"] + META) == 0
    points = json.loads(capsys.readouterr().out)["points"]
    assert [p["value"] for p in points] == ["0", "1", "2", "3"]
    peaks = [p["peak_bytes"] for p in points]
    assert peaks[0] > peaks[1] > peaks[2] > peaks[3]  # DDP > ZeRO-1 > ZeRO-2 > ZeRO-3
    assert all(p["step_ns"] > 0 and p["verdict"] == "not verified" for p in points)


def test_sweeping_a_degree_keeps_the_cluster_unless_dp_is_given():
    base = load(None, [])  # dp=8 on 8 GPUs
    assert overrides_for(base, "parallel.tp", "4", []) == ["parallel.tp=4", "parallel.dp=2"]
    assert overrides_for(base, "parallel.tp", "4", ["parallel.dp=1"]) == ["parallel.dp=1", "parallel.tp=4"]
    assert overrides_for(base, "parallel.zero", "1", []) == ["parallel.zero=1"]


def test_a_degree_sweep_shows_the_dp_that_follows(capsys):
    """dp changes with tp (the cluster is kept): the table and the JSON say to what."""
    assert main(["sweep", "--key", "parallel.tp", "--values", "1,2,4", "--json"] + META) == 0
    assert [(p["value"], p["dp"]) for p in json.loads(capsys.readouterr().out)["points"]] == [
        ("1", 8), ("2", 4), ("4", 2)]
    assert main(["sweep", "--key", "parallel.tp", "--values", "2,4"] + META) == 0
    rows = [line.split("│")[1:3] for line in capsys.readouterr().out.splitlines() if line.startswith("│")]
    assert [(tp.strip(), dp.strip()) for tp, dp in rows] == [("2", "4"), ("4", "2")]
    assert main(["sweep", "--key", "parallel.zero", "--values", "0,1"] + META) == 0
    assert "┃ dp" not in capsys.readouterr().out  # (dp stays what it was: no column)


def test_a_value_the_layout_cannot_take_is_a_row_not_the_end(capsys, tmp_path):
    svg = tmp_path / "s.svg"
    assert main(["sweep", "--key", "parallel.tp", "--values", "1,8,2", "--svg", str(svg)] + META) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "refused (1)" in out and "(1) parallel.tp=8: tensor-parallel degree 8 must divide heads=4" in out
    root = ET.parse(svg).getroot()
    assert len([e for e in root.iter() if e.get("class") == "bar"]) == 2 * 2  # two values ran, two charts
    assert "refused" in "".join(root.itertext())
    assert main(["sweep", "--key", "parallel.tp", "--values", "8,16"] + META) == 2  # nothing ran


def test_near_the_device_the_memory_chart_draws_its_capacity(tmp_path, capsys):
    svg = tmp_path / "s.svg"
    argv = ["sweep", "--key", "parallel.zero", "--values", "0,3", "--svg", str(svg), "--set", "cluster.memory_gbyte=0.0015"]
    assert main(argv + META) == 0
    out = capsys.readouterr().out
    assert "OUT OF MEMORY" in out  # DDP's 1.9 MB does not fit in 1.6 MB; ZeRO-3's 0.46 MB does
    assert [e for e in ET.parse(svg).getroot().iter() if e.get("class") == "capacity"]


def test_bad_sweeps_are_one_line(capsys):
    assert main(["sweep", "--key", "parallel.tpp", "--values", "1"]) == 2
    assert "--key 'parallel.tpp' is not a scenario key" in capsys.readouterr().err
    assert main(["sweep", "zero_memory", "--key", "parallel.tp", "--values", "1"]) == 2
    assert "has a [compare] table" in capsys.readouterr().err
