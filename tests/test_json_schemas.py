"""The published JSON Schemas (docs/scenario.schema.json, docs/report.schema.json) are current, valid,
and hold what the tool reads and writes: every library scenario file, every report (the golden test
validates each library scenario's report too, tests/test_scenarios.py)."""

import json
import tomllib
from pathlib import Path

import jsonschema
import pytest

from simcluster.cli import main
from simcluster.config.json_schema import scenario_schema
from simcluster.config.scenario import library
from simcluster.report.schema import REPORT_VERSION, report_schema

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_the_schemas_are_valid_and_the_published_copies_current(request):
    for name, schema in (("scenario", scenario_schema()), ("report", report_schema())):
        jsonschema.Draft202012Validator.check_schema(schema)
        path = DOCS / f"{name}.schema.json"
        if request.config.getoption("--update-golden"):
            path.write_text(json.dumps(schema, indent=2) + "\n")
        assert json.loads(path.read_text()) == schema, f"regenerate {path.name}: pytest --update-golden"


@pytest.mark.parametrize("path", library(), ids=lambda p: p.stem)
def test_every_library_scenario_file_is_valid_by_the_schema(path):
    jsonschema.validate(tomllib.loads(path.read_text()), scenario_schema())


def test_the_scenario_schema_refuses_what_the_loader_refuses():
    schema = scenario_schema()
    for bad in ({"model": {"layer": 2}}, {"parallel": {"schedule": "zb"}}, {"model": {"layers": 0}},
                {"run": {"steps": "3"}}, {"compare": {"parallel.zeroo": [1, 2]}}, {"job": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_a_report_is_versioned_and_its_ranks_in_numeric_order(capsys):
    """--json: report_version; ranks 0..15 in their order (not "0", "1", "10", ...); a broken report
    (a field of the wrong type) fails the schema."""
    assert main(["run", "--json", "--set", "run.numerics=meta", "--set", "parallel.dp=16",
                 "--set", "cluster.nodes=2", "--set", "model.global_batch=16"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["report_version"] == REPORT_VERSION
    jsonschema.validate(report, report_schema())
    assert list(report["memory_peak_bytes"]) == [str(r) for r in range(16)]
    assert list(report["busy_ns"]) == [str(r) for r in range(16)]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(report | {"step_time_ns": "fast"}, report_schema())
