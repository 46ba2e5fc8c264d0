"""How each collective moves bytes: a sequence of phases, each a set of concurrent flows.

A phase starts after `steps` link latencies, then its flows share the links (see engine/network.py);
it ends when its last flow ends. With one flow per link, the phases reproduce the textbook forms:

    ring all_reduce of S bytes over n ranks      2(n-1) * (alpha + S / (n B))
    ring reduce_scatter / all_gather (S = full)   (n-1) * (alpha + S / (n B))
    direct all_to_all (S per rank)                alpha + (n-1) S / (n B)
    pipelined chain broadcast / reduce            (n-1) alpha + S / B
    send / recv                                   alpha + S / B

A group spread evenly over several nodes, with more than one member per node, is hierarchical as in
NCCL's tree/2-D algorithms: reduce_scatter inside each node, the cross-node step on 1/k of the data
(k members per node, one ring per local index), then all_gather inside each node. Under NCCL's model
(`cluster.collectives = "nccl"`) those steps give the call its latencies, and its bytes move as NCCL's
rings move them, every hop at once (`nccl_ring`); the textbook model runs the steps one after another.

On a torus (cluster.torus), a group that is a grid of chips (every combination of its coordinates
along the dimensions it spans) reduces along one dimension at a time: reduce_scatter along x, then
along y on what is left, then z, and all_gather back in the reverse order. Along a dimension whose
links wrap around, a ring per line of chips in each direction, each carrying half the bytes, so
both of a chip's links work; all_gather of S bytes along n chips then takes

    (n-1) * (alpha + S / (2 n W))      W: one link, each way

(~ S / 2W). A line without wrap-around cannot close a ring on its own links: its chips pass shards
to both neighbours, and the end links carry all but one shard, (n-1) * alpha + (n-1) S / (n W),
twice the torus's time. Another group rings in rank order over routed hops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from simcluster.program.comm import CommKind
from simcluster.topology.cluster import Cluster


@dataclass(frozen=True)
class Phase:
    steps: int  # link latencies paid before the flows start
    flows: tuple[tuple[int, int, float], ...]  # (src rank, dst rank, bytes)


def _ring(ranks: tuple[int, ...], steps: int, per_flow: float) -> Phase:
    n = len(ranks)
    flows = tuple((ranks[i], ranks[(i + 1) % n], per_flow) for i in range(n)) if n > 1 else ()
    return Phase(steps if n > 1 else 0, flows)


def _merge(phases: list[Phase]) -> Phase:
    """Concurrent phases (e.g. one ring per node) as one."""
    return Phase(max((p.steps for p in phases), default=0), tuple(f for p in phases for f in p.flows))


def _by_node(cluster: Cluster, ranks: tuple[int, ...]) -> list[tuple[int, ...]] | None:
    """Members per node if the group is spread evenly with more than one per node, else None."""
    nodes: dict[int, list[int]] = {}
    for r in ranks:
        nodes.setdefault(cluster.node_of(r), []).append(r)
    if len(nodes) < 2:
        return None
    sizes = {len(v) for v in nodes.values()}
    if len(sizes) != 1 or sizes == {1}:
        return None
    return [tuple(nodes[k]) for k in sorted(nodes)]


def phases(kind: CommKind, ranks: tuple[int, ...], nbytes: int, cluster: Cluster, peer: int | None = None) -> list[Phase]:
    """Phases of a collective over `ranks` (group order; rings visit them in `cluster.ring_order`).
    `nbytes`: see the module docstring."""
    n = len(ranks)
    S = float(nbytes)
    if kind in (CommKind.SEND, CommKind.RECV):
        return [Phase(1, ((ranks[0], ranks[1], S),))]
    if n == 1:
        return []
    if kind is CommKind.BARRIER:
        return [_ring(cluster.ring_order(ranks), 2 * (n - 1), 0.0)]
    if kind is CommKind.ALL_TO_ALL:
        flows = tuple((a, b, S / n) for a in ranks for b in ranks if a != b)
        return [Phase(1, flows)]
    if kind in (CommKind.BROADCAST, CommKind.REDUCE):
        start = ranks.index(peer)
        chain = ranks[start:] + ranks[:start]
        if kind is CommKind.REDUCE:
            chain = chain[::-1]
        return [Phase(n - 1, tuple((chain[i], chain[i + 1], S) for i in range(n - 1)))]

    lines = _lines(cluster, ranks) if cluster.torus else None
    if lines is not None:
        return _on_torus(kind, lines, S, cluster)
    ring = cluster.ring_order(ranks)
    nodes = None if cluster.torus else _by_node(cluster, ring)
    if nodes is None:
        if kind is CommKind.ALL_REDUCE:
            return [_ring(ring, 2 * (n - 1), 2 * (n - 1) / n * S)]
        return [_ring(ring, n - 1, (n - 1) / n * S)]

    k, m = len(nodes[0]), len(nodes)
    intra_rs = _merge([_ring(node, k - 1, (k - 1) / k * S) for node in nodes])
    intra_ag = intra_rs
    rails = [tuple(node[j] for node in nodes) for j in range(k)]  # one cross-node ring per local index
    if kind is CommKind.ALL_REDUCE:
        inter = _merge([_ring(rail, 2 * (m - 1), 2 * (m - 1) / m * S / k) for rail in rails])
        return [intra_rs, inter, intra_ag]
    inter = _merge([_ring(rail, m - 1, (m - 1) / m * S / k) for rail in rails])
    if kind is CommKind.REDUCE_SCATTER:
        return [intra_rs, inter]
    assert kind is CommKind.ALL_GATHER, kind
    return [inter, intra_ag]


def nccl_ring(kind: CommKind, ranks: tuple[int, ...], nbytes: int, cluster: Cluster) -> Phase | None:
    """What NCCL's rings put on the links when a group spans nodes with more than one member on each
    (`phases` lays the call out in steps, which give its latencies; this, the bytes). NCCL runs one ring
    a GPU-NIC pair (a channel), each through every member, every chunk in flight at once: of the
    2(n-1)/n S an all-reduce member sends ((n-1)/n S in a reduce-scatter or all-gather), the channel that
    leaves its node through this member's NIC, 1/k of them, sends its share to the member of the same
    local index in the next node; the other channels, (k-1)/k, to the next member in its node over NVLink.
    So a bus bandwidth of k NICs' where NVLink keeps up, as nccl-tests measure across nodes: 24 GB/s a
    200 Gb/s NIC, 46-48 a 400 Gb/s one, four 200 Gb/s NICs 96 (NCCL's maintainers, NVIDIA/nccl-tests
    #119, #252, #290), where the steps one after another (reduce-scatter in the node, the rail, gather
    in the node) would get 66-78 % of it. None for another group or kind."""
    if cluster.torus or kind not in (CommKind.ALL_REDUCE, CommKind.REDUCE_SCATTER, CommKind.ALL_GATHER):
        return None
    nodes = _by_node(cluster, cluster.ring_order(ranks))
    if nodes is None:
        return None
    n, k, m = len(ranks), len(nodes[0]), len(nodes)
    sent = (2 if kind is CommKind.ALL_REDUCE else 1) * (n - 1) / n * float(nbytes)
    intra = ((node[i], node[(i + 1) % k], sent * (k - 1) / k) for node in nodes for i in range(k))
    rails = [tuple(node[j] for node in nodes) for j in range(k)]
    inter = ((rail[i], rail[(i + 1) % m], sent / k) for rail in rails for i in range(m))
    return Phase(0, (*intra, *inter))


def _lines(cluster: Cluster, ranks: tuple[int, ...]) -> list[tuple[int, list[tuple[int, ...]]]] | None:
    """For each torus dimension the group spans, (the dimension, its lines of chips along it, each in
    coordinate order); None if the group is not a grid."""
    coords = {r: cluster.coords(r) for r in ranks}
    values = [sorted({c[d] for c in coords.values()}) for d in range(len(cluster.torus))]
    if math.prod(len(v) for v in values) != len(ranks):  # (distinct chips whose coordinates take these values: the whole grid)
        return None
    out = []
    for d, v in enumerate(values):
        if len(v) > 1:
            lines: dict[tuple[int, ...], list[int]] = {}
            for r in ranks:
                c = coords[r]
                lines.setdefault(c[:d] + c[d + 1:], []).append(r)
            out.append((d, [tuple(sorted(line, key=lambda r: coords[r][d])) for _, line in sorted(lines.items())]))
    return out


def _on_torus(kind: CommKind, lines: list[tuple[int, list[tuple[int, ...]]]], S: float,
              cluster: Cluster) -> list[Phase]:
    """A grid's collective, one dimension at a time (the module docstring)."""
    scatter = []
    for d, dim in lines:
        k = len(dim[0])
        if cluster.wrap and k == cluster.torus[d]:  # rings both ways, each with half the bytes
            share = (k - 1) / k * S / 2
            scatter.append(_merge([_ring(line, k - 1, share) for line in dim] +
                                  [_ring(line[::-1], k - 1, share) for line in dim]))
        else:  # shards both ways along the line: a link carries every shard from its side
            scatter.append(_merge([Phase(k - 1, tuple(f for j in range(k - 1) for f in (
                (line[j], line[j + 1], (j + 1) / k * S), (line[j + 1], line[j], (k - 1 - j) / k * S))))
                for line in dim]))
        S /= k
    if kind is CommKind.REDUCE_SCATTER:
        return scatter
    if kind is CommKind.ALL_GATHER:
        return scatter[::-1]
    assert kind is CommKind.ALL_REDUCE, kind
    return scatter + scatter[::-1]


def semantic_bytes(kind: CommKind, in_bytes: int, group_size: int) -> int:
    """The S of the closed forms from one rank's input size."""
    if kind is CommKind.ALL_GATHER:
        return in_bytes * group_size
    return in_bytes
