"""Collectives timed as NCCL's cost model times them (topology/nccl.py): each call goes by the protocol
(LL, LL128, Simple) that is fastest for its size, paying that protocol's latencies and getting its share
of the links' rate. The expected times below are written from NVIDIA/nccl src/graph/tuning.cc's
tables (ring algorithm), not from our module."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from simcluster.scenario import ScenarioError, load
from test_timing import B_IB, B_NVL, lone

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
    """Two nodes of four, hierarchical (plans.py): a reduce-scatter of 3 NVLink steps, a ring of 2
    network steps on a quarter of the bytes, an all-gather of 3 NVLink steps; large: Simple."""
    S, k, m = 4 * 2**22 * 3, 4, 2
    latency = 1.4 * (BASE["Simple"] + 2 * (k - 1) * NVLINK_STEP["Simple"] + 2 * (m - 1) * NET_STEP["Simple"])
    moving = 2 * (k - 1) * S / (k * B_NVL) + 2 * (m - 1) * (S / k) / (m * B_IB)
    assert abs(nccl_lone("all_reduce", k * m, S, nodes=m, per_node=k) - (latency * 1000 + moving)) <= 3


def test_the_textbook_model_is_a_scenario_key_and_a_wrong_value_is_one_line():
    sets = ["run.numerics=meta", "parallel.dp=8"]
    nccl, textbook = (load(None, sets + [f"cluster.collectives={c}"]).cluster_spec() for c in ("nccl", "alpha-beta"))
    assert (nccl.collectives, textbook.collectives) == ("nccl", "alpha-beta")
    assert load(None, sets).cluster_spec().collectives == "nccl"  # the presets' default
    with pytest.raises(ScenarioError, match="cluster.collectives") as e:
        load(None, sets + ["cluster.collectives=ring"]).cluster_spec()
    assert "\n" not in str(e.value)
