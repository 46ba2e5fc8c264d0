"""What a call moves over which links: its phases (topology/phases.py) as flows on the
network's links, the bytes each member sends, and how long it takes where it has its links to
itself. Computed once per channel and call shape, then shared (the timed replay asks per call)."""

from __future__ import annotations

import math
from typing import Any

from simcluster.engine.calls import Call
from simcluster.engine.fold import Fold
from simcluster.engine.network import Network
from simcluster.numerics.tensor import ITEMSIZE
from simcluster.program.comm import CommKind
from simcluster.topology import nccl
from simcluster.topology.cluster import Cluster
from simcluster.topology.phases import Phase, nccl_ring, phases as phases_of, semantic_bytes

# (latency, flows) per phase; bytes sent per member; ns on links of its own (None: its flows share
# one); every link it crosses
Route = tuple[list[tuple[int, Any]], list[int], "int | None", frozenset[int]]


def _timed(steps: list[tuple[int, Any]], sent: list[int]) -> Route:
    """A call's route: its steps, the bytes each member sends, how long it takes on idle links
    where no two of a phase's flows share a link (each then runs alone at its slowest link's rate,
    and the phase ends with the last; None otherwise), and every link it crosses."""
    alone: int | None = 0
    links: set[int] = set()
    for latency, flows in steps:
        crossed = [link for f in flows for link in f[0]]
        if alone is not None and len(set(crossed)) == len(crossed):
            alone += latency + max((f[3] for f in flows), default=0)
        else:
            alone = None
        links.update(crossed)
    return steps, sent, alone, frozenset(links)


def _protocol(call: Call, phases: list[Any], raw: list[Any], cluster: Cluster, network: Network,
              nbytes: float) -> tuple[list[int], float]:
    """The NCCL algorithm and protocol's phase latencies and share of the links' rate
    (topology/nccl.py) for a call of `nbytes`: a phase's steps cross the network if any of its flows
    leaves a node; its bytes take what its busiest link needs for them."""
    steps = [(phase.steps, nccl.NVLINK if all(cluster.same_node(a, b) for a, b, _ in phase.flows) else nccl.NET)
             for phase in phases]
    simple_ns = 0.0
    for flows in raw:
        load: dict[int, float] = {}
        for links, b in flows:
            for link in links:
                load[link] = load.get(link, 0.0) + b
        simple_ns += max((b / network.capacity[link] for link, b in load.items()), default=0.0)
    nodes = len({cluster.node_of(r) for r in call.members})
    per_node = len(call.members) / nodes
    protocol, rate, _ = nccl.choose(call.kind, steps, simple_ns, nodes, per_node, nbytes)
    return nccl.latency_ns(protocol, call.kind, steps, nodes, per_node), rate


def routes(call: Call, cluster: Cluster, network: Network, fold: Fold | None) -> Route:
    """The call's phases as (latency to wait, flows over links), bytes sent per member, how long
    it takes on links it has to itself (None where a phase's flows share a link), and the links.

    Calls of the same kind, group and signature move the same bytes: computed once per
    channel, then shared.
    """
    op = call.ops[0]
    routes = call.channel.routes
    if op.splits is not None:
        return _uneven(call, cluster, network, fold)
    # first by the signature object itself (a taped block's calls share theirs; the entry holds
    # it, so its id is its own while the entry lives), then by its value
    seen = routes.get(id(op.sig))
    if seen is not None and seen[0] is op.sig and seen[1] is call.kind and seen[2] == op.peer:
        return seen[3]
    key = (call.kind._value_, op.sig, op.peer)
    cached = routes.get(key)
    if cached is not None:
        routes[id(op.sig)] = (op.sig, call.kind, op.peer, cached)
        return cached
    if cached is None and call.kind is CommKind.COPY:  # one flow over the rank's PCIe link, or NVMe drives
        size = math.prod(op.sig[2]) * ITEMSIZE[op.sig[1]]
        links = cluster.copy_route(op.rank, *op.tiers)
        cached = routes[key] = _timed([(cluster.spec.pcie_latency_ns, network.prepare([(links, size)]))],
                                      [size])
    if cached is None:
        size = 0 if op.sig is None else math.prod(op.sig[2]) * ITEMSIZE[op.sig[1]]
        nbytes = size if call.is_message else semantic_bytes(call.kind, size, len(call.members))
        cached = routes[key] = _routed(call, phases_of(call.kind, call.members, nbytes, cluster, peer=op.peer),
                                       nbytes, cluster, network, fold)
    return cached


