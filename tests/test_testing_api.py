"""simcluster.testing, the public testing API: its strategies draw what they promise (and nothing a
rule refuses), its assembly joins shards as written by hand, and its assertions fail on a broken
program with the report's words and pass a correct one."""

import numpy as np
import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis.errors import NoSuchExample

from broken import swapped_tp, wrong_coord
from simcluster.model.gpt import ModelConfig
from simcluster.parallel.composed import composed
from simcluster.parallel.data_parallel import TrainingConfig
from simcluster.parallel.parallelism import ATTENTIONS, Parallelism
from simcluster.parallel.pipeline_schedules import Schedule
from simcluster.parallel.tp_dp_mlp import MLPConfig, assemble, train_mlp
from simcluster.program.mesh import DeviceMesh
from simcluster.testing import (Layout, assert_bit_exact, assert_close_fast, assert_same, layouts, meshes, outputs,
                                replicated, unshard)

SEARCH = settings(database=None, derandomize=True, max_examples=400, suppress_health_check=list(HealthCheck))
MODEL = ModelConfig(layers=4, hidden=12, heads=6, ffn_hidden=6, seq=12, vocab=12, tied_head=False, dropout=0.1)


def first(strategy, condition):
    return find(strategy, condition, settings=SEARCH)


def test_meshes_shrink_to_the_smallest_and_stay_within_bounds():
    # sizes are ordered by world size, then by degrees: the smallest 5-rank mesh puts 5 on the last axis
    assert first(meshes(16), lambda m: m.world_size >= 5).sizes == {"dp": 1, "pp": 1, "cp": 1, "tp": 5}
    assert first(meshes(16, axes=("dp", "tp")), lambda m: m.sizes == {"dp": 3, "pp": 1, "cp": 1, "tp": 5})
    with pytest.raises(NoSuchExample):  # 4 x 5 = 20 ranks > 16
        first(meshes(16, axes=("dp", "tp")), lambda m: m.sizes["dp"] == 4 and m.sizes["tp"] == 5)
    with pytest.raises(NoSuchExample):  # pp is not among the axes
        first(meshes(16, axes=("dp", "tp")), lambda m: m.sizes["pp"] > 1)
    with pytest.raises(NoSuchExample):
        first(meshes(8, min_world=3), lambda m: m.world_size < 3 or m.world_size > 8)
    with pytest.raises(ValueError, match="mesh axes"):
        meshes(8, axes=("dp", "ep"))


@settings(max_examples=60)
@given(layouts(MODEL, max_world=16))
def test_every_drawn_layout_passes_the_plans_check(layout):
    sizes = layout.mesh.sizes
    assert layout.mesh.world_size <= 16
    layout.parallelism.check(sizes["dp"], sizes["pp"], sizes["cp"], sizes["tp"])  # raises on a broken rule
    assert layout.parallelism.data.global_batch % (sizes["dp"] * layout.parallelism.data.micro_batches) == 0


@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_schedule_and_attention_can_be_drawn(schedule):
    got = first(layouts(MODEL), lambda lay: lay.parallelism.schedule is schedule and lay.mesh.sizes["pp"] > 1)
    assert got.parallelism.schedule is schedule
    for attention in ATTENTIONS:
        first(layouts(MODEL), lambda lay: lay.parallelism.attention == attention and lay.mesh.sizes["cp"] > 1)


def test_the_rules_of_a_model_bound_what_is_drawn():
    tied = ModelConfig(layers=4, hidden=8, heads=4, ffn_hidden=8, seq=6, vocab=8, tied_head=True, causal=True)
    assert first(layouts(tied), lambda lay: lay.mesh.sizes["pp"] > 1)  # (a tied head's stage keeps a copy)
    with pytest.raises(NoSuchExample):  # causal ring attention's zigzag: seq 6 is not divisible by 2 x 2
        first(layouts(tied), lambda lay: lay.parallelism.attention == "ring" and lay.mesh.sizes["cp"] == 2)
    assert first(layouts(tied), lambda lay: lay.parallelism.attention == "ring" and lay.mesh.sizes["cp"] == 3)  # 6 % 6
    with pytest.raises(NoSuchExample):  # tp must divide heads = 4
        first(layouts(tied), lambda lay: lay.mesh.sizes["tp"] == 3)
    with pytest.raises(NoSuchExample):  # ulysses splits a tp rank's heads over cp: 4 / 2 = 2 heads, not 4 cp ranks
        first(layouts(tied), lambda lay: lay.parallelism.attention == "ulysses" and lay.mesh.sizes["tp"] == 2
              and lay.mesh.sizes["cp"] == 3)
    fixed = first(layouts(tied, global_batch=6, zero=2), lambda lay: lay.mesh.sizes["dp"] == 3)
    assert fixed.parallelism.data.global_batch == 6 and fixed.parallelism.data.zero == 2
    with pytest.raises(NoSuchExample):  # dp must divide the fixed batch of 6
        first(layouts(tied, global_batch=6), lambda lay: lay.mesh.sizes["dp"] == 4)


