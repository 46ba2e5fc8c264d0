"""The typed configuration (simcluster/config/schema.py): the loader, `simcluster keys` and the JSON
Schema agree on every key; its closed sets are the implementations'; the programs' configurations
take each key the scenario sets under the same name."""

import json
from dataclasses import fields
from enum import Enum
from pathlib import Path

import pytest

from simcluster.cli import main
from simcluster.config.json_schema import scenario_schema
from simcluster.config.scenario import ScenarioError, build
from simcluster.config.schema import (SCHEMA, SECTIONS, ModelSection, ParallelSection, RunSection, check_value,
                                      keys_of)
from simcluster.model.config import ARCHS, ModelConfig, Recompute
from simcluster.model.precision import PRECISIONS
from simcluster.parallel.data_parallel import OFFLOAD, TrainingConfig
from simcluster.parallel.parallelism import ATTENTIONS, ZERO_OVER, Parallelism
from simcluster.parallel.pipeline_schedules import Schedule
from simcluster.program.mesh import DeviceMesh
from simcluster.run.job import parallelism_of
from simcluster.topology.presets import COLLECTIVES, PRESETS
from simcluster.viz.keys_view import describe

EVERY_KEY = [(s, k) for s, keys in SCHEMA.items() for k in keys]
JSON_TYPES = {"boolean": bool, "integer": int, "number": float, "string": str}
WRONG = {"boolean": "1", "integer": '"2"', "number": '"x"', "string": "3"}  # a TOML value of another type


def _toml(value):
    return ("true" if value else "false") if isinstance(value, bool) else json.dumps(value)


