"""Simulated times equal the closed forms; links are shared; streams overlap; kernels are costed."""

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.engine import simulate
from simcluster.numerics.tensor import MetaTensor
from simcluster.program.mesh import DeviceMesh
from simcluster.topology.presets import preset

def a100(**kw):
    """A DGX A100 cluster whose collectives take the textbook forms (NCCL's protocols: test_nccl_protocols.py)."""
    return preset("dgx-a100", **({"collectives": "alpha-beta"} | kw))


A100 = a100()
ALPHA_NVL, ALPHA_IB = A100.nvlink_latency_ns, A100.nic_latency_ns
B_NVL, B_IB = A100.nvlink_bytes_per_ns, A100.nic_bytes_per_ns  # as NCCL gets them


def lone(kind, n, nbytes, *, nodes=1, per_node=None, cluster_kw=None, **kw):
    """Time of one collective over all n ranks (fp32 meta tensor of nbytes per rank)."""
    per_node = per_node or n // nodes
    spec = a100(nodes=nodes, gpus_per_node=per_node, **(cluster_kw or {}))

    def prog(ctx):
        x = MetaTensor((nbytes // 4,), "fp32")
        g = ctx.mesh.world
        extra = {"broadcast": {"src": 0}, "reduce": {"dst": 0}}.get(kind, {})
        yield getattr(ctx.comm, kind)(x, group=g, **extra, **kw)

    run = simulate(prog, mesh=DeviceMesh(dp=n), cluster=spec, mode="meta")
    spans = {(e.start, e.end) for e in run.trace}
    assert len(spans) == 1, "every member of a collective starts and ends together"
    (start, end), = spans
    return end - start


@given(st.integers(2, 8), st.integers(1, 2**22).map(lambda k: 4 * k * 8 * 105))
def test_ring_all_reduce_matches_closed_form(n, nbytes):
    want = 2 * (n - 1) * ALPHA_NVL + 2 * (n - 1) * nbytes / (n * B_NVL)
    assert abs(lone("all_reduce", n, nbytes) - want) <= 1


@pytest.mark.parametrize("n", [2, 3, 5, 8])
def test_ring_reduce_scatter_all_gather_all_to_all_broadcast_closed_forms(n):
    S = 4 * 840 * 1000  # divisible by every n here
    assert abs(lone("reduce_scatter", n, S) - ((n - 1) * ALPHA_NVL + (n - 1) * S / (n * B_NVL))) <= 1
    # all_gather's S is the gathered size: n inputs of S/n
    assert abs(lone("all_gather", n, S // n) - ((n - 1) * ALPHA_NVL + (n - 1) * S / (n * B_NVL))) <= 1
    assert abs(lone("all_to_all", n, S) - (ALPHA_NVL + (n - 1) * S / (n * B_NVL))) <= 1
    assert abs(lone("broadcast", n, S) - ((n - 1) * ALPHA_NVL + S / B_NVL)) <= 1


@pytest.mark.parametrize("kind,factor", [("all_reduce", lambda n: 2 * (n - 1) / n),
                                         ("reduce_scatter", lambda n: (n - 1) / n),
                                         ("all_gather", lambda n: (n - 1) / n),
                                         ("all_to_all", lambda n: (n - 1) / n)])
@pytest.mark.parametrize("n", [2, 4, 6, 8])
def test_bus_bandwidth_convention_of_nccl_tests(kind, factor, n):
    """With latency zero, busbw = algbw * factor equals the link bandwidth."""
    S = 4 * 2**20 * 3 * 5 * 7
    per_rank = S // n if kind == "all_gather" else S  # all_gather: S is the output size
    t = lone(kind, n, per_rank, cluster_kw={"nvlink_latency_ns": 0})
    # busbw = algbw * factor = B, i.e. t = S * factor / B, up to the whole-ns rounding of t
    assert abs(t - S * factor(n) / B_NVL) <= 1
    assert S / t * factor(n) == pytest.approx(B_NVL, rel=1e-5)


def test_cross_node_pair_is_slower_by_the_link_ratio():
    S = 64 * 2**20
    inside = lone("all_reduce", 2, S)  # one node of two
    across = lone("all_reduce", 2, S, nodes=2, per_node=1)  # two nodes of one
    assert inside == 2 * ALPHA_NVL + math.ceil(S / B_NVL)
    assert across == 2 * ALPHA_IB + math.ceil(S / B_IB)
    assert (across - 2 * ALPHA_IB) / (inside - 2 * ALPHA_NVL) == pytest.approx(B_NVL / B_IB, rel=1e-5)


def test_group_spanning_nodes_is_hierarchical():
    S, k, m = 4 * 2**22 * 3, 4, 2
    t = lone("all_reduce", k * m, S, nodes=m, per_node=k)
    want = (2 * ((k - 1) * ALPHA_NVL + (k - 1) * S / (k * B_NVL))
            + 2 * (m - 1) * ALPHA_IB + 2 * (m - 1) * (S / k) / (m * B_IB))
    assert abs(t - want) <= 3  # three phases, each rounded up to a whole ns


def test_concurrent_transfers_share_a_link():
    S = 30 * 2**20

    def prog(ctx, two):
        x = MetaTensor((S // 4,), "fp32")
        if ctx.rank == 0:
            works = [ctx.comm.send(x, dst=1, async_op=True)]
            if two:
                works.append(ctx.comm.send(x, dst=2, async_op=True))  # leaves by the same NVLink port
            yield works
        elif ctx.rank == 1 or two:
            yield ctx.comm.recv(src=0, like=x)
        else:
            return None

    spec = a100(gpus_per_node=3)
    one = simulate(prog, False, mesh=DeviceMesh(dp=3), cluster=spec, mode="meta").trace.end
    two = simulate(prog, True, mesh=DeviceMesh(dp=3), cluster=spec, mode="meta").trace.end
    assert one == ALPHA_NVL + math.ceil(S / B_NVL)
    assert abs(two - (ALPHA_NVL + 2 * S / B_NVL)) <= 1


def test_a_transfer_starting_mid_flight_halves_the_rate_of_the_one_running():
    """Flow 1 (0 -> 1) runs alone from alpha; flow 2 (0 -> 2, the same NVLink port out) starts at
    T + alpha, after a kernel of length T. Max-min: both at B/2 until flow 1 is done, then flow 2
    alone, so flow 1 ends at alpha + 2S/B - T and flow 2 at alpha + 2S/B."""
    S = 30 * 2**20

    def prog(ctx):
        x = MetaTensor((S // 4,), "fp32")
        if ctx.rank == 0:
            first = ctx.comm.send(x, dst=1, async_op=True)
            ctx.ops.kernel("k", flops=0.0, nbytes=5e7)
            second = ctx.comm.send(x, dst=2, async_op=True)
            yield [first, second]
        else:
            yield ctx.comm.recv(src=0, like=x)

    trace = simulate(prog, mesh=DeviceMesh(dp=3), cluster=a100(gpus_per_node=3), mode="meta").trace
    (kernel,) = [e for e in trace if e.kind == "compute"]
    sends = {e.group: e for e in trace if e.kind == "send"}
    T = kernel.end
    assert 0 < T < S / B_NVL, "the second flow must start while the first is running"
    assert abs(sends["p2p[0->1]"].end - (ALPHA_NVL + 2 * S / B_NVL - T)) <= 2
    assert abs(sends["p2p[0->2]"].end - (ALPHA_NVL + 2 * S / B_NVL)) <= 2
    assert sends["p2p[0->2]"].start == T


def test_kernel_time_is_the_roofline_plus_overhead():
    spec = a100(gpus_per_node=1)

    def prog(ctx):
        ctx.ops.kernel("big", flops=1e12, nbytes=1e6)  # compute bound
        ctx.ops.kernel("wide", flops=1e6, nbytes=1e10)  # memory bound
        return None

    events = simulate(prog, mesh=DeviceMesh(), cluster=spec, mode="meta", cost_dtype="bf16").trace.events
    peak = spec.peak_tflops * 1e3 * spec.compute_efficiency
    hbm = spec.hbm_gbyte_per_s * spec.memory_efficiency
    assert events[0].duration == math.ceil(1e12 / peak) + spec.kernel_overhead_ns
    assert events[1].duration == math.ceil(1e10 / hbm) + spec.kernel_overhead_ns
    assert events[1].start == events[0].end  # a stream runs in order


def test_async_communication_overlaps_compute_and_sync_does_not():
    S = 64 * 2**20

    def prog(ctx, async_op):
        x = MetaTensor((S // 4,), "fp32")
        h = ctx.comm.all_reduce(x, group=ctx.mesh.world, async_op=True)
        if not async_op:
            yield h
        ctx.ops.kernel("work", flops=5e11, nbytes=0)
        if async_op:
            yield h

    spec = a100(gpus_per_node=2)
    over = simulate(prog, True, mesh=DeviceMesh(dp=2), cluster=spec, mode="meta").trace
    serial = simulate(prog, False, mesh=DeviceMesh(dp=2), cluster=spec, mode="meta").trace
    comm = next(e for e in over if e.kind == "all_reduce")
    work = next(e for e in over if e.name == "work")
    assert comm.start < work.end and work.start < comm.end  # they run at the same time
    assert over.end == max(comm.end, work.end)
    assert serial.end == comm.duration + work.duration


def test_a_stream_waits_for_the_data_it_uses():
    def prog(ctx):
        x = MetaTensor((1024,), "fp32")
        ctx.ops.kernel("produce", flops=1e11, nbytes=0)
        got = yield ctx.comm.all_reduce(x, group=ctx.mesh.world)  # after produce, before consume
        ctx.ops.kernel("consume", flops=1e9, nbytes=0)
        return got

    trace = simulate(prog, mesh=DeviceMesh(dp=2), cluster=a100(gpus_per_node=2), mode="meta").trace
    for r in range(2):
        produce, consume = trace.lane(r, "compute")
        (ar,) = trace.lane(r, "comm:world")
        assert produce.end <= ar.start and ar.end <= consume.start


def _claims(monkeypatch, allow):
    """Count the calls the replay ends at once, and its attempts; with allow=False it ends none."""
    from simcluster.engine import timing
    seen = {"claimed": 0, "attempts": 0}
    claim, attempt = timing.Replay._claim, timing.Replay._attempt

    def counting_claim(self, call, links, alone):
        ok = allow and claim(self, call, links, alone)
        seen["claimed"] += ok
        return ok

    def counting_attempt(self, streams):
        seen["attempts"] += 1
        return attempt(self, streams)
    monkeypatch.setattr(timing.Replay, "_claim", counting_claim)
    monkeypatch.setattr(timing.Replay, "_attempt", counting_attempt)
    return seen


@pytest.mark.parametrize("crowd", [None, "world", "running", 0, 2e6, 2e7])
def test_a_call_on_links_of_its_own_ends_at_the_networks_time_and_company_sends_it_back(monkeypatch, crowd):
    """Each pair of ranks all-reduces over the pair, call after call, kernels between. Meanwhile, on
    another stream: nothing, an all-reduce over the node, or a message from rank 0 to rank 1 after a
    kernel moving `crowd` bytes: over the NVLink ports the pair's calls use, before them, among them
    or after they started. A call that finds its links idle ends at once, without moving flows
    through the network; company on its links, found when it starts or when a flow starts on them
    while it holds them, sends the replay back to the start to run in full. Either way the trace is
    the one the network alone gives, byte for byte."""
    S = 8 * 2**20

    def prog(ctx):
        x = MetaTensor((S // 4,), "fp32")
        works = []
        with ctx.stream("bulk"):
            if crowd == "world":
                works.append(ctx.comm.all_reduce(MetaTensor((8 * S,), "fp32"), group=ctx.mesh.world, async_op=True))
            elif crowd is not None and ctx.rank < 2:
                if crowd != "running":
                    ctx.ops.kernel("wait", flops=0.0, nbytes=crowd)
                big = MetaTensor((2 * S,), "fp32")
                works.append(ctx.comm.send(big, dst=1, async_op=True) if ctx.rank == 0
                             else ctx.comm.recv(src=0, like=big, async_op=True))
        if crowd == "running":  # first a short message from the other pair, which ends while the long one runs
            tiny, other = MetaTensor((1024,), "fp32"), (ctx.rank + 2) % 4
            yield ctx.comm.send(tiny, dst=other) if ctx.rank >= 2 else ctx.comm.recv(src=other, like=tiny)
        for _ in range(3):
            ctx.ops.kernel("k", flops=0.0, nbytes=1e6)
            yield ctx.comm.all_reduce(x, group=ctx.mesh.group("tp"))
        if works:
            yield works

    spec = a100(gpus_per_node=4)
    runs = {}
    for allow in (True, False):
        seen = _claims(monkeypatch, allow)
        trace = simulate(prog, mesh=DeviceMesh(dp=2, tp=2), cluster=spec, mode="meta").trace
        runs[allow] = (trace.to_jsonl(), trace.memory, dict(seen))
        monkeypatch.undo()
    assert runs[True][:2] == runs[False][:2]
    assert runs[False][2] == {"claimed": 0, "attempts": 1}
    fast = runs[True][2]
    assert fast["attempts"] == (1 if crowd in (None, "running") else 2), fast
    if crowd is None:
        assert fast["claimed"] == 6  # every call of both pairs
    if crowd == "running":
        assert fast["claimed"] == 3  # the other pair's: ranks 0 and 1 found the long message on their links
    pairs = [e for e in map(json.loads, runs[True][0].splitlines()) if e[1] == "comm:tp"]
    assert len(pairs) == 4 * 3  # each pair's three calls on each of its ranks


def uneven_time(sends, row_bytes=4 * 1024):
    """Time of one all_to_all_rows on one node, rank r sending sends[r][j] rows of row_bytes to rank j."""
    n = len(sends)

    def prog(ctx):
        mine = sends[ctx.rank]
        x = MetaTensor((sum(mine), row_bytes // 4), "fp32")
        yield ctx.comm.all_to_all_rows(x, group=ctx.mesh.world, send_rows=mine,
                                       recv_rows=[sends[q][ctx.rank] for q in range(n)])

    run = simulate(prog, mesh=DeviceMesh(dp=n), cluster=a100(gpus_per_node=n), mode="meta")
    return max(e.end for e in run.trace) - min(e.start for e in run.trace)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_an_uneven_all_to_all_takes_what_its_busiest_port_moves(n):
    """Evenly split it is the even all_to_all; when one rank alone sends, R rows to each peer, its port
    carries them all; a rank's rows to itself cross no link."""
    R, row = 64, 4 * 1024
    even = [[R] * n for _ in range(n)]
    assert uneven_time(even, row) == lone("all_to_all", n, n * R * row)
    one = [[R] * n] + [[0] * n for _ in range(n - 1)]
    assert abs(uneven_time(one, row) - (ALPHA_NVL + (n - 1) * R * row / B_NVL)) <= 1
    to_self = [[R if j == i else 0 for j in range(n)] for i in range(n)]
    assert uneven_time(to_self, row) == 0
