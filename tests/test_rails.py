"""A rail-optimised fabric with an oversubscribed spine (cluster.oversubscription, topology/cluster.py):
transfers between GPUs of one local index stay on their rail; others cross the spine, whose uplinks
carry nodes x NIC / oversubscription per rail."""

import pytest

from simcluster.config.scenario import ScenarioError, build, load
from simcluster.engine import simulate
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.mesh import DeviceMesh
from simcluster.run.runner import run_all
from simcluster.topology.presets import preset

ELEMENTS = 1 << 24  # bf16: 32 MiB, bandwidth-bound


def one_send(ctx, dst):
    x = MetaTensor((ELEMENTS,), "bf16")
    if ctx.rank == 0:
        yield ctx.comm.send(x, dst=dst)
    elif ctx.rank == dst:
        yield ctx.comm.recv(src=0, like=x)


def everyone_to_everyone(ctx):
    yield ctx.comm.all_to_all(MetaTensor((16, ELEMENTS // 16), "bf16"), group=ctx.mesh.world, split_dim=0,
                              concat_dim=0)


def time_of(program, *args, over, kind):
    spec = preset("dgx-a100", nodes=2, oversubscription=over, collectives="alpha-beta")
    run = simulate(program, *args, mesh=DeviceMesh(dp=16), cluster=spec, mode="meta")
    return max(e.end - e.start for e in run.trace if e.rank == 0 and e.kind == kind), spec


def test_a_send_across_rails_runs_at_the_spines_share():
    """Rank 0 (node 0, GPU 0) to rank 8 (node 1, GPU 0): on its rail, at the NIC's rate whatever the
    spine; to rank 9 (GPU 1): through the spine, at 2 nodes x NIC / 4."""
    for over in (1.0, 4.0):
        on_rail, spec = time_of(one_send, 8, over=over, kind="send")
        assert on_rail == time_of(one_send, 8, over=1.0, kind="send")[0]
    nic, lat, nbytes = spec.nic_bytes_per_ns, spec.nic_latency_ns, 2 * ELEMENTS
    across = time_of(one_send, 9, over=4.0, kind="send")[0]
    assert across == pytest.approx(lat + nbytes / min(nic, 2 * nic / 4), rel=1e-6)
    assert time_of(one_send, 9, over=1.0, kind="send")[0] == on_rail


def test_an_all_to_all_across_two_nodes_slows_by_what_max_min_gives():
    """16 ranks on 2 nodes: each GPU sends 7 flows across rails and 1 along its rail. Non-blocking,
    its NIC's 8 flows share it: S/16 at NIC/8. Oversubscribed 4x, rail i's uplink (2 NIC / 4) carries
    14 flows (7 from each node's GPU i): NIC/28 each, the slowest; the phase ends with them."""
    flat, spec = time_of(everyone_to_everyone, over=1.0, kind="all_to_all")
    tight, _ = time_of(everyone_to_everyone, over=4.0, kind="all_to_all")
    nic, lat, per_flow = spec.nic_bytes_per_ns, spec.nic_latency_ns, 2 * ELEMENTS / 16
    assert flat == pytest.approx(lat + per_flow / (nic / 8), rel=1e-6)
    assert tight == pytest.approx(lat + per_flow / (nic / 28), rel=1e-6)


def pipeline_beside_reduction(ctx, send, reduce):
    """Each node pair's data-parallel all-reduce (ranks i and i + 8, rail i) and, beside rank 0's, a
    pipeline send from rank 0 to rank 8 over the same NIC."""
    x = MetaTensor((ELEMENTS,), "bf16")
    works = [ctx.comm.all_reduce(x, group=ctx.mesh.dp, async_op=True)] if reduce else []
    if send and ctx.rank in (0, 8):
        works.append(ctx.comm.send(x, dst=8, async_op=True) if ctx.rank == 0 else
                     ctx.comm.recv(src=0, like=x, async_op=True))
    if works:
        yield works


def test_a_pipeline_send_and_the_data_parallel_reduction_share_their_nic():
    """Issue 40: the pipeline's sends and the data-parallel reduction on the same NICs. Alone, the send of
    S bytes and the two-rank ring all-reduce of S (S/2 each way in its reduce-scatter, S/2 in its
    all-gather) each move S through rank 0's NIC: S / NIC. Together the NIC is shared (max-min: half
    each while both run): both end at 2S / NIC, neither at its own time."""
    spec = preset("dgx-a100", nodes=2, collectives="alpha-beta")

    def ends(send, reduce):
        run = simulate(pipeline_beside_reduction, send, reduce, mesh=DeviceMesh(dp=2, tp=8), cluster=spec,
                       mode="meta")
        return {e.kind: e.end for e in run.trace if e.rank == 0 and e.kind in ("send", "all_reduce")}

    nbytes, nic = 2 * ELEMENTS, spec.nic_bytes_per_ns
    alone = {**ends(True, False), **ends(False, True)}
    assert alone["send"] == pytest.approx(nbytes / nic, rel=0.01) and alone["all_reduce"] == pytest.approx(
        nbytes / nic, rel=0.01)
    both = ends(True, True)
    for kind in ("send", "all_reduce"):
        assert both[kind] == pytest.approx(2 * nbytes / nic, rel=0.01) and both[kind] > 1.9 * alone[kind]


def test_layouts_that_stay_on_their_rails_do_not_notice_the_spine():
    """DP over 2 nodes of TP 4: its all-reduces cross nodes rail by rail (one ring per local index), so
    an oversubscribed spine changes nothing; the scenario's other layouts slow down (rails.toml, at a
    size where bandwidth shows: --at-scale)."""
    outcome = run_all(load("rails", at_scale=True))
    step = {label: o.report["step_time_ns"] for label, o in outcome.variants}
    labels = list(step)
    assert step[labels[0]] == step[labels[1]]  # dp over rails: 1x and 4x
    assert step[labels[3]] > step[labels[2]]  # pipeline boundary across rails
    assert step[labels[5]] > step[labels[4]]  # Ulysses all-to-all across nodes
    assert step[labels[5]] / step[labels[4]] > 1.2  # all-to-all: mostly across rails


def test_an_oversubscribed_spine_turns_folding_off_and_a_bad_figure_is_refused():
    from simcluster.run.runner import run_scenario

    sets = ["run.numerics=meta", "cluster.nodes=2", "parallel.dp=16", "model.global_batch=16"]
    assert run_scenario(build({}, sets)).result.fold is not None
    o = run_scenario(build({}, [*sets, "cluster.oversubscription=2"]))
    assert o.result.fold is None and "spine" in o.result.unfolded_because
    with pytest.raises(ScenarioError, match="oversubscription must be at least 1"):
        run_scenario(build({}, [*sets, "cluster.oversubscription=0.5"]))
