"""The TP x DP MLP is bit-exact against one device, deterministic, and a broken variant is caught."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from simcluster import report
from simcluster.engine import simulate
from simcluster.parallel.tp_dp_mlp import MLPConfig, assemble, train_mlp
from simcluster.program.mesh import DeviceMesh
from simcluster.testing import assert_bit_exact, meshes
from simcluster.topology.presets import preset

from broken import wrong_coord


def full_run(program, cfg, dp, tp):
    mesh = DeviceMesh(dp=dp, tp=tp)
    run = simulate(program, cfg, mesh=mesh, cluster=preset("dgx-a100", gpus_per_node=dp * tp))
    return assemble(run.results, [mesh.coords(r) for r in range(mesh.world_size)]), run


def reference(cfg):
    return full_run(train_mlp, cfg, 1, 1)[0]


@given(mesh=meshes(max_world=12, axes=("dp", "tp")), seed=st.integers(0, 99), steps=st.integers(1, 3),
       hidden=st.sampled_from([4, 8]))
def test_bit_exact_against_one_device(mesh, seed, steps, hidden):
    dp, tp = mesh.sizes["dp"], mesh.sizes["tp"]
    cfg = MLPConfig(hidden=hidden, ffn_hidden=2 * tp, tokens=dp * 2, steps=steps, seed=seed)
    run = assert_bit_exact(train_mlp, cfg, mesh=mesh, assemble=assemble)  # (simcluster.testing)
    got = assemble(run.results, [mesh.coords(r) for r in range(mesh.world_size)])
    assert set(got) == {f"loss[{i}]" for i in range(steps)} | {"y", "w1", "w2", "dw1", "dw2"}


def broken(axis, wrong):
    return wrong_coord(train_mlp, axis, wrong)


def test_swapped_tensor_parallel_shards_are_caught():
    cfg = MLPConfig(hidden=4, ffn_hidden=8, tokens=4, steps=2)
    got, _ = full_run(broken("tp", lambda c, n: n - 1 - c), cfg, 2, 2)
    verdict = report.verification("exact", reference(cfg), got)
    assert not verdict["bit_exact"]
    assert {m["output"] for m in verdict["mismatches"]} >= {"w1"}


def test_every_replica_reading_the_first_data_shard_is_caught():
    cfg = MLPConfig(hidden=4, ffn_hidden=8, tokens=4, steps=2)
    got, _ = full_run(broken("dp", lambda c, n: 0), cfg, 2, 1)
    verdict = report.verification("exact", reference(cfg), got)
    assert not verdict["bit_exact"]
    assert verdict["mismatches"][0]["output"] == "loss[0]"


def test_swapped_data_shards_change_only_the_per_token_output():
    """Exact sums do not depend on order: a permuted batch gives the same loss and weights, bit for bit."""
    cfg = MLPConfig(hidden=4, ffn_hidden=8, tokens=4, steps=2)
    got, _ = full_run(broken("dp", lambda c, n: n - 1 - c), cfg, 2, 1)
    verdict = report.verification("exact", reference(cfg), got)
    assert [m["output"] for m in verdict["mismatches"]] == ["y"]


def test_same_program_twice_gives_identical_traces_and_results():
    cfg = MLPConfig(hidden=8, ffn_hidden=12, tokens=6, steps=2)
    (a, run_a), (b, run_b) = full_run(train_mlp, cfg, 3, 2), full_run(train_mlp, cfg, 3, 2)
    assert run_a.trace.to_jsonl() == run_b.trace.to_jsonl()
    assert all(np.asarray(a[k]).tobytes() == np.asarray(b[k]).tobytes() for k in a)
    assert len(run_a.trace) > 0


def test_every_rank_finishes_and_time_respects_the_compute_bound():
    cfg = MLPConfig(hidden=8, ffn_hidden=12, tokens=6, steps=2)
    _, run = full_run(train_mlp, cfg, 3, 2)
    assert all(r is not None for r in run.results)
    for r in range(6):
        compute = sum(e.duration for e in run.trace.lane(r, "compute"))
        assert run.trace.end >= compute  # a stream cannot be busier than the step is long
