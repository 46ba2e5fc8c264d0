"""Mismatches and deadlocks stop the run with a message naming ranks, operations and groups."""

import numpy as np
import pytest

from simcluster.engine import CollectiveMismatchError, DeadlockError, ProgramError, simulate
from simcluster.program.mesh import DeviceMesh

X = np.zeros((4, 2), np.float32)


def run(prog, world=2):
    return simulate(prog, mesh=DeviceMesh(dp=world))


def test_different_collectives_on_one_group():
    def prog(ctx):
        if ctx.rank == 0:
            yield ctx.comm.all_reduce(X, group=ctx.mesh.dp)
        else:
            yield ctx.comm.all_gather(X, group=ctx.mesh.dp)

    with pytest.raises(CollectiveMismatchError) as e:
        run(prog)
    msg = str(e.value)
    assert "group dp[0, 1], call #0" in msg
    assert "rank 0 issued all_reduce(sum) of fp32(4, 2)" in msg
    assert "rank 1 issued all_gather() of fp32(4, 2)" in msg


def test_same_collective_different_shapes():
    def prog(ctx):
        yield ctx.comm.all_reduce(np.zeros((ctx.rank + 1,), np.float32), group=ctx.mesh.dp)

    with pytest.raises(CollectiveMismatchError, match=r"rank 1 issued all_reduce\(sum\) of fp32\(2,\)"):
        run(prog)


def test_recv_with_no_matching_send():
    def prog(ctx):
        if ctx.rank == 1:
            yield ctx.comm.recv(src=0, like=X)

    with pytest.raises(DeadlockError) as e:
        run(prog)
    msg = str(e.value)
    assert "rank 1 waits in recv of fp32(4, 2) from rank 0 (message #0 on p2p[0->1])" in msg
    assert "rank 0 has not issued it: rank 0 is finished" in msg


def test_a_rank_that_ends_while_others_wait():
    def prog(ctx):
        if ctx.rank != 2:
            yield ctx.comm.all_reduce(X, group=ctx.mesh.dp)

    with pytest.raises(DeadlockError) as e:
        run(prog, world=3)
    msg = str(e.value)
    assert "rank 0 waits in all_reduce(sum) of fp32(4, 2) on group dp[0, 1, 2]" in msg
    assert "rank 2 has not issued it: rank 2 is finished" in msg


def test_cycle_of_synchronous_sends():
    def prog(ctx):
        yield ctx.comm.send(X, dst=1 - ctx.rank)  # both send first: each waits for the other's recv
        yield ctx.comm.recv(src=1 - ctx.rank, like=X)

    with pytest.raises(DeadlockError) as e:
        run(prog)
    msg = str(e.value)
    assert "rank 0 waits in send of fp32(4, 2) to rank 1" in msg
    assert "rank 1 is waiting in send of fp32(4, 2) to rank 0" in msg


def test_collectives_in_different_orders_on_two_groups():
    def prog(ctx):
        a, b = ctx.mesh.world, ctx.mesh.tp  # the same two ranks, two communicators
        first, second = (a, b) if ctx.rank == 0 else (b, a)
        yield ctx.comm.all_reduce(X, group=first)
        yield ctx.comm.all_reduce(X, group=second)

    with pytest.raises(DeadlockError) as e:
        simulate(prog, mesh=DeviceMesh(tp=2))
    msg = str(e.value)
    assert "rank 0 waits in all_reduce(sum) of fp32(4, 2) on group world[0, 1]" in msg
    assert "rank 1 is waiting in all_reduce(sum) of fp32(4, 2) on group tp[0, 1]" in msg


def test_async_call_issued_by_one_rank_only():
    def prog(ctx):
        if ctx.rank == 0:
            ctx.comm.all_reduce(X, group=ctx.mesh.dp, async_op=True)
        return None
        yield

    with pytest.raises(DeadlockError, match=r"rank 0 issued all_reduce\(sum\) of fp32\(4, 2\) on group dp\[0, 1\].*"
                                            r"rank\(s\) 1 finished without issuing it"):
        run(prog)


