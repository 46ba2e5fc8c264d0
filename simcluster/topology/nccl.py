"""NCCL's protocols: what a collective pays in latency and gets of a link's rate, by message size.

NCCL moves a collective's bytes with one of three protocols and picks, for each call, the one its
cost model says is fastest (`ncclTopoGetAlgoTime`: latency + bytes / bandwidth):
  LL      8-byte stores of 4 data bytes and a flag: the lowest latency, a quarter of the bus bandwidth
          (a third for a gather, scatter or broadcast inside a node);
  LL128   128-byte lines of 120 data bytes: 92 % of it (70 % with one GPU a node);
  Simple  plain copies behind memory fences: all of it, the highest latency.
So a small message goes by LL at a few microseconds and a large one by Simple at the link's rate,
with LL128 between. The model's constants, ring algorithm (the one plans.py lays out), from
NVIDIA/nccl src/graph/tuning.cc (2.19/2.20, the NCCL of current NGC containers): a call's base
latency and each ring step's latency over NVLink and over the network, in microseconds:

                 LL    LL128  Simple
    base         6.6   14.0   8.4
    NVLink step  0.6    1.9   3.4
    network step 2.7    4.0   14.0

and a multi-node Simple all-reduce's latency times 1.4 (the "plateau effect of ring", Ampere and
later). Not modelled: the per-channel bandwidth caps (we do not count channels: a protocol gets its
share of whatever rate the links give, engine/network.py), the network post overhead that NCCL
adds to a multi-node ring's intra-node steps (1-2 us, by CPU vendor), the tree algorithm. All-to-all
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


PROTOCOLS = (  # NCCL's order (a tie goes to the first)
    Protocol("LL", 6.6, {NVLINK: 0.6, NET: 2.7}),
    Protocol("LL128", 14.0, {NVLINK: 1.9, NET: 4.0}),
    Protocol("Simple", 8.4, {NVLINK: 3.4, NET: 14.0}),
)
SIMPLE = PROTOCOLS[-1]
PLATEAU = 1.4  # a multi-node Simple all-reduce's latency, times this


def share(protocol: Protocol, kind: CommKind, nodes: int, per_node: float) -> float:
    """What the protocol gets of the links' rate (the module docstring)."""
    if protocol.name == "LL":
        return 1 / 4 if nodes > 1 or kind in (CommKind.ALL_REDUCE, CommKind.REDUCE) else 1 / 3
    if protocol.name == "LL128":
        return 0.7 if per_node < 2 else 0.92
    return 1.0


def latency_ns(protocol: Protocol, kind: CommKind, steps: list[tuple[int, str]], nodes: int) -> list[int]:
    """Each phase's latency: its steps over its links (`steps`: (count, NVLINK or NET) by phase), the
    call's base latency on the first."""
    plateau = PLATEAU if protocol is SIMPLE and kind is CommKind.ALL_REDUCE and nodes > 1 else 1.0
    return [round(1000 * plateau * ((protocol.base_us if i == 0 else 0.0) + count * protocol.step_us[link]))
            for i, (count, link) in enumerate(steps)]


def choose(kind: CommKind, steps: list[tuple[int, str]], simple_ns: float, nodes: int,
           per_node: float) -> tuple[Protocol, float, float]:
    """The protocol NCCL's model picks for a call whose phases take `steps` link latencies and whose
    bytes take `simple_ns` at the links' full rate: with its share of that rate, and the call's time by
    the model (what the planner's estimate charges, where no links are shared)."""
    best: tuple[float, Protocol, float] | None = None
    for p in PROTOCOLS:
        rate = share(p, kind, nodes, per_node)
        t = sum(latency_ns(p, kind, steps, nodes)) + simple_ns / rate
        if best is None or t < best[0]:
            best = (t, p, rate)
    assert best is not None
    return best[1], best[2], best[0]