def test_outputs_name_what_a_program_returns():
    got = outputs({"loss": [1.0, 2.0], "w": np.ones(2), "state": {"m": np.zeros(1)}, "nothing": None})
    assert list(got) == ["loss[0]", "loss[1]", "w", "state.m"]
    assert outputs(np.arange(3))["result"].tolist() == [0, 1, 2]


def test_unshard_joins_tiles_in_coordinate_order_and_reports_a_differing_replica():
    mesh = DeviceMesh(dp=2, tp=2)
    coords = [mesh.coords(r) for r in range(4)]  # rank = 2 dp + tp
    tiles = [{"w": np.array([[r]])} for r in range(4)]
    assert unshard(tiles, coords, "w", dims={"dp": 0, "tp": 1})["w"].tolist() == [[0, 1], [2, 3]]
    rows = unshard(tiles, coords, "w", dims={"tp": 1})  # dp replicas: [[0, 1]] and [[2, 3]] differ
    assert rows["w"].tolist() == [[0, 1]] and rows["w@dp1"].tolist() == [[2, 3]]
    same = [{"w": np.array([r % 2])} for r in range(4)]
    assert set(unshard(same, coords, "w", dims={"tp": 0})) == {"w"}
    assert set(replicated(same, coords)) == {"w", "w@tp1", "w@dp1,tp1"}  # ranks 1 and 3 hold 1, rank 0 holds 0
    with pytest.raises(ValueError, match="rank 0 returned no output named 'v'"):
        unshard(tiles, coords, "v")


def test_assert_bit_exact_passes_a_correct_program_and_names_the_mismatches_of_a_broken_one():
    cfg = MLPConfig(hidden=4, ffn_hidden=8, tokens=4, steps=2)
    run = assert_bit_exact(train_mlp, cfg, mesh=DeviceMesh(dp=2, tp=2), assemble=assemble)
    assert run.mesh.world_size == 4 and run.makespan_ns > 0

    swapped = wrong_coord(train_mlp, "tp", lambda c, n: n - 1 - c)  # the weights come out permuted
    with pytest.raises(AssertionError) as failure:
        assert_bit_exact(swapped, cfg, mesh=DeviceMesh(dp=2, tp=2), assemble=assemble)
    message = str(failure.value)
    assert message.startswith("not bit-exact on DeviceMesh(dp=2, pp=1, cp=1, tp=2):")
    assert "from the same program on one device" in message and "mismatch: output=w1, index=[0, 0]" in message


def test_assert_same_names_missing_outputs():
    with pytest.raises(AssertionError, match="output=b, problem=missing from the parallel run"):
        assert_same({"a": np.ones(1), "b": np.ones(1)}, {"a": np.ones(1)})
    assert_same({"a": np.float32(0.5)}, {"a": np.float32(0.5)})
    with pytest.raises(AssertionError, match="1 of 1 outputs differ"):  # -0.0 == 0.0, but not byte for byte
        assert_same({"a": np.float32(0.0)}, {"a": np.float32(-0.0)})


def test_assert_close_fast_passes_a_layout_and_fails_a_swapped_shard():
    model = ModelConfig(layers=2, hidden=8, heads=4, ffn_hidden=8, seq=4, vocab=8, tied_head=False)
    layout = Layout(DeviceMesh(dp=2, tp=2), Parallelism(data=TrainingConfig(model=model, global_batch=4, precision="bf16")))
    run = assert_close_fast(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                            reference_config=layout.one_device, bounds=layout.fast_bounds)
    assert run.mesh.world_size == 4
    with pytest.raises(AssertionError, match=r"relative error .* > bound"):
        assert_close_fast(swapped_tp, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                          reference_config=layout.one_device, bounds=layout.fast_bounds)
    with pytest.raises(AssertionError, match="no output was compared"):
        assert_close_fast(composed, layout.parallelism, mesh=layout.mesh, assemble=layout.assemble,
                          reference_config=layout.one_device, bounds=lambda name: None)