@pytest.mark.parametrize("section,name", EVERY_KEY, ids=[f"{s}.{k}" for s, k in EVERY_KEY])
def test_the_json_schema_keys_and_the_loader_agree(section, name, capsys):
    """For each key: its JSON Schema type, default, values and least value are what `keys` prints and
    what the loader gives and accepts, and a value of another type or below the least is refused."""
    prop = scenario_schema()["properties"][section]["properties"][name]
    loaded = getattr(build({}), section)
    assert getattr(loaded, name) == prop.get("default")  # (no default: None, the key unset)
    assert main(["keys", f"{section}.{name}"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    default = "unset" if "default" not in prop else _toml(prop["default"]) if prop["type"] != "string" \
        else repr(prop["default"])
    assert f"{section}.{name} default {default}" in shown or "default the preset's" in shown
    if "enum" in prop:
        assert f"; {', '.join(map(str, prop['enum']))} " in shown
        for value in prop["enum"]:
            assert getattr(getattr(build({}, [f"{section}.{name}={_toml(value)}"]), section), name) == value
        with pytest.raises(ScenarioError, match="is not valid; valid: "):
            build({}, [f"{section}.{name}={_toml('no such value' if prop['type'] == 'string' else 99)}"])
    assert type(getattr(loaded, name) if "default" in prop else JSON_TYPES[prop["type"]]()) is \
        JSON_TYPES[prop["type"]]
    with pytest.raises(ScenarioError, match=f"{section}.{name} must be"):
        build({}, [f"{section}.{name}={WRONG[prop['type']]}"])
    if prop["type"] in ("integer", "number") and prop["minimum"] >= 0:
        below = prop["minimum"] - 1
        with pytest.raises(ScenarioError, match=f"{section}.{name} = .* must be at least"):
            build({}, [f"{section}.{name}={below}"])


def test_the_schema_has_every_key_and_nothing_else():
    schema = scenario_schema()
    tables = {s: set(t["properties"]) for s, t in schema["properties"].items() if s in SECTIONS}
    assert tables == {s: set(keys) for s, keys in SCHEMA.items()}
    assert schema["properties"]["at_scale"]["properties"] == {s: schema["properties"][s] for s in SECTIONS}
    assert all(schema["properties"][s]["additionalProperties"] is False for s in SECTIONS)
    with pytest.raises(ScenarioError, match="unknown key 'model.layer'"):
        build({"model": {"layer": 2}})


def test_the_committed_json_schema_is_current(capsys):
    """docs/scenario.schema.json is what `simcluster keys --json-schema` prints (regenerate it with that)."""
    assert main(["keys", "--json-schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == scenario_schema()
    committed = Path(__file__).resolve().parents[1] / "docs" / "scenario.schema.json"
    assert json.loads(committed.read_text()) == printed


def test_json_schema_with_a_key_is_one_line():
    assert main(["keys", "model", "--json-schema"]) == 2


def test_a_section_checks_its_values_however_it_is_built():
    """The dataclasses are the one check: building a section directly refuses what the loader refuses."""
    with pytest.raises(ScenarioError, match="model.layers = 0 must be at least 1"):
        ModelSection(layers=0)
    with pytest.raises(ScenarioError, match="parallel.schedule = 'zb' is not valid; valid: gpipe, 1f1b"):
        ParallelSection(schedule="zb")
    with pytest.raises(ScenarioError, match="run.steps must be int"):
        RunSection(steps="3")
    assert RunSection(lr=1).lr == 1.0 and type(RunSection(lr=1).lr) is float


def _choices(section: type, name: str) -> set:
    return set(keys_of(section)[name].choices)


def test_the_closed_sets_are_the_implementations():
    """Each Literal of the schema lists what the code that implements it accepts."""
    model, cluster, parallel = ModelSection, SECTIONS["cluster"], ParallelSection
    assert _choices(model, "arch") == set(ARCHS)
    assert _choices(model, "dtype") == set(PRECISIONS)
    assert _choices(parallel, "attention") == set(ATTENTIONS)
    assert _choices(parallel, "zero_over") == set(ZERO_OVER)
    assert _choices(parallel, "schedule") == {s.value for s in Schedule}
    assert _choices(parallel, "recompute") == {r.value for r in Recompute}
    assert _choices(parallel, "offload_optimizer") == _choices(parallel, "offload_params") == set(OFFLOAD)
    assert _choices(cluster, "collectives") == set(COLLECTIVES)
    assert _choices(cluster, "preset") == set(PRESETS)


# every key the program's configurations share by name, set away from both defaults
SHARED = ["model.layers=3", "model.hidden=128", "model.heads=8", "model.ffn_hidden=200", "model.seq=48",
          "model.vocab=100", "model.causal=false", "model.dropout=0.125", "model.dtype=fp16", "model.arch=llama",
          "model.kv_heads=2", "model.gqa=native", "model.attention_kernel=unfused", "model.fused_kernels=false",
          "model.global_batch=16", "run.steps=2", "run.lr=0.5", "run.seed=7", "parallel.zero=3", "parallel.offload_params=cpu", "parallel.prefetch=false",
          "parallel.overlap_grad_reduce=false", "parallel.offload_optimizer=cpu", "parallel.delayed_update=true",
          "parallel.sp=true", "parallel.tp=1", "parallel.dp=8", "parallel.attention=ring",
          "parallel.schedule=gpipe", "parallel.zero_over=dp", "parallel.scatter_gather=true",
          "parallel.dualpipe_overlap=false", "parallel.embedding_in_split=true", "parallel.loss_in_split=true",
          "parallel.microbatch_group=2",
          "parallel.tp_comm_overlap=true", "parallel.tp_async_backward=true", "parallel.overlap_param_gather=true", "parallel.grads_fp32=true", "parallel.grad_accumulation_fusion=false", "model.loss_kernel=fused", "parallel.recompute=full", "model.moe_experts=4", "model.moe_top_k=1", "model.moe_ffn_hidden=64",
          "model.moe_first_dense=1", "model.moe_aux_coeff=0.001", "model.moe_capacity_factor=1.5",
          "model.moe_scores=sigmoid", "model.moe_normalize=true", "model.moe_route_scale=2.5", "model.moe_skew=0.5",
          "parallel.ep=2", "model.moe_shared_experts=1", "model.moe_bias_rate=0.001", "model.moe_groups=2",
          "model.moe_group_limit=1", "model.moe_shared_overlap=true"]


def _value(x):
    return x.value if isinstance(x, Enum) else x


def test_the_programs_configurations_take_every_key_they_share_by_name():
    """parallelism_of copies by name (job.alike): each field of ModelConfig, TrainingConfig and
    Parallelism that a section also has carries the scenario's value, set here away from both
    defaults (a name left out of the copy keeps the program's own default, and fails)."""
    sc = build({}, SHARED)
    got = parallelism_of(sc, DeviceMesh(**sc.parallel.degrees))
    shared = 0
    for target, cls in ((got.model, ModelConfig), (got.data, TrainingConfig), (got, Parallelism)):
        for f in fields(cls):
            for section in (sc.model, sc.parallel, sc.run):
                if f.name in {g.name for g in fields(section)} and f.name not in ("tied_head", "weight_decay",
                                                                                  "clip_grad"):
                    assert _value(getattr(target, f.name)) == getattr(section, f.name), f.name
                    assert _value(f.default) != getattr(section, f.name), f"{f.name}: set it away from the default"
                    shared += 1
    assert shared == 56  # 32 of ModelConfig (15 of them the mixture of experts), 12 of TrainingConfig, 12 of Parallelism
    assert got.model.seed == sc.run.seed and got.data.precision == "fp16" and got.virtual == 1


def test_check_value_names_the_key():
    with pytest.raises(ScenarioError, match=r"run.seed = 1e\+20 .* too large|run.seed must be int"):
        check_value("run.seed", keys_of(RunSection)["seed"], 1e20)
    assert "model.layers" in describe("model.layers")


def test_an_earlier_name_of_a_value_is_still_read():
    """run.program = 'gpt' (the name before the Llama joined) runs the transformer, from a file or --set."""
    assert build({"run": {"program": "gpt"}}).run.program == "transformer"
    assert build({}, ["run.program=gpt"]).run.program == "transformer"
    assert "'gpt', its earlier name, is read as transformer" in describe("run.program").replace("\n      ", " ")
    with pytest.raises(ScenarioError, match="run.program = 'gtp' is not valid; valid: transformer, mlp"):
        build({}, ["run.program=gtp"])


def test_a_layout_set_on_the_command_line_is_fitted_to_the_cluster(tmp_path, capsys):
    """--set of a parallel degree that leaves the cluster too big or too small: dp follows (as in a sweep)
    unless dp was set; else a one-node cluster takes the layout's rank count (a resume under another
    layout needs no cluster.gpus_per_node); a cluster size set beside it, or a file's own mismatch, is
    still refused. Each fitting is a note."""
    sc = build({}, ["parallel.tp=2"])  # the default: dp 8 on one node of 8
    assert (sc.parallel.dp, sc.parallel.tp, sc.cluster.gpus_per_node) == (4, 2, 8)
    assert sc.notes and "parallel.dp = 4" in sc.notes[0]
    sc = build({}, ["parallel.dp=2", "parallel.zero=3"])
    assert (sc.parallel.dp, sc.cluster.nodes, sc.cluster.gpus_per_node) == (2, 1, 2)
    assert "cluster.gpus_per_node = 2" in sc.notes[0]
    assert build({}, ["parallel.zero=1"]).notes == ()  # no degree set: nothing fitted
    assert build({}, ["parallel.tp=3"]).notes == ()  # 8 GPUs do not divide by 3: refused later, not grown
    assert build({}, ["parallel.dp=8"]).notes == ()  # the cluster holds it already
    with pytest.raises(ScenarioError, match="4 ranks, but the cluster has cluster.nodes=2"):
        build({}, ["parallel.dp=4", "cluster.nodes=2"]).cluster_spec()
    with pytest.raises(ScenarioError, match="4 ranks, but the cluster has cluster.nodes=2"):  # two nodes: not shrunk
        build({"cluster": {"nodes": 2}}, ["parallel.dp=4"]).cluster_spec()
    with pytest.raises(ScenarioError, match="= 2 ranks, but the cluster has"):  # the file's own: not fitted
        build({"parallel": {"dp": 2}}).cluster_spec()
    from simcluster.config.scenario import load
    narrowed = load("megatron_3d", ["parallel.tp=4", "parallel.schedule=1f1b"])  # a [compare] narrowed too: both said
    assert narrowed.parallel.dp == 1 and [n.split(":")[0] for n in narrowed.notes] == [
        "parallel.dp = 1", '--set parallel.schedule="1f1b"']
    assert main(["run", "--set", "parallel.tp=2", "--set", "run.numerics=meta", "--summary"]) == 0
    assert "note: parallel.dp = 4" in capsys.readouterr().err