def _uneven(call: Call, cluster: Cluster, network: Network, fold: Fold | None) -> Route:
    """An uneven all_to_all's route: a flow from each member to each other of the rows it sends
    there, all at once (NCCL's all-to-all: a send and a receive for each peer, grouped). Cached by
    every member's rows."""
    op = call.ops[0]
    splits = tuple(o.splits for o in call.ops)
    key = (call.kind._value_, op.sig[1], op.sig[2][1:], splits)
    cached = call.channel.routes.get(key)
    if cached is None:
        row = math.prod(op.sig[2][1:]) * ITEMSIZE[op.sig[1]]
        members = call.members
        flows = tuple((a, b, float(rows[j] * row)) for a, rows in zip(members, splits)
                      for j, b in enumerate(members) if b != a and rows[j])
        nbytes = max(sum(rows) * row for rows in splits)
        cached = call.channel.routes[key] = _routed(call, [Phase(1, flows)] if flows else [], nbytes, cluster,
                                                    network, fold)
    return cached


def _routed(call: Call, phases: list[Phase], nbytes: float, cluster: Cluster, network: Network,
            fold: Fold | None) -> Route:
    """`phases` as flows over the links, with the protocol's latencies and rate (or the textbook's).
    With NCCL's model, a call across nodes moves its bytes as NCCL's rings do, every step's at once
    (phases.nccl_ring), after all its steps' latencies."""
    if fold is not None and call.live < len(call.members):
        fold.check_phases(call.members, phases, call.where, call.kind.value)
    raw: list[list[tuple[Any, float]]] = []  # each phase's flows (links, bytes)
    alpha: list[int] = []  # each phase's latency in the textbook model
    sent: dict[int, float] = {}
    for phase in phases:
        flows, latency = _flows(phase, cluster, fold, sent)
        raw.append(flows)
        alpha.append(phase.steps * latency)
    latencies = alpha
    rate = 1.0
    if phases and cluster.spec.collectives == "nccl" and not cluster.torus:
        ring = nccl_ring(call.kind, call.members, int(nbytes), cluster) if len(phases) > 1 else None
        if ring is not None:
            if fold is not None and call.live < len(call.members):
                fold.check_phases(call.members, [ring], call.where, call.kind.value)
            sent = {}  # (what each member sends is the rings')
            raw = [_flows(ring, cluster, fold, sent)[0]]
        latencies, rate = _protocol(call, phases, raw, cluster, network, nbytes)
        if ring is not None:
            latencies = [sum(latencies)]
    elif phases:  # the textbook model: the share of the link a profile measured for this kind, if any
        rate = cluster.collective_rates.get(call.kind.value, 1.0)
    prepared = [network.prepare([(links, b / rate) for links, b in flows] if rate != 1.0 else flows) for flows in raw]
    return _timed(list(zip(latencies, prepared)), [int(round(sent.get(r, 0.0))) for r in call.members])


def _flows(phase: Phase, cluster: Cluster, fold: Fold | None, sent: dict[int, float]) -> tuple[list[Any], int]:
    """A phase's flows as (links, bytes), the folded ones into their representatives' ports, and the
    largest latency of their routes; adds what each rank sends to `sent`."""
    flows = []
    latency = 0
    for src, dst, b in phase.flows:
        links, lat = cluster.route(src, dst)
        latency = max(latency, lat)
        sent[src] = sent.get(src, 0.0) + b
        if fold is None:
            flows.append((links, b))
        elif fold.is_rep[src]:  # of each orbit of flows, the one leaving a representative,
            rep = fold.rep(dst)  # into the port of its destination's representative
            flows.append((links if rep == dst else (links[0], links[1] + 4 * (rep - dst)), b))
    return flows, latency
