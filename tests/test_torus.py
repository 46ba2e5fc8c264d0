"""A TPU-style torus (cluster.torus, topology/cluster.py and phases.py): links between neighbouring
chips, dimension-order routes, collectives reduced one dimension at a time, both directions of a
ring at once where the dimension wraps around, and twice the time on an open line."""

import pytest

from simcluster.config.scenario import ScenarioError, build, load
from simcluster.engine import simulate
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.comm import CommKind
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_all, run_scenario
from simcluster.topology.cluster import Cluster
from simcluster.topology.phases import phases
from simcluster.topology.presets import preset

ELEMENTS = 1 << 24  # bf16: 32 MiB in all, so bandwidth shows
S = 2 * ELEMENTS  # bytes of the whole array
W = 100.0  # TPU v5p: one link, each way, in bytes per ns (1,200 GB/s bidirectional over 6 links)
ALPHA = 1000  # ns per hop


def collective(kind):
    def program(ctx):
        group = ctx.mesh.group("tp")
        n = group.size
        if kind == "all_gather":
            yield ctx.comm.all_gather(MetaTensor((ELEMENTS // n,), "bf16"), group=group)
        else:
            yield ctx.comm.all_reduce(MetaTensor((ELEMENTS,), "bf16"), group=group)
    return program


def time_of(kind, torus, mesh):
    spec = preset("tpu-v5p", nodes=mesh.world_size // 4, torus=torus)
    run = simulate(collective(kind), mesh=mesh, cluster=spec, mode="meta")
    return max(e.end - e.start for e in run.trace if e.rank == 0 and e.kind == kind)


def ns(expected, phases=1):
    """What the engine gives for `expected` ns in `phases` phases: each phase ends on the first whole
    ns by which it is done."""
    return pytest.approx(expected + phases / 2, abs=phases / 2)


def test_the_v5p_link_figures():
    spec = preset("tpu-v5p", nodes=16, torus="4x4x4")
    assert spec.ici_gbyte_per_s * 2 * 6 == 1200  # bidirectional, per chip, over six links
    assert (spec.peak_tflops, spec.hbm_gbyte_per_s, spec.memory_gbyte) == (459.0, 2765.0, 95.0)


def test_routes_go_x_then_y_then_z_and_the_short_way_round_only_where_the_links_wrap():
    torus = Cluster(preset("tpu-v5p", nodes=16, torus="4x4x4"))
    assert torus.coords(0 + 1 + 2 * 4 + 3 * 16) == (1, 2, 3)
    assert torus.rank_at((1, 2, 3)) == 57
    links, latency = torus.route(0, 3)  # x: 0 -> 3 is one hop back over the wrap-around link
    assert [torus.link_name(link) for link in links] == ["rank0:ici-x-"] and latency == ALPHA
    links, latency = torus.route(0, 57)  # x +1, y +2 (a tie: the + way), z -1 (3 is one hop back from 0)
    assert [torus.link_name(link) for link in links] == [
        "rank0:ici-x+", "rank1:ici-y+", "rank5:ici-y+", "rank9:ici-z-"] and latency == 4 * ALPHA
    mesh = Cluster(preset("tpu-v5p", nodes=16, torus="2x4x8"))  # a dimension under 4: no wrap-around anywhere
    links, _ = mesh.route(0, 6)  # y from 0 to 3: three hops forward, none back around
    assert [mesh.link_name(link) for link in links] == ["rank0:ici-y+", "rank2:ici-y+", "rank4:ici-y+"]


def test_an_all_gather_along_a_wrapped_dimension_takes_its_closed_form():
    """4 chips along x of a 4x4x4 torus: a ring each way with half the bytes each, a chip's two x
    links busy at once: (n-1) (alpha + S / (2 n W))."""
    n = 4
    got = time_of("all_gather", "4x4x4", DeviceMesh(dp=16, tp=n))
    assert got == ns((n - 1) * (ALPHA + S / (2 * n * W)))


def test_an_open_line_takes_twice_the_links_time_of_a_wrapped_one():
    """8 chips along x: wrapped (8x4x4) as above; open (8x2x4, a slice with a dimension under 4) the
    end links carry every shard but one: (n-1) alpha + (n-1) S / (n W)."""
    n = 8
    wrapped = time_of("all_gather", "8x4x4", DeviceMesh(dp=16, tp=n))
    open_ = time_of("all_gather", "8x2x4", DeviceMesh(dp=8, tp=n))
    assert wrapped == ns((n - 1) * (ALPHA + S / (2 * n * W)))
    assert open_ == ns((n - 1) * ALPHA + (n - 1) * S / (n * W))
    assert (open_ - (n - 1) * ALPHA) / (wrapped - (n - 1) * ALPHA) == pytest.approx(2, rel=1e-5)


def test_an_all_reduce_over_a_plane_reduces_along_x_then_y_and_gathers_back():
    """The 4x4 x-y plane of a 4x4x4 torus: reduce_scatter along x (S bytes), along y (S/4), then
    all_gather along y and x: each phase 3 alpha + (3/4) D / 2W on its D bytes."""
    n = 4
    phase = [(n - 1) * ALPHA + (n - 1) / n * d / (2 * W) for d in (S, S / n)]
    got = time_of("all_reduce", "4x4x4", DeviceMesh(dp=4, tp=n * n))
    assert got == ns(2 * sum(phase), phases=4)
    # the same 16 chips as one ring (NVSwitch-style, no dimensions): 2 (n-1) steps over 16 members
    assert got < 2 * 15 * (ALPHA + S / (16 * W))


def test_a_torus_is_checked_and_turns_folding_off():
    sets = ["cluster.preset=tpu-v5p", "cluster.gpus_per_node=4", "cluster.nodes=4", "parallel.dp=16",
            "model.global_batch=16", "run.numerics=meta"]
    o = run_scenario(build({}, [*sets, "cluster.torus=4x2x2"]))
    assert o.result.fold is None and "torus" in o.result.unfolded_because
    assert o.report["cluster"]["torus"] == "4x2x2" and o.report["cluster"]["torus_wraps"] is False  # a 2 in it
    with pytest.raises(ScenarioError, match="has 8 chips but cluster.nodes x cluster.gpus_per_node = 4 x 4 = 16"):
        run_scenario(build({}, [*sets, "cluster.torus=2x2x2"]))
    with pytest.raises(ScenarioError, match="is not a torus shape"):
        run_scenario(build({}, [*sets, "cluster.torus=4x4x1x1"]))
    with pytest.raises(ScenarioError, match="no NIC or NVLink port"):
        run_scenario(build({}, [*sets, "cluster.torus=4x2x2", "faults.degraded_rank=1"]))


def test_fsdp_on_the_open_slice_is_slower_than_on_the_cube():
    """torus.toml at scale (its bit-exact runs are test_scenarios' golden test): FSDP over 64 chips
    gathers along x, y and z; on the open 2x4x8 slice every line is open, its links carry twice as
    much, and x has 2 chips, z 8: slower, though by less than 2x (compute does not change)."""
    outcome = run_all(load("torus", at_scale=True))
    cube, open_, _ = (o.report for _, o in outcome.variants)
    assert cube["cluster"]["torus"] == "4x4x4" and open_["cluster"]["torus"] == "2x4x8"
    assert cube["cluster"]["torus_wraps"] and not open_["cluster"]["torus_wraps"]
    assert cube["step_time_ns"] < open_["step_time_ns"] < 2 * cube["step_time_ns"]


def test_a_group_that_is_not_a_grid_rings_in_rank_order_over_routed_hops():
    """Chips (0,0,0) and (1,1,0): not every combination of their coordinates, so no dimension-wise
    plan; one ring of two, each transfer two hops (x, then y)."""
    torus = Cluster(preset("tpu-v5p", nodes=16, torus="4x4x4"))
    (phase,) = phases(CommKind.ALL_REDUCE, (5, 0), S, torus)
    assert phase.steps == 2 and phase.flows == ((0, 5, S), (5, 0, S))
    assert len(torus.route(0, 5)[0]) == len(torus.route(5, 0)[0]) == 2
    assert [len(p.flows) for p in phases(CommKind.ALL_REDUCE, (0, 1, 4, 5), S, torus)] == [4, 4, 4, 4]  # a 2x2 grid