def test_send_and_recv_shapes_must_agree():
    def prog(ctx):
        if ctx.rank == 0:
            yield ctx.comm.send(X, dst=1)
        else:
            yield ctx.comm.recv(src=0, like=np.zeros((3,), np.float32))

    with pytest.raises(CollectiveMismatchError, match=r"rank 0 sends fp32\(4, 2\) but rank 1 expects fp32\(3,\)"):
        run(prog)


def test_sync_request_that_is_not_yielded():
    def prog(ctx):
        ctx.comm.all_reduce(X, group=ctx.mesh.dp)
        yield ctx.comm.all_gather(X, group=ctx.mesh.dp)

    with pytest.raises(ProgramError, match="synchronous request that was never yielded"):
        run(prog)


def test_async_work_never_waited():
    def prog(ctx):
        ctx.comm.all_reduce(X, group=ctx.mesh.dp, async_op=True)
        return None
        yield

    with pytest.raises(ProgramError, match="finished without waiting for all_reduce"):
        run(prog)


def test_bad_arguments_are_reported_with_the_rank():
    def prog(ctx):
        yield ctx.comm.reduce_scatter(np.zeros((3, 2), np.float32), group=ctx.mesh.dp)

    with pytest.raises(ProgramError, match="rank 0: ValueError: reduce_scatter: dim 0 of fp32\\(3, 2\\) has size 3, "
                                           "not divisible by the group size 2"):
        run(prog)


def test_group_the_rank_is_not_in():
    def prog(ctx):
        other = ctx.mesh.mesh.group(1 - ctx.rank, "tp")
        yield ctx.comm.all_reduce(X, group=other)

    with pytest.raises(ProgramError, match=r"rank 0 is not a member of group tp\[1\]"):
        simulate(prog, mesh=DeviceMesh(dp=2))


def test_mesh_and_cluster_must_agree():
    from simcluster.topology.presets import preset

    with pytest.raises(ValueError, match="the mesh has 4 ranks .* but the cluster has 8 GPUs"):
        simulate(lambda ctx: None, mesh=DeviceMesh(dp=4), cluster=preset("dgx-a100"))


def _tagged(order, side_stream=None):
    """Rank 0 sends tag 1 (on `side_stream` if given) then tag 2; rank 1 receives in `order`."""
    def program(ctx):
        if ctx.rank == 0:
            one = ctx.comm.send(np.ones(4, np.float32), dst=1, tag=1, async_op=True, stream=side_stream)
            two = ctx.comm.send(np.full(4, 2, np.float32), dst=1, tag=2, async_op=True)
            yield [one, two]
            return None
        works = {t: ctx.comm.recv(src=0, like=np.zeros(4, np.float32), tag=t, async_op=True) for t in order}
        got = yield [works[t] for t in order]
        return dict(zip(order, got))
    return program


def test_tagged_messages_received_out_of_order_are_refused_by_both_passes():
    """The data pass would match them by tag (as gloo does); each stream runs in order, so the timed
    replay (and NCCL, which ignores tags) could not: both passes now refuse it, naming the order."""
    with pytest.raises(DeadlockError, match="out of order.*tag 1.*before.*tag 2.*the other way round"):
        simulate(_tagged([2, 1]), mesh=DeviceMesh(dp=2))
    run = simulate(_tagged([1, 2]), mesh=DeviceMesh(dp=2))  # the same order on both sides
    assert run.results[1][1].tolist() == [1] * 4 and run.results[1][2].tolist() == [2] * 4


def test_tagged_messages_on_separate_streams_may_be_received_in_any_order():
    run = simulate(_tagged([2, 1], side_stream="side"), mesh=DeviceMesh(dp=2))
    assert run.results[1][1].tolist() == [1] * 4 and run.results[1][2].tolist() == [2] * 4
    sends = {e.stream: e for e in run.trace.events if e.rank == 0 and e.kind == "send"}
    assert set(sends) == {"side", "send->1"}
