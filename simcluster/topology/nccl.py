"""NCCL's protocols and tree: what a collective pays in latency and gets of a link's rate, by size.

NCCL moves a collective's bytes with one of three protocols and picks, for each call, the one its
cost model says is fastest (`ncclTopoGetAlgoTime`: latency + bytes / bandwidth):
  LL      8-byte stores of 4 data bytes and a flag: the lowest latency, a quarter of the bus bandwidth
          (a third for a gather, scatter or broadcast inside a node);
  LL128   128-byte lines of 120 data bytes: 92 % of it (70 % with one GPU a node);
  Simple  plain copies behind memory fences: all of it, the highest latency.
So a small message goes by LL at a few microseconds and a large one by Simple at the link's rate,
with LL128 between. The model's constants, ring algorithm (the one phases.py lays out), from
NVIDIA/nccl src/graph/tuning.cc (2.19/2.20, the NCCL of current NGC containers): a call's base
latency and each ring step's latency over NVLink and over the network, in microseconds:

                 LL    LL128  Simple
    base         6.6   14.0   8.4
    NVLink step  0.6    1.9   3.4
    network step 2.7    4.0   14.0

and a multi-node Simple all-reduce's latency times 1.4 (the "plateau effect of ring", Ampere and
later). An all-reduce may go by the tree algorithm instead (a chain through each node's GPUs, a
double binary tree between the nodes), which NCCL's model charges, per protocol,

    base + 2 ((GPUs a node - 1) x NVLink step + floor(log2 nodes) x network step)

                 LL    LL128  Simple
    base         6.8   14.0    0
    NVLink step  0.6    1.25  28
    network step 5.0    8.5   28

at half the bus bandwidth, times 0.92 (LL: /3.8 more; LL128: x 120/128, 7/9 on one node) and a
correction by message size (`TREE_CORRECTION`): at many nodes its log2 beats the ring's 2(n-1)
steps for all but the largest messages. A tree call's bytes go over the ring's links at the rate
that gives its time (an assumption: the tree's own links are not laid out). Across nodes the ring's
bytes are NCCL's rings' (phases.nccl_ring: one a GPU-NIC pair, every hop at once), whose bus bandwidth
is the node's NICs' where NVLink keeps up, as nccl-tests measure (24 GB/s a 200 Gb/s NIC, 46-48 a
400 Gb/s one: NVIDIA/nccl-tests #119, #252, #290; 366 GB/s on four 8-NIC H100 nodes, #309). Not modelled: the
per-channel bandwidth caps (we do not count channels: a protocol gets its share of whatever rate
the links give, engine/network.py), the network post overhead that NCCL adds to a multi-node
ring's intra-node steps (1-2 us, by CPU vendor), the tree's 0.85 where its graph is a plain tree
rather than a balanced one, CollNet and NVLS (in-switch reduction). All-to-all
and point-to-point sends, which NCCL runs as grouped sends and receives outside this model, are
charged by it all the same (one step); an assumption.

With `cluster.collectives = "alpha-beta"` a call instead pays `nvlink_latency_ns` or
`nic_latency_ns` a step at the full rate: the textbook model, which a measured profile fits.
"""

from __future__ import annotations

from dataclasses import dataclass

from simcluster.program.comm import CommKind

NVLINK, NET = "nvlink", "net"


@dataclass(frozen=True)
class Protocol:
    name: str
    base_us: float
    step_us: dict[str, float]  # by link: NVLINK, NET
    algorithm: str = "ring"


PROTOCOLS = (  # NCCL's order (a tie goes to the first)
    Protocol("LL", 6.6, {NVLINK: 0.6, NET: 2.7}),
    Protocol("LL128", 14.0, {NVLINK: 1.9, NET: 4.0}),
    Protocol("Simple", 8.4, {NVLINK: 3.4, NET: 14.0}),
)
SIMPLE = PROTOCOLS[-1]
PLATEAU = 1.4  # a multi-node Simple all-reduce's latency, times this
TREE = (  # all-reduce only; NCCL tries the tree before the ring
    Protocol("LL", 6.8, {NVLINK: 0.6, NET: 5.0}, "tree"),
    Protocol("LL128", 14.0, {NVLINK: 1.25, NET: 8.5}, "tree"),
    Protocol("Simple", 0.0, {NVLINK: 28.0, NET: 28.0}, "tree"),
)
# the tree's bandwidth by message size, powers of two from 64 B (tuning.cc's treeCorrectionFactor)
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9, 1.0, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9, .9),
}


def share(protocol: Protocol, kind: CommKind, nodes: int, per_node: float, nbytes: float = 0.0) -> float:
    """What the protocol gets of the links' rate (the module docstring); for the tree, of the rate at
    which a ring's bytes would cross those links (its half of the bus bandwidth against the ring's
    n/2(n-1))."""
    if protocol.algorithm == "tree":
        rate = 0.92 * {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 120 / 128, "Simple": 1.0}[protocol.name]
        size, correction = _log2i(int(nbytes) >> 6), TREE_CORRECTION[protocol.name]
        n = nodes * per_node
        return rate * (correction[size] if size < len(correction) else 1.0) * (n - 1) / n
    if protocol.name == "LL":
        return 1 / 4 if nodes > 1 or kind in (CommKind.ALL_REDUCE, CommKind.REDUCE) else 1 / 3
    if protocol.name == "LL128":
        return 0.7 if per_node < 2 else 0.92
    return 1.0


def _log2i(n: int) -> int:
    """tuning.cc's log2i: floor(log2 n), 0 for 0."""
    return max(n.bit_length() - 1, 0)


def latency_ns(protocol: Protocol, kind: CommKind, steps: list[tuple[int, str]], nodes: int,
               per_node: float = 1.0) -> list[int]:
    """Each phase's latency: its steps over its links (`steps`: (count, NVLINK or NET) by phase), the
    call's base latency on the first; a tree's whole latency on the first."""
    if protocol.algorithm == "tree":
        hops = (int(per_node) - 1) * protocol.step_us[NVLINK] + _log2i(nodes) * protocol.step_us[NET]
        return [round(1000 * (protocol.base_us + 2 * hops))] + [0] * (len(steps) - 1)
    plateau = PLATEAU if protocol is SIMPLE and kind is CommKind.ALL_REDUCE and nodes > 1 else 1.0
    return [round(1000 * plateau * ((protocol.base_us if i == 0 else 0.0) + count * protocol.step_us[link]))
            for i, (count, link) in enumerate(steps)]


def choose(kind: CommKind, steps: list[tuple[int, str]], simple_ns: float, nodes: int,
           per_node: float, nbytes: float | None = None) -> tuple[Protocol, float, float]:
    """The algorithm and protocol NCCL's model picks for a call whose phases take `steps` link
    latencies and whose bytes take `simple_ns` at the links' full rate over the ring (an all-reduce of
    `nbytes` may go by the tree): with its share of that rate, and the call's time by the model (what
    the planner's estimate charges, where no links are shared)."""
    best: tuple[float, Protocol, float] | None = None
    trees = TREE if kind is CommKind.ALL_REDUCE and nbytes is not None and nodes * per_node > 1 else ()
    for p in trees + PROTOCOLS:
        rate = share(p, kind, nodes, per_node, nbytes or 0.0)
        t = sum(latency_ns(p, kind, steps, nodes, per_node)) + simple_ns / rate
        if best is None or t < best[0]:
            best = (t, p, rate)
    assert best is not None
    return best[1], best[2], best[0]
