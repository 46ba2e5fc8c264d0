"""Collectives timed as NCCL's cost model times them (topology/nccl.py): each call goes by the protocol
(LL, LL128, Simple) that is fastest for its size, paying that protocol's latencies and getting its share
of the links' rate. The expected times below are written from NVIDIA/nccl src/graph/tuning.cc's
tables (ring algorithm), not from our module."""

import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.config.scenario import ScenarioError, load
from test_timing import B_IB, B_NVL, lone

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from collective_busbw import busbw as all_reduce_busbw  # noqa: E402

# tuning.cc (2.19/2.20): base latency, a ring step's over NVLink and over the network, in us
BASE = {"LL": 6.6, "LL128": 14.0, "Simple": 8.4}
NVLINK_STEP = {"LL": 0.6, "LL128": 1.9, "Simple": 3.4}
NET_STEP = {"LL": 2.7, "LL128": 4.0, "Simple": 14.0}


def ncclS(n, S, *, share, latency_us):
    """(time in ns, protocol) NCCL's model gives a ring all-reduce of S bytes over n ranks inside a node,
    the fastest of the three; `share` and `latency_us` by protocol."""
    return min((latency_us[p] * 1000 + 2 * (n - 1) / n * S / (B_NVL * share[p]), p) for p in BASE)


def in_a_node(n, S):
    return ncclS(n, S, share={"LL": 1 / 4, "LL128": 0.92, "Simple": 1.0},
                 latency_us={p: BASE[p] + 2 * (n - 1) * NVLINK_STEP[p] for p in BASE})


def nccl_lone(kind, n, nbytes, **kw):
    return lone(kind, n, nbytes, cluster_kw={"collectives": "nccl"} | kw.pop("cluster_kw", {}), **kw)


@pytest.mark.parametrize("nbytes,protocol", [(1024, "LL"), (4 * 2**20, "LL128"), (256 * 2**20, "Simple")])
def test_a_small_medium_and_large_all_reduce_each_go_by_their_protocol(nbytes, protocol):
    """8 A100s: 1 KiB by LL (15 us of latency, a quarter of the rate), 4 MiB by LL128, 256 MiB by
    Simple (56 us of latency, the whole rate)."""
    want, chosen = in_a_node(8, nbytes)
    assert chosen == protocol
    assert abs(nccl_lone("all_reduce", 8, nbytes) - want) <= 1


@given(st.integers(2, 8), st.integers(1, 2**20).map(lambda k: 4 * 105 * k))
def test_every_all_reduce_in_a_node_takes_the_fastest_protocols_time(n, nbytes):
    want, _ = in_a_node(n, nbytes)
    got = nccl_lone("all_reduce", n, nbytes)
    assert abs(got - want) <= 1
    assert got > 2 * (n - 1) / n * nbytes / B_NVL  # never faster than its bytes at the links' full rate


@pytest.mark.parametrize("nbytes,protocol", [(512 * 2**10, "LL128"), (64 * 2**20, "Simple")])
def test_two_nodes_of_one_gpu_pay_network_steps_and_the_ring_plateau(nbytes, protocol):
    """A ring of two across nodes: two network steps; Simple's latency times 1.4 (a multi-node
    all-reduce); LL128 gets 70 % with one GPU a node (512 KiB goes by it all the same)."""
    want, chosen = min(((1.4 if p == "Simple" else 1.0) * (BASE[p] + 2 * NET_STEP[p]) * 1000
                        + nbytes / (B_IB * {"LL": 1 / 4, "LL128": 0.7, "Simple": 1.0}[p]), p) for p in BASE)
    assert chosen == protocol
    assert abs(nccl_lone("all_reduce", 2, nbytes, nodes=2, per_node=1) - want) <= 1


def test_a_group_across_nodes_pays_nvlink_steps_inside_and_network_steps_between():
    """Two nodes of four: the latencies of a reduce-scatter of 3 NVLink steps, a ring of 2 network steps,
    an all-gather of 3 NVLink steps (phases.py); the bytes as NCCL's four rings move them, all at once:
    of the 2(n-1)/n S a member sends, a quarter (its NIC's channel) over its NIC, the rest over NVLink,
    here NIC-bound. Large: Simple."""
    S, k, m = 4 * 2**22 * 3, 4, 2
    n = k * m
    latency = 1.4 * (BASE["Simple"] + 2 * (k - 1) * NVLINK_STEP["Simple"] + 2 * (m - 1) * NET_STEP["Simple"])
    sent = 2 * (n - 1) / n * S
    moving = max(sent * (k - 1) / k / B_NVL, sent / k / B_IB)
    assert moving == sent / k / B_IB
    assert abs(nccl_lone("all_reduce", n, S, nodes=m, per_node=k) - (latency * 1000 + moving)) <= 3


@pytest.mark.parametrize("preset, nodes, busbw", [
    # NCCL's maintainers: "24GB/s is the peak performance per 200G NIC ... 96GB/s is the target" for four
    # (nccl-tests #119), "~24GB/s per NIC" at 95 GB/s (#252): eight HDR NICs a DGX A100
    ("dgx-a100", 2, 8 * 24), ("dgx-a100", 8, 8 * 24),
    # "For NDR @ 400Gbps you should see 46-48GB/s per NIC" (#290, two H100 nodes, NCCL_ALGO=RING);
    # 365.84 GB/s measured on 4 HGX H100 nodes of 8 GPU-NIC pairs (#309)
    ("dgx-h100", 2, 8 * 47), ("dgx-h100", 4, 365.84),
])
def test_an_all_reduce_across_nodes_gets_the_bus_bandwidth_nccl_tests_measure(preset, nodes, busbw):
    """8 GiB (nccl-tests' largest size) over whole nodes (benchmarks/collective_busbw.py's run): within 5 %
    of what nccl-tests measure, where the steps one after another (reduce-scatter in each node, the rail,
    all-gather) got 66-78 % of it."""
    assert all_reduce_busbw(preset, nodes, 8 * 2**30) == pytest.approx(busbw, rel=0.05)


def test_the_textbook_model_is_a_scenario_key_and_a_wrong_value_is_one_line():
    sets = ["run.numerics=meta", "parallel.dp=8"]
    nccl, textbook = (load(None, sets + [f"cluster.collectives={c}"]).cluster_spec() for c in ("nccl", "alpha-beta"))
    assert (nccl.collectives, textbook.collectives) == ("nccl", "alpha-beta")
    assert load(None, sets).cluster_spec().collectives == "nccl"  # the presets' default
    with pytest.raises(ScenarioError, match="cluster.collectives") as e:
        load(None, sets + ["cluster.collectives=ring"]).cluster_spec()
    assert "\n" not in str(e.value)


# tuning.cc (2.19/2.20), the tree (all-reduce only): base latency, a hop's over NVLink (the chain through
# a node's GPUs) and over the network (the double binary tree between nodes), in us; its bus bandwidth
# times 0.92 (LL: / 3.8; LL128: x 120/128 across nodes), half of it an algorithm's, and by message size
# (powers of two from 64 B) treeCorrectionFactor
TREE_BASE = {"LL": 6.8, "LL128": 14.0, "Simple": 0.0}
TREE_NVLINK = {"LL": 0.6, "LL128": 1.25, "Simple": 28.0}
TREE_NET = {"LL": 5.0, "LL128": 8.5, "Simple": 28.0}
TREE_SHARE = {"LL": 0.92 / 3.8, "LL128": 0.92 * 120 / 128, "Simple": 0.92}
CORRECTION = {
    "LL": [1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0],
    "LL128": [1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0],
    "Simple": [.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9],
}


def across_nodes(k, m, S):
    """(time in ns, algorithm, protocol) for an all-reduce of S bytes over m nodes of k GPUs: the
    ring (NCCL's rings' bytes, after the hierarchical steps' latencies; the test above) by each protocol,
    and the tree by each, whose bytes
    NCCL's model times at 0.5 x its share x the correction where the ring's at n/2(n-1): the ring's
    time for them times n/(n-1) over share x correction."""
    n = k * m
    sent = 2 * (n - 1) / n * S
    ring_bytes = max(sent * (k - 1) / k / B_NVL, sent / k / B_IB)
    share = {"LL": 1 / 4, "LL128": 0.92, "Simple": 1.0}
    options = [((1.4 if p == "Simple" else 1.0) * (BASE[p] + 2 * (k - 1) * NVLINK_STEP[p]
                                                   + 2 * (m - 1) * NET_STEP[p]) * 1000 + ring_bytes / share[p], "ring", p)
               for p in BASE]
    size = max((S >> 6).bit_length() - 1, 0)
    for p in BASE:
        correction = CORRECTION[p][size] if size < 23 else 1.0
        hops = (k - 1) * TREE_NVLINK[p] + (m.bit_length() - 1) * TREE_NET[p]
        options.append(((TREE_BASE[p] + 2 * hops) * 1000 + ring_bytes * n / (n - 1) / (TREE_SHARE[p] * correction),
                        "tree", p))
    return min(options)


@pytest.mark.parametrize("S,algorithm,protocol", [(64, "tree", "LL"), (64 * 2**10, "tree", "LL"),
                                                  (2 * 2**20, "tree", "LL128"), (512 * 2**20, "ring", "LL128"),
                                                  (2**30, "ring", "Simple")])
def test_an_all_reduce_over_many_nodes_goes_by_the_tree_until_it_is_large(S, algorithm, protocol):
    """16 nodes of 8: 64 bytes pay the tree's 6.8 + 2 (7 x 0.6 + 4 x 5.0) = 55.2 us of LL latency, not
    the ring's 2 x 15 network steps; medium sizes take the tree at its corrected rate; 512 MiB the ring
    by LL128 (its 92 % of the rate for 0.5 ms less latency than Simple), 1 GiB by Simple."""
    k, m = 8, 16
    want, algo, proto = across_nodes(k, m, S)
    assert (algo, proto) == (algorithm, protocol)
    assert abs(nccl_lone("all_reduce", k * m, S, nodes=m, per_node=k) - want) <= 3
    if S == 64:
        assert abs(want - 55_200) < 10


def test_reduce_scatter_and_all_gather_never_go_by_the_tree():
    """NCCL's tree is an all-reduce's: a tiny all-gather over 16 nodes still pays the ring's steps."""
    k, m, S = 8, 16, 64 * 16 * 8
    got = nccl_lone("all_gather", k * m, S, nodes=m, per_node=k)
    assert got > (BASE["LL"] + (m - 1) * NET_STEP["LL"]) * 1000
